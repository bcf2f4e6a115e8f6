#!/usr/bin/env python
"""Build the demo model's training corpus: text, tokenizer, token arrays, manifest.

Sources (all present on this machine; licences recorded per source in the manifest):

  stdlib            CPython standard library sources of the running interpreter (PSF-2.0), without
                    tests, codec tables and pydoc data                                   kind code
  stdlib-tests      a seeded sample of the standard library's test suites (PSF-2.0)     kind code
  stdlib-docstrings module / class / function docstrings of the same modules, as prose   kind prose
  python-reference  the language-reference topics of pydoc (pydoc_data/topics.py)       kind prose
  nodejs-docs       /usr/share/doc/nodejs/api/*.md, Node.js API docs (MIT), if present  kind prose
  python-news       /usr/share/doc/python3.*/NEWS.gz, CPython change log (PSF-2.0), if present
  licenses          /usr/share/common-licenses/* (licence texts; verbatim copying permitted)
  chat              synthetic chats from chat_data.py rendered with chat_template.jinja  kind chat

Output directory (default .demo-data/):

  tokenizer.json, tokenizer_config.json, chat_template.jinja    byte-level BPE + Qwen3.5 specials
  train.npy / heldout.npy           uint16 token ids, every document followed by <|endoftext|>
  train_docs.npy / heldout_docs.npy int64 start offset of every document
  train_kinds.npy / heldout_kinds.npy  uint8 kind per document (0 code, 1 prose, 2 chat)
  manifest.json                     sources, licences, bytes, documents, tokens, hashes

Documents are split into train / held-out by a seeded hash of (source, document id). Deterministic
given --seed (and the interpreter / Debian packages present).

    python scripts/demo/build_corpus.py --out .demo-data                       # full build (~1-2 min)
    python scripts/demo/build_corpus.py --out /tmp/d --max-bytes 300000 --vocab-size 1024   # smoke
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import time
import unicodedata
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import chat_data  # noqa: E402
from ranks.random_checkpoint import tokenizer_config  # noqa: E402

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
ALL_ADDED = SPECIAL_TOKENS + ADDED_TOKENS
KINDS = {"code": 0, "prose": 1, "chat": 2}

# Qwen2 / Qwen3 / Qwen3.5 pre-tokenizer split: contractions, letter runs, single digits, punctuation
# runs, newlines, spaces
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

TEST_DIRS = ("test", "tests", "idle_test")
MAX_FILE_BYTES = 300_000
SKIP_DIRS = ("site-packages", "__pycache__", "encodings", "pydoc_data", "lib-dynload", "ensurepip", "turtledemo")


@dataclass
class Source:
    name: str
    kind: str
    licence: str
    origin: str
    cap: int                                   # bytes wanted (before --max-bytes scaling)
    docs: list[tuple[str, str]] = field(default_factory=list)   # (doc id, text)

    @property
    def nbytes(self) -> int:
        return sum(len(t.encode("utf-8")) for _, t in self.docs)


# --------------------------------------------------------------------------------------------------
# Collecting text


def _read(path: str) -> str | None:
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError, EOFError):
        return None


def _clean(text: str) -> str:
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    return text.strip("\n") + "\n"


def stdlib_files(libdir: str) -> tuple[list[str], list[str]]:
    """(library .py files, test .py files) of the interpreter's standard library, sorted."""
    lib, tests = [], []
    for root, dirs, files in os.walk(libdir):
        rel = os.path.relpath(root, libdir)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and parts[0] in SKIP_DIRS:
            dirs[:] = []
            continue
        dirs.sort()
        is_test = any(p in TEST_DIRS for p in parts)
        for f in sorted(files):
            if f.endswith(".py"):
                (tests if is_test else lib).append(os.path.join(root, f))
    return lib, tests


def _take(paths: list[str], budget: int, rng: random.Random | None, libdir: str) -> list[tuple[str, str]]:
    paths = list(paths)
    if rng is not None:
        rng.shuffle(paths)
    out, size = [], 0
    for p in paths:
        if size >= budget:
            break
        if os.path.getsize(p) > MAX_FILE_BYTES:      # data tables and generated files, not prose or code
            continue
        text = _read(p)
        if not text or not text.strip():
            continue
        text = _clean(text)
        out.append((os.path.relpath(p, libdir), text))
        size += len(text.encode("utf-8"))
    return out


def docstring_doc(path: str, modname: str) -> str | None:
    """The docstrings of one module as a prose document: module, classes, functions, methods."""
    text = _read(path)
    if not text:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    parts = []
    mod = ast.get_docstring(tree)
    if mod:
        parts.append(f"Module {modname}\n\n{mod.strip()}")

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name.startswith("_") and not child.name.startswith("__init"):
                    continue
                doc = ast.get_docstring(child)
                name = f"{prefix}{child.name}"
                if doc and len(doc) > 40:
                    what = "class" if isinstance(child, ast.ClassDef) else "function"
                    parts.append(f"{name} ({what})\n\n{doc.strip()}")
                if isinstance(child, ast.ClassDef):
                    visit(child, name + ".")

    visit(tree, modname + ".")
    return _clean("\n\n".join(parts)) if len("".join(parts)) > 200 else None


def pydoc_topics(libdir: str) -> list[tuple[str, str]]:
    path = os.path.join(libdir, "pydoc_data", "topics.py")
    text = _read(path)
    if not text:
        return []
    try:
        tree = ast.parse(text)
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
                topics = ast.literal_eval(node.value)
                return [(f"pydoc_data/topics.py:{k}", _clean(v)) for k, v in sorted(topics.items()) if v.strip()]
    except (SyntaxError, ValueError):
        pass
    return []


def collect_sources(args) -> list[Source]:
    libdir = args.stdlib_dir or sysconfig.get_paths()["stdlib"]
    rng = random.Random(f"tandem-demo-corpus-{args.seed}")
    lib, tests = stdlib_files(libdir)
    sources: list[Source] = []
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    sources.append(Source("stdlib", "code", "PSF-2.0 (CPython LICENSE.txt)", f"<stdlib> (CPython {version})",
                          args.stdlib_bytes, _take(lib, args.stdlib_bytes, None, libdir)))
    sources.append(Source("stdlib-tests", "code", "PSF-2.0 (CPython LICENSE.txt)", "<stdlib>/**/test*",
                          args.tests_bytes, _take(tests, args.tests_bytes, random.Random(rng.random()), libdir)))
    docs = []
    for p in lib:
        rel = os.path.relpath(p, libdir)
        mod = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        d = docstring_doc(p, mod)
        if d:
            docs.append((rel + ":docstrings", d))
    sources.append(Source("stdlib-docstrings", "prose", "PSF-2.0 (CPython LICENSE.txt)", "<stdlib> docstrings",
                          args.docstring_bytes, docs))
    sources.append(Source("python-reference", "prose", "PSF-2.0 (CPython LICENSE.txt)",
                          "<stdlib>/pydoc_data/topics.py", args.reference_bytes, pydoc_topics(libdir)))
    node = sorted(glob.glob(os.path.join(args.doc_root, "nodejs", "api", "*.md")))
    if node:
        sources.append(Source("nodejs-docs", "prose", "MIT (Node.js; /usr/share/doc/nodejs/copyright)",
                              os.path.join(args.doc_root, "nodejs", "api", "*.md"), args.nodejs_bytes,
                              [(os.path.relpath(p, args.doc_root), _clean(t)) for p in node
                               if (t := _read(p))]))
    news = sorted(glob.glob(os.path.join(args.doc_root, "python3.*", "NEWS.gz")))
    if news:
        text = _read(news[-1]) or ""
        # one document per release section ("What's New in Python X.Y.Z ...")
        sections = [s for s in re.split(r"\n(?=What's New in Python )", text) if len(s) > 200]
        sources.append(Source("python-news", "prose", "PSF-2.0 (Debian python3 copyright)", news[-1],
                              args.news_bytes, [(f"{os.path.relpath(news[-1], args.doc_root)}#{i}", _clean(s))
                                                for i, s in enumerate(sections)]))
    lic_dir = os.path.join(args.doc_root, "..", "common-licenses")
    lic = sorted(p for p in glob.glob(os.path.join(lic_dir, "*")) if os.path.isfile(p) and not os.path.islink(p))
    if lic:
        sources.append(Source("licenses", "prose", "licence texts (verbatim copying and distribution permitted)",
                              os.path.normpath(lic_dir), args.licenses_bytes,
                              [(f"common-licenses/{os.path.basename(p)}", _clean(t)) for p in lic if (t := _read(p))]))
    return sources


def trim_sources(sources: list[Source], chat_bytes: int, max_bytes: int | None, seed: int) -> tuple[list[Source], int]:
    """Cut every source to its cap, all caps scaled down together when they exceed --max-bytes.
    Returns the sources and the chat byte budget."""
    natural = {s.name: min(s.cap, s.nbytes) for s in sources}
    total = sum(natural.values()) + chat_bytes
    scale = min(1.0, max_bytes / total) if max_bytes else 1.0
    for s in sources:
        budget = int(natural[s.name] * scale)
        rng = random.Random(f"tandem-demo-trim-{seed}-{s.name}")
        if s.name not in ("stdlib-tests",):     # tests were sampled already; others: seeded subset
            order = list(range(len(s.docs)))
            if budget < s.nbytes:
                rng.shuffle(order)
            kept, size = [], 0
            for i in order:
                if size >= budget:
                    break
                kept.append(i)
                size += len(s.docs[i][1].encode("utf-8"))
            s.docs = [s.docs[i] for i in sorted(kept)]
        else:
            kept, size = [], 0
            for d in s.docs:
                if size >= budget:
                    break
                kept.append(d)
                size += len(d[1].encode("utf-8"))
            s.docs = kept
    return sources, int(chat_bytes * scale)


def chat_source(seed: int, budget: int) -> Source:
    template = chat_data.load_template()
    docs, size = [], 0
    it = chat_data.iter_rendered(seed, template)
    while size < budget:
        chat, text = next(it)
        docs.append((f"chat-{len(docs)}:{chat['kind']}:{'think' if chat['thinking'] else 'nothink'}", text))
        size += len(text.encode("utf-8"))
    return Source("chat", "chat", "generated by scripts/demo/chat_data.py (project licence, Apache-2.0)",
                  "scripts/demo/chat_data.py + chat_template.jinja", budget, docs)


def is_heldout(seed: int, source: str, doc_id: str, frac: float) -> bool:
    h = hashlib.sha256(f"{seed}\0{source}\0{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < frac


# --------------------------------------------------------------------------------------------------
# Tokenizer


_ADDED_RE = re.compile("|".join(re.escape(t) for t in ALL_ADDED))


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with the Qwen split, `vocab_size` ids in all: BPE ids first, then the nine
    added tokens in the order of ALL_ADDED (the first three special)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(ALL_ADDED) + 1:
        raise SystemExit(f"--vocab-size {vocab_size} is too small "
                         f"(byte-level needs > {len(alphabet) + len(ALL_ADDED)})")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(ALL_ADDED), min_frequency=2, show_progress=False,
                                  initial_alphabet=alphabet, special_tokens=[])

    def pieces():
        for t in texts:                     # the added tokens are single ids: keep them out of the merges
            yield from (p for p in _ADDED_RE.split(t) if p)

    tok.train_from_iterator(pieces(), trainer=trainer, length=len(texts))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    ids = [tok.token_to_id(t) for t in ALL_ADDED]
    n = tok.get_vocab_size(with_added_tokens=True)
    assert ids == list(range(n - len(ALL_ADDED), n)), ids
    return tok


def save_tokenizer(out: str, tok, template: str) -> None:
    tok.save(os.path.join(out, "tokenizer.json"))
    _write_json(os.path.join(out, "tokenizer_config.json"), tokenizer_config(tok, template))
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# --------------------------------------------------------------------------------------------------
# Encoding


def encode_docs(tok, docs: list[tuple[str, int]], batch: int = 2000):
    """Token stream (uint16) with <|endoftext|> after every document, start offsets, kinds."""
    import numpy as np

    eot = tok.token_to_id(ENDOFTEXT)
    chunks, starts, kinds = [], [], []
    at = 0
    for i in range(0, len(docs), batch):
        part = docs[i:i + batch]
        for (text, kind), enc in zip(part, tok.encode_batch([t for t, _ in part], add_special_tokens=False)):
            ids = np.asarray(enc.ids + [eot], dtype=np.uint16)
            chunks.append(ids)
            starts.append(at)
            kinds.append(kind)
            at += len(ids)
    stream = np.concatenate(chunks) if chunks else np.zeros(0, np.uint16)
    return stream, np.asarray(starts, np.int64), np.asarray(kinds, np.uint8)


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".demo-data", help="output directory (default .demo-data)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=8192, help="tokenizer ids incl. the 9 added tokens")
    ap.add_argument("--heldout-frac", type=float, default=0.015, help="fraction of documents held out")
    ap.add_argument("--max-bytes", type=int, default=None, help="scale every source down to this total")
    ap.add_argument("--chat-bytes", type=int, default=24_000_000, help="synthetic chat text (bytes)")
    ap.add_argument("--stdlib-bytes", type=int, default=12_000_000)
    ap.add_argument("--tests-bytes", type=int, default=17_000_000)
    ap.add_argument("--docstring-bytes", type=int, default=3_000_000)
    ap.add_argument("--reference-bytes", type=int, default=1_000_000)
    ap.add_argument("--nodejs-bytes", type=int, default=3_600_000)
    ap.add_argument("--news-bytes", type=int, default=2_000_000)
    ap.add_argument("--licenses-bytes", type=int, default=300_000)
    ap.add_argument("--tokenizer-bytes", type=int, default=20_000_000,
                    help="train the BPE on a seeded sample of at most this many bytes (speed)")
    ap.add_argument("--stdlib-dir", default=None, help="standard library to read (default: this interpreter's)")
    ap.add_argument("--doc-root", default="/usr/share/doc", help="Debian documentation root")
    args = ap.parse_args(argv)

    import numpy as np

    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    sources = collect_sources(args)
    sources, chat_budget = trim_sources(sources, args.chat_bytes, args.max_bytes, args.seed)
    sources.append(chat_source(args.seed, chat_budget))
    print(f"[corpus] collected {sum(len(s.docs) for s in sources)} documents, "
          f"{sum(s.nbytes for s in sources) / 1e6:.1f} MB in {time.time() - t0:.1f}s", flush=True)

    train_docs, held_docs = [], []
    per_source: dict[str, dict] = {}
    for s in sources:
        n_tr = n_ho = 0
        for doc_id, text in s.docs:
            if is_heldout(args.seed, s.name, doc_id, args.heldout_frac):
                held_docs.append((text, KINDS[s.kind], s.name))
                n_ho += 1
            else:
                train_docs.append((text, KINDS[s.kind], s.name))
                n_tr += 1
        per_source[s.name] = {"kind": s.kind, "licence": s.licence, "origin": s.origin,
                              "documents": len(s.docs), "train_documents": n_tr, "heldout_documents": n_ho,
                              "bytes": s.nbytes}

    # tokenizer: trained on a seeded sample of the training documents
    rng = random.Random(f"tandem-demo-tok-{args.seed}")
    order = list(range(len(train_docs)))
    rng.shuffle(order)
    sample, size = [], 0
    for i in order:
        if size >= args.tokenizer_bytes:
            break
        sample.append(train_docs[i][0])
        size += len(train_docs[i][0])
    t1 = time.time()
    tok = train_tokenizer(sample, args.vocab_size)
    template = chat_data.load_template()
    save_tokenizer(args.out, tok, template)
    print(f"[corpus] tokenizer: {tok.get_vocab_size(with_added_tokens=True)} ids, trained on "
          f"{size / 1e6:.1f} MB in {time.time() - t1:.1f}s", flush=True)

    t2 = time.time()
    result = {}
    for split, docs in (("train", train_docs), ("heldout", held_docs)):
        stream, starts, kinds = encode_docs(tok, [(t, k) for t, k, _ in docs])
        np.save(os.path.join(args.out, f"{split}.npy"), stream)
        np.save(os.path.join(args.out, f"{split}_docs.npy"), starts)
        np.save(os.path.join(args.out, f"{split}_kinds.npy"), kinds)
        ends = np.append(starts[1:], len(stream)) if len(starts) else starts
        for name in per_source:
            mask = np.asarray([s == name for _, _, s in docs], bool)
            per_source[name][f"{split}_tokens"] = int((ends - starts)[mask].sum()) if len(starts) else 0
        result[split] = {"tokens": int(len(stream)), "documents": int(len(starts)),
                         "tokens_by_kind": {k: int((ends - starts)[kinds == v].sum()) if len(starts) else 0
                                            for k, v in KINDS.items()},
                         "sha256": _sha(os.path.join(args.out, f"{split}.npy"))}
    print(f"[corpus] encoded {result['train']['tokens']:,} train + {result['heldout']['tokens']:,} held-out "
          f"tokens in {time.time() - t2:.1f}s", flush=True)

    total_bytes = sum(s.nbytes for s in sources)
    manifest = {
        "format": "tandem-demo-corpus/1",
        "seed": args.seed,
        "args": vars(args),
        "python": sys.version.split()[0],
        "tokenizer": {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
                      "added_tokens": {t: tok.token_to_id(t) for t in ALL_ADDED},
                      "special_tokens": list(SPECIAL_TOKENS),
                      "bytes_per_token": round(total_bytes / max(1, result["train"]["tokens"] +
                                                                 result["heldout"]["tokens"]), 3),
                      "sha256": _sha(os.path.join(args.out, "tokenizer.json"))},
        "kinds": KINDS,
        "splits": result,
        "sources": per_source,
        "text_bytes": total_bytes,
        "build_seconds": round(time.time() - t0, 1),
    }
    _write_json(os.path.join(args.out, "manifest.json"), manifest)
    disk = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"[corpus] wrote {args.out}: {disk / 2**20:.1f} MiB on disk, {time.time() - t0:.1f}s in all", flush=True)
    for name, s in per_source.items():
        print(f"  {name:18s} {s['kind']:5s} {s['documents']:6d} docs {s['bytes'] / 1e6:7.2f} MB "
              f"{s['train_tokens']:>11,} train tok  {s['licence']}")
    return manifest


if __name__ == "__main__":
    main()
