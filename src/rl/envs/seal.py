"""An env server reachable beyond this host, sealed with the run's secret (ZMQ's CURVE).

A request to an env server runs an episode: for a sandboxed environment, code. verifiers' server and client speak
plain ZMQ, so a server bound beyond loopback would run whatever any peer that reaches it sends. Both ends derive two
CURVE key pairs from the secret, one for the server and one for its clients: the server's socket handshakes as a CURVE
server and admits (through ZMQ's authentication handler, before any frame of the peer's reaches verifiers) only the
client key; the client handshakes knowing the server's key. A peer without the secret can neither complete the
handshake nor read the traffic, which is encrypted. ipc:// and loopback addresses stay open to this host's users:
the socket's directory, or the host, is the boundary there.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq
import zmq.auth.thread

ZAP_DOMAIN = "rl-env-server"
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def beyond_loopback(address: str) -> bool:
    """Whether a ZMQ endpoint is a TCP address other hosts may reach (ipc:// and inproc:// stay on this host)."""
    if not address.startswith("tcp://"):
        return False
    host = urlsplit(address).hostname or ""
    if host in LOOPBACK_NAMES:
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or an interface (`tcp://eth0:5000`, `tcp://*:5000`)
        return True


@dataclass(frozen=True)
class SealKeys:
    """Z85-encoded CURVE keys, derived from the secret alone."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def seal_keys(secret: str) -> SealKeys:
    def pair(role: str) -> tuple[bytes, bytes]:
        private = zmq.utils.z85.encode(hashlib.sha256(f"rl env-server {role} key\0{secret}".encode()).digest())
        return zmq.curve_public(private), private

    server_public, server_secret = pair("server")
    client_public, client_secret = pair("client")
    return SealKeys(server_public, server_secret, client_public, client_secret)


class AdmitOneKey:
    """ZMQ's authentication handler's question, answered: is this the run's client key?"""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:  # the key Z85-encoded
        return domain == ZAP_DOMAIN and key == self.client_public


def seal_server(socket: zmq.Socket, secret: str) -> zmq.auth.thread.ThreadAuthenticator:
    """Make `socket` a CURVE server that admits the run's clients only, for the endpoints it binds from now on (a
    listener takes the socket's options as they are when it is bound). The authenticator must run as long as the
    socket."""
    keys = seal_keys(secret)
    authenticator = zmq.auth.thread.ThreadAuthenticator(zmq.Context.shadow(socket.context.underlying))
    authenticator.start()
    authenticator.configure_curve_callback(ZAP_DOMAIN, AdmitOneKey(keys.client_public))
    socket.curve_secretkey, socket.curve_publickey = keys.server_secret, keys.server_public
    socket.curve_server = True
    socket.zap_domain = ZAP_DOMAIN.encode()
    return authenticator


CLIENT_OPTIONS = (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM)  # what verifiers sets on its client's socket


def seal_client(client, secret: str) -> None:
    """Give verifiers' `EnvClient` (connected open when made; nothing sent yet) a socket of the same kind and options
    that connects to its address as the run's CURVE client."""
    keys = seal_keys(secret)
    open_socket = client.socket
    sealed = client.ctx.socket(open_socket.socket_type)
    for option in CLIENT_OPTIONS:
        sealed.setsockopt(option, open_socket.getsockopt(option))
    sealed.curve_secretkey, sealed.curve_publickey = keys.client_secret, keys.client_public
    sealed.curve_serverkey = keys.server_public
    sealed.connect(client.address)
    open_socket.close()
    client.socket = sealed
