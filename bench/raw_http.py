"""A minimal keep-alive HTTP/1.1 client for one streamed (chunked) POST at a time.

The overhead benchmark times the platform from the moment a request leaves the client to the
first token reaching it. A full client library (httpx: request building, header models,
decoders, line iteration) spends about a millisecond of its own around each request on this
machine; this client writes prebuilt bytes and scans the chunks, so what it times is the stack's.
"""

import asyncio
import contextlib
import json
from collections.abc import Callable


class RawStreamClient:
    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post_stream(self, path: str, body: dict, on_chunk: Callable[[bytes], None]) -> dict[str, str]:
        """Send the request, call ``on_chunk`` with each body chunk as it arrives, read to the end;
        returns the response headers (lower-cased). Raises on a non-200 status."""
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._headers}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        reader, status_line = await self._send(head.encode() + payload)
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") != "chunked":
            data = await reader.readexactly(int(headers.get("content-length", "0")))
            raise RuntimeError(f"HTTP {status}: {data[:500]!r}")
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                break
            on_chunk(chunk[:-2])
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        return headers

    async def _send(self, request: bytes) -> tuple[asyncio.StreamReader, bytes]:
        """Write ``request`` and read the status line: on the kept-alive connection, or, where the
        server had closed that one (llama-server closes it after a stream), once more on a new one."""
        for _ in range(2):
            reused = self._reader is not None
            if self._reader is None or self._writer is None:  # the two are set together
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            reader = self._reader
            try:
                self._writer.write(request)
                await self._writer.drain()
                status_line = await reader.readline()
            except ConnectionError:
                status_line = b""
            if status_line or not reused:
                break
            await self.close()
        if not status_line:
            raise ConnectionResetError(f"{self.host}:{self.port} closed the connection without an answer")
        return reader, status_line

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
