"""Which credential the coordinator presents to an instance, given its registered http_url.

A registrant chooses its http_url, so the coordinator never derives a credential from it (no
default token file for "its" port): it presents only the instance token it was given explicitly,
and only to loopback instances whose listening socket belongs to this OS user (every address the
host resolves to, matched exactly) and to hosts the operator trusts (`--trust-host`). A KV-events
socket (ZMQ PLAIN) gets it on the same terms, but only while it is already bound by this user: ZMQ
reconnects by itself, so "nobody listening" is not safe there.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import urlparse

from kvprotocol import is_loopback
from kvprotocol._credentials import listener_is_ours, listener_uids


class InstanceCredentials:
    def __init__(self, token: str | None, trusted_hosts: tuple[str, ...] = ()) -> None:
        self.token = token
        self.trusted = {h.lower() for h in trusted_hosts}

    def token_for(self, http_url: str) -> str | None:
        """The instance token, if this URL may receive it; None: ask anonymously."""
        if not self.token:
            return None
        parsed = urlparse(http_url)
        host = (parsed.hostname or "").lower()
        if host in self.trusted:
            return self.token
        if is_loopback(host) and parsed.port and listener_is_ours(host, parsed.port):
            return self.token
        return None

    def token_for_events(self, endpoint: str) -> str | None:
        """The instance token for a KV-events endpoint (tcp:// or ipc://), if it may receive it."""
        if not self.token:
            return None
        scheme, _, rest = endpoint.partition("://")
        if scheme == "ipc":
            try:
                st = os.lstat(rest)
            except OSError:
                return None
            return self.token if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() else None
        if scheme != "tcp":
            return None
        host, _, port = rest.rpartition(":")
        host = (host[1:-1] if host.startswith("[") and host.endswith("]") else host).lower()
        if host in self.trusted:
            return self.token
        if not is_loopback(host) or not port.isdigit():
            return None
        owners = listener_uids(host, int(port))
        return self.token if owners and owners <= {os.getuid()} else None

    def headers_for(self, http_url: str) -> dict[str, str]:
        token = self.token_for(http_url)
        return {"Authorization": f"Bearer {token}"} if token else {}
