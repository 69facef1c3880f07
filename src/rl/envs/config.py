"""An `[[env]]` table: one verifiers environment of a run, how its tasks are drawn and where its episodes run
(shared by the orchestrator, eval, the env server and `rl`); and the config of an env server (`env-server`)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from rl.config import API_KEY_VAR, Secret, Section, Settings

ENV_SERVER_SECRET_VAR = "RL_ENV_SERVER__SECRET"  # an env server's secret, read by it and by its clients
GROUP_GAP_S = 0.003  # the default wait for a group's identical generate requests (rl/envs/engine_client.py)


class EpochSampling(Section):
    """Each epoch a seeded permutation of the tasks: every task once per epoch, exactly once on resume."""

    type: Annotated[Literal["epoch"], Field(description="epoch: every task once per epoch, in a seeded order")] = (
        "epoch")


class DifficultySampling(Section):
    """A curriculum: tasks in pools by their latest group's mean reward (easy, medium, hard; an unseen task is
    medium), a pool drawn by weight, then a task of it uniformly."""

    type: Annotated[Literal["difficulty"], Field(description="difficulty: pools by the latest group mean")] = (
        "difficulty")
    easy: Annotated[float, Field(description="a task whose latest group mean reward is at least this is easy")] = 0.8
    hard: Annotated[float, Field(description="at most this: hard (between the two: medium)")] = 0.2
    weights: Annotated[
        tuple[float, float, float],
        Field(description="[easy, medium, hard]: each pool's share of the draws (an empty pool's goes to the others)"),
    ] = (0.1, 0.6, 0.3)

    @model_validator(mode="after")
    def _pools(self):
        if not self.hard < self.easy:
            raise ValueError(f"sampler.hard ({self.hard}) must be below sampler.easy ({self.easy})")
        if min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError(f"sampler.weights {list(self.weights)} must be >= 0 with a positive sum")
        return self


SamplerConfig = Annotated[EpochSampling | DifficultySampling, Field(discriminator="type")]


class EnvConfig(Section):
    """One verifiers environment: its taskset (`id`, `args`) and how its seats run (`harness`, `runtime`,
    `overrides`, all validated by verifiers itself when the environment loads)."""

    id: Annotated[
        str, Field(min_length=1, description="verifiers environment id (an installed package), e.g. reverse-text")
    ]
    name: Annotated[
        str | None, Field(min_length=1, description="label in metrics and logs (default: the id); unique per run")
    ] = None
    args: Annotated[dict[str, Any], Field(description="taskset arguments (verifiers' taskset config fields)")] = {}
    ratio: Annotated[float, Field(gt=0, description="share of each batch drawn from this environment")] = 1.0
    sampler: Annotated[
        SamplerConfig, Field(description="how its tasks are drawn ({type = 'epoch'} or {type = 'difficulty', ...})")
    ] = EpochSampling()
    harness: Annotated[
        dict[str, Any] | None,
        Field(description="verifiers harness of every seat, e.g. {id = 'bash'}; unset: the environment's own, "
                          "else rl's in-process chat harness"),
    ] = None
    runtime: Annotated[
        dict[str, Any] | None,
        Field(description="verifiers runtime of every seat, e.g. {type = 'docker'}; unset: the environment's own "
                          "if it runs on this host, else {type = 'subprocess'}"),
    ] = None
    overrides: Annotated[
        dict[str, Any],
        Field(description="further verifiers EnvConfig fields, "
                          "e.g. {agent = {max_turns = 4}, timeout = {episode = 60}}"),
    ] = {}

    address: Annotated[
        str | None,
        Field(description="the env server its episodes run in: a ZMQ endpoint (tcp://host:port, ipc://path) of one "
                          "started elsewhere (`env-server`); unset: one started for it, with `workers` (by `rl` "
                          "beside the orchestrator; by the orchestrator or `eval` when started by hand)"),
    ] = None
    workers: Annotated[
        int | None, Field(ge=0, description="worker processes of the env server started for it (no `address`); "
                                            "unset: a quarter of the host's cores, 1 to 8; 0: no env server, the "
                                            "episodes run in the orchestrator's own process (cheaper on a small "
                                            "host, but an environment that crashes or blocks takes the run down)")
    ] = None
    secret: Annotated[
        Secret | None, Field(min_length=16, description="the secret of the env server at a tcp:// `address` (its "
                                                        "`secret`), which seals the connection; required beyond "
                                                        "loopback; unset: RL_ENV_SERVER__SECRET")
    ] = None

    @model_validator(mode="before")
    @classmethod
    def _secret_from_environment(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("secret") is None and str(data.get("address")).startswith("tcp://"):
            data = {**data, "secret": os.environ.get(ENV_SERVER_SECRET_VAR) or None}
        return data

    @model_validator(mode="after")
    def _sealed_beyond_loopback(self) -> "EnvConfig":
        from rl.envs.seal import beyond_loopback

        if self.address is not None and beyond_loopback(self.address) and self.secret is None:
            raise ValueError(f"address {self.address} is an env server beyond this host, which admits only clients "
                             f"that hold its secret: set secret (or {ENV_SERVER_SECRET_VAR})")
        return self

    @model_validator(mode="after")
    def _episodes_run_in_one_place(self) -> "EnvConfig":
        if self.address is not None and self.workers == 0:
            raise ValueError(f"workers = 0 runs the episodes in the orchestrator's process, and address {self.address} "
                             "is an env server to run them in: give one or the other")
        return self

    @property
    def in_process(self) -> bool:
        """Its episodes run in the orchestrator's (or eval's) own process, without an env server."""
        return self.workers == 0

    @property
    def label(self) -> str:
        return self.name or self.id


def check_env_labels(envs: list[EnvConfig], where: str) -> None:
    """Metrics are keyed by label, so two [[env]] tables of one list must not share one."""
    labels = [env.label for env in envs]
    for label in labels:
        if labels.count(label) > 1:
            raise ValueError(f"{where}: two environments are labelled {label!r}; give each a distinct `name`")


MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    """A quarter of this host's cores, 1 to 8: the orchestrator, inference's API processes and the trainer share
    the host, and an episode of a chat environment is mostly waiting on inference."""
    return max(1, min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 1) // 4))


class EnvServerConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_ENV_SERVER__")

    env: Annotated[EnvConfig, Field(description="the environment served, as an [[env]] table of the orchestrator")]
    workers: Annotated[
        int, Field(ge=1, default_factory=default_workers, description="worker processes, all started at once; "
                                                                       "default: a quarter of the host's cores, 1-8")
    ]
    address: Annotated[
        str, Field(min_length=1, description="ZMQ endpoint the broker binds: ipc://<path>, or tcp://<host>:<port> "
                                             "(port 0: any free one, logged)")
    ] = "tcp://127.0.0.1:5000"
    max_concurrent: Annotated[
        int | None, Field(ge=1, description="episodes in flight per worker; unset: no bound")
    ] = None
    secret: Annotated[
        Secret | None, Field(min_length=16, description="the run's secret: a tcp:// address is sealed with it (ZMQ "
                                                        "CURVE), admitting only clients that hold it; required beyond "
                                                        "loopback; give it by environment (RL_ENV_SERVER__SECRET) or "
                                                        "in a file (@ secret.toml), not as a flag, which ps shows")
    ] = None
    max_message_bytes: Annotated[
        int, Field(ge=1 << 16, description="largest request a peer may send; a larger one disconnects the peer, and "
                                           "nothing of it is kept")
    ] = 64 << 20
    worker_stall_s: Annotated[
        float, Field(gt=0, description="a worker whose event loop has not run for this long (stopped, or blocked by "
                                       "the environment's code) is hung: the server stops, naming it, to be restarted "
                                       "and its episodes run again")
    ] = 120.0
    client_env_vars: Annotated[
        list[str], Field(description="the environment variables a request's model client may have a worker read "
                                     "(its api_key_var, headers_from_env); a request naming another is refused; "
                                     "'*': any")
    ] = [API_KEY_VAR]
    model_endpoints: Annotated[
        list[str] | None, Field(description="the model servers (URLs; their scheme, host and port count) a "
                                            "request's episodes may call; '*': any; unset: any on loopback, none "
                                            "with a key (another local user may listen there)")
    ] = None
    renderer_models: Annotated[
        list[str], Field(description="besides local directories, the tokenizers (hub ids) a request's client may "
                                     "render with; '*': any")
    ] = []

    @model_validator(mode="after")
    def _sealed_beyond_loopback(self) -> "EnvServerConfig":
        from rl.envs.seal import beyond_loopback

        if beyond_loopback(self.address) and self.secret is None:
            raise ValueError(f"address {self.address} reaches beyond this host, and a request runs an episode (code, "
                             "for a sandboxed environment): set secret (or RL_ENV_SERVER__SECRET) to the run's secret, "
                             "which the orchestrator's [[env]] table then needs too")
        return self


def started_for(spec: EnvConfig, address: str, model_endpoints: list[str], client_env_vars: list[str] | None = None,
                renderer_models: list[str] = ()) -> EnvServerConfig:
    """The env server started for an `[[env]]` table without an address (by `rl`, or by an orchestrator or `eval`
    started by hand): the table's environment, its workers, at `address` (local: no secret), its episodes calling
    `model_endpoints` with `client_env_vars` (default: rl's inference key's) only, rendering with local tokenizers
    and `renderer_models` (the run's model, where it is a hub id)."""
    env = spec.model_copy(update={"address": None, "workers": None, "secret": None})
    return EnvServerConfig(env=env, workers=spec.workers or default_workers(), address=address,
                           model_endpoints=model_endpoints, client_env_vars=client_env_vars or [API_KEY_VAR],
                           renderer_models=list(renderer_models))
