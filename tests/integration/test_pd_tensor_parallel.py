"""P/D between instances of different --tensor-parallel-size: the output equals collocated serving (greedy) for
producer/consumer TP pairs (1,2), (2,1), (2,4), (4,2) and (4,4), in WRITE and READ mode, and no KV block stays in
use on either side. builtin:tiny has 2 KV heads, so TP 2 splits them (one per rank) and TP 4 replicates each on two
ranks: the pairs cover split, merge and replica choice (src/connector/transfer_plan.h). One rank's transfer failing
(xfer's fault injection fails one batch: one layer of one pair of ranks) fails the whole load: the consumer
recomputes, the output is still right, nothing stays held. The fp8 KV cache (codes and scales per head: four
strided sections per block) on the tiny Qwen3-MoE checkpoint, TP 2 -> TP 1 and back.

Instances are kv_both, so each serves as producer or consumer per request; they are shared by the module."""

from __future__ import annotations

import os

import pytest

from test_pd_support import assert_no_blocks_in_use, completion, pd_generate, start_instance, token_ids

MAX_TOKENS = 4
# Shorter than a block, a block and a bit, three blocks and a bit (16-token blocks).
PROMPTS = [[101 + 7 * i for i in range(n)] for n in (5, 20, 37)]
FLAGS = ["--num-kv-blocks", "64", "--max-num-seqs", "8"]
PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (4, 4)]


def start_tp(procs, tp: int, env=None):
    return start_instance(procs, "kv_both", flags=[*FLAGS, "--tensor-parallel-size", str(tp)], env=env)


@pytest.fixture(scope="module")
def instances(module_procs):
    """TP 1, TP 2 and two TP 4 instances (the (4,4) pair needs two)."""
    return {"1": start_tp(module_procs, 1), "2": start_tp(module_procs, 2), "4": start_tp(module_procs, 4),
            "4b": start_tp(module_procs, 4)}


@pytest.fixture(scope="module")
def expected(instances):
    """Collocated outputs: plain requests (no kv_transfer_params) on the TP 1 instance."""
    out = []
    for prompt in PROMPTS:
        status, body = completion(instances["1"].url, prompt, MAX_TOKENS)
        assert status == 200, body
        out.append(token_ids(body))
    assert len({tuple(o) for o in out}) > 1, "the model must not answer every prompt alike"
    return out


def moved_bytes(*insts) -> float:
    return sum(i.metric("pd_connector_bytes_total", {"direction": d}) for i in insts for d in ("write", "read"))


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
@pytest.mark.parametrize("producer_tp, consumer_tp", PAIRS, ids=[f"p{p}_c{c}" for p, c in PAIRS])
def test_pd_across_tp_sizes_equals_collocated(instances, expected, producer_tp, consumer_tp, read_mode):
    producer = instances[str(producer_tp)]
    consumer = instances["4b" if (producer_tp, consumer_tp) == (4, 4) else str(consumer_tp)]
    errors_before = consumer.metric("pd_connector_load_errors_total")
    bytes_before = moved_bytes(producer, consumer)
    got = [pd_generate(producer, consumer, prompt, MAX_TOKENS, read_mode) for prompt in PROMPTS]
    assert got == expected
    assert moved_bytes(producer, consumer) > bytes_before, "KV must actually move through xfer"
    assert consumer.metric("pd_connector_load_errors_total") == errors_before
    assert_no_blocks_in_use(producer, consumer)
    assert producer.metric("pd_connector_blocks_held") == 0


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_one_ranks_failed_transfer_recomputes_and_holds_nothing(procs, instances, expected, read_mode):
    # The side that posts the batches (WRITE: producer, READ: consumer) fails its first one:
    # layer 0 of one pair of ranks, while the other pairs' batches succeed.
    faulty = start_tp(procs, 2, env={"PD_CONNECTOR_XFER_FAULT": "fail:1"})
    producer, consumer = (instances["4"], faulty) if read_mode else (faulty, instances["4"])
    errors_before = consumer.metric("pd_connector_load_errors_total")
    recomputes_before = consumer.metric("pd_connector_recomputes_total")
    prompt = PROMPTS[2]
    assert pd_generate(producer, consumer, prompt, MAX_TOKENS, read_mode) == expected[2]
    assert consumer.metric("pd_connector_load_errors_total") == errors_before + 1
    assert consumer.metric("pd_connector_recomputes_total") == recomputes_before + 1
    if not read_mode:
        assert producer.metric("pd_connector_transfers_failed_total", {"side": "producer"}) == 1
    assert_no_blocks_in_use(producer, consumer)
    assert producer.metric("pd_connector_blocks_held") == 0
    # The fault was one batch: the next transfer between the same instances succeeds.
    assert pd_generate(producer, consumer, PROMPTS[1], MAX_TOKENS, read_mode) == expected[1]
    assert consumer.metric("pd_connector_load_errors_total") == errors_before + 1
    assert_no_blocks_in_use(producer, consumer)


MOE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "golden", "qwen3_moe")
FP8_FLAGS = ["--model", MOE_DIR, "--served-model-name", "builtin:tiny", "--max-model-len", "256", "--num-kv-blocks",
             "64", "--kv-cache-dtype", "fp8"]


def test_fp8_kv_moves_between_tp_sizes_in_both_modes(procs):
    def start(tp):
        return start_instance(procs, "kv_both", flags=[*FP8_FLAGS, "--tensor-parallel-size", str(tp)])
    one, two = start(1), start(2)
    prompts = [[3 + (11 * i) % 500 for i in range(n)] for n in (9, 33)]
    expected = []
    for prompt in prompts:
        status, body = completion(one.url, prompt, MAX_TOKENS)
        assert status == 200, body
        expected.append(token_ids(body))
    for producer, consumer in ((two, one), (one, two)):
        for read_mode in (False, True):
            got = [pd_generate(producer, consumer, p, MAX_TOKENS, read_mode) for p in prompts]
            assert got == expected, (producer.url, consumer.url, read_mode)
    assert one.metric("pd_connector_load_errors_total") == 0
    assert two.metric("pd_connector_load_errors_total") == 0
    assert_no_blocks_in_use(one, two)
