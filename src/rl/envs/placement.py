"""The env servers `rl` starts beside the orchestrator: one per `[[env]]` (and eval `[[env]]`) without an `address`
(rl/envs/server.py), each at a socket of its own, which is filled into the orchestrator's table; none for a table with
`workers = 0`, whose episodes run in the orchestrator's process."""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

from rl.envs.config import EnvConfig, EnvServerConfig, started_for

MAX_SOCKET_PATH = 100  # a Unix socket's path must fit sockaddr_un's 108 bytes


def socket_address(run_dir: Path, name: str) -> str:
    """An ipc:// endpoint in the run directory, or under the temporary directory where that path is too long."""
    path = run_dir / "envs" / f"{name}.sock"
    if len(str(path)) > MAX_SOCKET_PATH:
        digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
        path = Path(tempfile.gettempdir()) / f"rl-envs-{digest}" / f"{name}.sock"
    return f"ipc://{path}"


def place_env_servers(run_dir: Path, envs_by_kind: dict[str, list[EnvConfig]], model_endpoints: list[str],
                      renderer_models: list[str] = ()) -> dict[str, EnvServerConfig]:
    """Each env server rl starts, by its process name (`<kind>-<label>`: `env-...` for training, `eval-...`), with
    its `[[env]]` table now naming its socket in `run_dir`; its episodes may call `model_endpoints` only (the run's
    inference servers) and render with local tokenizers or `renderer_models` (the run's model)."""
    servers = {}
    for prefix, envs in envs_by_kind.items():
        for spec in envs:
            if spec.address is not None or spec.in_process:
                continue
            name = f"{prefix}-{re.sub(r'[^A-Za-z0-9._-]', '-', spec.label)}"
            address = socket_address(run_dir, name)
            servers[name] = started_for(spec, address, model_endpoints, renderer_models=renderer_models)
            spec.address = address
    return servers
