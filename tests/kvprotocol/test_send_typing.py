"""`send` is typed by its request: mypy sees the reply Struct each request gets, with no cast."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvprotocol import _replies as rp
from kvprotocol import _requests as rq

mypy_api = pytest.importorskip("mypy.api")

SNIPPET = """
from typing import assert_type

from kvprotocol import AsyncClient, Client
from kvprotocol import _replies as rp
from kvprotocol import _requests as rq

def sync(c: Client, ks: rq.KeySpaceW) -> None:
    assert_type(c.send(rq.Lookup(keyspace=ks, tokens=b""))[0], rp.LookupReply)
    assert_type(c.send(rq.Unpin(keyspace=ks, tokens=b""))[0], rp.PinReply)
    assert_type(c.send(rq.ECClear())[0], rp.ClearReply)

async def asynchronous(c: AsyncClient) -> None:
    assert_type((await c.send(rq.Retrieve(session="s", rank=0, start_chunk=0, end_chunk=1)))[0], rp.RetrieveReply)
"""


def test_each_request_names_the_reply_struct_of_its_op() -> None:
    """The Generic parameter of every request Struct agrees with REPLIES, the run-time table."""
    for op, cls in rq.REQUESTS.items():
        (base,) = [b for b in cls.__orig_bases__ if getattr(b, "__origin__", None) is not None]
        (arg,) = base.__args__
        assert arg.__forward_arg__ == f"rp.{rp.REPLIES[op].__name__}", op


def test_mypy_sees_the_reply_type_of_send(tmp_path: Path) -> None:
    path = tmp_path / "typed_send.py"
    path.write_text(textwrap.dedent(SNIPPET))
    out, err, status = mypy_api.run([str(path), "--no-incremental", "--ignore-missing-imports"])
    assert status == 0, out + err
