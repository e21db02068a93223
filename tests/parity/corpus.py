"""A varied, deterministic text corpus for tokenizer parity."""
import random

FIXED = [
    "",
    " ",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see who's ready.",
    "I'M SURE THEY'LL SAY IT'S FINE, YOU'RE RIGHT, WE'VE SEEN IT, HE'D KNOW.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n",
    "#include <stdio.h>\r\nint main(void) {\r\n\tprintf(\"%d\\n\", 42);\r\n\treturn 0;\r\n}\r\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "<html><body><p class=\"x\">&amp; &lt;tag&gt;</p></body></html>",
    "中文分词测试：我们今天去北京大学参观，然后吃了烤鸭。",
    "日本語のテキスト、カタカナとひらがな、そして漢字。",
    "한국어 텍스트입니다. 안녕하세요! 반갑습니다.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇫🇷🇯🇵 1️⃣",
    "Combining: e\u0301 a\u0300 o\u0308 n\u0303 A\u030a \u1100\u1161\u11a8 Ω Å ﬁ",
    "Decomposed vs composed: caf\u00e9 cafe\u0301 re\u0301sume\u0301",
    "Arabic: مرحبا بالعالم. Hebrew: שלום עולם. Hindi: नमस्ते दुनिया. Thai: สวัสดีชาวโลก",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -2.5e-10 1,000,000 ١٢٣ ⅔ ²³",
    "Whitespace runs:" + " " * 40 + "end" + "\t" * 7 + "x" + "\n" * 9 + "y   \n   \n z",
    " leading and trailing spaces   ",
    "\n\n\nnewlines first",
    "Unicode spaces:\u00a0a\u3000b\u2028c\u2029d\u200be\u0085f\u000bg\u000ch\u1680i\u202fj",
    "Special tokens in text: <|endoftext|> <|im_start|>user\nhi<|im_end|> <think>x</think> <tool_call>",
    "Partial special: <|im_start <|im_end| <|endoftext|",
    "Adjacent<|im_end|><|im_end|>specials<|endoftext|>",
    "URLs: https://example.com/path?q=1&r=two#frag and emails a.b+c@d-e.org",
    "Math: ∀x∈ℝ, x²≥0; ∑_{i=1}^{n} i = n(n+1)/2; √2 ≈ 1.41421356",
    "Quotes: “smart” ‘single’ «guillemets» „low“ — en–dash … ellipsis",
    "Mixed: abc123DEF_ghi-jkl.mno/pqr\\stu|vwx~yz`!@#$%^&*()[]{}",
    "Tabs\tand\tmore\ttabs\t\t\tand a vertical\x0btab",
    "Long word: " + "supercalifragilisticexpialidocious" * 5,
    "Repeated: " + "ab" * 300,
    "Zero width joiner alone \u200d and non-joiner \u200c and BOM \ufeff inside",
    "Greek: Καλημέρα κόσμε. Cyrillic: Привет, мир! Armenian: Բարեւ",
    "Private use \ue000\uf8ff and astral 𝕳𝖊𝖑𝖑𝖔 𐍈 𠀀",
    "  \n\t  \r\n mixed whitespace block \t\n",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D",
    "   'll",
    "a" * 2000,
    " " * 1000,
    "\u00e9" * 500,
    "😀" * 300,
]

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " .,;:!?'\"-_()[]{}<>/\\|@#$%^&*+=~`",
    "   \t\n\r\u00a0\u3000\u2028\u200b\x0b\x0c\x85",
    "中文测试汉字北京大学你好世界日本語カタカナ",
    "한국어안녕하세요\u1100\u1161\u11a8",
    "😀👍🏽❤️\u200d\ufe0f🇫🇷",
    "\u0301\u0300\u0308\u0303\u030a\u0327",
    "éèêëàâäôöûüçñÅΩ",
    "مرحبانمستेสวัสดี",
]

SPECIAL_SNIPPETS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|fim_prefix|>"]


def random_texts(seed, count, max_len=120):
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, max_len)):
            roll = rng.random()
            if roll < 0.02:
                parts.append(rng.choice(SPECIAL_SNIPPETS))
            elif roll < 0.06:
                parts.append(" " * rng.randint(2, 30))
            else:
                pool = rng.choice(POOLS)
                parts.append(pool[rng.randrange(len(pool))])
        texts.append("".join(parts))
    return texts


def invalid_utf8_inputs(seed, count):
    rng = random.Random(seed)
    fixed = [
        b"\xff",
        b"abc\x80def",
        b"\xc3",
        b"\xc3(",
        b"\xe2\x82",
        b"\xe2\x82 x",
        b"\xf0\x9f\x98",
        b"\xf0\x9f\x98 \xf0\x9f",
        b"\xed\xa0\x80 surrogate",
        b"\xc0\xaf overlong",
        b"\xf4\x90\x80\x80 too big",
        b"\xfe\xfe\xff\xff",
        "ok ".encode() + b"\x80\x81\x82" + " 中文".encode(),
    ]
    out = list(fixed)
    for _ in range(count):
        raw = bytearray()
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.3:
                raw.append(rng.randrange(256))
            else:
                raw += rng.choice(["a", " ", "é", "中", "😀", "\n"]).encode()
        out.append(bytes(raw))
    return out
