#!/usr/bin/env python3
"""Writes the seed corpora of fuzz_control_message, fuzz_openai_request, fuzz_router_input and
fuzz_ucx_descriptor.

The seeds are committed (tests/fuzz/corpus/<fuzzer>/); rerun this after a protocol change:
    python3 tests/fuzz/make_seeds.py
Control frames follow src/connector/messages.h (protocol version 2) and the descriptors
src/xfer/descriptors.cc (version 1); request bodies follow the OpenAI API as the server parses
it. Each seed is a valid input, so the fuzzer starts past the outer checks. Files named
regress_* are inputs the fuzzers once failed on, kept by hand as regression seeds; this script
leaves them alone.
"""
import json
import pathlib

import msgpack

CORPUS = pathlib.Path(__file__).resolve().parent / "corpus"
TRANSFER = "0123456789abcdef0123456789abcdef"


def engine_desc():
    return msgpack.packb({"v": 1, "t": "engine", "name": "prefill-0", "nonce": 7, "host": "h:boot",
                          "ep": {"ucx": b"\x01\x02\x03"}, "gpus": ["GPU-0"]}, use_bin_type=True)


def mem_desc(region):
    return msgpack.packb({"v": 1, "t": "mem", "engine": "prefill-0", "nonce": 7, "region": region,
                          "base": 4096, "bytes": 1 << 20, "kind": 0, "device": -1,
                          "keys": {"ucx": b"\x09" * 8}}, use_bin_type=True)


def control_frames():
    head = {"v": 2, "instance_id": "prefill-0", "boot_nonce": 7, "tp_rank": 0}
    meta = dict(head, type="meta", engine_desc=engine_desc(), layer_descs=[mem_desc(1), mem_desc(2)],
                fingerprint={"num_layers": 2, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
                             "block_size": 16, "tp_size": 1},
                num_blocks=512)
    with_id = dict(head, transfer_id=TRANSFER)
    return {
        "meta": meta,
        "meta_ok": dict(meta, type="meta_ok"),
        "blocks": dict(with_id, type="blocks", block_ids=[3, 1, 2], num_tokens=40, kv_tokens=39, num_skip_blocks=0),
        "read": dict(with_id, type="read", block_ids=[5, 6, 7], num_tokens=40, kv_tokens=40),
        "read_ok": dict(with_id, type="read_ok", first_token=151643, sampling_key=99),
        "done": dict(with_id, type="done", ok=True, num_tokens=40, text="", first_token=1, sampling_key=2),
        "abort": dict(with_id, type="abort", text="client went away"),
        "release": dict(with_id, type="release"),
        "error": dict(head, type="error", transfer_id="", text="layout mismatch", invalid_params=False),
    }


def write(fuzzer, name, data):
    folder = CORPUS / fuzzer
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


def main():
    # fuzz_control_message: the first byte picks the mode (0 frame, 1 engine desc, 2 mem desc, 3 built).
    for name, frame in control_frames().items():
        write("control_message", f"frame_{name}", b"\x00" + msgpack.packb(frame, use_bin_type=True))
    write("control_message", "engine_desc", b"\x01" + engine_desc())
    write("control_message", "mem_desc", b"\x02" + mem_desc(3))
    write("control_message", "built", b"\x03" + bytes(range(256)))

    consumer_read = {"do_remote_prefill": True, "transfer_id": TRANSFER, "mode": "read",
                     "remote_instance_id": "prefill-0", "remote_control": "127.0.0.1:5600",
                     "remote_boot_nonce": 7, "block_ids": [4, 9, 2], "num_tokens": 37}
    requests = {
        "completion_text": {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9,
                            "top_k": 20, "min_p": 0.05, "seed": 3, "stop": ["\n", "END"], "logprobs": 2,
                            "stream": True, "stream_options": {"include_usage": True}},
        "completion_ids": {"prompt": [[1, 2, 3], [4, 5]], "stop_token_ids": [7], "min_tokens": 1,
                           "ignore_eos": True, "n": 1, "echo": False},
        "completion_producer": {"prompt": "x", "max_tokens": 1,
                                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": TRANSFER,
                                                       "mode": "write"}},
        "completion_consumer_read": {"prompt": "x", "kv_transfer_params": consumer_read},
        "chat": {"messages": [{"role": "system", "content": "s"},
                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3,
                 "chat_template_kwargs": {"enable_thinking": False},
                 "kv_transfer_params": dict(consumer_read, mode="write", block_ids=None, num_tokens=None)},
        "response_format": {"prompt": "x", "response_format": {"type": "text"}, "logit_bias": {},
                            "presence_penalty": 0, "user": "u", "request_id": "r-1", "best_of": 1},
        "tokenize": {"prompt": "abc", "add_special_tokens": False, "return_token_strs": True},
        "detokenize": {"tokens": [1, 2, 3]},
    }
    for name, body in requests.items():
        write("openai_request", name, json.dumps(body).encode())

    # fuzz_router_input splits its input with FuzzedDataProvider::ConsumeRandomLengthString:
    # a backslash followed by any other character ends a piece.
    def router_seed(host_port, client, producer, stream):
        pieces = [host_port, json.dumps(client), json.dumps(producer)]
        return ("\\ ".join(p.replace("\\", "\\\\") for p in pieces) + "\\ " + stream).encode()

    producer_response = {"id": "cmpl-1", "choices": [{"text": "x"}], "kv_transfer_params": {
        "transfer_id": TRANSFER, "do_remote_decode": True, "remote_instance_id": "prefill-0",
        "remote_control": "127.0.0.1:5600", "remote_boot_nonce": 7, "block_ids": [1, 2], "num_tokens": 20}}
    stream = ('data: {"choices":[{"text":"a"}]}\n\n'
              'data: {"error":{"message":"boom","code":503}}\r\n\r\n'
              'data: [DONE]\n\n')
    write("router_input", "read_leg", router_seed("127.0.0.1:8000", {"model": "m", "prompt": "p", "stream": True},
                                                  producer_response, stream))
    write("router_input", "ipv6", router_seed("[::1]:9", {"messages": [], "kv_transfer_params": {"x": 1}},
                                              {"kv_transfer_params": None}, "data: x\n\n"))
    write("router_input", "url", router_seed("http://10.0.0.1:8000/", {}, [], ""))

    # fuzz_ucx_descriptor: modes 1 and 3 start from the running worker's own address and key
    # (these seeds only pick the mode and a few edits); modes 0 and 2 take raw descriptors.
    write("ucx_descriptor", "own_address", b"\x01")
    write("ucx_descriptor", "own_address_edits", b"\x01" + bytes([3, 0, 0, 0xff, 1, 5, 2, 7, 3, 0x40]))
    write("ucx_descriptor", "own_rkey", b"\x03")
    write("ucx_descriptor", "own_rkey_edits", b"\x03" + bytes([2, 0, 8, 0x20, 3, 1]))
    write("ucx_descriptor", "engine_desc_garbage_endpoint",
          b"\x00" + msgpack.packb({"v": 1, "t": "engine", "name": "prefill-0", "nonce": 7, "host": "h:boot",
                                   "ep": {"ucx": b"\xff" * 16}, "gpus": []}, use_bin_type=True))
    write("ucx_descriptor", "mem_desc", b"\x02" + mem_desc(3))


if __name__ == "__main__":
    main()
