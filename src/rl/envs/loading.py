"""Load a verifiers environment as an `[[env]]` table describes it.

verifiers builds an environment from its own `EnvConfig`: the taskset (`id` + its fields), and one
`AgentConfig` per seat (role) with the seat's harness (the program that talks to the model) and runtime
(where that program runs). Most published environments export only a Taskset, which leaves every seat on
verifiers' defaults: the `bash` harness, which installs its program with uv, on Prime's remote sandboxes.
Neither runs on an offline host, so where the user chose nothing:

- harness: the environment's own (declared on the seat, or bundled by its package), else rl's
  in-process chat harness (`environments/in_process_chat`: one chat call per turn, no program, no network);
- runtime: the seat's own if it runs on this host, else the local `subprocess` runtime.

What the user sets (`harness`, `runtime`, `overrides`) is passed to verifiers as given, and verifiers
validates it; its errors are reported under the `[[env]]` keys that caused them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import verifiers.v1 as vf
from pydantic import ValidationError
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.interception.tunnel import CustomTunnelConfig
from verifiers.v1.runtimes import runtime_is_local
from verifiers.v1.utils.compile import validate_pairing
from verifiers.v1.utils.loaders import default_harness_id, env_config_type, load_harness
from verifiers.v1.utils.prime import ensure_prime_auth

from rl.envs.client import ChildEnvServer, ServedEpisodes
from rl.envs.config import EnvConfig
from rl.envs.runner import EpisodeRunner, InProcessEpisodes

DEFAULT_HARNESS = "in-process-chat"
LOCAL_RUNTIME = "subprocess"

INTERCEPTION = {"type": "elastic", "multiplex": 8}
"""verifiers' interception servers, one per 8 concurrent rollouts (its default: 32). Chosen when the
training client used the OpenAI SDK over httpx, which scans every pooled connection on each request, so
small pools were faster; with `EngineClient` (aiohttp) 8 and 32 measure alike (benchmarks/RESULTS.md).
`overrides.interception` chooses otherwise."""


class EnvLoadError(ValueError):
    """An environment cannot be loaded as configured; the message names the environment and the key."""


class Environment:
    """A loaded verifiers environment with its tasks materialized for deterministic index access, and the runner of
    its episodes (rl/envs/runner.py)."""

    def __init__(
        self, name: str, env: vf.Env, tasks: list[vf.Task], seats: dict[str, str], toolsets: list[str],
        runner: EpisodeRunner,
    ) -> None:
        self.name = name  # the label of its metrics
        self.env = env
        self.tasks = tasks
        self.runner = runner  # where its episodes run
        self.seats = seats  # seat -> how it runs, for the log
        self.toolsets = toolsets  # the MCP tool servers its rollouts get (names), none for a chat environment

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def task(self, index: int) -> vf.Task:
        if not 0 <= index < len(self.tasks):
            raise IndexError(f"environment {self.name!r} has {len(self.tasks)} tasks, no task {index}")
        return self.tasks[index]

    def describe(self) -> str:
        seats = "; ".join(f"seat {seat!r}: {how}" for seat, how in self.seats.items())
        tools = f"; toolsets {', '.join(self.toolsets)}" if self.toolsets else ""
        where = self.runner.where()
        return f"environment {self.name!r}: {self.num_tasks} tasks; {seats}{tools}; episodes run by {where}"

    def serving(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Ready to run episodes while entered (rl/envs/runner.py)."""
        return self.runner.serving(self.env)


@contextlib.contextmanager
def launched(environments: list[Environment]) -> Iterator[None]:
    """What each environment's episodes run on (the env servers this process owns, its children) started now, so that
    they load while inference starts (`serving` then waits for them), and stopped on the way out: an env server's
    life in a process that runs episodes is this, then `serving`."""
    for environment in environments:
        environment.runner.launch()
    try:
        yield
    finally:
        for environment in environments:  # a no-op for what has stopped
            environment.runner.shut_down()


@contextlib.asynccontextmanager
async def serving(environments: list[Environment]) -> AsyncIterator[None]:
    """Every environment of the list serving (each once, though listed twice)."""
    async with contextlib.AsyncExitStack() as stack:
        for environment in {id(e): e for e in environments}.values():
            await stack.enter_async_context(environment.serving())
        yield


@contextlib.contextmanager
def named_errors(spec: EnvConfig, seats: dict[str, str]) -> Iterator[None]:
    """verifiers' errors in resolving or loading `spec` as EnvLoadError, named under its `[[env]]` keys."""
    try:
        yield
    except ValidationError as e:
        raise EnvLoadError(f"environment {spec.label!r}:\n{validation_errors(e, spec, set(seats))}") from None
    except ModuleNotFoundError as e:  # a harness or env id that verifiers cannot import
        raise EnvLoadError(f"environment {spec.label!r}: {plugin_key(str(e), spec)}: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise EnvLoadError(f"environment {spec.label!r}: {e}") from None


def resolved_env_config(spec: EnvConfig) -> tuple[vf.EnvConfig, dict[str, str]]:
    """verifiers' EnvConfig for `spec` with rl's defaults, validated, and how each seat runs; EnvLoadError names what
    is wrong under its `[[env]]` key."""
    import_environment_module(spec.id)
    data, seats = verifiers_env_config(spec)
    with named_errors(spec, seats):
        return vf.resolve_env_config(data), seats


def load_environment(spec: EnvConfig) -> Environment:
    """Load `spec`'s environment; EnvLoadError names what is wrong under its `[[env]]` key."""
    config, seats = resolved_env_config(spec)
    with named_errors(spec, seats):
        env = vf.load_environment(config)
    toolsets = declared_toolsets(env)
    check_runnable(spec, env, toolsets)
    if not env.taskset.bounded:
        raise EnvLoadError(f"environment {spec.label!r} has an infinite taskset; bound it with its args")
    return Environment(spec.label, env, list(env.taskset), seats, [toolset_name(t) for t in toolsets], runner_for(spec))


def runner_for(spec: EnvConfig) -> EpisodeRunner:
    """Where `spec`'s episodes run, chosen once: this process (`workers = 0`), the env server at its address, or one
    this process starts as its child."""
    if spec.in_process:
        return InProcessEpisodes()
    if spec.address is not None:
        return ServedEpisodes(spec.label, spec.address, secret=spec.secret)
    return ServedEpisodes(spec.label, child=ChildEnvServer(spec))


def load_environments(specs: list[EnvConfig], where: str) -> list[Environment]:
    """Load every environment of a config list; errors name the list entry (`env[0]`)."""
    environments = []
    for i, spec in enumerate(specs):
        try:
            environments.append(load_environment(spec))
        except EnvLoadError as e:
            raise EnvLoadError(f"{where}[{i}]: {e}") from None
    return environments


def module_name(env_id: str) -> str:
    """The module verifiers imports for an id: `owner/name@version` -> `name`, `-` -> `_`."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def import_environment_module(env_id: str) -> None:
    """Import the environment's package, telling 'not installed' apart from 'a dependency is missing'
    (verifiers reports both as 'not found')."""
    module = module_name(env_id)
    builtin = f"verifiers.v1.tasksets.{module}"
    target = builtin if importlib.util.find_spec(builtin) else module
    try:
        importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name != target:
            raise EnvLoadError(
                f"environment {env_id!r}: its package imports {e.name!r}, which is not installed; "
                "reinstall the environment package with its dependencies"
            ) from None
        raise EnvLoadError(
            f"environment {env_id!r} is not installed: verifiers imports it as the module {module!r}, which "
            f"this Python ({sys.executable}) cannot find. Install its package into this environment: "
            f"`uv pip install -e path/to/{env_id}` for a local package, `uv pip install <package>` for a published "
            f"one, or `prime env install <owner>/{env_id}` from the Prime environments hub"
        ) from None


def verifiers_env_config(spec: EnvConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """verifiers' EnvConfig data for `spec`, and per seat a line saying which harness and runtime it gets."""
    if "taskset" in spec.overrides:
        raise EnvLoadError(f"environment {spec.label!r}: overrides.taskset: set the taskset's fields in `args`")
    try:
        config_class = env_config_type(spec.id, spec.overrides.get("id") or "")
    except ModuleNotFoundError as e:
        raise EnvLoadError(f"environment {spec.label!r}: overrides.id: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise EnvLoadError(f"environment {spec.label!r}: {e}") from None
    data = {"interception": INTERCEPTION, **spec.overrides, "taskset": {**spec.args, "id": spec.id}}
    seats = {}
    declared_seats = {
        name: field.default for name, field in config_class.model_fields.items()
        if isinstance(field.default, vf.AgentConfig)
    }
    for seat, declared in declared_seats.items():
        seat_data = data.get(seat) or {}
        if not isinstance(seat_data, dict):
            raise EnvLoadError(f"environment {spec.label!r}: overrides.{seat}: give a table of the seat's fields")
        harness, harness_note = seat_setting(spec, seat, seat_data, "harness"), "as configured"
        if harness is None:
            harness, harness_note = default_harness(spec.id, declared)
        runtime, runtime_note = seat_setting(spec, seat, seat_data, "runtime"), "as configured"
        if runtime is None:
            runtime, runtime_note = default_runtime(declared)
        data[seat] = seat_data | {"harness": harness, "runtime": runtime}  # verifiers merges the seat's own fields
        seats[seat] = (
            f"harness {harness.get('id')!r} ({harness_note}), runtime {runtime.get('type')!r} ({runtime_note})"
        )
    return data, seats


def seat_setting(spec: EnvConfig, seat: str, seat_data: dict, key: str) -> dict | None:
    """The harness or runtime the user set for a seat: `[[env]].<key>` (every seat) or `overrides.<seat>.<key>`."""
    everywhere, here = getattr(spec, key), seat_data.get(key)
    if everywhere is not None and here is not None:
        raise EnvLoadError(
            f"environment {spec.label!r}: both `{key}` and `overrides.{seat}.{key}` are set; set it in one place"
        )
    return everywhere if everywhere is not None else here


def default_harness(taskset_id: str, seat_default: vf.AgentConfig) -> tuple[dict, str]:
    if seat_default.harness is not None:
        return {"id": seat_default.harness.id}, "the environment's own"
    if default_harness_id(taskset_id) == taskset_id:
        return {"id": taskset_id}, "bundled with the taskset"
    return {"id": DEFAULT_HARNESS}, "rl's default: the environment ships no harness"


def default_runtime(seat_default: vf.AgentConfig) -> tuple[dict, str]:
    declared = seat_default.runtime
    if runtime_is_local(declared):
        return {"type": declared.type}, "the environment's own"
    return {"type": LOCAL_RUNTIME}, f"rl's default: the environment's {declared.type!r} is a remote sandbox"


def validation_errors(error: ValidationError, spec: EnvConfig, seats: set[str]) -> str:
    """verifiers' validation errors, each under the `[[env]]` key the user wrote."""
    return "\n".join(f"  {config_key(item['loc'], spec, seats)}: {item['msg']}" for item in error.errors())


RUNTIME_TAGS = {"subprocess", "docker", "podman", "apptainer", "prime", "modal", "e2b"}


def config_key(loc: tuple, spec: EnvConfig, seats: set[str]) -> str:
    """Map a location in verifiers' EnvConfig back to the `[[env]]` key that set it."""
    parts = [str(p) for p in loc]
    if parts[:1] == ["taskset"]:
        return ".".join(["args", *parts[1:]])
    if len(parts) >= 2 and parts[0] in seats and parts[1] in ("harness", "runtime"):
        key, rest = parts[1], parts[2:]
        if key == "runtime" and rest[:1] and rest[0] in RUNTIME_TAGS:
            rest = rest[1:]  # pydantic names the union member it tried
        if getattr(spec, key) is not None:
            return ".".join([key, *rest])
    return ".".join(["overrides", *parts])


def plugin_key(message: str, spec: EnvConfig) -> str:
    """The `[[env]]` key of the plugin id verifiers could not import (its message starts with the kind)."""
    if not message.startswith("harness "):
        return "overrides.id"
    if spec.harness is not None:
        return "harness.id"
    seat = next((seat for seat, value in spec.overrides.items() if isinstance(value, dict) and "harness" in value), "")
    return f"overrides.{seat}.harness.id"


def declared_toolsets(env: vf.Env) -> list:
    """The MCP toolsets its rollouts get: the task class's (a classmethod of the task config) and the
    taskset's shared ones. Building them starts nothing."""
    taskset = env.taskset
    return [*type(taskset).task_type().toolsets(taskset.config.task), *taskset.toolsets(taskset.config)]


def toolset_name(toolset) -> str:
    return toolset.server_name or type(toolset).__name__


def check_runnable(spec: EnvConfig, env: vf.Env, toolsets: list) -> None:
    """What verifiers would only find out per rollout: a harness that cannot run the environment's tools or
    needs a container on a host runtime, and remote sandboxes without the Prime credentials their tunnel
    needs."""
    task_class = type(env.taskset).task_type()
    agents = agent_config_fields(env.config)
    for seat, agent in agents.items():
        harness = load_harness(agent.harness)  # as verifiers loaded it for the seat (a stateless value)
        if toolsets and not harness.SUPPORTS_MCP:
            raise EnvLoadError(
                f"environment {spec.label!r}, seat {seat!r}: its tasks call tools (MCP toolsets "
                f"{', '.join(map(toolset_name, toolsets))}), but harness "
                f"{harness.config.id!r} cannot offer tools; remove `harness` from its [[env]] table (rl's default "
                f"{DEFAULT_HARNESS!r} runs tools in process) or set one that supports MCP, e.g. "
                f"harness = {{id = '{DEFAULT_HARNESS}'}} or {{id = 'null'}} (installs its program with uv)"
            )
        try:
            validate_pairing(harness, task_class, agent.runtime, tools=toolsets)
        except ValueError as e:  # its advice names verifiers' CLI flags; ours is the [[env]] key
            raise EnvLoadError(
                f"environment {spec.label!r}, seat {seat!r}: {e} (in rl: `runtime = {{type = 'docker'}}` in its "
                "[[env]] table)"
            ) from None
    remote = [
        f"{seat!r} on {agent.runtime.type!r}" for seat, agent in agents.items() if not runtime_is_local(agent.runtime)
    ]
    tunnel = getattr(env.config.interception, "tunnel", None)
    if remote and not isinstance(tunnel, CustomTunnelConfig):
        try:
            ensure_prime_auth()  # verifiers exits the process where credentials are missing
        except SystemExit as e:
            raise EnvLoadError(
                f"environment {spec.label!r}: seat {', '.join(remote)} runs in a remote sandbox, which reaches this "
                f"host's model through a Prime tunnel and so needs Prime credentials ({e}) and the network; to run "
                f"on this host instead set runtime = {{type = '{LOCAL_RUNTIME}'}}"
            ) from None
