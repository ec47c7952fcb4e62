"""Fixtures: a real kvserver publishing KV events, and a subscriber already in sync with it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kvevents_util import BlockIndex, EventServer, start_event_server, sync
from kvtestkit.kvhelpers import register, tiny_layout
from kvprotocol import Client, KeySpace
from kvtestkit.kvsub import Subscriber


@pytest.fixture
def event_server(server_factory: Any) -> EventServer:
    return start_event_server(server_factory, "--l1-size-gb", "0.25")


@pytest.fixture
def synced(event_server: EventServer) -> Iterator[tuple[Subscriber, Client, KeySpace, BlockIndex]]:
    """A subscriber in sync, a registered client (one group, world 1), and the index built so far."""
    sub = event_server.subscriber()
    with event_server.proc.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        index = BlockIndex()
        index.apply(sync(sub, c, ks, event_server.replay_endpoint, plain=event_server.plain))
        yield sub, c, ks, index
    sub.close()
