"""Fixtures and helpers for the pdrouter integration tests (test_router_*.py).

- `start_router(procs, *flags)`: starts build/bin/pdrouter on a free port, reads the
  "pdrouter listening on http://HOST:PORT" (and registration) lines, each with a deadline.
- `Registrar`: a real ZMQ DEALER client of the router's registration listener
  (pyzmq + msgpack), for discovery tests that do not need an engine's own heartbeat.
- `RecordingBackend`: a tiny HTTP/1.1 server that records every request body it
  receives, parsed and as raw bytes. It is used ONLY to assert what reaches an engine
  (client-supplied kv_transfer_params must never arrive, the client's key order must
  survive); every other router test runs against real pdserve processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq

from conftest import HttpEndpoint, ProcessFactory, bin_path, metric_value, wait_for

ROUTER_LISTEN_RE = re.compile(r"pdrouter listening on http://([0-9.]+):(\d+)")
ROUTER_REGISTRATION_RE = re.compile(r"pdrouter registration on tcp://([0-9.]+):(\d+)")
TINY_MODEL = "builtin:tiny"


@dataclass
class Router(HttpEndpoint):
    process: object
    host: str
    port: int
    registration_port: int | None

    def metric(self, name: str, labels: dict | None = None) -> float:
        return metric_value(self.metrics(), name, labels) or 0.0

    def instances(self) -> list[dict]:
        _, body, _ = self.get("/health", timeout_s=5)
        return json.loads(body)["instances"]

    def instance_ids(self, role: str | None = None) -> set[str]:
        return {i["instance_id"] for i in self.instances() if role is None or i["role"] == role}

    def wait_for_instances(self, count: int, timeout_s: float = 30.0, role: str | None = None):
        return wait_for(lambda: len(self.instance_ids(role)) >= count and self.instances(), timeout_s,
                        f"{count} instance(s) discovered by the router")


def start_router(factory: ProcessFactory, *flags: str, registration: bool = True,
                 ready_timeout_s: float = 30.0, env: dict | None = None) -> Router:
    argv = [bin_path("pdrouter"), "--port", "0", *flags]
    # The tests written for fixed flows keep them: P/D for every request when both roles are there.
    if "--pd-policy" not in flags:
        argv += ["--pd-policy", "always"]
    if registration and "--registration-port" not in flags:
        argv += ["--registration-port", "0"]
    managed = factory.spawn(argv, env=env)
    registration_port = None
    if registration:
        registration_port = int(managed.wait_for_line(ROUTER_REGISTRATION_RE, ready_timeout_s).group(2))
    match = managed.wait_for_line(ROUTER_LISTEN_RE, ready_timeout_s)
    return Router(managed, match.group(1), int(match.group(2)), registration_port)


def registration_record(instance_id: str, role: str, http: str, *, control: str = "127.0.0.1:1",
                        boot_nonce: int | None = None, mode: str = "write", model: str = TINY_MODEL) -> dict:
    return {"v": 1, "type": "register", "role": role, "http": http, "control": control,
            "instance_id": instance_id, "boot_nonce": boot_nonce if boot_nonce is not None else secrets.randbits(63),
            "tp_size": 1, "dp_size": 1, "mode": mode, "model": model}


class Registrar:
    """A DEALER connected to the router's registration port; sends raw frames or records.

    Every send has a deadline (SNDTIMEO): a DEALER whose handshake the router refused outright (a plain
    client at a CURVE router) has no connection left to queue on, and a blocking send there never returns.
    try_send_record is for such clients: a send refused that way is the refusal under test."""

    SEND_TIMEOUT_MS = 5000

    def __init__(self, port: int, curve_keys: dict | None = None):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, self.SEND_TIMEOUT_MS)
        if curve_keys:
            self.socket.curve_serverkey = curve_keys["server_public"]
            self.socket.curve_publickey = curve_keys["client_public"]
            self.socket.curve_secretkey = curve_keys["client_secret"]
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def send_record(self, record: dict):
        self.socket.send(msgpack.packb(record))

    def try_send_record(self, record: dict) -> bool:
        """False when the socket has nowhere to send (its handshake was refused)."""
        try:
            self.socket.send(msgpack.packb(record), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def send_frames(self, frames: list[bytes]):
        self.socket.send_multipart(frames)

    def close(self):
        self.socket.close(0)
        self.context.term()


class Heartbeat:
    """Sends one registration record every period_s from a thread until stopped (a stand-in for an
    instance's own heartbeat thread, used where only the router's discovery is under test)."""

    def __init__(self, port: int, record: dict, period_s: float = 1.0):
        self.registrar = Registrar(port)
        self.record = record
        self.period_s = period_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopped.is_set():
            self.registrar.send_record(self.record)
            self.stopped.wait(self.period_s)

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=5)
        self.registrar.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RecordingBackend:
    """An HTTP/1.1 server (keep-alive, Content-Length and chunked SSE answers) that records
    every POST body, parsed in `bodies` and byte for byte in `raw_bodies` (a parsed dict
    cannot show key order, which chat templates render). ONLY for asserting what the router
    forwards to engines."""

    def __init__(self, role: str, instance_id: str, mode: str = "write"):
        self.role = role
        self.instance_id = instance_id
        self.mode = mode
        self.bodies: list[dict] = []
        self.raw_bodies: list[bytes] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("recording backend did not start")

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.http}"

    def info(self) -> dict:
        return {"role": self.role, "http": self.http, "control": "127.0.0.1:9", "instance_id": self.instance_id,
                "boot_nonce": 1, "tp_size": 1, "dp_size": 1, "mode": self.mode, "model": TINY_MODEL}

    def _run(self):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.server = server
        self.ready.set()
        self.loop.run_forever()

    def stop(self):
        def shutdown():
            self.server.close()
            self.loop.stop()
        self.loop.call_soon_threadsafe(shutdown)
        self.thread.join(timeout=5)

    def _answer(self, body: dict) -> tuple[bytes, bool]:
        params = body.get("kv_transfer_params")
        text_choice = {"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}
        response = {"id": "cmpl-rec", "object": "text_completion", "created": int(time.time()), "model": TINY_MODEL,
                    "choices": [text_choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        if params and params.get("do_remote_decode") and params.get("mode") == "read":
            response["kv_transfer_params"] = {"transfer_id": params["transfer_id"],
                                              "remote_instance_id": self.instance_id,
                                              "remote_control": "127.0.0.1:9", "remote_boot_nonce": 1,
                                              "block_ids": [0], "num_tokens": 1}
        if body.get("stream"):
            chunk = {**response, "choices": [{**text_choice, "finish_reason": None}]}
            events = [f"data: {json.dumps(chunk)}\n\n", f"data: {json.dumps(response)}\n\n", "data: [DONE]\n\n"]
            return "".join(events).encode(), True
        return json.dumps(response).encode(), False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
                length = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(length) if length else b""
                if method == "GET" and path == "/pd/info":
                    payload, stream, ctype = json.dumps(self.info()).encode(), False, "application/json"
                elif method == "GET":
                    payload, stream, ctype = json.dumps({"object": "list", "data": [{"id": TINY_MODEL}]}).encode(), \
                        False, "application/json"
                else:
                    body = json.loads(raw)
                    self.raw_bodies.append(raw)
                    self.bodies.append(body)
                    payload, stream = self._answer(body)
                    ctype = "text/event-stream" if stream else "application/json"
                if stream:
                    writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 .encode() + f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n")
                else:
                    writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n\r\n"
                                 .encode() + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            try:
                writer.close()
            except RuntimeError:  # the loop is already shutting down (stop())
                pass


def raise_fd_limit(wanted: int = 8192) -> int:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, wanted), hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def pdserve_flags(role: str, *, router: Router | None = None, mode: str = "write", extra: dict | None = None,
                  model: str = TINY_MODEL) -> list[str]:
    """pdserve flags for one instance of a P/D deployment (the connector's --kv-transfer-config)."""
    flags = ["--model", model, "--max-model-len", "2048"]
    kv_role = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}[role]
    config = {"kv_connector": "PdConnector", "kv_role": kv_role,
              "kv_connector_extra_config": {"read_mode": mode == "read", **(extra or {})}}
    if router is not None and router.registration_port:
        config["kv_connector_extra_config"].update({"proxy_ip": "127.0.0.1",
                                                    "proxy_ping_port": router.registration_port})
    flags += ["--kv-transfer-config", json.dumps(config)]
    return flags


ENV_TIMEOUT_S = float(os.environ.get("PDROUTER_TEST_TIMEOUT_S", "60"))
