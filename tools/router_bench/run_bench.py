#!/usr/bin/env python3
"""Router benchmark: added latency and maximum request rate of pdrouter against fast
backends, beside vLLM's reference toy proxy for MoRIIO, same machine, same backends,
same run.

    python3 tools/router_bench/run_bench.py --toy-proxy /tmp/toyproxy/moriio_toy_proxy_server.py

The toy proxy is an upstream file (vllm examples/online_serving/disaggregated_serving/
moriio_toy_proxy_server.py) that is never committed here: copy it to /tmp and install
what it needs (quart, aiohttp, msgpack, pyzmq) first. Both proxies run the P/D WRITE
flow (prefill and decode legs sent concurrently) against the same two fast_backend
processes (a producer and a consumer; tools/router_bench/fast_backend.cc, compiled here
with g++). Load: tools/router_bench/loadgen.cc, closed loop over keep-alive connections.

Added latency = latency through the proxy minus latency of the same request sent
directly to the consumer backend, at the same percentile, one connection (no queueing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tools(out_dir: Path) -> dict[str, Path]:
    built = {}
    for name in ["fast_backend", "loadgen"]:
        binary = out_dir / name
        source = HERE / f"{name}.cc"
        if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
            subprocess.run(["g++", "-O2", "-std=c++20", "-pthread", "-o", str(binary), str(source)], check=True)
        built[name] = binary
    return built


class Procs:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, pattern: str | None = None, timeout_s: float = 30, env=None) -> tuple[subprocess.Popen, re.Match | None]:
        proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        if pattern is None:
            # Nothing to wait for, but the output must still be drained: a child that
            # logs every request (the toy proxy) blocks once the pipe buffer is full.
            subprocess.Popen(["cat"], stdin=proc.stdout, stdout=subprocess.DEVNULL)
            return proc, None
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{argv[0]} exited before printing {pattern}")
            match = regex.search(line)
            if match:
                # Keep draining output so the child never blocks on a full pipe.
                subprocess.Popen(["cat"], stdin=proc.stdout, stdout=subprocess.DEVNULL)
                return proc, match
        raise RuntimeError(f"{argv[0]}: no {pattern} within {timeout_s}s")

    def stop_all(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def wait_http_ok(url: str, body: dict | None, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200:
                    return resp.read()
        except Exception as error:  # noqa: BLE001 - retried until the deadline
            last = error
        time.sleep(0.1)
    raise RuntimeError(f"{url} never answered 200: {last}")


def loadgen(binary: Path, port: int, body: dict, connections: int, duration_s: float) -> dict:
    out = subprocess.run([str(binary), "--port", str(port), "--path", "/v1/completions", "--body", json.dumps(body),
                          "--connections", str(connections), "--duration-s", str(duration_s), "--warmup-s", "1"],
                         capture_output=True, text=True, check=True, timeout=duration_s + 120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def register_with_toy_proxy(port: int, role: str, http_port: int):
    import msgpack
    import zmq
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(msgpack.packb({"type": "register", "role": role,
                             "request_address": f"http://127.0.0.1:{http_port}/v1/completions",
                             "handshake_port": 1, "notify_port": 2, "dp_size": 1, "tp_size": 1,
                             "transfer_mode": "WRITE"}))
    sock.close()
    context.term()


def histogram_quantiles_us(lines: list[str]) -> dict:
    """Upper bound of the bucket holding p50 / p99 of the router's own added-latency histogram
    (every request of the run, all connection counts)."""
    buckets = []
    for line in lines:
        match = re.match(r'pd_router_added_latency_seconds_bucket\{.*le="([^"]+)"\} (\S+)', line)
        if match:
            buckets.append((float(match.group(1)), float(match.group(2))))
    if not buckets or buckets[-1][1] == 0:
        return {}
    total = buckets[-1][1]
    out = {"count": int(total)}
    for q in (0.5, 0.99):
        out[f"p{int(q * 100)}_le_us"] = next(le * 1e6 for le, count in buckets if count >= q * total)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pdrouter", default=str(ROOT / "build" / "bin" / "pdrouter"))
    parser.add_argument("--toy-proxy", required=True, help="path of an upstream moriio_toy_proxy_server.py copy")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64, help="connections for the max-rate runs")
    parser.add_argument("--router-io-threads", type=int, default=2)
    parser.add_argument("--stream", action="store_true", help="streaming requests (SSE) instead of plain JSON")
    parser.add_argument("--json-out", help="write the results here too")
    args = parser.parse_args()

    body = {"model": "builtin:tiny", "prompt": "hello router", "max_tokens": 8}
    if args.stream:
        body["stream"] = True
    procs = Procs()
    results: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                     "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
                     "loadavg_before": os.getloadavg(), "body": body, "connections": args.connections,
                     "duration_s": args.duration_s}
    try:
        tools = build_tools(Path(tempfile.gettempdir()))
        _, p_match = procs.start([tools["fast_backend"], "--port", "0", "--role", "producer", "--mode", "write",
                                  "--id", "fastp"], r"listening on http://127.0.0.1:(\d+)")
        _, d_match = procs.start([tools["fast_backend"], "--port", "0", "--role", "consumer", "--mode", "write",
                                  "--id", "fastd"], r"listening on http://127.0.0.1:(\d+)")
        p_port, d_port = int(p_match.group(1)), int(d_match.group(1))

        _, r_match = procs.start([args.pdrouter, "--port", "0", "--io-threads", str(args.router_io_threads),
                                  "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
                                  "--pd-policy", "always", "--log-level", "warn"],
                                 r"pdrouter listening on http://127.0.0.1:(\d+)")
        router_port = int(r_match.group(1))
        deadline = time.monotonic() + 20
        while len(json.loads(wait_http_ok(f"http://127.0.0.1:{router_port}/health", None))["instances"]) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("pdrouter did not discover both backends")
            time.sleep(0.1)

        toy_http, toy_zmq = free_port(), free_port()
        toy_dir = str(Path(args.toy_proxy).resolve().parent)
        toy_module = Path(args.toy_proxy).stem
        launcher = (f"import sys; sys.path.insert(0, {toy_dir!r}); import {toy_module} as m; "
                    f"m.start_service_discovery('127.0.0.1', {toy_zmq}); m.app.debug = True; "
                    "m.app.config['BODY_TIMEOUT'] = 360000; m.app.config['RESPONSE_TIMEOUT'] = 360000; "
                    f"m.app.run(host='127.0.0.1', port={toy_http}, use_reloader=False)")
        procs.start([sys.executable, "-c", launcher])
        time.sleep(0.5)  # the listener thread binds asynchronously; registration is re-sent below until it works
        deadline = time.monotonic() + 30
        while True:
            register_with_toy_proxy(toy_zmq, "P", p_port)
            register_with_toy_proxy(toy_zmq, "D", d_port)
            try:
                wait_http_ok(f"http://127.0.0.1:{toy_http}/v1/completions", body, timeout_s=2)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise

        # Latency at one connection: direct to the consumer, through pdrouter, through the toy proxy.
        results["latency_1conn"] = {
            "direct": loadgen(tools["loadgen"], d_port, body, 1, args.duration_s),
            "pdrouter": loadgen(tools["loadgen"], router_port, body, 1, args.duration_s),
            "toy_proxy": loadgen(tools["loadgen"], toy_http, body, 1, args.duration_s),
        }
        lat = results["latency_1conn"]
        results["added_latency_us"] = {
            name: {q: round(lat[name][f"{q}_us"] - lat["direct"][f"{q}_us"], 1) for q in ["p50", "p90", "p99"]}
            for name in ["pdrouter", "toy_proxy"]}
        # Maximum rate: many connections, closed loop.
        results["max_rate"] = {
            "direct": loadgen(tools["loadgen"], d_port, body, args.connections, args.duration_s),
            "pdrouter": loadgen(tools["loadgen"], router_port, body, args.connections, args.duration_s),
            "toy_proxy": loadgen(tools["loadgen"], toy_http, body, args.connections, args.duration_s),
        }
        rate = results["max_rate"]
        results["rate_ratio_pdrouter_over_toy"] = round(rate["pdrouter"]["rps"] / max(rate["toy_proxy"]["rps"], 1e-9), 2)
        with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        results["pdrouter_added_latency_histogram"] = [
            line for line in metrics.splitlines() if line.startswith("pd_router_added_latency_seconds")]
        results["pdrouter_self_measured_added_latency_us"] = histogram_quantiles_us(
            results["pdrouter_added_latency_histogram"])
        results["loadavg_after"] = os.getloadavg()
    finally:
        procs.stop_all()
    text = json.dumps(results, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
