#!/usr/bin/env python3
"""Runs tokenizer_bench and HF `tokenizers` (one thread) on the same mixed text, in one run.

  python3 tools/tokenizer_bench/run_bench.py --bin build/bin/tokenizer_bench [--tokenizer qwen3]

The text is built deterministically (make_corpus) from the repository's docs and sources plus
multilingual/emoji/code lines, about 8 MB. Prints a JSON line per implementation and the ratio."""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = pathlib.Path(__file__).resolve().parents[2]

MULTILINGUAL = [
    "中文分词测试：我们今天去北京大学参观，然后吃了烤鸭。这是一个用于测试的句子，包含标点符号。",
    "日本語のテキスト、カタカナとひらがな、そして漢字。東京は日本の首都です。",
    "한국어 텍스트입니다. 안녕하세요! 반갑습니다. 오늘 날씨가 좋네요.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇫🇷🇯🇵 — mixed with text 🎉 done.",
    "Ελληνικά: Καλημέρα κόσμε. Русский: Привет, мир! Как дела? العربية: مرحبا بالعالم.",
    "Numbers 3.14159 2.71828 1,000,000 -42 0x1F 1e-10 and dates 2026-11-30T14:05:30Z.",
]


def make_corpus(target_bytes=8_000_000):
    sources = []
    for pattern in ("docs/**/*.md", "src/**/*.h", "src/**/*.cc", "tests/**/*.py", "*.md"):
        for path in sorted(REPO.glob(pattern)):
            try:
                sources.append(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                pass
    base = "\n".join(sources)
    parts = []
    size = 0
    i = 0
    while size < target_bytes:
        block = base[(i * 7919) % max(1, len(base) - 20000):][:20000]
        block += "\n" + "\n".join(MULTILINGUAL[(i + k) % len(MULTILINGUAL)] for k in range(6)) + "\n"
        parts.append(block)
        size += len(block.encode("utf-8"))
        i += 1
    return "".join(parts)


def bench_hf(folder, text, chunk_bytes, repeats):
    import transformers
    import tokenizers

    with tempfile.TemporaryDirectory() as tmp:
        transformers.AutoTokenizer.from_pretrained(str(folder)).save_pretrained(tmp)
        tok = tokenizers.Tokenizer.from_file(os.path.join(tmp, "tokenizer.json"))
    data = text.encode("utf-8")
    chunks = []
    pos = 0
    while pos < len(data):
        end = min(len(data), pos + chunk_bytes)
        nl = data.find(b"\n", end)
        end = len(data) if nl < 0 else nl + 1
        chunks.append(data[pos:end].decode("utf-8"))
        pos = end
    best = best_cpu = 1e30
    tokens = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        c0 = time.thread_time()
        tokens = sum(len(tok.encode(c, add_special_tokens=False).ids) for c in chunks)
        best_cpu = min(best_cpu, time.thread_time() - c0)
        best = min(best, time.perf_counter() - t0)
    mb = len(data) / 1e6
    return {"impl": f"hf_tokenizers {tokenizers.__version__}", "bytes": len(data), "chunks": len(chunks),
            "tokens": tokens, "encode_s": best, "encode_cpu_s": best_cpu, "encode_mb_per_s": mb / best,
            "encode_mb_per_cpu_s": mb / best_cpu}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default=str(REPO / "build" / "bin" / "tokenizer_bench"))
    parser.add_argument("--tokenizer", default="qwen3")
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=8_000_000)
    args = parser.parse_args()
    folder = REPO / "assets" / "tokenizers" / args.tokenizer
    text = make_corpus(args.bytes)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        ours = json.loads(subprocess.check_output(
            [args.bin, "--dir", str(folder), "--input", path,
             "--chunk-bytes", str(args.chunk_bytes), "--repeats", str(args.repeats)], text=True))
    finally:
        os.unlink(path)
    hf = bench_hf(folder, text, args.chunk_bytes, args.repeats)
    print(json.dumps(ours))
    print(json.dumps(hf))
    print(json.dumps({"same_token_count": ours["tokens"] == hf["tokens"],
                      "cpu_speedup_vs_hf": ours["encode_mb_per_cpu_s"] / hf["encode_mb_per_cpu_s"]}))
    return 0 if ours["tokens"] == hf["tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
