"""A lean asyncio HTTP/1.1 client for the proxy's upstream requests: one keep-alive pool
per engine, O(1) per request. (httpx's pool walks and polls every idle connection on each
request: 5 ms of CPU per proxied request at 32 connections.)

asyncio sets TCP_NODELAY on its TCP transports. A response's body is read as the engine
writes it: ``content-length`` bodies whole, ``chunked`` ones chunk by chunk (one SSE event
per chunk from vLLM-like servers). A connection goes back to its pool only after a complete
response; one abandoned mid-body is closed, which is how an engine learns the client left.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

__all__ = ["Pool", "Response", "UpstreamError"]


class UpstreamError(OSError):
    """The engine could not be reached, or broke the HTTP exchange."""


class Response:
    """An engine's answer: ``status``, lower-cased ``headers``, and the body to read."""

    __slots__ = ("_conn", "_left", "_pool", "chunked", "done", "headers", "keep", "status")

    def __init__(self, pool: Pool, conn: tuple, status: int, headers: dict[bytes, bytes]
                 ) -> None:
        self._pool = pool
        self._conn = conn
        self.status = status
        self.headers = headers
        self.chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        n = headers.get(b"content-length")
        self._left = int(n) if n is not None and not self.chunked else None
        self.keep = headers.get(b"connection", b"").lower() != b"close"
        self.done = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked: each chunk's data)."""
        reader = self._conn[0]
        try:
            if self.chunked:
                while True:
                    line = await reader.readline()
                    if not line.endswith(b"\n"):
                        raise UpstreamError("engine closed the connection mid-body")
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._left is not None:
                if self._left:
                    yield await reader.readexactly(self._left)
            else:  # read to EOF
                self.keep = False
                while chunk := await reader.read(65536):
                    yield chunk
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            self.close()
            raise UpstreamError(f"engine broke its answer: {e!r}") from None
        self.done = True
        self.close()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    def close(self) -> None:
        """Back to the pool when complete, else closed (the engine aborts the request)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.done and self.keep:
            self._pool.put(conn)
        else:
            conn[1].close()


class Pool:
    """Keep-alive connections to one ``host:port``."""

    def __init__(self, host: str, port: int, connect_timeout: float = 2.0,
                 max_idle: int = 256) -> None:
        self.host, self.port = host, port
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: deque[tuple] = deque()
        self._hostline = f"host: {host}:{port}\r\n".encode()

    def put(self, conn: tuple) -> None:
        if len(self._idle) < self.max_idle and not conn[0].at_eof():
            self._idle.append(conn)
        else:
            conn[1].close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()

    async def _connect(self) -> tuple:
        try:
            return await asyncio.wait_for(asyncio.open_connection(self.host, self.port),
                                          self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {e!r}") from None

    async def request(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes, sent: list[float] | None = None) -> Response:
        """Send a request and read the status line and headers. A kept-alive connection
        the engine closed meanwhile is replaced by a fresh one, once. ``sent`` gets the
        ``time.perf_counter()`` of each time the request is written."""
        head = b"".join([method, b" ", path, b" HTTP/1.1\r\n", self._hostline,
                         *[k + b": " + v + b"\r\n" for k, v in headers],
                         b"content-length: %d\r\n\r\n" % len(body)])
        while self._idle:
            conn = self._idle.pop()
            if conn[0].at_eof() or conn[1].is_closing():
                conn[1].close()
                continue
            try:
                return await self._exchange(conn, head, body, sent=sent)
            except _Stale:
                continue
        return await self._exchange(await self._connect(), head, body, True, sent)

    async def _exchange(self, conn: tuple, head: bytes, body: bytes,
                        fresh: bool = False, sent: list[float] | None = None) -> Response:
        reader, writer = conn
        try:
            writer.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                writer.write(body)
            if sent is not None:
                sent.append(time.perf_counter())
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            writer.close()
            if not fresh and not e.partial:
                raise _Stale from None
            raise UpstreamError("engine closed the connection before answering") from None
        except (OSError, asyncio.LimitOverrunError) as e:
            writer.close()
            if not fresh and isinstance(e, ConnectionResetError):
                raise _Stale from None
            raise UpstreamError(f"engine broke the exchange: {e!r}") from None
        except BaseException:  # cancelled (the client left): the request is abandoned
            writer.close()
            raise
        try:
            lines = raw.split(b"\r\n")
            status = int(lines[0].split(b" ", 2)[1])
            headers: dict[bytes, bytes] = {}
            for line in lines[1:]:
                if line:
                    k, _, v = line.partition(b":")
                    headers[k.strip().lower()] = v.strip()
        except (ValueError, IndexError):
            writer.close()
            raise UpstreamError(f"malformed response head: {raw[:80]!r}") from None
        return Response(self, conn, status, headers)


class _Stale(Exception):
    """A pooled connection the engine had closed: try another."""
