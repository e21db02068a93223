"""pdrouter in front of real collocated pdserve instances: completions and chat, stream and
not, through the official openai client; /v1/models, /health, API key; policies; a killed
instance expires and traffic moves away; a restarted one is re-admitted; client disconnect
frees the engine's blocks; 2,000 concurrent streaming clients; HTTP/1.0 and 100-continue clients;
stale pooled engine connections; --client-idle-timeout-ms."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import openai
import pytest

from conftest import LISTEN_RE, PdserveServer, bin_path, metric_value, start_pdserve, wait_for
from router_fixtures import TINY_MODEL, raise_fd_limit, start_router

ENGINE_FLAGS = ["--model", TINY_MODEL, "--max-model-len", "256"]


@pytest.fixture(scope="module")
def engines(module_procs):
    return [start_pdserve(module_procs, *ENGINE_FLAGS) for _ in range(2)]


@pytest.fixture(scope="module")
def router(module_procs, engines):
    router = start_router(module_procs, "--collocated", engines[0].base_url, "--collocated", engines[1].base_url,
                          "--decode-policy", "round_robin", registration=False)
    router.wait_for_instances(2)
    return router


def client_for(base_url, **kw):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)


def test_completion_through_router_equals_direct_greedy(router, engines):
    direct = client_for(engines[0].base_url).completions.create(model=TINY_MODEL, prompt="The quick brown",
                                                                max_tokens=12, temperature=0)
    routed = client_for(router.base_url).completions.create(model=TINY_MODEL, prompt="The quick brown",
                                                            max_tokens=12, temperature=0)
    assert routed.choices[0].text == direct.choices[0].text
    assert routed.usage.completion_tokens == direct.usage.completion_tokens


def test_streamed_completion_matches_and_ends_with_usage(router):
    client = client_for(router.base_url)
    whole = client.completions.create(model=TINY_MODEL, prompt="Once upon", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=TINY_MODEL, prompt="Once upon", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_stream_and_not(router):
    client = client_for(router.base_url)
    messages = [{"role": "user", "content": "Say something"}]
    whole = client.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_stream_is_event_stream_and_relayed_event_by_event(router):
    """Raw HTTP: the router answers text/event-stream and the first event arrives before the last."""
    host, port = router.host, router.port
    body = (b'{"model":"%s","prompt":"abc","max_tokens":40,"ignore_eos":true,"stream":true}' % TINY_MODEL.encode())
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        arrivals = []
        while b"data: [DONE]" not in received:
            data = sock.recv(65536)
            assert data, "connection closed before [DONE]"
            received += data
            arrivals.append((time.monotonic(), received.count(b"\ndata: ") + received.startswith(b"data: ")))
    head = received.split(b"\r\n\r\n", 1)[0].decode().lower()
    assert head.startswith("http/1.1 200")
    assert "content-type: text/event-stream" in head
    assert "transfer-encoding: chunked" in head
    assert len(arrivals) > 2, "the stream arrived in one piece: not relayed event by event"


def test_models_and_health_reflect_the_discovered_set(router):
    models = client_for(router.base_url).models.list()
    assert [m.id for m in models.data] == [TINY_MODEL]
    status, _, _ = router.get("/health")
    assert status == 200
    assert len(router.instances()) == 2
    assert {i["role"] for i in router.instances()} == {"both"}


def test_unknown_model_is_404(router):
    with pytest.raises(openai.NotFoundError):
        client_for(router.base_url).completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_bad_json_is_400_and_router_keeps_serving(router):
    status, body, _ = router.post("/v1/completions", b"{not json")
    assert status == 400 and b"error" in body
    assert client_for(router.base_url).completions.create(model=TINY_MODEL, prompt="x", max_tokens=1).choices


def test_round_robin_spreads_requests_over_both_engines(router, engines):
    def served(engine):
        return metric_value(engine.metrics(), "pd_generation_tokens_total") or 0.0

    before = [served(e) for e in engines]
    client = client_for(router.base_url)
    for _ in range(10):
        client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    after = [served(e) for e in engines]
    assert after[0] - before[0] == 10 and after[1] - before[1] == 10, (before, after)


def test_api_key_guards_v1_routes(procs, engines):
    router = start_router(procs, "--collocated", engines[0].base_url, "--api-key", "s3cret", registration=False)
    router.wait_for_instances(1)
    with pytest.raises(openai.AuthenticationError):
        client_for(router.base_url).completions.create(model=TINY_MODEL, prompt="x", max_tokens=1)
    allowed = openai.OpenAI(base_url=router.base_url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
    assert allowed.completions.create(model=TINY_MODEL, prompt="x", max_tokens=1).choices
    assert router.get("/health")[0] == 200


def test_backend_api_key_is_sent_on_probes_and_legs(procs):
    """An engine run with --api-key: a collocated engine has no /pd/info, so the router discovers it
    through GET /v1/models, which needs the key, and every completion leg needs it too."""
    engine = start_pdserve(procs, *ENGINE_FLAGS, "--api-key", "engine-key")

    def engine_requests(route: str, status: int) -> float:
        return metric_value(engine.metrics(), "pd_http_requests_total", {"route": route, "status": str(status)}) or 0.0

    unkeyed = start_router(procs, "--collocated", engine.base_url, registration=False)
    wait_for(lambda: engine_requests("/v1/models", 401) >= 1, 15, "the keyless probe refused by the engine")
    assert unkeyed.instances() == [], "an engine that refused the probe was admitted"

    keyed = start_router(procs, "--collocated", engine.base_url, "--backend-api-key", "engine-key",
                         registration=False)
    keyed.wait_for_instances(1)
    assert engine_requests("/v1/models", 200) >= 1
    answer = client_for(keyed.base_url).completions.create(model=TINY_MODEL, prompt="x", max_tokens=2)
    assert answer.choices
    assert engine_requests("/v1/completions", 200) == 1

    # The same key from the environment (kept out of the process list) works the same way.
    from_env = start_router(procs, "--collocated", engine.base_url, registration=False,
                            env={"PDROUTER_BACKEND_API_KEY": "engine-key"})
    from_env.wait_for_instances(1)
    assert client_for(from_env.base_url).completions.create(model=TINY_MODEL, prompt="x", max_tokens=2).choices
    assert engine_requests("/v1/completions", 200) == 2


def blocks_used(engine) -> float:
    return metric_value(engine.metrics(), "pd_kv_blocks_used") or 0.0


def test_client_disconnect_aborts_the_engine_request_and_frees_its_blocks(procs):
    # Long enough that the generation (~1 s on builtin:tiny) outlives the client that closes early.
    engine = start_pdserve(procs, "--model", TINY_MODEL, "--max-model-len", "2048")
    router = start_router(procs, "--collocated", engine.base_url, registration=False)
    router.wait_for_instances(1)
    body = (b'{"model":"%s","prompt":"%s","max_tokens":1900,"ignore_eos":true,"stream":true}'
            % (TINY_MODEL.encode(), b"word " * 60))
    sock = socket.create_connection((router.host, router.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    wait_for(lambda: blocks_used(engine) > 0, 30, "the request holds KV blocks")
    sock.close()
    wait_for(lambda: blocks_used(engine) == 0, 30, "blocks back to 0 after the client went away")
    wait_for(lambda: router.instances()[0]["outstanding"] == 0, 10, "router released the leg")
    assert router.metric("pd_router_requests_total", {"route": "/v1/completions", "status": "200"}) == 1


def test_killed_instance_expires_traffic_moves_away_and_restart_is_readmitted(procs):
    first = start_pdserve(procs, *ENGINE_FLAGS)
    second = start_pdserve(procs, *ENGINE_FLAGS)
    router = start_router(procs, "--collocated", first.base_url, "--collocated", second.base_url,
                          "--decode-policy", "round_robin", registration=False)
    router.wait_for_instances(2)
    client = client_for(router.base_url)
    first_http = f"{first.host}:{first.port}"

    first.process.proc.kill()
    first.process.proc.wait(timeout=10)
    killed_at = time.monotonic()
    # Before expiry, a dead instance costs a refused connect and the request is re-planned: no client error.
    for _ in range(4):
        assert client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2).choices
    wait_for(lambda: first_http not in {i["http"] for i in router.instances()}, 10, "killed instance expired")
    assert time.monotonic() - killed_at <= 6.5
    assert router.metric("pd_router_instance_expiries_total") >= 1
    for _ in range(6):
        assert client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2).choices

    # Restart on the same address and expect re-admission.
    managed = procs.spawn([bin_path("pdserve"), *ENGINE_FLAGS, "--port", str(first.port)])
    match = managed.wait_for_line(LISTEN_RE, 90)
    restarted = PdserveServer(managed, match.group(1), int(match.group(2)))
    wait_for(restarted.healthy, 90, "restarted engine healthy")
    wait_for(lambda: first_http in {i["http"] for i in router.instances()}, 15, "restarted instance re-admitted")
    before = metric_value(restarted.metrics(), "pd_generation_tokens_total") or 0.0
    for _ in range(6):
        client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    after = metric_value(restarted.metrics(), "pd_generation_tokens_total") or 0.0
    assert after - before > 0, "no traffic reached the re-admitted instance"


def added_latency_histogram(router) -> list[tuple[str, float]]:
    """(le, cumulative count) of pd_router_added_latency_seconds{route="/v1/completions"}."""
    buckets = re.findall(r'^pd_router_added_latency_seconds_bucket\{([^}]*)\}\s+(\S+)$', router.metrics(), re.M)
    out = []
    for labels, value in buckets:
        if 'route="/v1/completions"' in labels:
            out.append((re.search(r'le="([^"]*)"', labels).group(1), float(value)))
    return out


def test_two_thousand_concurrent_streaming_clients(procs):
    """2,000 streams at once through the router (loopback, one CPU engine): every one completes, nothing
    is left held. Prints the router's added-latency histogram at that load (docs/perf/router.md)."""
    raise_fd_limit(16384)
    engine = start_pdserve(procs, *ENGINE_FLAGS, "--max-num-seqs", "256")
    router = start_router(procs, "--collocated", engine.base_url, registration=False)
    router.wait_for_instances(1)
    num_clients = 2000

    async def run() -> list:
        # The openai client's own transport, with a pool large enough for every client at once.
        transport = openai._base_client  # noqa: SLF001 - where the client keeps its default Limits type
        limits = type(transport.DEFAULT_CONNECTION_LIMITS)(max_connections=num_clients + 10,
                                                           max_keepalive_connections=num_clients + 10)
        http_client = openai.DefaultAsyncHttpxClient(limits=limits, timeout=300)
        async with openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300, http_client=http_client) as client:
            async def one(i: int):
                stream = await client.completions.create(model=TINY_MODEL, prompt=f"client {i}", max_tokens=2,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True})
                chunks = [chunk async for chunk in stream]
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
                return True
            return await asyncio.gather(*(one(i) for i in range(num_clients)), return_exceptions=True)

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    errors = [r for r in results if r is not True]
    assert not errors, f"{len(errors)} of {num_clients} failed, first: {errors[0]!r}"
    assert router.metric("pd_router_requests_total", {"route": "/v1/completions", "status": "200"}) == num_clients
    wait_for(lambda: blocks_used(engine) == 0, 10, "no blocks held after the load")
    wait_for(lambda: router.instances()[0]["outstanding"] == 0, 10, "every leg released")
    histogram = added_latency_histogram(router)
    assert histogram and histogram[-1][1] == num_clients
    print(f"{num_clients} concurrent streams in {elapsed:.1f}s; router added latency (le, cumulative count): "
          + ", ".join(f"{le}:{int(count)}" for le, count in histogram))


def test_least_outstanding_counts_a_stream_for_its_whole_life(procs):
    long_flags = ["--model", TINY_MODEL, "--max-model-len", "2048"]
    engines = [start_pdserve(procs, *long_flags) for _ in range(2)]
    router = start_router(procs, "--collocated", engines[0].base_url, "--collocated", engines[1].base_url,
                          "--decode-policy", "least_outstanding", registration=False)
    router.wait_for_instances(2)
    body = (b'{"model":"%s","prompt":"long","max_tokens":1900,"ignore_eos":true,"stream":true}' % TINY_MODEL.encode())
    sock = socket.create_connection((router.host, router.port), timeout=60)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the stream is live and counted
        busy = {i["http"] for i in router.instances() if i["outstanding"] == 1}
        assert len(busy) == 1
        idle_engine = next(e for e in engines if f"{e.host}:{e.port}" not in busy)
        before = metric_value(idle_engine.metrics(), "pd_generation_tokens_total") or 0.0
        client = client_for(router.base_url)
        for _ in range(5):  # every short request goes to the instance without the stream
            client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
        after = metric_value(idle_engine.metrics(), "pd_generation_tokens_total") or 0.0
        assert after - before == 10
        assert {i["http"] for i in router.instances() if i["outstanding"] == 1} == busy
    finally:
        sock.close()
    wait_for(lambda: all(i["outstanding"] == 0 for i in router.instances()), 30, "stream leg released")


def raw_request(host: str, port: int, request: bytes, timeout_s: float = 60.0) -> bytes:
    """Sends raw request bytes and reads until the peer closes the connection."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(request)
        received = b""
        while data := sock.recv(65536):
            received += data
        return received


STREAM_BODY = b'{"model":"%s","prompt":"x","max_tokens":4,"ignore_eos":true,"stream":true}' % TINY_MODEL.encode()


@pytest.mark.parametrize("target", ["router", "engine"])
def test_http10_client_gets_a_stream_without_chunked_encoding_ended_by_close(router, engines, target):
    """HTTP/1.0 has no chunked encoding: the events come as they are, Connection: close ends the body."""
    endpoint = router if target == "router" else engines[0]
    answer = raw_request(endpoint.host, endpoint.port,
                         b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(STREAM_BODY), STREAM_BODY))
    head, _, body = answer.partition(b"\r\n\r\n")
    headers = head.lower().split(b"\r\n")
    assert headers[0].startswith(b"http/1.") and b" 200 " in headers[0]
    assert b"transfer-encoding: chunked" not in headers
    assert b"connection: close" in headers
    events = [e for e in body.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events), body[:200]  # no chunk-size lines in between
    assert events[-1] == b"data: [DONE]"
    # An HTTP/1.1 client still gets chunks.
    answer11 = raw_request(endpoint.host, endpoint.port,
                           b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                           % (len(STREAM_BODY), STREAM_BODY))
    assert b"transfer-encoding: chunked" in answer11.partition(b"\r\n\r\n")[0].lower()


def test_router_answers_expect_100_continue_before_the_body(router):
    """A client that sends `Expect: 100-continue` waits for the interim answer before its body."""
    body = b'{"model":"%s","prompt":"x","max_tokens":2}' % TINY_MODEL.encode()
    with socket.create_connection((router.host, router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.settimeout(5)  # far below the client idle timeout: only a 100 Continue answers this soon
        interim = sock.recv(65536)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        final = b""
        while b"\r\n\r\n" not in final:
            final += sock.recv(65536)
        assert final.startswith(b"HTTP/1.1 200")


def test_client_idle_timeout_flag_closes_a_silent_connection(procs, engines):
    router = start_router(procs, "--collocated", engines[0].base_url, "--client-idle-timeout-ms", "300",
                          registration=False)
    with socket.create_connection((router.host, router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and then nothing
        started = time.monotonic()
        assert sock.recv(65536) == b""  # closed by the router
        assert time.monotonic() - started < 5


def test_pooled_connections_the_engine_closed_while_idle_never_fail_a_request(procs):
    """The engine closes connections idle for its keep-alive (1 s here). A router that keeps them longer
    (--backend-idle-timeout-ms 60000, a misconfiguration) must still answer every request: a stale pooled
    connection is retried on a NEW connection, never on another pooled one."""
    engine = start_pdserve(procs, *ENGINE_FLAGS, "--keep-alive-timeout-ms", "1000")
    router = start_router(procs, "--collocated", engine.base_url, "--backend-idle-timeout-ms", "60000",
                          "--io-threads", "1", registration=False)
    router.wait_for_instances(1)

    async def burst(num_requests: int) -> list:
        async with openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=60) as client:
            async def one(i: int):
                answer = await client.completions.create(model=TINY_MODEL, prompt=f"x {i}", max_tokens=2)
                return answer.usage.completion_tokens == 2
            return await asyncio.gather(*(one(i) for i in range(num_requests)), return_exceptions=True)

    assert all(r is True for r in asyncio.run(burst(16)))  # fills the pool with several connections
    time.sleep(2.0)  # idles past the engine's keep-alive (what is tested, not synchronisation)
    # One at a time: every request finds more stale pooled connections than it has retries.
    client = client_for(router.base_url)
    for i in range(8):
        assert client.completions.create(model=TINY_MODEL, prompt=f"y {i}", max_tokens=2).usage.completion_tokens == 2
    assert router.metric("pd_router_stale_connection_retries_total") >= 1


def test_pooled_connections_are_closed_after_backend_idle_timeout(procs):
    """With --backend-idle-timeout-ms below the engine's keep-alive no request meets a stale connection."""
    engine = start_pdserve(procs, *ENGINE_FLAGS, "--keep-alive-timeout-ms", "1000")
    router = start_router(procs, "--collocated", engine.base_url, "--backend-idle-timeout-ms", "400",
                          registration=False)
    router.wait_for_instances(1)
    client = client_for(router.base_url)
    for round_index in range(3):
        for i in range(4):
            assert client.completions.create(model=TINY_MODEL, prompt=f"{round_index} {i}",
                                             max_tokens=2).usage.completion_tokens == 2
        time.sleep(1.5)  # idles past the engine's keep-alive (what is tested, not synchronisation)
    assert router.metric("pd_router_stale_connection_retries_total") == 0
