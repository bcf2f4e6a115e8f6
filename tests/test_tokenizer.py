"""runtime.tokenizer on the random-checkpoint tokenizer: round trips, special tokens, streaming decode, errors."""

import json
import os
import random
import subprocess
import sys

import pytest

from ranks import random_checkpoint as rc
from runtime.tokenizer import Tokenizer, TokenizerError, generation_defaults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_ADDED = rc.SPECIAL_TOKENS + rc.ADDED_TOKENS
TEXTS = [
    "Hello, world! 👋🌍",
    "日本語のテキストと中文文本，还有한국어도 있어요。",
    "Family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵, skin tones: 👍🏽👍🏿, keycap: 1️⃣",
    "Combining: e\u0301 a\u0308 — Ελληνικά, русский, العربية, עברית, हिन्दी",
    "def f(x):\n\treturn x ** 2  # 😀\r\n\n   trailing   ",
    "<|im_start|>user\n天气怎么样？🌧️<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n晴天☀️",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𐍈 \U0001F9D1\u200d\U0001F4BB \x00\x7f\u2028",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    ids = rc.write_tokenizer(d, rc.build_tokenizer(rc.tokenizer_size_for(1024)))
    with open(d / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [ids[rc.IM_END], ids[rc.ENDOFTEXT]], "pad_token_id": ids[rc.ENDOFTEXT]}, f)
    return d


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


def _random_text(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E)] * 4 + [(0x09, 0x0D), (0xA0, 0x24F), (0x370, 0x52F), (0x591, 0x6FF), (0x900, 0x97F),
                                    (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF),
                                    (0x300, 0x36F), (0x10000, 0x10FFFF), (0x0, 0x1F), (0xE000, 0xFFFD)]
    out = []
    for _ in range(n):
        if rng.random() < 0.05:
            out.append(rng.choice(ALL_ADDED))
            continue
        lo, hi = rng.choice(ranges)
        c = rng.randint(lo, hi)
        out.append(chr(c) if not 0xD800 <= c <= 0xDFFF else "x")
    return "".join(out)


def test_sizes_and_ids(tok, model_dir):
    assert tok.vocab_size == rc.tokenizer_size_for(1024) <= 1024
    ids = [tok.token_to_id(t) for t in ALL_ADDED]
    assert ids == list(range(tok.vocab_size - len(ALL_ADDED), tok.vocab_size))   # appended after the BPE ids
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.eos_token == "<|im_end|>"


def test_round_trip_random_unicode(tok, seed):
    rng = random.Random(seed)
    for _ in range(200):
        s = _random_text(rng, rng.randint(0, 60))
        ids = tok.encode(s)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == s, (seed, s)
    for s in TEXTS:
        assert tok.decode(tok.encode(s)) == s


def test_special_tokens_are_single_ids(tok):
    for t in ALL_ADDED:
        i = tok.token_to_id(t)
        assert i is not None and tok.encode(t) == [i] and tok.decode([i]) == t
        assert tok.id_to_token(i) == t
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"
            "<think>\nok</think><tool_call>{}</tool_call>")
    ids = tok.encode(text)
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tok.token_to_id(t) in ids
    assert tok.decode(ids) == text
    # skipping drops the special tokens but keeps Qwen's non-special added tokens (<think>, <tool_call>, ...)
    assert tok.decode(ids, skip_special_tokens=True) == (
        "system\nBe brief.\nassistant\n<think>\nok</think><tool_call>{}</tool_call>")
    # text that merely resembles a special token is not one
    assert len(tok.encode("<|im_start")) > 1
    assert tok.encode("ab", add_special_tokens=True) == tok.encode("ab")   # nothing is prepended


def _stream(tok, ids, skip=False):
    dec = tok.incremental_decoder(skip_special_tokens=skip)
    parts = [dec.add(i) if n % 2 else dec.push(i) for n, i in enumerate(ids)]
    return parts, dec.flush()


def test_incremental_decode_never_splits_characters(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (False, True):
            parts, rest = _stream(tok, ids, skip)
            assert "".join(parts) + rest == tok.decode(ids, skip_special_tokens=skip)
            assert rest == ""
            assert not any("\ufffd" in p for p in parts), parts
        # multi-byte characters made of several byte-level tokens: some pushes return "" (held back)
    parts, _ = _stream(tok, tok.encode("🇫🇷😀"))
    assert "" in parts and "".join(parts) == "🇫🇷😀"


def test_incremental_decode_random_ids(tok, seed):
    rng = random.Random(seed)
    for _ in range(300):
        # ids past the tokenizer (the model's padding rows) decode to nothing, as in a full decode
        ids = [rng.randrange(1024) for _ in range(rng.randint(1, 25))]
        for skip in (False, True):
            parts, rest = _stream(tok, ids, skip)
            assert "".join(parts) + rest == tok.decode(ids, skip_special_tokens=skip), ids


def test_incremental_decode_generic_path(model_dir, seed):
    """A tokenizer whose decoder is not plain ByteLevel uses the re-decoding window; same results."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders

    raw = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    raw.decoder = decoders.Sequence([decoders.ByteLevel()])
    tok = Tokenizer(raw, eos_token="<|im_end|>")
    assert not tok._byte_level
    for text in TEXTS:
        ids = tok.encode(text)
        parts, rest = _stream(tok, ids)
        assert "".join(parts) + rest == text and not any("\ufffd" in p for p in parts)
    rng = random.Random(seed)
    for _ in range(100):
        ids = [rng.randrange(1024) for _ in range(rng.randint(1, 20))]
        parts, rest = _stream(tok, ids)
        assert "".join(parts) + rest == tok.decode(ids)


def test_render_chat(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.render_chat(msgs, enable_thinking=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.render_chat(msgs).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.render_chat(msgs, add_generation_prompt=False).endswith("U<|im_end|>\n")


def test_missing_and_invalid_files_are_named(tmp_path, model_dir):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"bad[/\\]tokenizer\.json"):
        Tokenizer.from_dir(bad)
    (bad / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    Tokenizer.from_dir(bad)                                   # config files are optional
    (bad / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(bad)
    (bad / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match="tokenizer_config.json.*<\\|nope\\|>"):
        Tokenizer.from_dir(bad)
    (bad / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 10**6]}))
    with pytest.raises(TokenizerError, match="generation_config.json.*1000000"):
        Tokenizer.from_dir(bad)
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    t = Tokenizer.from_dir(bad)
    assert t.eos_token_ids == {5, t.token_to_id("<|im_end|>")}


def test_chat_template_file_wins_over_tokenizer_config(tmp_path, model_dir):
    """chat_template.jinja takes priority over tokenizer_config.json's chat_template, as in transformers
    (a checkpoint saved by recent transformers may carry both)."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from the config"}))
    assert Tokenizer.from_dir(d).chat_template == "from the config"
    (d / "chat_template.jinja").write_text("from the file")
    assert Tokenizer.from_dir(d).chat_template == "from the file"
    (d / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")       # not UTF-8: named, not a traceback
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja"):
        Tokenizer.from_dir(d)


def test_build_is_deterministic_across_processes(tok):
    """Same Python version -> same tokenizer, whatever the hash seed (BPE ties broken deterministically)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from ranks.random_checkpoint import build_tokenizer;"
            "import hashlib; print(hashlib.sha256(build_tokenizer(1008).to_str().encode()).hexdigest())")
    digests = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        p = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        digests.add(p.stdout.strip())
    import hashlib
    digests.add(hashlib.sha256(rc.build_tokenizer(1008).to_str().encode()).hexdigest())
    assert len(digests) == 1


def test_too_small_vocab():
    with pytest.raises(ValueError, match="too small"):
        rc.build_tokenizer(256)


def test_generation_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [7, 5], "bos_token_id": 5}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_ids": [7, 5]}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7,
                                                                 "eos_token_id": 3}))
    assert generation_defaults(tmp_path) == {"temperature": 0.0, "eos_token_ids": [3]}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": "many"}))
    with pytest.raises(TokenizerError, match="generation_config.json.*top_k"):
        generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        generation_defaults(tmp_path)
    # values no request could sample with are refused at load, naming the field (SamplingParams' ranges);
    # top_k <= 0 is "off" and an integral float is an integer
    for bad, field in (({"top_p": 0.0}, "top_p"), ({"top_k": 1.5}, "top_k"), ({"temperature": -0.5}, "temperature"),
                       ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                       ({"presence_penalty": 3}, "presence_penalty"), ({"max_new_tokens": 0}, "max_new_tokens")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(TokenizerError, match=f"generation_config.json: field '?{field}"):
            generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": -1, "top_p": 1.0, "temperature": 1e-3}))
    assert generation_defaults(tmp_path) == {"top_k": -1, "top_p": 1.0, "temperature": 1e-3, "eos_token_ids": []}
