"""The router's client to its workers (helixserve/router/upstream.py) against real loopback
servers: SSE lines reassembled across reads, a stalled worker is a timeout (504), an unreachable
one is not (503, marked unhealthy), a body that is not JSON becomes an error object."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

pytest.importorskip("aiohttp")

from helixserve.router.upstream import Upstream, UpstreamError  # noqa: E402

HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _serve(handler) -> tuple[asyncio.AbstractServer, str]:  # noqa: ANN001
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)


def test_stream_lines_are_whole_whatever_the_reads_split() -> None:
    pieces = [b'data: {"a"', b': 1}\n', b'\nda', b'ta: {"b": "\xc3', b'\xa9"}\r\n\r\ndata: [DONE]\n\n']

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(HEAD)
        for piece in pieces:
            writer.write(_chunk(piece))
            await writer.drain()
            await asyncio.sleep(0.02)  # separate reads on the client
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> list[str]:
        server, url = await _serve(handler)
        async with server, Upstream(1.0, 5.0, 4, {}) as client:
            stream = await client.open(f"{url}/v1/completions", {"x": 1})
            assert stream.status == 200
            lines = [line async for line in stream.lines()]
            stream.close()
            return lines

    assert asyncio.run(main()) == ['data: {"a": 1}', "", 'data: {"b": "é"}', "", "data: [DONE]", ""]


def test_a_worker_that_never_answers_is_a_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)  # never answers within the hop's timeout
        writer.close()

    async def main() -> UpstreamError:
        server, url = await _serve(handler)
        async with server, Upstream(1.0, 0.3, 4, {}) as client:
            with pytest.raises(UpstreamError) as caught:
                await asyncio.wait_for(client.post(f"{url}/v1/completions", {"x": 1}), 3.0)
            with pytest.raises(UpstreamError) as control:  # a per-hop timeout (the release's)
                await asyncio.wait_for(client.post(f"{url}/v1/release", {}, timeout_s=0.2), 3.0)
            assert control.value.timed_out
            return caught.value

    err = asyncio.run(main())
    assert err.timed_out, err


def test_an_unreachable_worker_is_not_a_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> UpstreamError:
        async with Upstream(1.0, 5.0, 4, {}) as client:
            with pytest.raises(UpstreamError) as caught:
                await client.post(f"http://127.0.0.1:{port}/v1/completions", {"x": 1})
            return caught.value

    err = asyncio.run(main())
    assert not err.timed_out and "Connect" in str(err), err


def test_a_stream_cut_mid_body_is_an_upstream_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(HEAD + _chunk(b"data: {}\n\n") + b"40\r\ndata: cut")  # a chunk never finished
        await writer.drain()
        writer.close()

    async def main() -> tuple[list[str], UpstreamError]:
        server, url = await _serve(handler)
        async with server, Upstream(1.0, 5.0, 4, {}) as client:
            stream = await client.open(f"{url}/v1/completions", {})
            seen: list[str] = []
            with pytest.raises(UpstreamError) as caught:
                async for line in stream.lines():
                    seen.append(line)
            stream.close()
            return seen, caught.value

    seen, err = asyncio.run(main())
    assert seen[:2] == ["data: {}", ""] and not err.timed_out, (seen, err)


def test_an_answer_that_is_not_json_becomes_an_error_object() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        body = b"<html>bad gateway</html>"
        writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    async def main():  # noqa: ANN202
        server, url = await _serve(handler)
        async with server, Upstream(1.0, 5.0, 4, {}) as client:
            return await client.post(f"{url}/v1/completions", {})

    answer = asyncio.run(main())
    assert answer.status == 502 and answer.json() == {"error": {"message": "<html>bad gateway</html>"}}


def test_a_hop_waiting_for_a_pooled_connection_has_a_bound() -> None:
    """One connection allowed and held by a stalled hop: the next hop gives up within the request
    timeout instead of waiting for the pool forever."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)
        writer.close()

    async def main() -> UpstreamError:
        server, url = await _serve(handler)
        async with server, Upstream(1.0, 0.4, 1, {}) as client:
            held = asyncio.create_task(client.post(f"{url}/a", {}, timeout_s=10.0))  # holds the one
            await asyncio.sleep(0.05)
            began = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamError) as caught:
                await asyncio.wait_for(client.post(f"{url}/b", {}), 3.0)
            assert asyncio.get_running_loop().time() - began < 2.0
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held
            return caught.value

    err = asyncio.run(main())
    assert "Timeout" in str(err), err


def test_no_redirect_is_followed_and_no_cookie_carried_over() -> None:
    """A worker's redirect is answered as it is (never chased to where it points), and a cookie
    one answer sets is not sent on the next hop."""
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\n"
                     b"Set-Cookie: session=abc; Path=/\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> tuple[int, int]:
        server, url = await _serve(handler)
        async with server, Upstream(1.0, 5.0, 4, {}) as client:
            first = await client.post(f"{url}/v1/completions", {"prompt": "é"})
            second = await client.post(f"{url}/v1/completions", {"prompt": "x"})
            return first.status, second.status

    assert asyncio.run(main()) == (307, 307)
    assert len(seen) == 2 and all(b"/elsewhere" not in h.split(b"\r\n")[0] for h in seen), seen
    assert not any(b"cookie:" in h.lower() for h in seen), seen
    assert all(b"accept-encoding: identity" in h.lower() for h in seen), seen


def test_an_idle_connection_is_dropped_before_the_workers_keep_alive_ends() -> None:
    """A connection idle for longer than the router's keep-alive (but not the worker's) is not
    reused: the next hop opens a new one, so it can never land on a connection the worker is
    closing at that moment (a worker closes idle ones after its connections.timeout_keep_alive,
    which must exceed the router's)."""
    from helixserve.config import UPSTREAM_KEEPALIVE_S as KEEPALIVE_S
    from helixserve.config import WorkerConnectionsConfig

    assert KEEPALIVE_S < WorkerConnectionsConfig().timeout_keep_alive
    with pytest.raises(ValueError, match="timeout_keep_alive"):
        WorkerConnectionsConfig(timeout_keep_alive=KEEPALIVE_S)
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        try:
            while True:  # keep-alive: answer every request on this connection
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server, url = await _serve(handler)
        async with server, Upstream(1.0, 5.0, 4, {}) as client:
            await client.post(f"{url}/a", {})
            await client.post(f"{url}/b", {})  # at once: the same connection
            assert len(connections) == 1
            await asyncio.sleep(KEEPALIVE_S + 0.4)  # idle past ours, not past the worker's
            await client.post(f"{url}/c", {})

    asyncio.run(main())
    assert len(connections) == 2, connections
