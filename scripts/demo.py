#!/usr/bin/env python3
"""The README's main job: a P/D deployment on one machine.

Starts pdrouter, one producer and one consumer pdserve (built-in tiny model on
the CPU, or --device cuda), waits until both registered with the router,
streams one chat completion through the router with the official OpenAI
client, prints a short report (TTFT, tokens, KV bytes moved and transfer time
from the instances' /metrics) and shuts everything down with SIGTERM.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

LISTEN_RE = {
    "pdrouter": re.compile(r"pdrouter listening on http://([0-9.]+):(\d+)"),
    "pdserve": re.compile(r"pdserve listening on http://([0-9.]+):(\d+)"),
}
REGISTRATION_RE = re.compile(r"pdrouter registration on tcp://([0-9.]+):(\d+)")


class Process:
    """A child process whose output is echoed (prefixed) and scanned for patterns."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None):
        self.name = name
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
            if VERBOSE or "listening" in line or "error" in line.lower():
                print(f"  [{self.name}] {line}", flush=True)
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
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready:\n"
                                       + "\n".join(self.lines[-20:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name} not ready within {timeout_s:.0f} s:\n" + "\n".join(self.lines[-20:]))
                self.cond.wait(min(left, 0.5))

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"  [{self.name}] did not stop within {timeout_s:.0f} s; killing it")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def metric_sum(metrics_text: str, name: str, label_filter: str = "") -> float:
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and label_filter in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", default="build/bin")
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto (cuda when nvidia-smi sees a GPU)")
    parser.add_argument("--mode", default="write", choices=["write", "read"], help="P/D transfer mode")
    parser.add_argument("--prompt", default="Explain prefill/decode disaggregation in one paragraph.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--verbose", action="store_true", help="echo every log line of the processes")
    args = parser.parse_args()
    global VERBOSE
    VERBOSE = args.verbose

    device = args.device
    if device == "auto":
        try:
            gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
            device = "cuda" if "GPU" in gpus else "cpu"
        except (OSError, subprocess.TimeoutExpired):
            device = "cpu"

    from openai import OpenAI  # installed by scripts/install_deps.sh

    bin_dir = os.path.abspath(args.bin_dir)
    processes: list[Process] = []
    exit_code = 1
    try:
        print(f"[demo] starting pdrouter ({args.mode.upper()} mode)")
        router = Process("router", [f"{bin_dir}/pdrouter", "--port", "0", "--registration-port", "0",
                                    "--mode", args.mode])
        processes.append(router)
        rhost, rport = router.wait_for(LISTEN_RE["pdrouter"], 30).groups()
        reg_port = int(router.wait_for(REGISTRATION_RE, 30).group(2))
        router_url = f"http://{rhost}:{rport}"

        instances = {}
        for role in ("producer", "consumer"):
            config = {"kv_connector": "PdConnector", "kv_role": f"kv_{role}",
                      "kv_connector_extra_config": {"read_mode": args.mode == "read", "proxy_ip": "127.0.0.1",
                                                    "proxy_ping_port": reg_port}}
            print(f"[demo] starting pdserve {role} on {args.model} ({device})")
            proc = Process(role, [f"{bin_dir}/pdserve", "--model", args.model, "--device", device, "--port", "0",
                                  "--max-model-len", "2048", "--kv-transfer-config", json.dumps(config)])
            processes.append(proc)
            host, port = proc.wait_for(LISTEN_RE["pdserve"], 300).groups()
            instances[role] = f"http://{host}:{port}"

        deadline = time.monotonic() + 30
        while True:
            health = json.loads(http_get(f"{router_url}/health"))
            roles = json.dumps(health)
            if "producer" in roles and "consumer" in roles:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances did not register with the router: {health}")
            time.sleep(0.2)  # polling the router's view; each poll is a real request
        print(f"[demo] router {router_url} sees producer {instances['producer']} and consumer {instances['consumer']}")

        client = OpenAI(base_url=f"{router_url}/v1", api_key="unused")
        print(f"\n[demo] user: {args.prompt}\n[demo] assistant (streamed through the router):\n")
        start = time.monotonic()
        ttft = None
        num_chunks = 0
        usage = None
        stream = client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text = choice.delta.content or ""
                if text and ttft is None:
                    ttft = time.monotonic() - start
                num_chunks += 1
                sys.stdout.write(text)
                sys.stdout.flush()
        total = time.monotonic() - start
        print("\n")

        producer_metrics = http_get(f"{instances['producer']}/metrics")
        consumer_metrics = http_get(f"{instances['consumer']}/metrics")
        moved = metric_sum(producer_metrics, "pd_connector_bytes_total") + metric_sum(consumer_metrics,
                                                                                       "pd_connector_bytes_total")
        transfer_count = metric_sum(consumer_metrics, "pd_connector_transfer_seconds_count") + metric_sum(
            producer_metrics, "pd_connector_transfer_seconds_count")
        transfer_sum = metric_sum(consumer_metrics, "pd_connector_transfer_seconds_sum") + metric_sum(
            producer_metrics, "pd_connector_transfer_seconds_sum")
        print("[demo] report")
        print(f"  mode                 {args.mode.upper()} ({device}, {args.model})")
        print(f"  TTFT                 {ttft * 1000:.1f} ms" if ttft is not None else "  TTFT                 (no text)")
        print(f"  end-to-end           {total * 1000:.1f} ms")
        if usage is not None:
            print(f"  tokens               prompt {usage.prompt_tokens}, completion {usage.completion_tokens}")
        print(f"  KV bytes moved       {moved:,.0f}")
        if transfer_count:
            print(f"  KV transfer time     {transfer_sum / transfer_count * 1000:.2f} ms mean over {transfer_count:.0f}")
        blocks_used = [metric_sum(m, "pd_kv_blocks_used") for m in (producer_metrics, consumer_metrics)]
        print(f"  KV blocks in use     producer {blocks_used[0]:.0f}, consumer {blocks_used[1]:.0f}")
        if moved <= 0:
            print("[demo] error: no KV bytes were moved; the request did not go through P/D")
            return 1
        exit_code = 0
    finally:
        print("[demo] shutting down")
        for proc in reversed(processes):
            code = proc.stop()
            if code not in (0, -signal.SIGTERM):
                print(f"  [{proc.name}] exited with {code}")
                exit_code = exit_code or 1
    print("[demo] done" if exit_code == 0 else "[demo] FAILED")
    return exit_code


VERBOSE = False

if __name__ == "__main__":
    sys.exit(main())
