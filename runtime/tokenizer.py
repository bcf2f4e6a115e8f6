"""The model directory's tokenizer: encode, decode, streaming (incremental) decode, stop ids.

Wraps a `tokenizers.Tokenizer` read from ``tokenizer.json``. ``tokenizer_config.json`` (optional)
gives the eos / pad tokens and the chat template (``chat_template.jinja``, when present, wins over it,
as in transformers); ``generation_config.json`` (optional) gives more eos ids. Qwen3.5/3.6 tokenizers
are byte-level BPE: one token may hold part of a UTF-8 character, so streaming decode goes through
bytes and holds back incomplete characters (IncrementalDecoder).
Any file that is present but unreadable is refused with a TokenizerError naming it.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any, Iterable

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; the message names the file."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: byte -> printable character (the map ByteLevel uses)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _read_json(path: str, required: bool) -> Any:
    if not os.path.isfile(path):
        if required:
            raise TokenizerError(f"{path}: missing (the model directory has no {os.path.basename(path)})")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot parse {os.path.basename(path)}: {e}") from e


def _token_content(value: Any) -> str | None:
    """A token given as a string or as an AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode / decode with a model's tokenizer; eos ids and the chat template from its config files."""

    def __init__(self, tok, *, eos_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | None = None, extra_eos_ids: Iterable[int] = (), source: str = "<tokenizer>"):
        self._tok = tok
        self.source = source
        self.eos_token, self.pad_token, self.chat_template = eos_token, pad_token, chat_template
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        eos: set[int] = set()
        for name, token in (("eos_token", eos_token), ("pad_token", pad_token)):
            if token is not None and tok.token_to_id(token) is None:
                raise TokenizerError(f"{source}: {name} {token!r} is not a token of the tokenizer")
        if eos_token is not None:
            eos.add(tok.token_to_id(eos_token))
        eos.update(int(i) for i in extra_eos_ids)
        self.eos_token_ids: set[int] = eos
        self.pad_token_id: int | None = tok.token_to_id(pad_token) if pad_token is not None else None
        # id -> (bytes, is_special) for the byte-level fast path of IncrementalDecoder
        self._byte_level = _is_byte_level(tok)
        self._special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self._piece_cache: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "Tokenizer":
        """Load MODEL_DIR/tokenizer.json (+ tokenizer_config.json, generation_config.json if present)."""
        from tokenizers import Tokenizer as HFTokenizer

        d = os.fspath(model_dir)
        path = os.path.join(d, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise TokenizerError(f"{path}: missing (the model directory has no {TOKENIZER_FILE})")
        try:
            tok = HFTokenizer.from_file(path)
        except Exception as e:          # tokenizers raises a bare Exception on bad JSON or unknown fields
            raise TokenizerError(f"{path}: cannot load {TOKENIZER_FILE}: {e}") from e

        cfg_path = os.path.join(d, TOKENIZER_CONFIG_FILE)
        cfg = _read_json(cfg_path, required=False) or {}
        if not isinstance(cfg, dict):
            raise TokenizerError(f"{cfg_path}: must be a JSON object, got {type(cfg).__name__}")
        template = cfg.get("chat_template")
        if isinstance(template, list):        # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = os.path.join(d, "chat_template.jinja")
        if os.path.isfile(jinja):             # the file wins over the config's entry, as in transformers
            try:
                with open(jinja, encoding="utf-8") as f:
                    template = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja}: cannot read chat_template.jinja: {e}") from e

        gen_path = os.path.join(d, GENERATION_CONFIG_FILE)
        gen = _read_json(gen_path, required=False) or {}
        if not isinstance(gen, dict):
            raise TokenizerError(f"{gen_path}: must be a JSON object, got {type(gen).__name__}")
        eos = gen.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        size = tok.get_vocab_size(with_added_tokens=True)
        for i in eos_ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < size:
                raise TokenizerError(f"{gen_path}: eos_token_id {i!r} is not an id of the tokenizer "
                                     f"({size} ids in {path})")
        return cls(tok, eos_token=_token_content(cfg.get("eos_token")), pad_token=_token_content(cfg.get("pad_token")),
                   chat_template=template if isinstance(template, str) else None, extra_eos_ids=eos_ids,
                   source=cfg_path)

    # ----------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised as single ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes token `i` contributes to decoded text (byte-level tokenizers only); b"" for an
        id outside the tokenizer (a model may have more embedding rows than the tokenizer has ids)."""
        if skip_special_tokens and i in self._special_ids:
            return b""
        piece = self._piece_cache.get(i)
        if piece is None:
            token = self._tok.id_to_token(i)
            if token is None:
                piece = b""
            else:   # as the ByteLevel decoder: map every char back to its byte, or keep the raw UTF-8
                try:
                    piece = bytes(_CHAR_TO_BYTE[c] for c in token)
                except KeyError:
                    piece = token.encode("utf-8")
            self._piece_cache[i] = piece
        return piece

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the tokenizer_config chat template (sandboxed jinja2, as transformers does)."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: no chat_template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(messages=messages,
                                                          add_generation_prompt=add_generation_prompt, **kwargs)


_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "max_new_tokens")


def generation_defaults(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Sampling defaults and stop ids from MODEL_DIR/generation_config.json ({} when there is none).

    Returns the keys present among temperature, top_k, top_p, min_p, repetition_penalty,
    presence_penalty, frequency_penalty, max_new_tokens, plus ``eos_token_ids`` (a list, from
    eos_token_id int or list). ``do_sample: false`` means greedy, as in transformers: temperature 0.
    """
    path = os.path.join(os.fspath(model_dir), GENERATION_CONFIG_FILE)
    gen = _read_json(path, required=False)
    if gen is None:
        return {}
    if not isinstance(gen, dict):
        raise TokenizerError(f"{path}: must be a JSON object, got {type(gen).__name__}")
    out: dict[str, Any] = {}
    for key in _SAMPLING_KEYS:
        value = gen.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TokenizerError(f"{path}: field {key!r} must be a number, got {value!r}")
        out[key] = value
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    # the values every request without its own would sample with: checked here, so a bad file stops the
    # server at start naming it instead of failing those requests (top_k <= 0 is "off", as vLLM's -1)
    from runtime.sampling import SamplingParams
    probe = dict(out)
    if "top_k" in probe:
        k = probe["top_k"]
        if k != int(k):
            raise TokenizerError(f"{path}: field 'top_k' must be an integer, got {k!r}")
        probe["top_k"] = max(0, int(k))
    if "max_new_tokens" in probe and probe["max_new_tokens"] == int(probe["max_new_tokens"]):
        probe["max_new_tokens"] = int(probe["max_new_tokens"])
    try:
        SamplingParams(**probe)
    except ValueError as e:
        raise TokenizerError(f"{path}: field {e}") from None
    eos = gen.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TokenizerError(f"{path}: field 'eos_token_id' must be an id or a list of ids, got {eos!r}")
    out["eos_token_ids"] = list(ids)
    return out


def _is_byte_level(tok) -> bool:
    try:
        decoder = json.loads(tok.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    return decoder.get("type") == "ByteLevel"


class IncrementalDecoder:
    """Streaming detokenisation: feed ids one at a time, get the new text each one completes.

    A fragment never ends inside a multi-byte UTF-8 character: the bytes of an incomplete character
    are held back until the tokens that complete it arrive (invalid bytes become U+FFFD exactly as a
    full decode would). ``"".join(push(i) for i in ids) + flush()`` equals ``decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        if tokenizer._byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:                       # generic path: re-decode a short window, emit once it stops ending in U+FFFD
            self._utf8 = None
            self._prefix = self._read = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly "")."""
        self.ids.append(int(token_id))
        if self._utf8 is not None:
            return self._utf8.decode(self.tokenizer.token_bytes(int(token_id), self.skip_special_tokens))
        tok, skip = self.tokenizer, self.skip_special_tokens
        prefix_text = tok.decode(self.ids[self._prefix:self._read], skip)
        new_text = tok.decode(self.ids[self._prefix:], skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    add = push      # alias

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end becomes U+FFFD)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        tok, skip = self.tokenizer, self.skip_special_tokens
        prefix_text = tok.decode(self.ids[self._prefix:self._read], skip)
        new_text = tok.decode(self.ids[self._prefix:], skip)
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):]
