#!/usr/bin/env python3
"""Start one pdserve deployment behind pdrouter, run a command against it, shut it down.

    python3 tools/pdbench/deploy.py --config pd-write --model builtin:tiny -- \\
        python3 tools/pdbench/pdbench.py run --base-url {url} --num-requests 20

Configurations (one instance per GPU with --device cuda; --gpus picks them):
  collocated   N collocated instances, the router round-robins between them
  pd-write     1 producer + 1 consumer, WRITE mode (legs sent concurrently)
  pd-read      1 producer + 1 consumer, READ mode (prefill leg, then decode leg)

Every instance registers with the router over ZMQ (the heartbeat of DESIGN.md
§3.5), so the router's /health shows them before the command starts. In the
command, {url} is replaced by the router's base URL (it is also exported as
PDBENCH_URL), and {metrics_args} by `--metrics-url URL` for the router and for every instance
(pdbench search reads their /metrics per window): separate arguments where it is a whole
argument, text inside a longer one (a `bash -c` line). After the command, the tool prints each instance's KV blocks in
use and KV transfer totals from /metrics, stops everything with SIGTERM and
exits with the command's status (non-zero too when an instance died or still
holds KV blocks). Standard library only: it runs on the GPU machine as it is.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LISTEN_RE = re.compile(r"(?:pdrouter|pdserve) listening on http://([0-9.]+):(\d+)")
REGISTRATION_RE = re.compile(r"pdrouter registration on tcp://([0-9.]+):(\d+)")


class Process:
    """A child process whose output goes to a log file and is scanned for patterns."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, echo: bool, env: dict | None = None):
        self.name = name
        self.argv = argv
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.log = open(log_dir / f"{name}.log", "w", encoding="utf-8")
        self.echo = echo
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            line = line.rstrip("\n")
            with self.cond:
                self.lines.append(line)
                del self.lines[:-2000]
                self.cond.notify_all()
            if self.echo or " error" in line.lower() or "[error]" in line.lower():
                print(f"  [{self.name}] {line}", file=sys.stderr, flush=True)
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pattern: re.Pattern, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for line in self.lines:
                    if m := pattern.search(line):
                        return m
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready:\n" +
                                       "\n".join(self.lines[-30:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name} not ready within {timeout_s:.0f} s:\n" +
                                       "\n".join(self.lines[-30:]))
                self.cond.wait(min(left, 0.5))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"  [{self.name}] did not stop within {timeout_s:.0f} s; killing it", file=sys.stderr)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def router_health(url: str) -> str:
    """The router's /health body; it answers 503 (with the same body) until an instance is usable."""
    try:
        return http_get(url)
    except urllib.error.HTTPError as error:
        return error.read().decode(errors="replace")


def metric_sum(metrics_text: str, name: str, label: str = "") -> float:
    """Sum of a metric's samples; with label (e.g. 'result="accepted"'), of those carrying it."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and len(line) > len(name) and line[len(name)] in " {":
            labels = line[len(name):].split("}", 1)[0] if line[len(name)] == "{" else ""
            if label and label not in labels:
                continue
            total += float(line.rsplit(" ", 1)[1])
    return total


def instance_plan(config: str, gpus: list[int], num_collocated: int) -> list[tuple[str, str | None, int]]:
    """(name, kv_role or None, gpu) per instance."""
    if config == "collocated":
        return [(f"collocated{i}", None, gpus[i % len(gpus)]) for i in range(num_collocated)]
    if config in ("pd-write", "pd-read"):
        return [("producer", "kv_producer", gpus[0]), ("consumer", "kv_consumer", gpus[1 % len(gpus)])]
    raise ValueError(f"unknown configuration '{config}' (collocated | pd-write | pd-read)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, choices=["collocated", "pd-write", "pd-read"])
    parser.add_argument("--bin-dir", default=str(ROOT / "build" / "bin"))
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpus", default="0,1", help="CUDA device ordinals, one per instance (cuda only)")
    parser.add_argument("--num-collocated", type=int, default=2, help="instances in the collocated configuration")
    parser.add_argument("--router-policy", default="round_robin",
                        help="pdrouter policy for every pool (round_robin|least_outstanding|power_of_two)")
    parser.add_argument("--serve-args", default="",
                        help="extra pdserve flags for every instance, one string (e.g. '--max-num-batched-tokens 4096')")
    parser.add_argument("--producer-args", default="", help="extra pdserve flags for the producer only")
    parser.add_argument("--consumer-args", default="", help="extra pdserve flags for the consumer only")
    parser.add_argument("--kv-extra", default="{}",
                        help="JSON object merged into every instance's kv_connector_extra_config, "
                             "e.g. '{\"first_token_handover\": false}'")
    parser.add_argument("--log-dir", default=None, help="where instance logs go (default: a temporary folder)")
    parser.add_argument("--ready-timeout-s", type=float, default=600, help="model load + warm-up limit per instance")
    parser.add_argument("--echo", action="store_true", help="echo every log line of the processes")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run against the router ({url})")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")

    log_dir = Path(args.log_dir) if args.log_dir else Path(os.environ.get("TMPDIR", "/tmp")) / f"pddeploy-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(args.bin_dir).resolve()
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    processes: list[Process] = []
    status = 1
    try:
        router = Process("router", [
            str(bin_dir / "pdrouter"), "--port", "0", "--registration-port", "0", "--io-threads", "4",
            "--prefill-policy", args.router_policy, "--decode-policy", args.router_policy,
            "--mode", {"pd-write": "write", "pd-read": "read"}.get(args.config, "auto"),
            "--pd-policy", "always"], log_dir, args.echo)
        processes.append(router)
        rhost, rport = router.wait_for(LISTEN_RE, 30).groups()
        reg_port = int(router.wait_for(REGISTRATION_RE, 30).group(2))
        router_url = f"http://{rhost}:{rport}"

        kv_extra = json.loads(args.kv_extra)
        if not isinstance(kv_extra, dict):
            raise SystemExit("--kv-extra must be a JSON object")
        plan = instance_plan(args.config, gpus, args.num_collocated)
        instances: dict[str, str] = {}
        for name, role, gpu in plan:
            extra = {"kv_role": role} if role else {"kv_role": "kv_both"}
            kv_config = {"kv_connector": "PdConnector", **extra,
                         "kv_connector_extra_config": {"read_mode": args.config == "pd-read", "proxy_ip": "127.0.0.1",
                                                       "proxy_ping_port": reg_port, **kv_extra}}
            argv = [str(bin_dir / "pdserve"), "--model", args.model, "--device", args.device, "--port", "0",
                    "--kv-transfer-config", json.dumps(kv_config)]
            if args.device == "cuda":
                argv += ["--cuda-device", str(gpu)]
            argv += shlex.split(args.serve_args)
            argv += shlex.split({"producer": args.producer_args, "consumer": args.consumer_args}.get(name, ""))
            print(f"[deploy] starting {name}: {' '.join(shlex.quote(a) for a in argv[1:])}", file=sys.stderr,
                  flush=True)
            processes.append(Process(name, argv, log_dir, args.echo))
        for proc in processes[1:]:
            host, port = proc.wait_for(LISTEN_RE, args.ready_timeout_s).groups()
            instances[proc.name] = f"http://{host}:{port}"

        deadline = time.monotonic() + 30
        while True:
            health = router_health(f"{router_url}/health")
            if all(url.split("//", 1)[1] in health for url in instances.values()):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances did not all register with the router within 30 s: {health}")
            time.sleep(0.2)  # each poll is a real request to the router
        print(f"[deploy] {args.config}: router {router_url}, instances {instances}, logs {log_dir}", file=sys.stderr,
              flush=True)

        # pdbench's --metrics-url for the router and every instance: separate arguments, or
        # spliced as text into a longer one (a `bash -c` command line).
        metrics_args = [arg for url in [router_url, *instances.values()] for arg in ("--metrics-url", url)]
        argv = []
        for part in command:
            if part == "{metrics_args}":
                argv += metrics_args
            else:
                argv.append(part.replace("{url}", router_url).replace("{metrics_args}", " ".join(metrics_args)))
        env = dict(os.environ, PDBENCH_URL=router_url)
        status = subprocess.run(argv, env=env).returncode

        for name, url in instances.items():
            try:
                metrics = http_get(f"{url}/metrics")
            except OSError as error:
                print(f"[deploy] {name}: /metrics failed: {error}", file=sys.stderr)
                status = status or 1
                continue
            used = metric_sum(metrics, "pd_kv_blocks_used")
            moved = metric_sum(metrics, "pd_connector_bytes_total")
            count = metric_sum(metrics, "pd_connector_transfer_seconds_count")
            seconds = metric_sum(metrics, "pd_connector_transfer_seconds_sum")
            mean = f", mean transfer {seconds / count * 1e3:.2f} ms over {count:.0f}" if count else ""
            handed = metric_sum(metrics, "pd_connector_first_tokens_total", 'result="accepted"')
            handover = f", first tokens handed over {handed:.0f}" if handed else ""
            preempted = metric_sum(metrics, "pd_preemptions_total")
            deferred = metric_sum(metrics, "pd_remote_admissions_deferred_total")
            print(f"[deploy] {name}: KV blocks in use {used:.0f}, KV bytes moved {moved:,.0f}{mean}{handover}, "
                  f"preemptions {preempted:.0f}, remote admissions deferred {deferred:.0f}", file=sys.stderr)
            if used != 0:
                # Prefix-cache blocks are not "in use": the metric counts referenced blocks only.
                print(f"[deploy] error: {name} still holds {used:.0f} KV blocks", file=sys.stderr)
                status = status or 1
    except (RuntimeError, TimeoutError, OSError) as error:
        print(f"[deploy] error: {error}", file=sys.stderr)
        status = 1
    finally:
        for proc in reversed(processes):
            died = not proc.alive()
            code = proc.stop()
            if died or code not in (0, -signal.SIGTERM):
                print(f"[deploy] {proc.name} exited with {code}{' (before shutdown)' if died else ''}; "
                      f"log {log_dir / (proc.name + '.log')}", file=sys.stderr)
                status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
