#!/usr/bin/env python3
"""Produce golden logits for the CPU model runner's parity test.

For each model family (Llama with llama3 rope scaling, Qwen2 with qkv bias,
Qwen3 with q/k norm and an explicit head_dim) this builds a small random model
in HF transformers (fp32, eager attention, CPU), saves it as config.json +
safetensors, runs one forward pass over a fixed prompt and a 32-step greedy
generation, and writes the results next to the weights:

  <out>/<family>/config.json, *.safetensors[, model.safetensors.index.json]
  <out>/<family>/golden.json         prompt ids, greedy ids, shapes, versions
  <out>/<family>/prompt_logits.f32   float32 little-endian [num_prompt_tokens][vocab]
  <out>/<family>/decode_logits.f32   float32 little-endian [num_decode_steps][vocab];
                                     row i is the logits that chose greedy token i
                                     (row 0 equals the last prompt row)

Greedy steps recompute the whole sequence without a KV cache: slower but free
of cache-API differences between transformers versions, and the tiny models
make it cheap. Needs torch + transformers (run it where they are installed):

  python3 make_golden.py --out ../../tests/data/golden
"""
import argparse
import copy
import json
import os
import struct
import sys

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_long")
NUM_DECODE_STEPS = 32
PROMPT_LEN = 21
# qwen3_long: head_dim 128 at positions up to ~1.5k, where a RoPE frequency that is
# off by one bf16 rounding (0.4% relative) turns the angle by radians. Its weights are
# stored in bf16 (rounded before the reference runs, so the fp32 reference holds the
# same values) and only some prompt rows are kept, to keep the files small.
LONG_PROMPT_LEN = 1500
LONG_DECODE_STEPS = 8
LONG_CHECKED_POSITIONS = list(range(0, LONG_PROMPT_LEN, 100)) + [LONG_PROMPT_LEN - 1]


def family_config_kwargs(family):
    """HF config kwargs of the small random model of one family."""
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        return "LlamaForCausalLM", dict(
            common,
            rope_theta=500000.0,
            # original_max_position_embeddings is small so that the prompt spans
            # all three llama3 frequency bands.
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
    if family == "qwen2":
        return "Qwen2ForCausalLM", dict(common, rope_theta=1000000.0, tie_word_embeddings=True)
    if family == "qwen3":
        # head_dim 32 != hidden/heads (16): exercises the explicit head_dim.
        return "Qwen3ForCausalLM", dict(common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)
    if family == "qwen3_long":
        return "Qwen3ForCausalLM", dict(common, vocab_size=256, hidden_size=128, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=128, max_position_embeddings=2048,
                                        rope_theta=1000000.0, tie_word_embeddings=True)
    raise ValueError(f"unknown family {family!r}")


def prompt_token_ids(seed, vocab_size, length=PROMPT_LEN):
    """A fixed pseudo-random prompt (an LCG, so it needs no numpy/torch)."""
    state = (seed * 6364136223846793005 + 1442695040888963407) % (1 << 64)
    ids = []
    for _ in range(length):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        ids.append(3 + (state >> 33) % (vocab_size - 3))
    return ids


def write_f32(path, rows):
    """rows: list of lists of floats -> float32 little-endian, row-major."""
    with open(path, "wb") as f:
        for row in rows:
            f.write(struct.pack("<%df" % len(row), *row))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (one sub-folder per family)")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of " + ",".join(FAMILIES))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dry-run", action="store_true", help="print the plan (configs, prompts) without torch")
    args = p.parse_args(argv)
    fams = [f.strip() for f in args.families.split(",") if f.strip()]
    for f in fams:
        if f not in FAMILIES:
            p.error(f"unknown family {f!r}; choose from {FAMILIES}")
    args.families = fams
    return args


def reinit_parameters(model, torch, seed):
    """Non-trivial weights: norms around 1, random biases (HF inits them to 0/1,
    which would leave those code paths untested), matrices N(0, 0.05)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if "norm" in name:
                value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith(".bias"):
                value = 0.1 * torch.randn(shape, generator=gen)
            else:
                value = 0.05 * torch.randn(shape, generator=gen)
            param.copy_(value.to(param.dtype))


def make_family(family, out_root, seed, torch, transformers):
    arch, kwargs = family_config_kwargs(family)
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}[family]
    model_cls = getattr(transformers, arch)
    config = cfg_cls(**kwargs)
    config.architectures = [arch]
    try:
        config._attn_implementation = "eager"
    except Exception:  # older/newer versions name it differently; eager is the default on CPU fp32 anyway
        pass
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    reinit_parameters(model, torch, seed + 17)

    out = os.path.join(out_root, family)
    os.makedirs(out, exist_ok=True)
    # Qwen3 is saved in two shards to exercise model.safetensors.index.json.
    attempts = [dict(safe_serialization=True), dict()]
    if family == "qwen3":
        attempts = [dict(a, max_shard_size="300KB") for a in attempts] + attempts
    for i, save_kwargs in enumerate(attempts):
        try:
            model.save_pretrained(out, **save_kwargs)
            break
        except TypeError as e:  # keyword not known to this transformers version
            if i == len(attempts) - 1:
                raise
            print(f"note: save_pretrained({save_kwargs}) failed: {e}", file=sys.stderr)

    prompt = prompt_token_ids(seed + FAMILIES.index(family), config.vocab_size)
    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.long)
        prompt_logits = model(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
        tokens = list(prompt)
        greedy, decode_rows = [], []
        for _ in range(NUM_DECODE_STEPS):
            logits = model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False).logits[0, -1]
            logits = logits.to(torch.float32)
            nxt = int(torch.argmax(logits).item())
            top2 = torch.topk(logits, 2).values
            decode_rows.append(logits.tolist())
            greedy.append(nxt)
            tokens.append(nxt)
            margin = float(top2[0] - top2[1])
            if margin < 1e-4:
                print(f"warning: {family} step {len(greedy) - 1} top-2 margin {margin:.2e} is tiny", file=sys.stderr)

    # The files must reproduce the model: reload them and compare (catches a
    # tied/untied weight saved wrongly).
    reload_max_abs_diff = None
    try:
        try:
            reloaded = model_cls.from_pretrained(out, dtype=torch.float32).eval()
        except TypeError:
            reloaded = model_cls.from_pretrained(out, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            again = reloaded(input_ids=torch.tensor([prompt], dtype=torch.long), use_cache=False).logits[0]
        reload_max_abs_diff = float((again.to(torch.float32) - prompt_logits).abs().max())
        if reload_max_abs_diff > 1e-5:
            print(f"warning: {family} reloaded model differs: max abs {reload_max_abs_diff}", file=sys.stderr)
    except Exception as e:  # keep the golden data even if the check itself breaks
        print(f"warning: {family} reload check failed: {e!r}", file=sys.stderr)

    write_f32(os.path.join(out, "prompt_logits.f32"), prompt_logits.tolist())
    write_f32(os.path.join(out, "decode_logits.f32"), decode_rows)
    meta = {
        "family": family,
        "architecture": arch,
        "vocab_size": config.vocab_size,
        "prompt_token_ids": prompt,
        "greedy_token_ids": greedy,
        "num_prompt_tokens": len(prompt),
        "num_decode_steps": NUM_DECODE_STEPS,
        "prompt_logits_file": "prompt_logits.f32",
        "decode_logits_file": "decode_logits.f32",
        "logits_format": "float32 little-endian, row-major [rows][vocab_size]",
        "seed": seed,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "reload_max_abs_diff": reload_max_abs_diff,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "effective_config": json.loads(config.to_json_string()),
    }
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{family}: prompt {len(prompt)} tokens, greedy {greedy[:8]}..., files in {out}")


def row_relative_errors(torch, ours, ref):
    """Per row: ||ours - ref|| / ||ref|| (the measure the C++ test applies)."""
    return ((ours - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).tolist()


def make_long_family(family, out_root, seed, torch, transformers):
    """qwen3_long: bf16-valued weights, a LONG_PROMPT_LEN prompt, LONG_DECODE_STEPS greedy steps,
    prompt rows at LONG_CHECKED_POSITIONS only. The reference is the model as from_pretrained
    builds it: RoPE frequencies computed in fp32. A model.to(torch.bfloat16) rounds that buffer
    (it is not a weight, so the files never carry it) and a later .to(torch.float32) keeps the
    rounding; golden.json records how far the logits move then, which shows that the test
    tells the two apart."""
    arch, kwargs = family_config_kwargs(family)
    model_cls = getattr(transformers, arch)
    config = transformers.Qwen3Config(**kwargs)
    config.architectures = [arch]
    try:
        config._attn_implementation = "eager"
    except Exception:
        pass
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    reinit_parameters(model, torch, seed + 17)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    out = os.path.join(out_root, family)
    os.makedirs(out, exist_ok=True)
    # Saved from a bf16 copy, so that `model` keeps its fp32 RoPE frequencies.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)

    prompt = prompt_token_ids(seed + FAMILIES.index(family), config.vocab_size, LONG_PROMPT_LEN)
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        prompt_logits = model(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
        tokens = list(prompt)
        greedy, decode_rows = [], []
        for _ in range(LONG_DECODE_STEPS):
            logits = model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False).logits[0, -1]
            logits = logits.to(torch.float32)
            top2 = torch.topk(logits, 2).values
            if float(top2[0] - top2[1]) < 1e-3:
                print(f"warning: {family} step {len(greedy)} top-2 margin {float(top2[0] - top2[1]):.2e}",
                      file=sys.stderr)
            decode_rows.append(logits.tolist())
            greedy.append(int(torch.argmax(logits).item()))
            tokens.append(greedy[-1])
        rotary = model.model.rotary_emb
        exact = rotary.inv_freq.clone()
        rotary.inv_freq = exact.to(torch.bfloat16).to(torch.float32)
        rounded = model(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
        rotary.inv_freq = exact
    rows = torch.tensor(LONG_CHECKED_POSITIONS)
    sensitivity = row_relative_errors(torch, rounded[rows], prompt_logits[rows])

    try:
        reloaded = model_cls.from_pretrained(out, dtype=torch.float32).eval()
    except TypeError:
        reloaded = model_cls.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        again = reloaded(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
    reload_max_abs_diff = float((again - prompt_logits).abs().max())
    if reload_max_abs_diff > 1e-5:
        print(f"warning: {family} reloaded model differs: max abs {reload_max_abs_diff}", file=sys.stderr)

    write_f32(os.path.join(out, "prompt_logits.f32"), prompt_logits[rows].tolist())
    write_f32(os.path.join(out, "decode_logits.f32"), decode_rows)
    meta = {
        "family": family,
        "architecture": arch,
        "vocab_size": config.vocab_size,
        "prompt_token_ids": prompt,
        "greedy_token_ids": greedy,
        "num_prompt_tokens": len(prompt),
        "num_decode_steps": LONG_DECODE_STEPS,
        "prompt_logits_file": "prompt_logits.f32",
        "prompt_logits_positions": LONG_CHECKED_POSITIONS,
        "decode_logits_file": "decode_logits.f32",
        "logits_format": "float32 little-endian, row-major [rows][vocab_size]; prompt rows at prompt_logits_positions",
        "weights_dtype": "bfloat16",
        "rope_frequencies_rounded_to_bf16_row_relative_error": sensitivity,
        "seed": seed,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "reload_max_abs_diff": reload_max_abs_diff,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "effective_config": json.loads(config.to_json_string()),
    }
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{family}: prompt {len(prompt)} tokens, greedy {greedy}, bf16-rounded RoPE frequencies move the "
          f"checked rows by up to {max(sensitivity):.3g} relative; files in {out}")


def main(argv):
    args = parse_args(argv)
    if args.dry_run:
        for fam in args.families:
            arch, kwargs = family_config_kwargs(fam)
            print(fam, arch, json.dumps(kwargs, sort_keys=True))
            length = LONG_PROMPT_LEN if fam == "qwen3_long" else PROMPT_LEN
            print("  prompt", prompt_token_ids(args.seed + FAMILIES.index(fam), kwargs["vocab_size"], length))
        return 0
    import torch  # noqa: E402 (only needed for the real run)
    import transformers

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for fam in args.families:
        if fam == "qwen3_long":
            make_long_family(fam, args.out, args.seed, torch, transformers)
        else:
            make_family(fam, args.out, args.seed, torch, transformers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
