"""ZMQ CURVE for the KV-events socket: who may receive every tenant's token ids.

A PUB socket has no authentication of its own: whoever connects receives. CURVE
(ZMQ's elliptic-curve encryption, RFC 26/CurveZMQ) encrypts the stream, and the side
that binds (the CURVE server) admits only clients whose public keys it holds, through
a ZAP handler. Keys are pyzmq's certificate files (`zmq.auth.create_certificates(DIR,
NAME)` writes `NAME.key`, public, and `NAME.key_secret`, both halves):

- bind: this server's `.key_secret`, and a directory of the subscribers' `.key` files;
- connect: this server's `.key_secret`, and the listener's `.key` (its public key).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from server.private_files import shared_mode

Mode = Literal["bind", "connect"]


class CurveError(ValueError):
    """Keys that cannot be used; the message names the file and the flag."""


def is_local_endpoint(endpoint: str) -> bool:
    """ipc/inproc, or tcp on a loopback address: nothing off this machine reaches it."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # `*`, an interface name or a host name: reachable from elsewhere


@dataclass(frozen=True)
class CurveKeys:
    secret_key: Path  # this server's NAME.key_secret
    peer_keys: Path  # bind: directory of subscribers' public .key files; connect: the listener's .key

    def check(self, mode: Mode) -> None:
        """Refuse a secret readable by others, and peer keys of the wrong kind for `mode`."""
        private_file(self.secret_key, "--kv-events-secret-key")
        if mode == "bind" and not self.peer_keys.is_dir():
            raise CurveError(
                f"--kv-events-peer-keys {self.peer_keys}: bind needs a directory of subscribers' .key files"
            )
        if mode == "connect" and not self.peer_keys.is_file():
            raise CurveError(f"--kv-events-peer-keys {self.peer_keys}: connect needs the listener's public .key file")

    def apply(self, context: Any, socket: Any, mode: Mode) -> Any:
        """Make `socket` a CURVE server (bind) or client (connect); the authenticator to stop
        at close (bind), else None."""
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(str(self.secret_key))
        if secret is None:
            raise CurveError(f"--kv-events-secret-key {self.secret_key} holds no secret key (a .key_secret file)")
        socket.curve_secretkey, socket.curve_publickey = secret, public
        if mode == "connect":
            socket.curve_serverkey, _ = zmq.auth.load_certificate(str(self.peer_keys))
            return None
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(self.peer_keys))
        socket.curve_server = True
        return authenticator


def private_file(path: Path, flag: str) -> None:
    """A secret the server reads: refused where group or others may read it."""
    try:
        info = path.stat()
    except OSError as exc:
        raise CurveError(f"{flag} {path}: {exc.strerror}") from exc
    if problem := shared_mode(info, f"{flag} {path}"):
        raise CurveError(problem)
