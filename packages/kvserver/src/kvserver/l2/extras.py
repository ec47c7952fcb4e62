"""Optional L2 dependencies: each tier's library is an extra of kvserver, imported only when configured.

Why: a server with L1 only (or the fs tier) needs none of boto3, redis, zstandard or cryptography;
an operator who configures a tier whose library is missing gets one line naming the extra to install,
at start-up, instead of a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> the kvserver extra that installs it
EXTRAS = {"boto3": "s3", "redis": "redis", "zstandard": "zstd", "cryptography": "crypto"}


class MissingExtra(ValueError):
    """A configured feature needs an optional dependency that is not installed (a configuration error)."""


def require(module: str, feature: str) -> ModuleType:
    """Import `module` for `feature`, or raise MissingExtra naming `pip install 'kvserver[extra]'`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = EXTRAS.get(module.split(".")[0], "all")
        raise MissingExtra(
            f"{feature} needs the Python package {module.split('.')[0]!r}: "
            f"install it with pip install 'kvserver[{extra}]'"
        ) from None
