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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "pdbench"))
# The process handling is tools/pdbench/deploy.py's (one copy for the demo and the benchmarks).
from deploy import LISTEN_RE, REGISTRATION_RE, Process, http_get, metric_sum, router_health  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", default="build/bin")
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--device", default="auto",
                        help="cpu | cuda | auto (cuda when nvidia-smi sees a GPU and --model is not builtin:tiny)")
    parser.add_argument("--mode", default="write", choices=["write", "read"], help="P/D transfer mode")
    parser.add_argument("--prompt", default="Explain prefill/decode disaggregation in one paragraph.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--verbose", action="store_true", help="echo every log line of the processes")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="pddemo-"))

    try:
        gpu_lines = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
        num_gpus = sum(1 for line in gpu_lines.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        num_gpus = 0
    device = args.device
    if args.model == "builtin:tiny" and device != "cpu":
        # The tiny model's head_dim (32) has no CUDA kernel instantiation (64 and 128 only):
        # it is the CPU demo. On a GPU, pass a real model (an HF directory) with --model.
        if device == "cuda":
            print("[demo] error: builtin:tiny runs on the CPU only; give an HF model directory with --model "
                  "for --device cuda", file=sys.stderr)
            return 2
        device = "cpu"
    elif device == "auto":
        device = "cuda" if num_gpus > 0 else "cpu"
    # Producer on GPU 0, consumer on GPU 1 when there are two (every GPU stays visible: CUDA IPC).
    cuda_device = {"producer": 0, "consumer": 1 if num_gpus > 1 else 0}

    from openai import OpenAI  # installed by scripts/install_deps.sh

    bin_dir = os.path.abspath(args.bin_dir)
    processes: list[Process] = []
    exit_code = 1
    try:
        print(f"[demo] starting pdrouter ({args.mode.upper()} mode)")
        router = Process("router", [f"{bin_dir}/pdrouter", "--port", "0", "--registration-port", "0",
                                    "--mode", args.mode, "--pd-policy", "always"], log_dir, args.verbose)
        processes.append(router)
        rhost, rport = router.wait_for(LISTEN_RE, 30).groups()
        reg_port = int(router.wait_for(REGISTRATION_RE, 30).group(2))
        router_url = f"http://{rhost}:{rport}"

        instances = {}
        for role in ("producer", "consumer"):
            config = {"kv_connector": "PdConnector", "kv_role": f"kv_{role}",
                      "kv_connector_extra_config": {"read_mode": args.mode == "read", "proxy_ip": "127.0.0.1",
                                                    "proxy_ping_port": reg_port}}
            print(f"[demo] starting pdserve {role} on {args.model} ({device})")
            argv = [f"{bin_dir}/pdserve", "--model", args.model, "--device", device, "--port", "0",
                    "--max-model-len", "2048", "--kv-transfer-config", json.dumps(config)]
            if device == "cuda":
                argv += ["--cuda-device", str(cuda_device[role])]
            proc = Process(role, argv, log_dir, args.verbose)
            processes.append(proc)
            host, port = proc.wait_for(LISTEN_RE, 300).groups()
            instances[role] = f"http://{host}:{port}"

        deadline = time.monotonic() + 30
        while True:
            health = json.loads(router_health(f"{router_url}/health"))
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



if __name__ == "__main__":
    sys.exit(main())
