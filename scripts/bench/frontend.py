#!/usr/bin/env python
"""What the HTTP frontend costs per streamed token, with the engine taken out; a benchmark, not a test.

    python scripts/bench/frontend.py --concurrency 8 32 128 --tokens 256 --step-ms 10 --out frontend.json

The server process runs the real app (server.app.create_app over server.service.Service, uvicorn on
uvloop, the demo model's tokenizer and chat template) in front of a paced engine: a thread that, every
--step-ms, gives each running request one token, as a decode step would (the tokens are the ids of an
English text, so detokenisation does real work). C clients in this process each stream one OpenAI
chat completion of --tokens tokens (`stream: true`, `ignore_eos`), over a bare HTTP/1.1 client that
costs far less than the server per chunk. For each C it reports:

* server CPU per streamed token (user + system time of the server process over the level, divided by
  the tokens streamed): what the frontend spends on each token, whatever the machine's load;
* the server's core use (its CPU seconds over the level's wall time; the event loop is one thread, so
  near 1.0 the frontend is the limit);
* delivered against offered token rate (the paced engine offers C x 1000 / step_ms tokens a second):
  1.0 when the frontend keeps up;
* the one-core ceiling, 1e6 / (us per token): tokens a second the frontend could stream at most.

--http picks uvicorn's HTTP implementation (h11, pure Python, or httptools where installed) to compare
them. JSON with the configuration and every level to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TEXT = ("The coordinator plans each step while the ranks exchange partial sums through a shared mailbox, "
        "so that decoding stays bound by memory bandwidth; the frontend turns each token into text, frames "
        "it as a server-sent event and writes it to the client's socket. ") * 8


class PacedEngine:
    """The runtime.Engine interface the service uses, giving every running request one token a step."""

    def __init__(self, token_ids: list[int], vocab_size: int, step_s: float, per_step: int = 1):
        from types import SimpleNamespace
        self.spec = SimpleNamespace(vocab_size=vocab_size)
        self.token_ids, self.step_s, self.per_step = token_ids, step_s, per_step
        self.running: dict[int, list] = {}            # id -> [stream, produced, wanted, prompt_len]
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.steps = 0
        self.stop = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="paced-engine").start()

    def submit(self, prompt_ids, params, stop_token_ids=None):
        from runtime.engine import RequestStream
        stream = RequestStream(next(self.ids))
        with self.lock:
            self.running[stream.id] = [stream, 0, params.max_new_tokens, len(prompt_ids)]
        return stream

    def cancel(self, request_id: int) -> None:
        from runtime.engine import Event
        with self.lock:
            r = self.running.pop(request_id, None)
        if r is not None:
            r[0]._push(Event(request_id, [], finish_reason="cancelled",
                             usage=dict(prompt_tokens=r[3], completion_tokens=r[1])))

    def _loop(self) -> None:
        from runtime.engine import Event
        n = len(self.token_ids)
        next_t = time.perf_counter()
        while not self.stop.is_set():
            next_t += self.step_s
            with self.lock:
                items = list(self.running.items())
                self.steps += 1
            for rid, r in items:
                stream, produced, wanted, prompt_len = r
                k = min(self.per_step, wanted - produced)
                toks = [self.token_ids[(produced + j) % n] for j in range(k)]
                r[1] = produced = produced + k
                if produced >= wanted:
                    with self.lock:
                        self.running.pop(rid, None)
                    stream._push(Event(rid, toks, finish_reason="length",
                                       usage=dict(prompt_tokens=prompt_len, completion_tokens=produced),
                                       timings=dict(ttft_s=0.0, total_s=0.0)))
                else:
                    stream._push(Event(rid, toks))
            delay = next_t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                next_t = time.perf_counter()            # behind: no burst of catch-up steps

    def stats(self) -> dict:
        with self.lock:
            running = len(self.running)
        return dict(healthy=True, failure=None, tp=1, running=running, waiting=0, slots_used=running,
                    pages_used=0, pages_total=1 << 20, requests=0, finished=0, cancelled=0, failed=0,
                    prompt_tokens=0, generated_tokens=0, steps=self.steps)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop.set()


def serve(sock: socket.socket, step_s: float, http: str, per_step: int = 1) -> None:
    """The server process: the app over the paced engine, on the given listening socket."""
    import uvicorn

    from ranks.demo import default_model_dir
    from runtime.tokenizer import Tokenizer, generation_defaults
    from server.app import create_app
    from server.service import Service

    d = default_model_dir()
    tok = Tokenizer.from_dir(d)
    engine = PacedEngine(tok.encode(TEXT), tok.vocab_size, step_s, per_step)
    service = Service(engine, tok, "bench", 1 << 20, generation_defaults(d))
    app = create_app(service, throughput_interval_s=3600.0)
    config = uvicorn.Config(app, loop="uvloop", http=http, lifespan="on", log_level="warning", access_log=False,
                            server_header=False)
    uvicorn.Server(config).run(sockets=[sock])


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


async def one_stream(port: int, tokens: int, nonce: int) -> dict:
    """One streaming chat completion over a bare HTTP/1.1 connection: token events and timing."""
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": f"{nonce} write on"}],
                       "max_tokens": tokens, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True},
                       "chat_template_kwargs": {"enable_thinking": False}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    t0 = time.perf_counter()
    first = last = None
    events = completion_tokens = 0
    status = (await reader.readline()).split()[1]
    buf = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        buf += data
        lines = buf.split(b"\n")
        buf = lines.pop()
        for line in lines:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                events += 1
                last = time.perf_counter()
                first = first or last
            elif line.startswith(b'data: {') and b'"choices":[]' in line:
                completion_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    writer.close()
    return dict(status=int(status), events=events, tokens=completion_tokens, ttft_s=(first or t0) - t0,
                stream_s=(last or t0) - (first or t0))


async def level(port: int, concurrency: int, tokens: int) -> list[dict]:
    return await asyncio.gather(*(one_stream(port, tokens, i) for i in range(concurrency)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the paced engine's step time")
    ap.add_argument("--round-tokens", type=int, default=1,
                    help="tokens an event carries (a speculation round's; 1: plain decode)")
    ap.add_argument("--http", choices=["h11", "httptools", "auto"], default="auto")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args()
    import uvloop

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=serve, args=(sock, args.step_ms / 1e3, args.http, args.round_tokens), daemon=True)
    proc.start()
    results = []
    try:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(level(port, 2, 8))                    # warm: imports, the first template render
        for c in args.concurrency:
            (u0, s0), t0 = cpu_seconds(proc.pid), time.perf_counter()
            streams = asyncio.run(level(port, c, args.tokens))
            (u1, s1), wall = cpu_seconds(proc.pid), time.perf_counter() - t0
            cpu, system = (u1 - u0) + (s1 - s0), s1 - s0
            bad = [s for s in streams if s["status"] != 200 or s["tokens"] != args.tokens]
            streamed = sum(s["tokens"] for s in streams)
            chunks = sum(s["events"] for s in streams)
            offered = c * args.round_tokens * 1e3 / args.step_ms
            rate = [(s["tokens"] - args.round_tokens) / s["stream_s"] for s in streams if s["stream_s"] > 0]
            results.append(dict(
                concurrency=c, streams=len(streams), failed=len(bad), tokens=streamed, chunks=chunks,
                wall_s=round(wall, 3),
                server_cpu_s=round(cpu, 3), us_per_token=round(cpu / streamed * 1e6, 1),
                system_share=round(system / cpu, 3) if cpu > 0 else None,
                core_use=round(cpu / wall, 3), offered_tok_s=round(offered, 1),
                delivered_tok_s=round(streamed / wall, 1),
                delivered_over_offered=round(streamed / wall / offered, 3),
                one_core_ceiling_tok_s=round(streamed / cpu) if cpu > 0 else None,
                per_stream_tok_s_p50=round(statistics.median(rate), 1) if rate else None,
                ttft_ms_p50=round(statistics.median(s["ttft_s"] for s in streams) * 1e3, 1)))
    finally:
        proc.terminate()
        proc.join(10)
    import uvicorn
    info = dict(date=time.strftime("%Y-%m-%d"), host=platform.node(), cpu=platform.processor() or platform.machine(),
                cores=os.cpu_count(), python=platform.python_version(), uvicorn=uvicorn.__version__,
                http=args.http, tokens=args.tokens, step_ms=args.step_ms, commit=os.environ.get("TANDEM_COMMIT"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(config=info, levels=results), f, indent=1)
    print(f"frontend, {args.http} http, {args.tokens} tokens a stream, {args.round_tokens} token(s) an event every "
          f"{args.step_ms:g} ms a stream")
    print(f"{'C':>5} {'us/token':>9} {'(system)':>9} {'core use':>9} {'delivered/offered':>18} {'1-core ceiling tok/s':>21} "
          f"{'per-stream p50':>15} {'failed':>7}")
    for r in results:
        print(f"{r['concurrency']:>5} {r['us_per_token']:>9} {r['system_share']:>9} {r['core_use']:>9} {r['delivered_over_offered']:>18} "
              f"{r['one_core_ceiling_tok_s']:>21} {r['per_stream_tok_s_p50']:>15} {r['failed']:>7}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
