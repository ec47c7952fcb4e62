"""Defaults every component agrees on: where the server listens and how many tokens a chunk holds.

Why one place: a server and its clients that disagree on the port or the chunk size silently miss.
"""

from __future__ import annotations

DEFAULT_PORT = 5555
DEFAULT_HTTP_PORT = 8080
DEFAULT_URL = f"tcp://127.0.0.1:{DEFAULT_PORT}"
DEFAULT_CHUNK_SIZE = 256
