"""Which credentials the coordinator's fan-out presents to an instance, given its registered http_url.

A registrant chooses its http_url, so the coordinator never sends its token to just any address:
only to loopback instances (when no socket of another OS user listens on that port) and to hosts
the operator trusts (`--trust-host`). A loopback instance of this user with no fleet token gets its
own generated token from its default 0600 file (per-instance credentials, zero configuration).
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from kvprotocol import is_loopback
from kvprotocol._credentials import default_token, listener_uid


class InstanceCredentials:
    def __init__(self, token: str | None, trusted_hosts: tuple[str, ...] = ()) -> None:
        self.token = token
        self.trusted = {h.lower() for h in trusted_hosts}

    def headers_for(self, http_url: str) -> dict[str, str]:
        parsed = urlparse(http_url)
        host = (parsed.hostname or "").lower()
        token: str | None = None
        if is_loopback(host):
            owner = listener_uid(parsed.port) if parsed.port else None
            if owner is None or owner == os.getuid():
                token = self.token or default_token(http_url)
        elif host in self.trusted:
            token = self.token
        return {"Authorization": f"Bearer {token}"} if token else {}
