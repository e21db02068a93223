"""HF transformers baseline for docs/perf/engine.md: the same Qwen3-8B shapes
(random bf16 weights) as pd_gpu_engine_bench, eager and sdpa attention.

Prefill: one 2,000-token prompt and 8 of them (logits of the last token only).
Decode: one step at batch 1/16/64 after a 2,047-token prefill (context 2,048),
DynamicCache. Median of a few timed runs after a warm-up, CUDA-synchronized.
Usage: python3 hf_baseline.py [device index]. GPU only; never run by CI.
"""
import statistics
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    dev = torch.device("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    torch.cuda.set_device(dev)
    rows = []
    for impl in ("sdpa", "eager"):
        cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                          tie_word_embeddings=False)
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        with torch.device(dev):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
        for n in (1, 8):
            ids = torch.randint(0, cfg.vocab_size, (n, 2000), device=dev)
            try:
                with torch.no_grad():
                    ms = timed(lambda: model(ids, use_cache=False, logits_to_keep=1), 3)
                rows.append((f"HF {impl} prefill {n}x2000", ms))
            except Exception as e:  # noqa: BLE001 - report and continue
                rows.append((f"HF {impl} prefill {n}x2000 FAILED {type(e).__name__}", float("nan")))
            torch.cuda.empty_cache()
        if impl == "sdpa":
            for b in (1, 16, 64):
                try:
                    with torch.no_grad():
                        ids = torch.randint(0, cfg.vocab_size, (b, 2047), device=dev)
                        out = model(ids, use_cache=True, logits_to_keep=1)
                        pkv = out.past_key_values
                        nxt = out.logits[:, -1:].argmax(-1)
                        step = lambda: model(nxt, past_key_values=pkv, use_cache=True)
                        ms = timed(step, 5)
                    rows.append((f"HF {impl} decode b{b} ctx2048", ms))
                    del out, pkv
                except Exception as e:  # noqa: BLE001
                    rows.append((f"HF {impl} decode b{b} FAILED {type(e).__name__}: {e}"[:100], float("nan")))
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    print(f"\n{'HF transformers ' + __import__('transformers').__version__ + ' step':<44} {'ms':>10}")
    for name, ms in rows:
        print(f"{name:<44} {ms:>10.2f}")


if __name__ == "__main__":
    main()
