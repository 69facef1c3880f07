"""What an env server takes from its peers (a request runs an episode: for a sandboxed environment, code).

- Frames: a message past `max_message_bytes` is refused by ZMQ at the broker's socket (`MAXMSGSIZE`: the peer is
  disconnected, nothing of the message is kept); a request whose id is not short ASCII text is answered with an error
  and dropped by the worker before verifiers or rl decode it (`screen_request`), so one frame cannot end a worker.
- Model clients: a request names the client its episodes call the model through (verifiers resolves the API key and
  headers from environment variables the request names, and sends them to the URL it names). A worker runs an episode
  only where every variable named is one the server allows (`client_env_vars`) and the URL's origin is one it allows
  (`model_endpoints`; unset: loopback only, and then no key: another local user may listen on a loopback port), so a
  request can neither read another variable of the worker's nor send one elsewhere (`ClientPolicy`); rl's client
  follows no redirect. The tokenizer a request renders with is a local directory or one of `renderer_models` (a hub
  id would have the worker reach the hub). `*` allows any: the env server an orchestrator or `eval` started by hand
  starts as its child is reached through a socket in a directory only its user can enter, and calls whatever that
  user's process names.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

ANY = "*"
MAX_REQUEST_ID_BYTES = 128  # verifiers' and rl's clients send 32 hex characters


def screen_request(frames: list) -> str | None:
    """Why a worker must not take these frames ([peer, request id, method, payload]), or None."""
    request_id = bytes(frames[1]) if len(frames) == 4 else b""
    if len(frames) == 4 and (len(request_id) > MAX_REQUEST_ID_BYTES or not request_id.isascii()):
        return f"the request id is not ASCII text of at most {MAX_REQUEST_ID_BYTES} bytes"
    return None


def origin(url: str) -> str:
    """`scheme://host:port` of a URL, the port made explicit."""
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme, 0)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


def on_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ClientPolicy:
    """The environment variables and model endpoints a request's model client may name."""

    env_vars: frozenset[str]  # `*`: any
    endpoints: frozenset[str] | None  # origins, or `*`: any; None: any on loopback, none with a key
    renderer_models: frozenset[str] = frozenset()  # besides local directories, the tokenizers a request may name

    @classmethod
    def of(cls, env_vars: list[str], endpoints: list[str] | None,
           renderer_models: list[str] = ()) -> "ClientPolicy":
        origins = None if endpoints is None else frozenset(e if e == ANY else origin(e) for e in endpoints)
        return cls(frozenset(env_vars), origins, frozenset(renderer_models))

    def check(self, client, model: str | None = None) -> None:
        """ValueError naming what `client` (verifiers' client config; `model`, the model its request names) may not
        do here."""
        named = {client.api_key_var, *client.headers_from_env.values()} - {None}
        refused = [] if ANY in self.env_vars else sorted(named - self.env_vars)
        if refused:
            raise ValueError(f"the request's client names environment variables this env server does not allow: "
                             f"{', '.join(refused)} (allowed: client_env_vars = {sorted(self.env_vars)})")
        keys = sorted(v for v in named if os.environ.get(v))
        if self.endpoints is None and keys:  # any loopback port: another local user's listener among them
            raise ValueError(f"the request's client would send {', '.join(keys)} to {origin(client.base_url)}, but "
                             "this env server names no model_endpoints: set model_endpoints to the model servers "
                             "its episodes may call with a key")
        if self.endpoints is None:
            allowed = on_loopback(client.base_url)
        else:
            allowed = ANY in self.endpoints or origin(client.base_url) in self.endpoints
        if not allowed:
            where = "loopback only" if self.endpoints is None else f"model_endpoints = {sorted(self.endpoints)}"
            raise ValueError(f"the request's client calls {origin(client.base_url)}, which this env server does not "
                             f"allow ({where})")
        renders = hasattr(client, "renderer")  # a training client: it loads the tokenizer it names, else the model's
        renderer = (client.renderer_model_name or model) if renders else None
        if renderer and not (Path(renderer).is_dir() or {renderer, ANY} & self.renderer_models):
            raise ValueError(f"the request's client renders with {renderer!r}, which is no local directory and not "
                             f"among renderer_models = {sorted(self.renderer_models)}: a worker reaches no hub "
                             "it was not allowed to")
