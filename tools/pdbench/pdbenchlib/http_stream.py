"""HTTP/1.1 and SSE by hand on asyncio streams (standard library only): one streamed
OpenAI completion per call, with keep-alive connection reuse.

Timing: a request's clock starts before a connection is taken (connect time is part of
the TTFT a client sees). A chunk's arrival time is read once per network read, right
after it returns; events that arrive in the same read share that time.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from .stats import RequestResult

MAX_ERROR_BODY_CHARS = 500
READ_SIZE = 65536


class PdbenchError(Exception):
    """An error the user can act on (bad URL, unreachable endpoint, bad answer)."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    path_prefix: str  # "" or "/something", prepended to /v1/...
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.path_prefix}"

    @staticmethod
    def parse(base_url: str, api_key: str | None = None) -> "Endpoint":
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise PdbenchError(f"--base-url must be an http:// URL (no TLS support), got {base_url!r}")
        if not parts.hostname:
            raise PdbenchError(f"--base-url has no host: {base_url!r}")
        try:
            port = parts.port or 80
        except ValueError as error:
            raise PdbenchError(f"--base-url has a bad port: {base_url!r} ({error})") from None
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[: -len("/v1")]
        return Endpoint(parts.hostname, port, prefix, api_key)

    def request_head(self, method: str, path: str, body_len: int, keep_alive: bool, accept: str) -> bytes:
        lines = [f"{method} {self.path_prefix}{path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "User-Agent: pdbench", f"Accept: {accept}",
                 f"Connection: {'keep-alive' if keep_alive else 'close'}"]
        if body_len or method == "POST":
            lines += ["Content-Type: application/json", f"Content-Length: {body_len}"]
        if self.api_key:
            lines.append(f"Authorization: Bearer {self.api_key}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reused: bool):
        self.reader = reader
        self.writer = writer
        self.reused = reused

    def close(self) -> None:
        self.writer.close()


class ConnectionPool:
    """Idle keep-alive connections to one endpoint. A connection is returned only after its
    response body was read to its end; anything else closes it."""

    def __init__(self, endpoint: Endpoint, keep_alive: bool):
        self.endpoint = endpoint
        self.keep_alive = keep_alive
        self._idle: list[Connection] = []

    async def acquire(self) -> Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                conn.reused = True
                return conn
            conn.close()
        reader, writer = await asyncio.open_connection(self.endpoint.host, self.endpoint.port, limit=1 << 20)
        return Connection(reader, writer, reused=False)

    def release(self, conn: Connection, reusable: bool) -> None:
        if self.keep_alive and reusable:
            self._idle.append(conn)
        else:
            conn.close()

    def close_all(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status_parts = lines[0].split(" ", 2)
    if len(status_parts) < 2 or not status_parts[0].startswith("HTTP/1.") or not status_parts[1].isdigit():
        raise PdbenchError(f"malformed HTTP status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return int(status_parts[1]), headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yields the body as it arrives (de-chunked). Ends at the body's framed end, or at EOF
    when the response has no framing."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise PdbenchError(f"malformed chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            piece = await reader.read(min(left, READ_SIZE))
            if not piece:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(piece)
            yield piece
    else:
        while piece := await reader.read(READ_SIZE):
            yield piece


def _body_is_framed(headers: dict[str, str]) -> bool:
    return "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers


class SseParser:
    """Splits a byte stream into the `data` payloads of server-sent events."""

    def __init__(self):
        self._buffer = b""

    def feed(self, piece: bytes) -> list[str]:
        self._buffer += piece
        if b"\r" in self._buffer:
            self._buffer = self._buffer.replace(b"\r\n", b"\n")
        payloads = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return payloads
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            data_lines = []
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    value = line[5:]
                    data_lines.append(value[1:] if value.startswith(b" ") else value)
            if data_lines:
                payloads.append(b"\n".join(data_lines).decode("utf-8", errors="replace"))


def _error_text(body: bytes) -> str:
    """The server's error message when the body is an OpenAI error object, else the raw body."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:MAX_ERROR_BODY_CHARS]
    except (ValueError, AttributeError):
        pass
    return text[:MAX_ERROR_BODY_CHARS]


def describe_connection_error(endpoint: Endpoint, error: BaseException) -> str:
    if isinstance(error, ConnectionRefusedError):
        return f"cannot connect to {endpoint.host}:{endpoint.port}: connection refused"
    if isinstance(error, asyncio.IncompleteReadError):
        return "the server closed the connection mid-response"
    if isinstance(error, OSError):
        reason = error.strerror or str(error) or type(error).__name__
        return f"connection to {endpoint.host}:{endpoint.port} failed: {reason}"
    return f"{type(error).__name__}: {error}"


async def _get(endpoint: Endpoint, path: str, timeout_s: float, accept: str) -> tuple[int, bytes]:
    """One GET on a fresh connection: (status, body). Raises PdbenchError when the endpoint
    cannot be reached or does not speak HTTP."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
            try:
                writer.write(endpoint.request_head("GET", path, 0, keep_alive=False, accept=accept))
                await writer.drain()
                status, headers = await _read_head(reader)
                body = b"".join([piece async for piece in _body_pieces(reader, headers)])
            finally:
                writer.close()
    except TimeoutError:
        raise PdbenchError(f"GET {endpoint.url}{path}: no answer within {timeout_s:g} s") from None
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as error:
        raise PdbenchError(f"GET {endpoint.url}{path}: {describe_connection_error(endpoint, error)}") from None
    return status, body


async def fetch_json(endpoint: Endpoint, path: str, timeout_s: float) -> tuple[int, object, str]:
    """One GET on a fresh connection: (status, parsed JSON or None, error text for non-200).
    Raises PdbenchError when the endpoint cannot be reached or does not speak HTTP."""
    status, body = await _get(endpoint, path, timeout_s, "application/json")
    if status != 200:
        return status, None, _error_text(body)
    try:
        return status, json.loads(body), ""
    except ValueError:
        raise PdbenchError(f"GET {endpoint.url}{path}: answer is not JSON: {body[:200]!r}") from None


async def fetch_text(endpoint: Endpoint, path: str, timeout_s: float) -> tuple[int, str]:
    """One GET on a fresh connection: (status, body as text). Raises PdbenchError as fetch_json."""
    status, body = await _get(endpoint, path, timeout_s, "text/plain")
    return status, body.decode("utf-8", errors="replace")


async def _send(pool: ConnectionPool, head: bytes, body: bytes) -> tuple[Connection, int, dict[str, str]]:
    """Sends one request and reads the response head. A reused keep-alive connection that
    the server closed while idle (EOF or reset before any response byte) is replaced by a
    fresh one once."""
    for attempt in range(2):
        conn = await pool.acquire()
        try:
            conn.writer.write(head + body)
            await conn.writer.drain()
            status, headers = await _read_head(conn.reader)
            return conn, status, headers
        except (ConnectionError, asyncio.IncompleteReadError) as error:
            conn.close()
            partial = getattr(error, "partial", b"")
            if not conn.reused or partial or attempt == 1:
                raise
        except BaseException:
            conn.close()
            raise
    raise AssertionError("unreachable")


async def stream_completion(pool: ConnectionPool, body: bytes, result: RequestResult, clock_zero: float) -> None:
    """POSTs one streaming completion and fills `result`. Never raises for network or server
    errors (they become result.error); cancellation (the per-request timeout) propagates
    after the connection is closed, with what was received so far left in `result`."""
    send_time = time.perf_counter()
    result.sent_s = send_time - clock_zero
    head = pool.endpoint.request_head("POST", "/v1/completions", len(body), pool.keep_alive, "text/event-stream")
    conn = None
    reusable = False
    try:
        conn, status, headers = await _send(pool, head, body)
        result.http_status = status
        if status != 200:
            error_body = b"".join([piece async for piece in _body_pieces(conn.reader, headers)])
            reusable = _body_is_framed(headers)
            result.error = f"HTTP {status}: {_error_text(error_body)}"
            return
        parser = SseParser()
        done = False
        async for piece in _body_pieces(conn.reader, headers):
            arrival = time.perf_counter() - send_time
            for data in parser.feed(piece):
                if data == "[DONE]":
                    done = True
                    result.e2e_s = arrival
                    continue
                try:
                    event = json.loads(data)
                except ValueError:
                    result.error = result.error or f"malformed SSE data: {data[:200]!r}"
                    continue
                if not isinstance(event, dict):
                    result.error = result.error or f"unexpected SSE data: {data[:200]!r}"
                    continue
                if event.get("error"):
                    result.error = result.error or f"stream error: {_error_text(data.encode())}"
                if event.get("choices"):
                    if result.ttft_s is None:
                        result.ttft_s = arrival
                    result.chunk_times_s.append(arrival)
                usage = event.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    result.output_tokens = usage["completion_tokens"]
                    result.usage_reported = True
        reusable = _body_is_framed(headers) and headers.get("connection", "").lower() != "close"
        if result.error:
            return
        if not done:
            result.error = "the stream ended without data: [DONE]"
        elif not result.chunk_times_s:
            result.error = "the stream carried no tokens"
        else:
            if not result.usage_reported:
                result.output_tokens = len(result.chunk_times_s)
            result.ok = True
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as error:
        result.error = describe_connection_error(pool.endpoint, error)
    except PdbenchError as error:
        result.error = str(error)
    finally:
        if conn is not None:
            if result.error is None and not result.ok:  # cancelled mid-stream
                reusable = False
            pool.release(conn, reusable and (result.ok or result.http_status != 200))
