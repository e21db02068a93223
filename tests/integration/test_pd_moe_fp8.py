"""P/D on a tiny Qwen3-MoE checkpoint with the fp8 KV cache (--kv-cache-dtype fp8): WRITE and READ mode give
the collocated greedy output token for token, and both instances hold zero KV blocks afterwards. A producer and a
consumer whose KV dtypes differ refuse each other at the handshake, naming the dtype."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random

import pytest

from conftest import wait_for

from test_server_process import run_to_exit
from test_pd_support import assert_no_blocks_in_use, completion, consumer_params_write, new_transfer_id, \
    pd_generate, start_instance, token_ids

MOE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "golden", "qwen3_moe")
VOCAB = 512
MAX_TOKENS = 6
# completion() names the model "builtin:tiny"; the MoE directory is served under that name.
FP8_FLAGS = ["--model", MOE_DIR, "--served-model-name", "builtin:tiny", "--max-model-len", "256", "--num-kv-blocks",
             "256", "--kv-cache-dtype", "fp8"]


def moe_prompts(count: int = 16, seed: int = 3) -> list[list[int]]:
    """Below, at and past block boundaries (block size 16), and long ones."""
    rng = random.Random(seed)
    lengths = [1, 5, 15, 16, 17, 32, 33, 64, 100, 150, 200, 240]
    return [[rng.randint(3, VOCAB - 1) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


@pytest.fixture(scope="module")
def fp8_reference(module_procs):
    plain = start_instance(module_procs, None, flags=FP8_FLAGS)
    prompts = moe_prompts()
    outputs = []
    for p in prompts:
        status, body = completion(plain.url, p, MAX_TOKENS)
        assert status == 200, body
        outputs.append(token_ids(body))
    assert len({tuple(o) for o in outputs}) > 1, "the model must not answer every prompt alike"
    return prompts, outputs


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_moe_fp8_kv_pd_equals_collocated(procs, fp8_reference, read_mode):
    prompts, expected = fp8_reference
    producer = start_instance(procs, "kv_producer", read_mode, flags=FP8_FLAGS)
    consumer = start_instance(procs, "kv_consumer", read_mode, flags=FP8_FLAGS)
    with concurrent.futures.ThreadPoolExecutor(16) as legs:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: pd_generate(producer, consumer, p, MAX_TOKENS, read_mode, pool=legs),
                                prompts))
    mismatches = [(i, len(prompts[i]), e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ, first: {mismatches[:3]}"
    moved = producer.metric("pd_connector_bytes_total", {"direction": "write"}) + \
        consumer.metric("pd_connector_bytes_total", {"direction": "read"})
    assert moved > 0, "KV must actually move through xfer"
    # Whole fp8 blocks move as they are: every byte count is a multiple of one (layer, block) segment
    # (2 x 16 tokens x 2 kv heads x (32 code bytes + 4 scale bytes)).
    assert moved % (2 * 16 * 2 * (32 + 4)) == 0, moved
    assert consumer.metric("pd_connector_load_errors_total") == 0
    assert_no_blocks_in_use(producer, consumer)


def test_kv_dtype_mismatch_is_refused_at_the_handshake(procs):
    """The fp8 producer refuses the float32 consumer's handshake, naming both dtypes; the consumer's KV load
    fails with that message and it computes the prompt itself, so the request is still answered; no KV moves."""
    # No consumer ever takes the producer's held blocks: they go back after defer_timeout (2 s here).
    producer = start_instance(procs, "kv_producer", False, flags=FP8_FLAGS, defer_timeout=2)
    consumer = start_instance(procs, "kv_consumer", False, flags=[f for f in FP8_FLAGS if f not in ("--kv-cache-dtype",
                                                                                                   "fp8")])
    prompt = moe_prompts(1)[0] * 20
    transfer_id = new_transfer_id()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(completion, producer.url, prompt, 1,
                              {"transfer_id": transfer_id, "do_remote_decode": True, "mode": "write"})
        status, body = completion(consumer.url, prompt, MAX_TOKENS, consumer_params_write(producer, transfer_id))
        prefill.result(timeout=60)
    assert status == 200, body
    assert producer.metric("pd_connector_handshakes_refused_total") >= 1
    needle = "KV layout mismatch, refusing the peer: dtype fp8_e4m3 here vs float32 at the peer"
    wait_for(lambda: needle in producer.server.process.text(), 10, "the refusal in the producer's log")
    wait_for(lambda: needle in consumer.server.process.text(), 10, "the failed KV load in the consumer's log")
    moved = producer.metric("pd_connector_bytes_total", {"direction": "write"}) + \
        consumer.metric("pd_connector_bytes_total", {"direction": "read"})
    assert moved == 0
    assert_no_blocks_in_use(producer, consumer)


def test_bad_kv_cache_dtype_exits_naming_the_flag():
    result = run_to_exit("--kv-cache-dtype", "fp16")
    assert result.returncode != 0
    assert "--kv-cache-dtype must be auto or fp8, got 'fp16'" in result.stdout + result.stderr


@pytest.mark.parametrize("field,value,needle", [
    ("quant_method", "awq", "quant_method 'awq'"),
    ("weight_block_size", [64, 64], "weight_block_size [64,64]"),
    ("activation_scheme", "static", "activation_scheme 'static'"),
    ("fmt", "e5m2", "fmt 'e5m2'"),
])
def test_unsupported_quantization_is_refused_at_load_naming_it(tmp_path, field, value, needle):
    fp8_dir = os.path.join(os.path.dirname(MOE_DIR), "qwen3_moe_fp8")
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run_to_exit("--model", str(tmp_path), "--load-format", "dummy")
    assert result.returncode != 0
    assert needle in result.stdout + result.stderr, result.stdout + result.stderr
