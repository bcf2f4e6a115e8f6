#!/usr/bin/env python
"""Load on a running `tandem serve` through the OpenAI chat endpoint; a benchmark, not a test.

    python scripts/bench/serve_load.py http://127.0.0.1:8000 --concurrency 1 4 8 16 --out load.json

For each concurrency C, C clients each send --rounds streaming chat completions back to back
(httpx async, `stream: true`, `stream_options.include_usage`), every prompt made unique by a nonce
at its start so the prefix cache cannot serve it. Per request it records:

* TTFT: from sending the request to the first chunk carrying reasoning, content or a tool call;
* decode tok/s: (completion_tokens - 1) / (last chunk - first token), completion_tokens from the
  usage chunk (else the number of non-empty chunks);
and per level the aggregate tok/s: all completion tokens / wall time from the level's first request
to its last completion. Prints TTFT p50/p95, per-request decode tok/s p50/p5 and aggregate tok/s per
level, and writes the configuration, the summary and every request's numbers as JSON to --out.
By default every request asks for exactly --max-tokens tokens (`ignore_eos`), thinking off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time

import httpx

WORDS = ("the model serves tokens across two devices while the coordinator plans each step and the ranks "
         "exchange partial sums through a shared mailbox so that decoding stays bound by memory bandwidth").split()


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def make_prompt(rng: random.Random, words: int) -> str:
    nonce = f"[request {rng.getrandbits(64):016x}] "
    return nonce + " ".join(rng.choice(WORDS) for _ in range(words)) + "\nSummarise the text above."


async def one_request(client: httpx.AsyncClient, args, model: str, prompt: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": args.max_tokens,
            "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.thinking != "default":
        body["chat_template_kwargs"] = {"enable_thinking": args.thinking == "on"}
    t0 = time.perf_counter()
    first = last = None
    chunks, usage, finish, error = 0, None, None, None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        error = json.dumps(msg["error"])[:300]
                        break
                    usage = msg.get("usage") or usage
                    for choice in msg.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") \
                                or delta.get("tool_calls"):
                            now = time.perf_counter()
                            first = first if first is not None else now
                            last = now
                            chunks += 1
                        finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens", chunks)
    decode_s = (last - first) if first is not None and last is not None else None
    return {"ttft_s": None if first is None else first - t0, "total_s": end - t0,
            "completion_tokens": tokens, "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "decode_tok_s": (tokens - 1) / decode_s if decode_s and tokens > 1 else None,
            "finish_reason": finish, "error": error, "start_s": t0, "end_s": end}


async def run_level(client: httpx.AsyncClient, args, model: str, concurrency: int, rng: random.Random) -> dict:
    prompts = [[make_prompt(rng, args.prompt_words) for _ in range(args.rounds)] for _ in range(concurrency)]

    async def worker(mine: list[str]) -> list[dict]:
        return [await one_request(client, args, model, p) for p in mine]

    t0 = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(worker(p) for p in prompts)) for r in rs]
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    rate = [r["decode_tok_s"] for r in ok if r["decode_tok_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in ok)
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "wall_s": wall, "completion_tokens": tokens, "aggregate_tok_s": tokens / wall if wall else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "decode_tok_s_p50": percentile(rate, 50), "decode_tok_s_p5": percentile(rate, 5),
            "decode_tok_s_mean": statistics.fmean(rate) if rate else None,
            "first_errors": [r["error"] for r in results if r["error"]][:3],
            "samples": [{k: v for k, v in r.items() if k not in ("start_s", "end_s")} for r in results]}


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


async def main_async(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4, max_keepalive_connections=max(args.concurrency))
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout_s, connect=10.0)) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        rng = random.Random(args.seed)
        if args.warmup:
            warm = await one_request(client, args, model, make_prompt(rng, args.prompt_words))
            if warm["error"]:
                raise SystemExit(f"serve_load: the warm-up request failed: {warm['error']}")
        levels = []
        print(f"{'C':>4} {'reqs':>5} {'err':>4} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} {'dec tok/s p50':>14} "
              f"{'dec tok/s p5':>13} {'aggr tok/s':>11}", flush=True)
        for c in args.concurrency:
            lv = await run_level(client, args, model, c, rng)
            levels.append(lv)
            print(f"{c:>4} {lv['requests']:>5} {lv['errors']:>4} {fmt(lv['ttft_p50_s'], 1e3):>12} "
                  f"{fmt(lv['ttft_p95_s'], 1e3):>12} {fmt(lv['decode_tok_s_p50']):>14} "
                  f"{fmt(lv['decode_tok_s_p5']):>13} {fmt(lv['aggregate_tok_s']):>11}", flush=True)
            for e in lv["first_errors"]:
                print(f"     error: {e}", flush=True)
    return {"url": args.url, "model": model, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "client_host": platform.node(), "config": {k: v for k, v in vars(args).items() if k != "api_key"},
            "levels": levels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16], help="levels of concurrent clients")
    p.add_argument("--rounds", type=int, default=3, help="requests per client and level, sent back to back")
    p.add_argument("--prompt-words", type=int, default=200, help="words per prompt (about 1.3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: exactly --max-tokens tokens)")
    p.add_argument("--thinking", choices=["on", "off", "default"], default="off", help="enable_thinking")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="default: $TANDEM_API_KEY")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request read timeout")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up request")
    p.add_argument("--seed", type=int, default=0, help="prompt text seed")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--concurrency, --rounds and --max-tokens must be >= 1")
    result = asyncio.run(main_async(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if any(lv["errors"] for lv in result["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
