"""`listen_socket` (the HTTP planes of kvserver and the coordinator): accepted connections get TCP_NODELAY.

Without it, Nagle's algorithm and the client's delayed ACK add ~40 ms to every HTTP reply
(bench/http_api.py measures it); asyncio only sets the option on sockets whose proto is TCP.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvprotocol import listen_socket


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_connections_accepted_by_asyncio_on_a_listen_socket_have_nodelay(host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")

    async def main() -> int:
        try:
            sock = listen_socket(host, 0)
        except OSError:
            pytest.skip(f"cannot bind {host}")
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("socket")
            accepted.set_result(peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_conn, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(host, sock.getsockname()[1])
            value = await asyncio.wait_for(accepted, 5)
            writer.close()
        return value

    assert sock_proto_is_tcp(host)
    assert asyncio.run(main()) != 0


def sock_proto_is_tcp(host: str) -> bool:
    try:
        sock = listen_socket(host, 0)
    except OSError:
        pytest.skip(f"cannot bind {host}")
    with sock:
        return sock.proto == socket.IPPROTO_TCP
