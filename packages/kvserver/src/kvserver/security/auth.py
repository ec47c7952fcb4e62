"""The server's credentials: its API token (configured, or generated at first start) and CURVE keys.

Every ZMQ op but ping and every HTTP endpoint but the probes, status and metrics needs the token,
on loopback too: with the default configuration a process of another OS user can neither read nor
write KV, pin nor clear. Same-user clients find the token (generated or configured) in a 0600 file
the server writes once its ports are bound (see kvprotocol._credentials). Beyond loopback the ZMQ
plane is also encrypted with CURVE.
"""

from __future__ import annotations

import logging
from pathlib import Path

import zmq

from kvprotocol import is_loopback, tokens_equal
from kvprotocol._credentials import curve_paths, ensure_server_keypair, load_or_new_token, publish_token, token_path

from ..config import ServerConfig
from .tenants import ADMIN, Identity, TenantBook, tenants_path

log = logging.getLogger("kvserver")


class ServerAuth:
    def __init__(self, config: ServerConfig) -> None:
        self.generated = config.api_token is None
        self.token: str = config.api_token or load_or_new_token(config.port)
        self.token_file: Path = token_path(config.port)
        self.curve = config.curve if config.curve is not None else not is_loopback(config.host)
        self.public_key_file: Path | None = curve_paths(config.port)[1] if self.curve else None
        self._keys = ensure_server_keypair(config.port) if self.curve else None
        self.tenants = TenantBook(Path(config.tenants_file) if config.tenants_file else tenants_path(config.port))

    def publish(self, port: int) -> None:
        """Write the token for a port this server has bound, for same-user clients to find."""
        publish_token([port], self.token)

    def secure(self, sock: zmq.Socket) -> None:
        """Make a ROUTER socket a CURVE server (before it binds) when CURVE is on."""
        if self._keys is None:
            return
        public, secret = self._keys
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    @property
    def public_key(self) -> str | None:
        return self._keys[0].decode() if self._keys else None

    def accepts(self, auth: object) -> bool:
        return isinstance(auth, str) and tokens_equal(auth, self.token)

    def identify(self, auth: object) -> Identity | None:
        """Who a token is: the server's own token is the admin (default tenant), else a tenant's, else None."""
        if not isinstance(auth, str) or not auth:
            return None
        if tokens_equal(auth, self.token):
            return ADMIN
        tenant = self.tenants.identify(auth)
        return None if tenant is None else Identity(tenant.name, shm=tenant.allow_shm)

    def describe(self) -> str:
        """One line for the start banner: where clients find the credentials."""
        parts = [f"token={self.token_file}" + ("" if self.generated else " (configured)")]
        if self.public_key_file is not None:
            parts.append(f"curve-key={self.public_key_file}")
        return " ".join(parts)
