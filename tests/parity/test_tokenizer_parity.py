"""Token ids, decoding and streaming of pd_tokenizer vs HF transformers on the same folder."""
import random
import unicodedata

import pytest

from conftest import ASSETS, TokenizerCli
from corpus import FIXED, invalid_utf8_inputs, random_texts

transformers = pytest.importorskip("transformers")

TOKENIZERS = ["qwen3", "qwen2.5", "gpt2"]


@pytest.fixture(scope="module", params=TOKENIZERS)
def pair(request, tmp_path_factory):
    """(name, HF tokenizer, our CLI on the same folder, our CLI on HF's saved tokenizer.json)."""
    name = request.param
    folder = ASSETS / name
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    saved = tmp_path_factory.mktemp(f"saved-{name}")
    hf.save_pretrained(str(saved))
    assert (saved / "tokenizer.json").exists()
    ours = TokenizerCli("--dir", str(folder))
    ours_json = TokenizerCli("--dir", str(saved))
    yield name, hf, ours, ours_json
    ours.close()
    ours_json.close()


def corpus():
    return FIXED + random_texts(seed=1234, count=150)


def test_encode_matches_hf_on_varied_corpus(pair):
    name, hf, ours, _ = pair
    mismatches = []
    for text in corpus():
        for add_special in (True, False):
            expected = hf.encode(text, add_special_tokens=add_special)
            got = ours.ask({"op": "encode", "text": text, "add_special_tokens": add_special})["ids"]
            if got != expected:
                mismatches.append((text, expected, got))
    assert not mismatches, f"{name}: {len(mismatches)} mismatches, first: {mismatches[0]!r}"


def test_tokenizer_json_saved_by_hf_loads_identically(pair):
    name, _, ours, ours_json = pair
    for text in corpus():
        a = ours.ask({"op": "encode", "text": text})["ids"]
        b = ours_json.ask({"op": "encode", "text": text})["ids"]
        assert a == b, f"{name}: vocab/merges and tokenizer.json loads differ on {text!r}"
    assert ours.ask({"op": "info"}) == ours_json.ask({"op": "info"})


def test_invalid_utf8_is_encoded_as_its_replacement_decoding(pair):
    """Defined behaviour: each maximal invalid subpart becomes U+FFFD (Python's errors='replace'), then encoded."""
    name, hf, ours, _ = pair
    for raw in invalid_utf8_inputs(seed=99, count=60):
        expected = hf.encode(raw.decode("utf-8", errors="replace"), add_special_tokens=False)
        got = ours.ask({"op": "encode", "text_hex": raw.hex(), "add_special_tokens": False})["ids"]
        assert got == expected, f"{name}: {raw!r}"


def test_decode_matches_hf_and_round_trips(pair):
    name, hf, ours, _ = pair
    for text in corpus():
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip)
            got = ours.ask({"op": "decode", "ids": ids, "skip_special_tokens": skip})["text"]
            assert got == expected, f"{name}: decode of {text!r} (skip={skip})"
        got = ours.ask({"op": "decode", "ids": ids, "skip_special_tokens": False})["text"]
        # Byte-level BPE is lossless up to the normalizer (Qwen applies NFC).
        normalized = unicodedata.normalize("NFC", text) if name.startswith("qwen") else text
        assert got == normalized, f"{name}: round trip of {text!r}"


def test_decode_of_random_ids_matches_hf_including_broken_utf8(pair):
    name, hf, ours, _ = pair
    rng = random.Random(7)
    vocab_size = ours.ask({"op": "info"})["vocab_size"]
    for _ in range(200):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip)
            got = ours.ask({"op": "decode", "ids": ids, "skip_special_tokens": skip})["text"]
            assert got == expected, f"{name}: ids {ids} skip={skip}"


def test_streamed_chunks_concatenate_to_decode(pair):
    """Incremental detokenizer: chunks never lose or duplicate text, whatever the split (CJK, emoji, byte tokens)."""
    name, hf, ours, _ = pair
    rng = random.Random(11)
    vocab_size = ours.ask({"op": "info"})["vocab_size"]
    sequences = [hf.encode(t, add_special_tokens=False) for t in corpus()[:80]]
    # Single-byte tokens split multi-byte characters across tokens.
    byte_ids = [hf.convert_tokens_to_ids(c) for c in ["ä", "¸", "Ń", "Ģ", "ð", "Ł", "ĺ", "Ģ"]]
    for _ in range(120):
        sequences.append([rng.choice([rng.randrange(vocab_size), rng.choice(byte_ids)]) for _ in range(rng.randint(1, 30))])
    for ids in sequences:
        for skip in (True, False):
            chunks = ours.ask({"op": "stream", "ids": ids, "skip_special_tokens": skip})["chunks"]
            assert "".join(chunks) == hf.decode(ids, skip_special_tokens=skip), f"{name}: {ids}"


def test_special_token_ids_match_hf(pair):
    name, hf, ours, _ = pair
    info = ours.ask({"op": "info"})
    assert info["eos_token_id"] == hf.eos_token_id
    assert info["bos_token_id"] == hf.bos_token_id
    assert info["vocab_size"] == len(hf)
