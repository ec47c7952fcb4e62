"""Print the request and reply tables of docs/protocol.md from kvprotocol's typed definitions.

`uv run python scripts/protocol_tables.py` prints them; tests/kvprotocol/test_protocol_doc.py checks
that docs/protocol.md holds exactly this text, so the doc cannot drift from the Structs.
"""

from __future__ import annotations

import msgspec.inspect as mi

from kvprotocol._replies import REPLIES
from kvprotocol._requests import REQUESTS, Request

ENVELOPE = {"v", "id", "auth"}


def _type(t: mi.Type) -> str:
    if isinstance(t, mi.UnionType):
        parts = [_type(x) for x in t.types if not isinstance(x, mi.NoneType)]
        return " \\| ".join(parts) + (" \\| null" if any(isinstance(x, mi.NoneType) for x in t.types) else "")
    if isinstance(t, mi.IntType):
        bounds = [f">= {t.ge}" if t.ge is not None else "", f"<= {t.le}" if t.le is not None else ""]
        return "int" + (f" ({', '.join(b for b in bounds if b)})" if any(bounds) else "")
    if isinstance(t, mi.StrType):
        if t.pattern:
            return f"str `{t.pattern}`"
        if t.max_length is not None:
            return f"str ({t.min_length or 0}-{t.max_length} chars)"
        return "str"
    if isinstance(t, mi.BytesType):
        return "bytes" + (f" (<= {t.max_length} B)" if t.max_length is not None else "")
    if isinstance(t, mi.ListType):
        n = f", {t.min_length or 0}-{t.max_length}" if t.max_length is not None else ""
        return f"[{_type(t.item_type)}{n}]"
    if isinstance(t, mi.TupleType):
        return "[" + ", ".join(_type(x) for x in t.item_types) + "]"
    if isinstance(t, mi.LiteralType):
        return " \\| ".join(f'"{v}"' for v in t.values)
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    if isinstance(t, mi.DictType):
        return "map"
    return type(t).__name__.removesuffix("Type").lower()


def _fields(cls: type, skip: set[str]) -> str:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    out = []
    for f in info.fields:
        if f.name in skip:
            continue
        opt = "" if f.required else (f" = {f.default!r}" if f.default is not mi.NODEFAULT else "?")
        out.append(f"`{f.name}`{opt}: {_type(f.type)}")
    return "; ".join(out) or "–"


def tables() -> str:
    lines = ["| op | request fields (`?`/`= x`: optional) | reply fields |", "|---|---|---|"]
    for op, cls in REQUESTS.items():
        data = " (+ data frames)" if cls.DATA_IN else ""
        lines.append(f"| `{op}` | {_fields(cls, ENVELOPE)}{data} | {_fields(REPLIES[op], set())} |")
    lines += ["", "| type | fields |", "|---|---|"]
    from kvprotocol import _replies as rp
    from kvprotocol import _requests as rq

    for cls in (
        rq.KeySpaceW,
        rq.LayoutW,
        rp.StoreSlot,
        rp.BlendSlot,
        rp.BlendMatch,
        rp.RetrievedObject,
        rp.ECObject,
        rp.ArenaInfo,
    ):
        lines.append(f"| `{cls.__name__}` | {_fields(cls, set())} |")
    lines += ["", "Envelope of every request: " + _fields(Request, set())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(tables(), end="")
