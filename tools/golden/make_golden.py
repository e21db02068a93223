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

qwen3_moe, qwen3_fp8 and qwen3_moe_fp8 are written as the published checkpoints
are (make_checkpoint_family): per-expert tensor names (mlp.experts.{e}.{gate,up,
down}_proj.weight, router mlp.gate.weight), bf16 for unquantised tensors, and for
the FP8 families quantization_config {quant_method fp8, fmt e4m3,
weight_block_size [128, 128], activation_scheme dynamic} with float8_e4m3fn
linear weights and fp32 weight_scale_inv per 128x128 block (scale = amax/448,
codes = e4m3(w / scale), round to nearest even, saturating). The reference is
the HF model in fp32 holding exactly the values the files denote (bf16 values;
FP8 weights dequantised as code * scale_inv), with every quantised linear (and
the experts' linears) patched to quantise its input per token per 128-column
group first (s = amax/448, 1 when 0; x -> e4m3(x / s) * s; the last group of a
width that is not a multiple of 128 is narrower). The FP8 dims include 192 so
that partial blocks and groups are exercised.
"""
import argparse
import copy
import json
import os
import struct
import sys

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_long", "qwen3_moe", "qwen3_fp8", "qwen3_moe_fp8")
CHECKPOINT_FAMILIES = ("qwen3_moe", "qwen3_fp8", "qwen3_moe_fp8")
FP8_MAX = 448.0
FP8_BLOCK = 128
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                           "activation_scheme": "dynamic"}
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
    if family == "qwen3_moe":
        # Qwen3-30B-A3B's structure at toy size: layers 0 and 2 sparse, layer 1 dense
        # (mlp_only_layers), renormalised top-k, untied lm_head.
        return "Qwen3MoeForCausalLM", dict(common, num_hidden_layers=3, head_dim=32, rope_theta=1000000.0,
                                           tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                           mlp_only_layers=[1])
    if family == "qwen3_fp8":
        # q_proj out and o_proj in are 192 = 1.5 blocks; k/v out 64 = half a block.
        return "Qwen3ForCausalLM", dict(common, hidden_size=128, intermediate_size=256, num_attention_heads=3,
                                        num_key_value_heads=1, head_dim=64, rope_theta=1000000.0,
                                        tie_word_embeddings=False)
    if family == "qwen3_moe_fp8":
        # decoder_sparse_step 2: only layer 1 is sparse; experts 192 wide (partial blocks);
        # top-k weights not renormalised.
        return "Qwen3MoeForCausalLM", dict(common, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                           rope_theta=1000000.0, tie_word_embeddings=False, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=192, norm_topk_prob=False,
                                           decoder_sparse_step=2, mlp_only_layers=[])
    raise ValueError(f"unknown family {family!r}")


def published_config(arch, kwargs, fp8):
    """config.json as the published checkpoints spell it (num_experts, rope_theta)."""
    doc = {"architectures": [arch], "model_type": "qwen3_moe" if "Moe" in arch else "qwen3",
           "attention_bias": False, "torch_dtype": "bfloat16", "use_sliding_window": False}
    doc.update(kwargs)
    if fp8:
        doc["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    return doc


def fp8_block_quantize(torch, w):
    """Block FP8 of a [out, in] fp32 weight: (codes, scale_inv [ceil(out/128), ceil(in/128)], dequantised)."""
    rows, cols = w.shape
    nb_r, nb_c = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(nb_r * FP8_BLOCK, nb_c * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w.abs()
    amax = padded.view(nb_r, FP8_BLOCK, nb_c, FP8_BLOCK).amax(dim=(1, 3))
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
    codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale.contiguous(), codes.to(torch.float32) * full


# The closest any quantised activation came to an e4m3 rounding midpoint, in units of
# the e4m3 step there. Near a midpoint the rounding depends on the last fp32 bit, so
# any other summation order (the C++ runner's) may round the other way; with bf16
# inputs exact ties (e.g. x / s == 34.0, between 32 and 36) do occur.
FP8_TIE_TRACKER = {"min_distance": 0.5}
FP8_MIN_TIE_DISTANCE = 5e-6


def fp8_act_quant(torch, x):
    """Dynamic per-token activation quantisation, as quantise-then-dequantise, per 128-column group."""
    out = torch.empty_like(x)
    for c0 in range(0, x.shape[-1], FP8_BLOCK):
        g = x[..., c0:c0 + FP8_BLOCK]
        s = g.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        r = (g / s).abs().clamp(max=FP8_MAX)
        step = torch.where(r < 2.0 ** -6, torch.full_like(r, 2.0 ** -9),
                           torch.exp2(torch.floor(torch.log2(r.clamp(min=2.0 ** -6)))) / 8)
        frac = r / step - torch.floor(r / step)
        inner = r < FP8_MAX - 16  # above 432 everything saturates or rounds to 448
        if inner.any():
            dist = float((frac[inner] - 0.5).abs().min())
            FP8_TIE_TRACKER["min_distance"] = min(FP8_TIE_TRACKER["min_distance"], dist)
        out[..., c0:c0 + FP8_BLOCK] = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s
    return out


def quantised_linear_names(config, arch):
    """HF module names (published naming) of the linears a block-FP8 checkpoint quantises."""
    names = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{n}_proj" for n in "qkvo"]
        if "Moe" in arch and i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0:
            for e in range(config.num_experts):
                names += [p + f"mlp.experts.{e}.{n}_proj" for n in ("gate", "up", "down")]
        else:
            names += [p + f"mlp.{n}_proj" for n in ("gate", "up", "down")]
    return names


def published_state_dict(model, torch):
    """fp32 tensors under the published names: fused experts split per expert."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.float32)
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{p}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e].clone()
        elif not name.endswith("inv_freq"):
            out[name] = t.clone()
    return out


def load_published_state_dict(model, state, torch):
    """The inverse of published_state_dict: copies per-expert tensors into the fused parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if name.endswith("mlp.experts.gate_up_proj"):
                p = name[: -len("gate_up_proj")]
                inter = param.shape[1] // 2
                for e in range(param.shape[0]):
                    param[e, :inter].copy_(state[f"{p}{e}.gate_proj.weight"])
                    param[e, inter:].copy_(state[f"{p}{e}.up_proj.weight"])
            elif name.endswith("mlp.experts.down_proj"):
                p = name[: -len("down_proj")]
                for e in range(param.shape[0]):
                    param[e].copy_(state[f"{p}{e}.down_proj.weight"])
            else:
                param.copy_(state[name])


def patch_fp8_activations(model, config, arch, torch):
    """Every quantised nn.Linear and every expert linear quantises its input first."""
    import types
    F = torch.nn.functional
    wanted = set(quantised_linear_names(config, arch))
    patched = 0
    for name, module in model.named_modules():
        if name in wanted and isinstance(module, torch.nn.Linear):
            def fwd(self, x):
                return F.linear(fp8_act_quant(torch, x), self.weight, self.bias)
            module.forward = types.MethodType(fwd, module)
            patched += 1
        elif type(module).__name__ == "Qwen3MoeExperts":
            def experts_fwd(self, hidden_states, top_k_index, top_k_weights):
                # transformers' eager Qwen3MoeExperts.forward with the inputs of the
                # gate/up and down linears quantised.
                final = torch.zeros_like(hidden_states)
                for e in range(self.num_experts):
                    token_idx, top_k_pos = torch.where(top_k_index == e)
                    if token_idx.numel() == 0:
                        continue
                    cur = fp8_act_quant(torch, hidden_states[token_idx])
                    gate, up = F.linear(cur, self.gate_up_proj[e]).chunk(2, dim=-1)
                    h = fp8_act_quant(torch, self.act_fn(gate) * up)
                    h = F.linear(h, self.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
                    final.index_add_(0, token_idx, h.to(final.dtype))
                return final
            module.forward = types.MethodType(experts_fwd, module)
            patched += 1
    return patched


def build_hf_model(arch, kwargs, torch, transformers):
    cfg_cls = transformers.Qwen3MoeConfig if "Moe" in arch else transformers.Qwen3Config
    config = cfg_cls(**kwargs)
    config.architectures = [arch]
    for attr in ("_attn_implementation", "_experts_implementation"):
        try:
            setattr(config, attr, "eager")
        except Exception:  # not known to this transformers version
            pass
    return config, getattr(transformers, arch)(config).to(torch.float32).eval()


def greedy_reference(model, prompt, steps, torch, family):
    with torch.no_grad():
        prompt_logits = model(input_ids=torch.tensor([prompt], dtype=torch.long), use_cache=False).logits[0]
        prompt_logits = prompt_logits.to(torch.float32)
        tokens, greedy, rows, margins = list(prompt), [], [], []
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False).logits[0, -1]
            logits = logits.to(torch.float32)
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            if margins[-1] < 1e-3:
                print(f"warning: {family} step {len(greedy)} top-2 margin {margins[-1]:.2e} is tiny", file=sys.stderr)
            rows.append(logits.tolist())
            greedy.append(int(torch.argmax(logits).item()))
            tokens.append(greedy[-1])
    return prompt_logits, greedy, rows, min(margins)


def make_checkpoint_family(family, out_root, seed, torch, transformers):
    """qwen3_moe / qwen3_fp8 / qwen3_moe_fp8: files as the published checkpoints ship them.
    FP8 families draw weights again (seed + 17 + 1000 * attempt) until no quantised
    activation of the whole reference run lies within FP8_MIN_TIE_DISTANCE steps of a
    rounding midpoint, so that the test compares arithmetic, not a coin flip."""
    for attempt in range(60):
        FP8_TIE_TRACKER["min_distance"] = 0.5
        done = make_checkpoint_attempt(family, out_root, seed, attempt, torch, transformers)
        if done or not family.endswith("_fp8"):
            return
        print(f"{family}: attempt {attempt} had an activation {FP8_TIE_TRACKER['min_distance']:.2e} steps from "
              f"an e4m3 rounding midpoint; drawing new weights", file=sys.stderr)
    raise SystemExit(f"{family}: no weights without near-tied activations in 60 attempts")


def make_checkpoint_attempt(family, out_root, seed, attempt, torch, transformers):
    from safetensors.torch import save_file

    arch, kwargs = family_config_kwargs(family)
    fp8 = family.endswith("_fp8")
    config, model = build_hf_model(arch, kwargs, torch, transformers)
    torch.manual_seed(seed)
    weight_seed = seed + 17 + 1000 * attempt
    reinit_parameters(model, torch, weight_seed)
    # The reference holds exactly what the files denote: bf16 values, FP8 weights dequantised.
    state = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in published_state_dict(model, torch).items()}
    files = {}
    quantised = set(quantised_linear_names(config, arch)) if fp8 else set()
    for name, t in state.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in quantised:
            codes, scale_inv, deq = fp8_block_quantize(torch, t)
            files[name] = codes.contiguous()
            files[module + ".weight_scale_inv"] = scale_inv
            state[name] = deq
        else:
            files[name] = t.to(torch.bfloat16).contiguous()
    load_published_state_dict(model, state, torch)
    patched = patch_fp8_activations(model, config, arch, torch) if fp8 else 0

    out = os.path.join(out_root, family)
    os.makedirs(out, exist_ok=True)
    save_file(files, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(published_config(arch, kwargs, fp8), f, indent=2)
        f.write("\n")

    prompt = prompt_token_ids(seed + FAMILIES.index(family), config.vocab_size)
    prompt_logits, greedy, decode_rows, min_margin = greedy_reference(model, prompt, NUM_DECODE_STEPS, torch, family)
    tie_distance = FP8_TIE_TRACKER["min_distance"]
    if fp8 and tie_distance < FP8_MIN_TIE_DISTANCE:
        return False

    # The published names must map onto HF's own module layout: a model that
    # transformers loads from the same values under those names (fp32, no
    # quantization_config, so it needs no FP8 kernels) gives the same logits.
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(published_config(arch, kwargs, False), f)
        try:
            reloaded = getattr(transformers, arch).from_pretrained(tmp, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
        except TypeError:
            reloaded = getattr(transformers, arch).from_pretrained(tmp, torch_dtype=torch.float32).eval()
        for attr in ("_experts_implementation",):
            try:
                setattr(reloaded.config, attr, "eager")
            except Exception:
                pass
        if fp8:
            patch_fp8_activations(reloaded, config, arch, torch)
        with torch.no_grad():
            again = reloaded(input_ids=torch.tensor([prompt], dtype=torch.long), use_cache=False).logits[0]
        reload_max_abs_diff = float((again.to(torch.float32) - prompt_logits).abs().max())
    if reload_max_abs_diff > 1e-5:
        raise SystemExit(f"{family}: transformers' own load of the published names differs by {reload_max_abs_diff}")

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
        "weights_dtype": "float8_e4m3fn linears + bfloat16" if fp8 else "bfloat16",
        "fp8_patched_modules": patched,
        "weight_seed": weight_seed,
        "fp8_min_activation_tie_distance_steps": tie_distance if fp8 else None,
        "min_greedy_top2_margin": min_margin,
        "seed": seed,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "reload_max_abs_diff": reload_max_abs_diff,
        "effective_config": json.loads(config.to_json_string()),
    }
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{family}: prompt {len(prompt)} tokens, greedy {greedy[:8]}..., {patched} patched modules, "
          f"min top-2 margin {min_margin:.3g}, reload diff {reload_max_abs_diff:.3g}; files in {out}")
    return True


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
            if fam in CHECKPOINT_FAMILIES:
                print("  config.json", json.dumps(published_config(arch, kwargs, fam.endswith("_fp8")), sort_keys=True))
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
        elif fam in CHECKPOINT_FAMILIES:
            make_checkpoint_family(fam, args.out, args.seed, torch, transformers)
        else:
            make_family(fam, args.out, args.seed, torch, transformers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
