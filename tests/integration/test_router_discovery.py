"""pdrouter discovery: ZMQ registration (docs/pd_contract.md), expiry, boot-nonce replacement,
malformed registrations, CURVE. The registrations come from a real ZMQ client of the
router's real listener; what the router believes is read back from its /health."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import time

import msgpack
import pytest
import zmq
import zmq.utils.z85

from conftest import metric_value, start_pdserve, wait_for
from router_fixtures import TINY_MODEL, Heartbeat, Registrar, registration_record, start_router


def nonces(router, instance_id):
    return [i["boot_nonce"] for i in router.instances() if i["instance_id"] == instance_id]


def test_registration_is_admitted_kept_by_heartbeats_and_expires_within_ttl(procs):
    router = start_router(procs)
    assert router.get("/health")[0] == 503, "no instance yet: unhealthy"
    record = registration_record("d-hb", "consumer", "127.0.0.1:9", control="127.0.0.1:10")
    heartbeat = Heartbeat(router.registration_port, record, period_s=1.0)
    try:
        wait_for(lambda: router.instance_ids() == {"d-hb"}, 10, "registration admitted")
        assert router.get("/health")[0] == 200
        # Heartbeats keep it: still there well past one TTL.
        kept_until = time.monotonic() + 7
        while time.monotonic() < kept_until:
            assert router.instance_ids() == {"d-hb"}
            time.sleep(0.5)  # sampling interval of an invariant, not synchronisation
    finally:
        heartbeat.stop()
    silent_since = time.monotonic()
    wait_for(lambda: not router.instance_ids(), 10, "silent instance expired")
    elapsed = time.monotonic() - silent_since
    assert 3.5 <= elapsed <= 6.5, f"expired after {elapsed:.2f}s, contract is 5 s"
    assert router.metric("pd_router_instance_expiries_total") == 1
    assert router.get("/health")[0] == 503


def test_every_silent_instance_expires_not_just_the_first(procs):
    router = start_router(procs)
    registrar = Registrar(router.registration_port)
    try:
        for i in range(5):
            registrar.send_record(registration_record(f"p{i}", "producer", f"127.0.0.1:{100 + i}"))
        wait_for(lambda: len(router.instance_ids()) == 5, 10, "five registrations")
        outstanding = "pd_router_instance_outstanding"
        assert metric_value(router.metrics(), outstanding, {"instance": "p3", "role": "producer"}) == 0
        wait_for(lambda: not router.instance_ids(), 10, "all five expired")
        assert router.metric("pd_router_instance_expiries_total") == 5
        # An instance that left takes its per-instance series with it.
        assert "instance=\"p" not in router.metrics()
    finally:
        registrar.close()


def test_new_boot_nonce_replaces_the_old_registration(procs):
    router = start_router(procs)
    registrar = Registrar(router.registration_port)
    try:
        registrar.send_record(registration_record("p0", "producer", "127.0.0.1:11", boot_nonce=1))
        wait_for(lambda: nonces(router, "p0") == [1], 10, "first incarnation")
        registrar.send_record(registration_record("p0", "producer", "127.0.0.1:11", boot_nonce=2))
        wait_for(lambda: nonces(router, "p0") == [2], 10, "restarted incarnation replaces the old one")
        assert router.metric("pd_router_registrations_total", {"outcome": "replaced"}) == 1
    finally:
        registrar.close()


def test_malformed_registrations_are_counted_dropped_and_the_listener_survives(procs):
    router = start_router(procs)
    good = registration_record("good", "consumer", "127.0.0.1:12")
    bad_records = [
        {**good, "v": 2},
        {**good, "type": "hello"},
        {**good, "role": "P"},
        {**good, "http": "no-port"},
        {**good, "http": "127.0.0.1:0"},
        {**good, "instance_id": "x" * 129},
        {**good, "instance_id": ""},
        {**good, "boot_nonce": -1},
        {**good, "boot_nonce": "7"},
        {**good, "tp_size": 0},
        {**good, "mode": "push"},
        {k: v for k, v in good.items() if k != "model"},
    ]
    raw_frames = [[b"\xc1"], [b"not msgpack at all"], [msgpack.packb([1, 2, 3])], [msgpack.packb(good) + b"x"],
                  [b"", b"", msgpack.packb(good)], [msgpack.packb("a" * 100)], [b"\x91" * 40 + b"\x01"]]
    registrar = Registrar(router.registration_port)
    try:
        for record in bad_records:
            registrar.send_record(record)
        for frames in raw_frames:
            registrar.send_frames(frames)
        expected = len(bad_records) + len(raw_frames)
        wait_for(lambda: router.metric("pd_router_registrations_malformed_total") == expected, 10,
                 f"{expected} malformed registrations counted")
        assert router.instance_ids() == set()
        registrar.send_record(good)
        wait_for(lambda: router.instance_ids() == {"good"}, 10, "a valid registration after the garbage")
    finally:
        registrar.close()
    # An oversized message is refused by libzmq itself (the peer is disconnected); the listener stays up.
    big = Registrar(router.registration_port)
    try:
        big.send_record({**good, "instance_id": "big", "model": "m" * 100_000})
    finally:
        big.close()
    again = Registrar(router.registration_port)
    try:
        again.send_record(registration_record("after-big", "producer", "127.0.0.1:13"))
        wait_for(lambda: "after-big" in router.instance_ids(), 10, "listener alive after an oversized message")
        assert "big" not in router.instance_ids()
    finally:
        again.close()


def derive_curve_keys(secret: bytes) -> dict:
    """Python twin of src/common/curve_auth.cc derive_curve_keys (BLAKE2b-256, X25519)."""
    digest = hashlib.blake2b(secret, digest_size=32).digest()

    def pair(label: bytes):
        secret_key = hashlib.blake2b(label, digest_size=32, key=digest).digest()
        secret_z85 = zmq.utils.z85.encode(secret_key)
        return zmq.curve_public(secret_z85), secret_z85

    server_public, _ = pair(b"pdserve-curve-server-v1")
    client_public, client_secret = pair(b"pdserve-curve-client-v1")
    return {"server_public": server_public, "client_public": client_public, "client_secret": client_secret}


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_registration_admits_only_holders_of_the_secret(procs, tmp_path):
    secret = b"router-test-secret-0123456789"
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(secret + b"\n")
    router = start_router(procs, "--control-secret-file", str(secret_file))

    outsider = Registrar(router.registration_port)  # plain, no CURVE
    wrong = Registrar(router.registration_port, derive_curve_keys(b"some-other-secret-abcdefgh"))
    member = Registrar(router.registration_port, derive_curve_keys(secret))
    try:
        # The router may already have refused the outsider's handshake (plain vs CURVE): its DEALER then has
        # nowhere to queue the record, and a blocking send would wait forever. Refused either way.
        outsider.try_send_record(registration_record("outsider", "producer", "127.0.0.1:14"))
        wrong.try_send_record(registration_record("wrong", "producer", "127.0.0.1:15"))
        member_record = registration_record("member", "producer", "127.0.0.1:16")
        member.send_record(member_record)
        wait_for(lambda: "member" in router.instance_ids(), 10, "CURVE client with the derived keys admitted")
        # The member's message came after the others on independent connections; give the others the same
        # chance by sending the member again and requiring two admissions' worth of refreshes.
        member.send_record(member_record)
        wait_for(lambda: router.metric("pd_router_registrations_total", {"outcome": "refreshed"}) >= 1, 10,
                 "second member registration processed")
        assert router.instance_ids() == {"member"}
        assert router.metric("pd_router_registrations_malformed_total") == 0
    finally:
        for registrar in (outsider, wrong, member):
            registrar.close()


def outstanding_of(router, instance_id):
    return [i["outstanding"] for i in router.instances() if i["instance_id"] == instance_id]


def test_a_re_registered_instance_keeps_counting_the_streams_it_still_runs(procs):
    """A new record for the same instance (here a new boot nonce) must not reset its outstanding count to 0
    while streams started before it still run: least_outstanding would pile new work on it."""
    engine = start_pdserve(procs, "--model", TINY_MODEL, "--max-model-len", "2048")
    router = start_router(procs)
    registrar = Registrar(router.registration_port)
    sock = None
    try:
        registrar.send_record(registration_record("e0", "both", f"{engine.host}:{engine.port}", boot_nonce=1))
        wait_for(lambda: nonces(router, "e0") == [1], 10, "first record")
        body = (b'{"model":"%s","prompt":"long","max_tokens":1900,"ignore_eos":true,"stream":true}'
                % TINY_MODEL.encode())
        sock = socket.create_connection((router.host, router.port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert outstanding_of(router, "e0") == [1]
        registrar.send_record(registration_record("e0", "both", f"{engine.host}:{engine.port}", boot_nonce=2))
        wait_for(lambda: nonces(router, "e0") == [2], 10, "the new record replaced the old one")
        assert outstanding_of(router, "e0") == [1]
        sock.close()
        sock = None
        wait_for(lambda: outstanding_of(router, "e0") == [0], 30, "the stream's end counted on the new record")
    finally:
        if sock is not None:
            sock.close()
        registrar.close()


SLOW_RESOLVER_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <string.h>
#include <unistd.h>

/* Names ending in .slow.test take 2 s to resolve (to 127.0.0.1); every other name resolves as usual. */
int getaddrinfo(const char* node, const char* service, const struct addrinfo* hints, struct addrinfo** res) {
  int (*real)(const char*, const char*, const struct addrinfo*, struct addrinfo**) = dlsym(RTLD_NEXT, "getaddrinfo");
  static const char suffix[] = ".slow.test";
  size_t n = node ? strlen(node) : 0;
  if (n > sizeof(suffix) - 1 && strcmp(node + n - (sizeof(suffix) - 1), suffix) == 0) {
    sleep(2);
    return real("127.0.0.1", service, hints, res);
  }
  return real(node, service, hints, res);
}
"""


@pytest.fixture(scope="module")
def slow_resolver(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slow_resolver")
    source = directory / "slow_resolver.c"
    source.write_text(SLOW_RESOLVER_C)
    library = directory / "slow_resolver.so"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler to build the getaddrinfo interposer")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"], check=True)
    return str(library)


def test_host_names_are_resolved_off_the_control_thread_within_the_resolve_timeout(procs, slow_resolver):
    """A registration naming a host that takes 2 s to resolve must not hold up other registrations
    (they are admitted at once), and is dropped when --resolve-timeout-ms passes without an answer."""
    env = {**os.environ, "LD_PRELOAD": slow_resolver}
    router = start_router(procs, "--resolve-timeout-ms", "500", env=env)
    registrar = Registrar(router.registration_port)
    try:
        registrar.send_record(registration_record("slow", "producer", "engine.slow.test:9"))
        registrar.send_record(registration_record("fast", "producer", "127.0.0.1:9"))
        wait_for(lambda: "fast" in router.instance_ids(), 1.5, "the instance with an IP address admitted at once")
        assert "slow" not in router.instance_ids()
        time.sleep(2.5)  # past the slow lookup itself: its late answer must not admit it
        assert "slow" not in router.instance_ids()
        # A name that resolves in time is admitted.
        registrar.send_record(registration_record("named", "producer", "localhost:9"))
        wait_for(lambda: "named" in router.instance_ids(), 5, "an instance registered by host name")
    finally:
        registrar.close()
