"""Shared fixtures for pdserve integration tests.

Every process a test starts goes through `ProcessFactory` (fixture `procs`),
which kills it on teardown. Helpers:

- `bin_path(name)`: a binary under $PDSERVE_BIN_DIR (default /work/main/build/bin).
- `start_pdserve(procs, *flags)`: starts `pdserve --port 0 <flags>`, reads the port from its
  "pdserve listening on http://HOST:PORT" line and waits for GET /health == 200, each with a deadline.
- `wait_for(predicate, timeout_s, what)`: polls a real condition until it holds or the deadline passes.
- `http_request(...)`, `metric_value(text, name, labels)`: plain HTTP and Prometheus parsing.
- `open_keep_alive_connection(endpoint, path)`: a connection the server has accepted (one request
  answered 200 on it) and keeps open, for tests of --max-connections.
- `assert_accept_survives_fd_exhaustion(endpoint, process, path)`: runs a server out of file
  descriptors and shows it accepts again once descriptors are free.

Other suites add their own fixtures in their own files and reuse these helpers.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BIN_DIR = Path(os.environ.get("PDSERVE_BIN_DIR", "/work/main/build/bin"))
LISTEN_RE = re.compile(r"pdserve listening on http://([0-9.]+):(\d+)")


def bin_path(name: str) -> Path:
    path = BIN_DIR / name
    if not path.exists():
        pytest.fail(f"{path} does not exist: build it first (PDSERVE_BIN_DIR={BIN_DIR})")
    return path


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Polls predicate() until it returns a truthy value; fails the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what} (last value: {last!r})")
        time.sleep(interval_s)  # poll interval, not synchronisation: the condition is re-checked


@dataclass
class ManagedProcess:
    """A child process with its stdout lines collected by a reader thread."""

    argv: list[str]
    proc: subprocess.Popen
    lines: "queue.Queue[str]" = field(default_factory=queue.Queue)
    output: list[str] = field(default_factory=list)

    def wait_for_line(self, pattern: re.Pattern, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"{self.argv[0]}: no line matching {pattern.pattern!r} within {timeout_s}s; "
                            f"output so far:\n{self.text()}")
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    pytest.fail(f"{self.argv[0]} exited with {self.proc.returncode} before printing "
                                f"{pattern.pattern!r}; output:\n{self.text()}")
                continue
            match = pattern.search(line)
            if match:
                return match

    def text(self) -> str:
        return "".join(self.output)

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Sends sig, waits up to timeout_s, then SIGKILLs. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


class ProcessFactory:
    def __init__(self):
        self.procs: list[ManagedProcess] = []

    def spawn(self, argv: list[str], env: dict | None = None) -> ManagedProcess:
        proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                env={**os.environ, **(env or {})})
        managed = ManagedProcess([str(a) for a in argv], proc)

        def reader():
            for line in proc.stdout:
                managed.output.append(line)
                managed.lines.put(line)

        threading.Thread(target=reader, daemon=True).start()
        self.procs.append(managed)
        return managed

    def cleanup(self):
        """SIGTERM (clean shutdown) with a deadline, then SIGKILL."""
        for managed in self.procs:
            managed.stop(signal.SIGTERM, timeout_s=10)


@pytest.fixture
def procs():
    """Function-scoped process factory: everything spawned is killed on teardown."""
    factory = ProcessFactory()
    yield factory
    factory.cleanup()


@pytest.fixture(scope="module")
def module_procs():
    """Module-scoped process factory, for servers shared by a test module."""
    factory = ProcessFactory()
    yield factory
    factory.cleanup()


def http_request(base_url: str, method: str, path: str, body=None, headers: dict | None = None,
                 timeout_s: float = 30.0) -> tuple[int, bytes, dict]:
    """One HTTP request on a fresh connection. body may be bytes, str or a JSON-able object."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


def open_keep_alive_connection(endpoint: "HttpEndpoint", path: str,
                               timeout_s: float = 10.0) -> http.client.HTTPConnection:
    """Opens a connection and completes GET path on it, so the server has accepted and counted it;
    the connection stays open (keep-alive) until the caller closes it. A connection turned away
    (e.g. while the server still counts one a client just closed) is retried until timeout_s."""
    def attempt():
        conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            if response.status == 200 and not response.will_close:
                return conn
        except OSError:
            pass
        conn.close()
        return None
    return wait_for(attempt, timeout_s, f"a keep-alive connection answered 200 on {path}")


def assert_accept_survives_fd_exhaustion(endpoint: "HttpEndpoint", process: "ManagedProcess", path: str,
                                         num_connections: int = 8):
    """Lowers the server's RLIMIT_NOFILE below what it already holds, so accept() fails with EMFILE,
    sends GET path on num_connections connections (the kernel completes them into the listen
    backlog), waits until the server has reported failed accepts twice, restores the limit and
    expects every one of those requests to be answered 200: the accept loop backed off and retried
    instead of ending."""
    import resource
    pid = process.proc.pid
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    # Below the descriptors it holds: those keep working, every new one fails with EMFILE.
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, limits[1]))
    pending = []
    try:
        for _ in range(num_connections):
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=30)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            pending.append(sock)
        # Failures are reported at most once a second: a second report means the loop backed off,
        # retried (and failed) again, and is still running.
        wait_for(lambda: process.text().count("accept failed") >= 2, 10, "a second report of failed accepts")
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    for sock in pending:
        with sock:
            answer = b""
            while data := sock.recv(65536):  # Connection: close: the server closes after answering
                answer += data
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


class HttpEndpoint:
    """HTTP helpers for a process listening on self.host:self.port (pdserve, pdrouter)."""

    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get(self, path: str, **kw):
        return http_request(self.base_url, "GET", path, **kw)

    def post(self, path: str, body, **kw):
        return http_request(self.base_url, "POST", path, body, **kw)

    def metrics(self) -> str:
        status, body, _ = self.get("/metrics")
        assert status == 200
        return body.decode()


@dataclass
class PdserveServer(HttpEndpoint):
    process: ManagedProcess
    host: str
    port: int

    def healthy(self) -> bool:
        try:
            return self.get("/health", timeout_s=5)[0] == 200
        except OSError:
            return False


def start_pdserve(factory: ProcessFactory, *flags: str, ready_timeout_s: float = 90.0,
                  env: dict | None = None) -> PdserveServer:
    """Starts pdserve on a free port (--port 0) and waits until /health answers 200."""
    argv = [bin_path("pdserve"), "--port", "0", *flags]
    managed = factory.spawn(argv, env=env)
    match = managed.wait_for_line(LISTEN_RE, ready_timeout_s)
    server = PdserveServer(managed, match.group(1), int(match.group(2)))
    wait_for(server.healthy, ready_timeout_s, f"{server.base_url}/health")
    return server


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metric_value(text: str, name: str, labels: dict | None = None) -> float | None:
    """Value of one Prometheus sample (labels must match exactly when given; None = the unlabelled one)."""
    want = labels or {}
    for line in text.splitlines():
        match = _SAMPLE_RE.match(line)
        if not match or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if got == want:
            return float(match.group(3))
    return None
