"""kvprotocol: the wire protocol, cache keys and clients every kvserver component speaks.

Never imports torch: it runs on hosts with no GPU.
"""

from ._backoff import Backoff
from ._defaults import DEFAULT_CHUNK_SIZE, DEFAULT_HTTP_PORT, DEFAULT_PORT, DEFAULT_URL
from ._client import DEFAULT_TIMEOUT, AsyncClient, Client, Reply
from ._pipeline import Pipeline
from ._credentials import (
    SERVER_KEY_ENV,
    STATE_DIR_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    CredentialError,
    resolve_server_key,
    resolve_token,
)
from ._errors import ErrorCode, KVProtocolError, RequestTimeout, ServerError, ValidationError
from ._blend import BLEND_SEED, blend_fingerprints, blend_object_hash
from ._hashing import (
    EXTRA_DIGEST_BYTES,
    ZERO_HASH,
    ExtraKeys,
    check_extra,
    chunk_hashes,
    pack_tokens,
    tail_hash,
    unpack_tokens,
)
from ._keys import SHARED_RANK, ObjectKey, validate_model, validate_salt
from ._geometry import GroupGeometry, prefix_hit
from ._layout import DTYPES, LAYOUT_TAGS, MAX_OBJECT_BYTES, LayoutDescriptor
from ._messages import MAX_KEYS, MAX_TOKENS, PROTOCOL_VERSION, SCHEMA, validate_request
from ._keyspace import KeySpace
from ._typed import SESSION_ID_BYTES, new_session_id
from . import _flows as flows
from . import _replies as replies
from . import _requests as requests
from ._security import bearer_matches, bearer_refusal, exposure_refusal, is_loopback, listen_socket, tokens_equal

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "DTYPES",
    "LAYOUT_TAGS",
    "MAX_TOKENS",
    "PROTOCOL_VERSION",
    "SCHEMA",
    "ZERO_HASH",
    "AsyncClient",
    "Client",
    "Pipeline",
    "bearer_matches",
    "bearer_refusal",
    "exposure_refusal",
    "listen_socket",
    "is_loopback",
    "tokens_equal",
    "ErrorCode",
    "KVProtocolError",
    "KeySpace",
    "LayoutDescriptor",
    "ObjectKey",
    "Reply",
    "RequestTimeout",
    "ServerError",
    "ValidationError",
    "chunk_hashes",
    "tail_hash",
    "pack_tokens",
    "unpack_tokens",
    "validate_model",
    "validate_request",
    "validate_salt",
    "SERVER_KEY_ENV",
    "STATE_DIR_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "CredentialError",
    "resolve_server_key",
    "resolve_token",
    "MAX_KEYS",
    "MAX_OBJECT_BYTES",
    "EXTRA_DIGEST_BYTES",
    "ExtraKeys",
    "check_extra",
    "flows",
    "replies",
    "requests",
    "BLEND_SEED",
    "blend_fingerprints",
    "blend_object_hash",
    "SESSION_ID_BYTES",
    "new_session_id",
    "Backoff",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_PORT",
    "DEFAULT_URL",
    "SHARED_RANK",
    "GroupGeometry",
    "prefix_hit",
]
