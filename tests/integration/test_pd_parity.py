"""P/D output == collocated output, token for token (greedy), in WRITE and READ mode, with 32 concurrent
requests over >= 50 prompts of mixed length; on loopback and across two network namespaces (veth).
After each test both instances hold zero KV blocks."""

from __future__ import annotations

import concurrent.futures
import re

import pytest

from conftest import bin_path, wait_for, PdserveServer, LISTEN_RE
from test_pd_support import (MODEL_FLAGS, NetnsPair, Instance, assert_no_blocks_in_use, completion, kv_config,
                             mixed_prompts, pd_generate, require_root_with_netns, start_instance, token_ids)
import json

NUM_PROMPTS = 54
MAX_TOKENS = 6
CONCURRENCY = 32


@pytest.fixture(scope="module")
def reference(module_procs):
    """Collocated outputs from a plain instance (no connector)."""
    plain = start_instance(module_procs, None)
    prompts = mixed_prompts(NUM_PROMPTS)
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda p: completion(plain.url, p, MAX_TOKENS), prompts))
    outputs = []
    for status, body in results:
        assert status == 200, body
        outputs.append(token_ids(body))
    return prompts, outputs


def run_parity(producer, consumer, prompts, expected, read_mode, extra=None):
    with concurrent.futures.ThreadPoolExecutor(2 * CONCURRENCY) as legs:
        with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            got = list(pool.map(lambda p: pd_generate(producer, consumer, p, MAX_TOKENS, read_mode, pool=legs,
                                                      producer_extra=extra, consumer_extra=extra),
                                prompts))
    mismatches = [(i, len(prompts[i]), e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ, first: {mismatches[:3]}"


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_pd_equals_collocated_on_loopback(procs, reference, read_mode):
    prompts, expected = reference
    producer = start_instance(procs, "kv_producer", read_mode)
    consumer = start_instance(procs, "kv_consumer", read_mode)
    bytes_before = producer.metric("pd_connector_bytes_total", {"direction": "write"}) + \
        consumer.metric("pd_connector_bytes_total", {"direction": "read"})
    run_parity(producer, consumer, prompts, expected, read_mode)
    moved = producer.metric("pd_connector_bytes_total", {"direction": "write"}) + \
        consumer.metric("pd_connector_bytes_total", {"direction": "read"}) - bytes_before
    assert moved > 0, "KV must actually move through xfer"
    assert consumer.metric("pd_connector_load_errors_total") == 0
    # First-token hand-over: every consumer request longer than one token took the producer's token.
    multi_token = sum(1 for p in prompts if len(p) > 1)
    assert consumer.metric("pd_connector_first_tokens_total", {"result": "accepted"}) == multi_token
    assert consumer.metric("pd_connector_first_tokens_total", {"result": "refused_sampling_key"}) == 0
    # Each of those tokens was streamed ahead of the engine's next poll, not after its step in flight: in
    # WRITE by the consumer's control-plane thread as its done arrived, in READ by its completion thread as
    # the last read of the prompt's KV completed.
    assert consumer.metric("pd_connector_first_tokens_streamed_total") == multi_token
    assert_no_blocks_in_use(producer, consumer)


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_pd_equals_collocated_when_the_consumer_computes_the_first_token(procs, reference, read_mode):
    """With logprobs asked for (or with the hand-over switched off) the consumer computes the last prompt token
    itself, as vLLM's connectors do; the output is the same."""
    prompts, expected = reference
    subset = prompts[::3]
    expected_subset = expected[::3]
    producer = start_instance(procs, "kv_producer", read_mode)
    consumer = start_instance(procs, "kv_consumer", read_mode, first_token_handover=not read_mode)
    run_parity(producer, consumer, subset, expected_subset, read_mode, extra={"logprobs": 0} if not read_mode else None)
    assert consumer.metric("pd_connector_first_tokens_total", {"result": "accepted"}) == 0
    assert consumer.metric("pd_connector_load_errors_total") == 0
    assert_no_blocks_in_use(producer, consumer)


def start_in_namespace(procs, netns: NetnsPair, index: int, role: str, read_mode: bool, peer_ip: str,
                       secret_file: str) -> Instance:
    host = netns.ips[index]
    # Beyond loopback the control plane must be authenticated (or explicitly not): CURVE here.
    argv = [*netns.prefix(index), str(bin_path("pdserve")), "--port", "0", *MODEL_FLAGS, "--host", host,
            "--kv-transfer-config", kv_config(role, read_mode, kv_ip=host, allowed_peers=[peer_ip],
                                              control_secret_file=secret_file)]
    # Control plane, HTTP and the UCX data plane all cross the veth: UCX_TLS=tcp,self keeps UCX off
    # shared memory, as between two hosts. (xfer waits for the veth's carrier before UCX lists its
    # devices; without carrier UCX advertises loopback only and ucp_ep_create fails with
    # "Destination is unreachable": src/xfer/README.md.)
    managed = procs.spawn(argv, env={"UCX_TLS": "tcp,self"})
    match = managed.wait_for_line(LISTEN_RE, 90)
    server = PdserveServer(managed, match.group(1), int(match.group(2)))
    wait_for(server.healthy, 60, f"{server.base_url}/health")
    status, body, _ = server.get("/pd/info")
    assert status == 200
    return Instance(server, json.loads(body))


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_pd_equals_collocated_across_network_namespaces(procs, reference, read_mode, tmp_path):
    require_root_with_netns()
    prompts, expected = reference
    secret = tmp_path / "control_secret"
    secret.write_text("a deployment secret shared by both instances\n")
    with NetnsPair() as netns:
        # The test's own sockets live in the consumer's namespace; the producer is reached over the veth.
        restore = netns.enter(1)
        try:
            producer = start_in_namespace(procs, netns, 0, "kv_producer", read_mode, netns.ips[1], str(secret))
            consumer = start_in_namespace(procs, netns, 1, "kv_consumer", read_mode, netns.ips[0], str(secret))
            assert producer.info["control"].startswith(netns.ips[0] + ":")
            run_parity(producer, consumer, prompts, expected, read_mode)
            assert_no_blocks_in_use(producer, consumer)
            for managed in procs.procs:
                managed.stop()
        finally:
            restore()
