"""pdserve --tensor-parallel-size N on the cpu device serves the same greedy completions as one rank, through the
OpenAI API: builtin:tiny (4 heads, 2 KV heads: TP 4 replicates each KV head on two ranks) and the tiny Qwen3-MoE
checkpoint; prompts past block boundaries and prompts sharing a prefix (prefix-cache hits); the MoE checkpoint with
--enable-expert-parallel (whole experts per rank). Start-up refusals: TP that does not divide the heads, P/D with TP on cuda,
expert parallelism on a dense model or off the cpu device."""

from __future__ import annotations

import json
import os
import random

import pytest

from conftest import http_request, start_pdserve
from test_server_process import run_to_exit
from test_pd_support import completion, token_ids

MOE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "golden", "qwen3_moe")
MAX_TOKENS = 8


def prompts(vocab: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randint(3, vocab - 1) for _ in range(40)]
    out = [[rng.randint(3, vocab - 1) for _ in range(n)] for n in (1, 15, 16, 17, 60)]
    # The same 40-token prefix twice more: the later requests hit the prefix cache.
    out += [shared + [rng.randint(3, vocab - 1) for _ in range(n)] for n in (0, 3, 9)]
    return out


def greedy_outputs(server, ps: list[list[int]]) -> list[list[int]]:
    outputs = []
    for p in ps:  # one after the other, so the later shared-prefix prompts find the earlier blocks cached
        status, body = completion(server.base_url, p, MAX_TOKENS)
        assert status == 200, body
        outputs.append(token_ids(body))
    return outputs


@pytest.mark.parametrize("model_flags, vocab, tp_sizes", [
    ([], 151936, [2, 4]),
    (["--model", MOE_DIR, "--served-model-name", "builtin:tiny", "--max-model-len", "256"], 512, [2]),
], ids=["tiny_dense", "tiny_moe"])
def test_tensor_parallel_serves_the_same_greedy_completions(procs, model_flags, vocab, tp_sizes):
    ps = prompts(vocab)
    flags = [*model_flags, "--num-kv-blocks", "64"]
    one = start_pdserve(procs, *flags)
    expected = greedy_outputs(one, ps)
    assert len({tuple(o) for o in expected}) > 1, "the model must not answer every prompt alike"
    one.process.stop()
    for tp in tp_sizes:
        server = start_pdserve(procs, *flags, "--tensor-parallel-size", str(tp))
        assert "tensor_parallel_size " + str(tp) in server.process.text()
        got = greedy_outputs(server, ps)
        mismatches = [(i, e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
        assert not mismatches, f"tp {tp}: {len(mismatches)} of {len(ps)} differ, first: {mismatches[:3]}"
        status, body, _ = http_request(server.base_url, "GET", "/metrics")
        assert status == 200
        server.process.stop()


def test_expert_parallel_serves_the_same_greedy_completions(procs):
    """8 experts as 4 per rank at TP 2 and 2 per rank at TP 4: the TP 1 completions, a prefix hit included."""
    ps = [p for i, p in enumerate(prompts(512)) if i in (1, 3, 5, 6)]
    flags = ["--model", MOE_DIR, "--served-model-name", "builtin:tiny", "--max-model-len", "256",
             "--num-kv-blocks", "64"]
    one = start_pdserve(procs, *flags)
    expected = greedy_outputs(one, ps)
    one.process.stop()
    for tp in (2, 4):
        server = start_pdserve(procs, *flags, "--tensor-parallel-size", str(tp), "--enable-expert-parallel")
        assert f"expert parallel ({8 // tp} experts per rank)" in server.process.text()
        got = greedy_outputs(server, ps)
        assert got == expected, f"tp {tp} with expert parallelism"
        server.process.stop()


def test_tensor_parallel_text_prompt_matches_one_rank(procs):
    """A text prompt through the tokenizer: the same completion text at TP 1 and TP 2."""
    texts = []
    for tp in (1, 2):
        server = start_pdserve(procs, "--num-kv-blocks", "32", "--tensor-parallel-size", str(tp))
        body = {"model": "builtin:tiny", "prompt": "The capital of France is", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        status, raw, _ = http_request(server.base_url, "POST", "/v1/completions", body)
        assert status == 200, raw
        texts.append(raw)
        server.process.stop()
    assert json.loads(texts[0])["choices"][0]["text"] == json.loads(texts[1])["choices"][0]["text"]


@pytest.mark.parametrize("flags, needle", [
    (["--tensor-parallel-size", "8"], "must divide the number of attention heads (4)"),
    (["--tensor-parallel-size", "2", "--device", "cuda", "--kv-role", "kv_consumer"],
     "P/D transfer of tensor-parallel KV shards on GPUs is not supported"),
    (["--tensor-parallel-size", "2", "--enable-expert-parallel"], "enable_expert_parallel needs a MoE model"),
    (["--enable-expert-parallel", "--device", "cuda"], "expert parallelism runs on --device cpu only"),
])
def test_tensor_parallel_refusals_name_the_reason(flags, needle):
    result = run_to_exit(*flags)
    assert result.returncode != 0
    assert needle in result.stdout + result.stderr, result.stdout + result.stderr
