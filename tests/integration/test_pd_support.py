"""Shared helpers for the P/D connector suites (test_pd_*.py): start producer / consumer / collocated
pdserve instances, play the router's part (mint transfer ids, send the two legs exactly as
docs/pd_contract.md specifies), compare outputs token for token, and check that no KV block stays in use.

This module holds no tests; the suites import it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import random
import secrets
import subprocess
import uuid
from dataclasses import dataclass

import pytest

from conftest import PdserveServer, http_request, metric_value, start_pdserve, wait_for

MODEL = "builtin:tiny"
BLOCK_SIZE = 16
MODEL_FLAGS = ["--model", MODEL, "--max-model-len", "512", "--block-size", str(BLOCK_SIZE), "--seed", "0",
               "--num-kv-blocks", "1024", "--max-num-seqs", "64"]
# Bytes of one (layer, block) of builtin:tiny: 2 (K,V) x 16 tokens x 2 kv heads x 32 dims x 4 bytes.
BYTES_PER_LAYER_BLOCK = 2 * BLOCK_SIZE * 2 * 32 * 4
NUM_LAYERS = 2


def base_flags(overrides=()) -> list[str]:
    """MODEL_FLAGS minus the flags that `overrides` sets itself."""
    out, skip = [], False
    for i, flag in enumerate(MODEL_FLAGS):
        if skip:
            skip = False
            continue
        if flag.startswith("--") and flag in overrides:
            skip = True
            continue
        out.append(flag)
    return out


def kv_config(role: str, read_mode: bool = False, kv_ip: str | None = None, **extra) -> str:
    cfg = {"kv_connector": "PdConnector", "kv_role": role,
           "kv_connector_extra_config": {"read_mode": read_mode, "backend": "ucx", **extra}}
    if kv_ip:
        cfg["kv_ip"] = kv_ip
    return json.dumps(cfg)


@dataclass
class Instance:
    server: PdserveServer
    info: dict

    @property
    def url(self) -> str:
        return self.server.base_url

    def metric(self, name: str, labels: dict | None = None) -> float:
        return metric_value(self.server.metrics(), name, labels) or 0.0


def start_instance(procs, role: str | None, read_mode: bool = False, flags=(), env=None, host="127.0.0.1",
                   **extra) -> Instance:
    argv = [*base_flags(flags), "--host", host, *flags]
    if role is not None:
        argv += ["--kv-transfer-config", kv_config(role, read_mode, kv_ip=host if host != "127.0.0.1" else None,
                                                   **extra)]
    server = start_pdserve(procs, *argv, env=env)
    info = {}
    if role is not None:
        status, body, _ = server.get("/pd/info")
        assert status == 200, body
        info = json.loads(body)
    return Instance(server, info)


def completion(url: str, prompt_ids: list[int], max_tokens: int, kv_params: dict | None = None,
               timeout_s: float = 120.0, **extra) -> tuple[int, dict]:
    # Token ids come back through vLLM's return_token_ids (builtin:tiny has no tokenizer, so no text).
    # No logprobs by default: a consumer takes the producer's first token (first-token hand-over) only
    # when none are asked for; pass logprobs=0 to test the path that computes it again.
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    status, raw, _ = http_request(url, "POST", "/v1/completions", body, timeout_s=timeout_s)
    return status, json.loads(raw) if raw else {}


def token_ids(response: dict) -> list[int]:
    return [int(t) for t in response["choices"][0]["token_ids"]]


def new_transfer_id() -> str:
    return secrets.token_hex(16)


def consumer_params_write(producer: Instance, transfer_id: str) -> dict:
    return {"transfer_id": transfer_id, "do_remote_prefill": True, "mode": "write",
            "remote_instance_id": producer.info["instance_id"], "remote_control": producer.info["control"],
            "remote_boot_nonce": producer.info["boot_nonce"]}


def pd_generate(producer: Instance, consumer: Instance, prompt_ids: list[int], max_tokens: int, read_mode: bool,
                pool: concurrent.futures.Executor | None = None, transfer_id: str | None = None,
                producer_extra: dict | None = None, consumer_extra: dict | None = None) -> list[int]:
    """One request through P/D exactly as pdrouter sends it; returns the consumer's token ids."""
    transfer_id = transfer_id or new_transfer_id()
    mode = "read" if read_mode else "write"
    producer_params = {"transfer_id": transfer_id, "do_remote_decode": True, "mode": mode}
    if read_mode:
        status, prefill = completion(producer.url, prompt_ids, 1, producer_params, **(producer_extra or {}))
        assert status == 200, prefill
        params = prefill.get("kv_transfer_params")
        assert params and params["transfer_id"] == transfer_id, prefill
        params = {**params, "do_remote_prefill": True, "mode": "read"}
        status, decode = completion(consumer.url, prompt_ids, max_tokens, params, **(consumer_extra or {}))
        assert status == 200, decode
        return token_ids(decode)
    own_pool = pool is None
    pool = pool or concurrent.futures.ThreadPoolExecutor(2)
    try:
        prefill_future = pool.submit(completion, producer.url, prompt_ids, 1, producer_params,
                                     **(producer_extra or {}))
        status, decode = completion(consumer.url, prompt_ids, max_tokens, consumer_params_write(producer, transfer_id),
                                    **(consumer_extra or {}))
        p_status, prefill = prefill_future.result(timeout=180)
        assert p_status == 200, prefill
        assert status == 200, decode
        return token_ids(decode)
    finally:
        if own_pool:
            pool.shutdown(wait=True)


def mixed_prompts(count: int, seed: int = 7) -> list[list[int]]:
    """Shorter than a block, exact multiples of the block size, one past, and long prompts."""
    rng = random.Random(seed)
    lengths = [1, 2, 5, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100, 128, 150, 200, 255, 256, 300]
    prompts = []
    for i in range(count):
        n = lengths[i % len(lengths)] if i < 2 * len(lengths) else rng.randint(1, 320)
        prompts.append([rng.randint(100, 30000) for _ in range(n)])
    return prompts


def assert_no_blocks_in_use(*instances: Instance, timeout_s: float = 30.0):
    for inst in instances:
        def free(inst=inst):
            return inst.metric("pd_kv_blocks_used") == 0
        try:
            wait_for(free, timeout_s, f"{inst.url}: pd_kv_blocks_used == 0")
        except BaseException:
            state = [line for line in inst.server.metrics().splitlines()
                     if line.startswith(("pd_connector_transfers", "pd_connector_timeouts", "pd_connector_blocks",
                                         "pd_kv_blocks", "pd_num_requests", "pd_connector_load"))]
            print(f"{inst.url} connector state:\n" + "\n".join(state))
            raise


# --------------------------------------------------------------------------- network namespaces

_CLONE_NEWNET = 0x40000000


def _setns(fd: int):
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class NetnsPair:
    """Two network namespaces joined by a veth pair (unique names; removed on close)."""

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.ns = [f"pdp{tag}", f"pdc{tag}"]
        self.veth = [f"vp{tag}", f"vc{tag}"]
        octet = int(tag[:2], 16) % 200 + 20
        self.ips = [f"10.{octet}.7.1", f"10.{octet}.7.2"]
        self.created = []

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    def __enter__(self):
        for ns in self.ns:
            self._ip("netns", "add", ns)
            self.created.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
        self._ip("link", "add", self.veth[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.veth[1],
                 "netns", self.ns[1])
        for ns, veth, ip in zip(self.ns, self.veth, self.ips):
            self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
            self._ip("-n", ns, "link", "set", veth, "up")
        return self

    def __exit__(self, *exc):
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def prefix(self, index: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[index]]

    def enter(self, index: int):
        """Moves the calling thread (and threads it starts later) into namespace `index`; returns a restorer."""
        original = os.open("/proc/self/task/%d/ns/net" % threading_native_id(), os.O_RDONLY)
        target = os.open(f"/run/netns/{self.ns[index]}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)

        def restore():
            try:
                _setns(original)
            finally:
                os.close(original)
        return restore


def threading_native_id() -> int:
    import threading
    return threading.get_native_id()


def require_root_with_netns():
    if os.geteuid() != 0:
        pytest.skip("network-namespace tests need root (ip netns); skipped: not running as root")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip(f"ip netns unavailable: {probe.stderr.decode().strip()}")
