"""CurveZMQ for the live, replay and snapshot sockets, configured by key files.

Prompt token ids travel in ``BlockStored`` events; on a shared network they should be
neither readable nor subscribable by strangers. CurveZMQ (pyzmq's ``zmq.auth``) gives both
encryption and client authentication: the publisher holds a secret key and accepts only
clients whose public keys sit in a directory; a client holds its own key pair and the
publisher's public key. Key files are the ones ``zmq.auth.create_certificates`` writes
(``kvwire keys NAME``).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["CurveClient", "CurveServer", "generate_keys"]


class CurveServer(msgspec.Struct, frozen=True, kw_only=True):
    """Publisher side: its secret key file and the directory of authorised client keys.

    ``authorized_keys_dir=None`` accepts any client that speaks CURVE (encryption only).
    """

    secret_key_file: str
    authorized_keys_dir: str | None = None

    def _keys(self) -> tuple[bytes, bytes]:
        public, secret = _load(self.secret_key_file, need_secret=True)
        return public, secret

    def start(self, ctx: zmq.Context) -> ThreadAuthenticator:
        """Start the ZAP handler for ``ctx``; call before any socket binds."""
        if self.authorized_keys_dir is not None and not os.path.isdir(self.authorized_keys_dir):
            raise ValueError(
                f"curve authorized_keys_dir {self.authorized_keys_dir!r} is not a directory"
            )
        self._keys()  # fail early on a bad key file
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(
            domain="*",
            location=self.authorized_keys_dir
            if self.authorized_keys_dir is not None
            else zmq.auth.CURVE_ALLOW_ANY,
        )
        return auth

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = self._keys()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_server = True


class CurveClient(msgspec.Struct, frozen=True, kw_only=True):
    """Consumer side: its own secret key file and the publisher's public key file."""

    secret_key_file: str
    server_public_key_file: str

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = _load(self.secret_key_file, need_secret=True)
        server_public, _ = _load(self.server_public_key_file, need_secret=False)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_public


def _load(path: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read CURVE key file {path!r}: {e}") from None
    if need_secret and not secret:
        raise ValueError(
            f"CURVE key file {path!r} has no secret key (use the .key_secret file)"
        )
    return public, secret


def generate_keys(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(d), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)
