"""vLLM integration: `KVServerConnector`, a KV connector for vLLM 0.32 (v1 connector API).

Only this subpackage imports vLLM, and only when `KVServerConnector` is first touched (vLLM's
connector factory does `getattr(import_module("kvconnector.vllm"), "KVServerConnector")`), so its
torch-free helpers (`config`, `plan`) import anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .connector import KVServerConnector
    from .ec_connector import KVServerECConnector

__all__ = ["KVServerConnector", "KVServerECConnector"]


def __getattr__(name: str) -> type[KVServerConnector] | type[KVServerECConnector]:
    if name == "KVServerConnector":
        from .connector import KVServerConnector

        return KVServerConnector
    if name == "KVServerECConnector":
        from .ec_connector import KVServerECConnector

        return KVServerECConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
