"""Where credentials live and how every client finds them without configuration.

A server with no configured token generates one at first start; it writes its token (generated or
configured) into `<state dir>/token-<port>` (0600, in a 0700 directory of the server's user) for its
ZMQ port and its HTTP port once each is bound. A client of
the same OS user reads it automatically for a loopback URL; a process of another user cannot. The
server's CURVE key pair lives next to it (`curve-<port>.key`, `curve-<port>.pub`).

Lookup order of a client's token: explicit argument > $KVSERVER_API_TOKEN > the file named by
$KVSERVER_API_TOKEN_FILE > the deprecated $KVCLI_TOKEN / $KVCLI_COORDINATOR_API_TOKEN > the default
file for the URL's port (loopback URLs only, and never when a socket of another OS user listens
on an address that URL may reach: every address its host resolves to, matched exactly).
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import warnings
from pathlib import Path
from urllib.parse import urlparse

from ._security import is_loopback

TOKEN_ENV = "KVSERVER_API_TOKEN"  # one name for the server, kvcli, kvconnector and the coordinator
TOKEN_FILE_ENV = "KVSERVER_API_TOKEN_FILE"
STATE_DIR_ENV = "KVSERVER_STATE_DIR"
LEGACY_TOKEN_ENVS = ("KVCLI_TOKEN", "KVCLI_COORDINATOR_API_TOKEN")  # deprecated spellings, still honoured
SERVER_KEY_ENV = "KVSERVER_SERVER_KEY"  # the server's CURVE public key (z85), for clients beyond loopback
MAX_TOKEN_CHARS = 1024


class CredentialError(Exception):
    """A credential file is missing, unsafe (readable by others, owned by another user) or malformed."""


def state_dir() -> Path:
    """$KVSERVER_STATE_DIR, else $XDG_RUNTIME_DIR/kvserver, else ~/.local/state/kvserver."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kvserver"
    return Path.home() / ".local" / "state" / "kvserver"


def private_dir(path: Path) -> Path:
    """Create (0700) or check a directory only this user can enter; refuses one owned by another user."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise CredentialError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write a 0600 file atomically (never readable by others, whatever the umask)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_private(path: Path, strict: bool = True) -> str:
    """Read a credential file; `strict` (default files) refuses one others can read or another user owns.

    A file the operator names explicitly (--api-token-file, a mounted secret) is read as it is.
    """
    try:
        st = path.stat()
        if strict and st.st_uid != os.getuid():
            raise CredentialError(f"{path} belongs to uid {st.st_uid}, not to this user")
        if strict and stat.S_IMODE(st.st_mode) & 0o077:
            raise CredentialError(f"{path} is readable by other users (chmod 600 it)")
        text = path.read_text().strip()
    except OSError as exc:
        raise CredentialError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not text or len(text) > MAX_TOKEN_CHARS or any(ch.isspace() for ch in text):
        raise CredentialError(f"{path} holds no valid token (1-{MAX_TOKEN_CHARS} chars, no whitespace)")
    return text


def token_path(port: int) -> Path:
    return state_dir() / f"token-{port}"


def load_or_new_token(port: int) -> str:
    """The token in the port's default file (a restart keeps it), else a new random one (not written yet)."""
    path = token_path(port)
    try:
        return read_private(path)
    except CredentialError:
        try:
            if path.exists() and path.stat().st_uid != os.getuid():
                raise
        except OSError as exc:
            raise CredentialError(f"cannot use {path}: {exc.strerror or exc}") from exc
        return secrets.token_urlsafe(32)


def publish_token(ports: list[int], token: str) -> None:
    """Write the token into each port's default file (0600, in the 0700 state directory).

    Called once a port is bound, so a server that fails to start never overwrites the file of the
    server that owns the port.
    """
    private_dir(state_dir())
    for port in ports:
        path = token_path(port)
        try:
            if read_private(path) == token:
                continue
        except CredentialError:
            pass
        write_private(path, token)


def _proc_listeners() -> list[tuple[int, bytes, int, int]] | None:
    """(family, packed address, port, uid) of every listening TCP socket (Linux /proc), None if unreadable."""
    found: list[tuple[int, bytes, int, int]] = []
    readable = False
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as fh:
                readable = True
                next(fh)
                for line in fh:
                    cols = line.split()
                    if cols[3] != "0A":  # 0A = LISTEN
                        continue
                    addr_hex, port_hex = cols[1].rsplit(":", 1)
                    raw = bytes.fromhex(addr_hex)  # the kernel prints each 32-bit word in host order
                    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append((family, packed, int(port_hex, 16), int(cols[7])))
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return found if readable else None


_ANY4, _ANY6 = bytes(4), bytes(16)
_MAPPED = bytes(10) + b"\xff\xff"


def _accepts(listener: tuple[int, bytes, int, int], family: int, packed: bytes) -> bool:
    """Whether a listening socket can accept a connection to (family, address): the same address,
    its family's wildcard, or for IPv4 an IPv6 wildcard or v4-mapped socket (dual stack)."""
    lfam, laddr, _, _ = listener
    if lfam == family:
        return laddr == packed or laddr == (_ANY4 if family == socket.AF_INET else _ANY6)
    return family == socket.AF_INET and lfam == socket.AF_INET6 and laddr in (_ANY6, _MAPPED + packed)


def listener_uids(host: str, port: int) -> set[int] | None:
    """The uids owning the sockets a connection to host:port may reach: for every address the host
    resolves to, the listener on that exact address (or a wildcard accepting it). None: /proc is
    unreadable or the host does not resolve (unknown, not "nobody")."""
    listeners = _proc_listeners()
    if listeners is None:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    owners: set[int] = set()
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        packed = socket.inet_pton(family, str(sockaddr[0]).split("%", 1)[0])
        owners.update(lst[3] for lst in listeners if lst[2] == port and _accepts(lst, family, packed))
    return owners


def listener_is_ours(host: str, port: int) -> bool:
    """True unless a socket of another OS user may receive a connection to host:port.

    Nobody listening counts as ours (the connection fails; nothing is sent). Every resolved address
    is checked, so `localhost` answering ::1 and 127.0.0.1 is safe only if both are ours.
    """
    owners = listener_uids(host, port)
    return owners is None or owners <= {os.getuid()}


def default_token(url: str) -> str | None:
    """The default token file for a loopback URL's port, if this user can read it and no listener of
    another user may receive a connection to that URL (a squatter must never receive it)."""
    parsed = urlparse(url)
    if not parsed.hostname or not is_loopback(parsed.hostname) or parsed.port is None:
        return None
    path = token_path(parsed.port)
    try:
        if not path.exists():
            return None
    except OSError:  # e.g. another user's state directory: not ours to read
        return None
    if not listener_is_ours(parsed.hostname, parsed.port):
        return None
    try:
        return read_private(path)
    except CredentialError:
        return None


def resolve_token(token: str | None = None, url: str | None = None) -> str | None:
    """A client's token: explicit > $KVSERVER_API_TOKEN > $KVSERVER_API_TOKEN_FILE > default file for `url`."""
    if token:
        return token
    env = os.environ.get(TOKEN_ENV)
    if env:
        return env
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        return read_private(Path(path), strict=False)
    legacy = legacy_token()
    if legacy:
        return legacy
    return default_token(url) if url else None


def legacy_token() -> str | None:
    """A token in a deprecated variable (KVCLI_TOKEN, KVCLI_COORDINATOR_API_TOKEN), with a warning once."""
    for name in LEGACY_TOKEN_ENVS:
        value = os.environ.get(name)
        if value:
            if name not in _WARNED:
                _WARNED.add(name)
                warnings.warn(
                    f"${name} is deprecated: use ${TOKEN_ENV} (or ${TOKEN_FILE_ENV})", FutureWarning, stacklevel=3
                )
            return value
    return None


_WARNED: set[str] = set()


def curve_paths(port: int) -> tuple[Path, Path]:
    return state_dir() / f"curve-{port}.key", state_dir() / f"curve-{port}.pub"


def ensure_server_keypair(port: int) -> tuple[bytes, bytes]:
    """The server's CURVE (public, secret) keys (z85), generated at first start into 0600 files."""
    import zmq

    private_dir(state_dir())
    secret_path, public_path = curve_paths(port)
    try:
        secret = read_private(secret_path).encode()
        public = zmq.curve_public(secret)
        if public_path.read_text().strip().encode() != public:
            write_private(public_path, public.decode())
        return public, secret
    except (CredentialError, OSError, ValueError, zmq.ZMQError):
        if secret_path.exists() and secret_path.stat().st_uid != os.getuid():
            raise
    pub, sec = zmq.curve_keypair()
    write_private(secret_path, sec.decode())
    write_private(public_path, pub.decode())
    return pub, sec


def resolve_server_key(server_key: str | None = None) -> bytes | None:
    """The server's CURVE public key a client must know: explicit, else $KVSERVER_SERVER_KEY (the z85
    key itself, or the path of the server's curve-<port>.pub file). None: talk without CURVE."""
    value = server_key or os.environ.get(SERVER_KEY_ENV)
    if not value:
        return None
    if len(value) != 40 and os.path.exists(value):
        value = Path(value).read_text().strip()
    if len(value) != 40:
        raise CredentialError("a CURVE server key is 40 z85 characters")
    return value.encode()
