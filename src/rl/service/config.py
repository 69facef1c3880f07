"""The service's config: where it listens, and what `rl serve-api` fills from the run (its directory, model,
inference servers)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rl.config import Section, Settings
from rl.orchestrator.config import ClientConfig

API_KEY_VAR = "TINKER_API_KEY"  # the Tinker SDK's own variable: the client sends it, the service checks it


class ApiConfig(Section):
    """`rl serve-api`'s REST surface."""

    host: Annotated[str, Field(description="address the API binds (loopback unless you expose it)")] = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535, description="its port: the SDK's base_url is http://<host>:<port>")] = (
        8100
    )
    call_timeout_s: Annotated[
        float, Field(gt=0, description="deadline for one call to the trainer (a forward/backward, an optimizer step, "
                                       "a save) or to inference (a reload, a sample)")
    ] = 600.0
    idle_timeout_s: Annotated[
        float, Field(gt=0, description="the trainer stops when no call comes for this long")
    ] = 86400.0
    served_model_name: Annotated[
        str | None, Field(min_length=1, description="the name clients give the model (base_model) and load its "
                                                    "tokenizer by, e.g. the hub id of a local copy; default: "
                                                    "model.name")
    ] = None
    long_poll_s: Annotated[
        float, Field(gt=0, le=40, description="how long a retrieve_future holds before answering try_again (the "
                                              "SDK's own read timeout is 45 s)")
    ] = 20.0


class ServiceConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_SERVICE__")

    api: ApiConfig = ApiConfig()
    model: Annotated[str, Field(min_length=1, description="the base model (what create_model must name)")] = "model"
    output_dir: Annotated[Path, Field(description="run directory shared with the trainer")] = Path("outputs/run")
    seq_len: Annotated[int, Field(ge=16, description="longest datum or sample in tokens")] = 2048
    client: ClientConfig = ClientConfig()
