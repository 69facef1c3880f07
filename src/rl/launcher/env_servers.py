"""The env servers `rl` starts beside the orchestrator: one per `[[env]]` (and eval `[[env]]`) without an `address`
(rl/env_server.py), each at a socket of its own, which is filled into the orchestrator's table; none for a table with
`workers = 0`, whose episodes run in the orchestrator's process."""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

from rl.env_server import EnvServerConfig, started_for
from rl.orchestrator.config import OrchestratorConfig

MAX_SOCKET_PATH = 100  # a Unix socket's path must fit sockaddr_un's 108 bytes


def socket_address(run_dir: Path, name: str) -> str:
    """An ipc:// endpoint in the run directory, or under the temporary directory where that path is too long."""
    path = run_dir / "envs" / f"{name}.sock"
    if len(str(path)) > MAX_SOCKET_PATH:
        digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
        path = Path(tempfile.gettempdir()) / f"rl-envs-{digest}" / f"{name}.sock"
    return f"ipc://{path}"


def place_env_servers(o: OrchestratorConfig) -> dict[str, EnvServerConfig]:
    """Each env server rl starts, by its process name (`env-<label>`, `eval-<label>`), with the orchestrator's
    table now naming its socket."""
    servers = {}
    for prefix, envs in (("env", o.env), ("eval", o.eval.env)):
        for spec in envs:
            if spec.address is not None or spec.in_process:
                continue
            name = f"{prefix}-{re.sub(r'[^A-Za-z0-9._-]', '-', spec.label)}"
            address = socket_address(o.output_dir.absolute(), name)
            servers[name] = started_for(spec, address)
            spec.address = address
    return servers
