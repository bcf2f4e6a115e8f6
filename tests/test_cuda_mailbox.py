"""transport.mailbox_cuda: the GPU mailbox between real processes (one per GPU, multiprocessing 'spawn').

* Exactness: all_reduce of random bf16 / float32 partials of 1 .. 524288 elements (beyond one slot, so
  exchanges split into pieces; an even and an odd slot size, i.e. the 16-byte and the 8-byte word paths)
  is bit-identical on every rank and equals the float32 rank-order sum cast once, computed here on the
  CPU; guard elements around the tensor stay poisoned; all_gather into a poisoned buffer is exact.
* Graph replay: a captured graph of 64 exchanges (all-reduces and all-gathers) replayed 2,000 times
  (10^5 in the slow variant) checks every result on the device (a mismatch counter read once) and the
  device epoch advances by exactly one per exchange.
* Wrap: exchanges across the 32-bit epoch wrap stay exact.
* Hang: a rank killed mid-exchange makes the other's kernel return within its bound with the hang word
  set to 1 + its rank, and the Python side raises MailboxHang.
* Kernel variants (transport/mailbox_cuda.py Variant): every GPU test runs for the default kernel (lean16),
  the classic one and the lean kernels (lean16, lean8; small grids and blocks so that threads own many units and several
  rounds; a first-poll delay); the graph test also switches variants between the exchanges of one graph.
* CPU-only: epoch arithmetic, piece planning, argument checks, variant parsing and the launch arguments
  against the kernels' parameter lists run without a GPU (no `gpu` mark; the GPU tests carry it one by
  one, so this file's CPU tests run everywhere).

The rank functions below run in spawned children, which import this module: keep its top light.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import time
import traceback

import numpy as np
import pytest

from transport.mailbox import _HANG_OFFSET, MailboxHang
from transport.mailbox_cuda import (BLOCKS_PER_SM, PERIOD, THREADS, CudaMailbox, Variant, check_start_epoch,
                                    launch_shape, make_variant, next_epoch, parse_variant, piece_elements,
                                    pieces, variant_from_env)

gpu = pytest.mark.gpu
SIZES = [1, 7, 8, 1000, 5120, 20480, 65536, 524288]
JOIN_S = 300
# Kernel variants under test (None: the default). b/t make threads own many units (several rounds per
# thread, one warp per block); d adds the lean kernel's first-poll delay.
EXACT_VARIANTS = [None, "classic", "lean8", "lean8b2t64", "lean16b1t32d300"]       # None: lean16
GRAPH_VARIANTS = [None, "classic", "lean8", "lean8d400", "mix"]
MIX = ["classic", "lean16", "lean8t128", "lean8d200", "f0"]   # "mix": one of these per exchange, in turn
OTHER_VARIANTS = [None, "classic", "lean8"]


def _vid(v) -> str:
    return "default" if v is None else v


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def needs_gpus(n: int):
    return pytest.mark.skipif(_gpus() < n, reason=f"needs {n} GPUs")


# --------------------------------------------------------------------------------------------------
# Inputs, shared by the children (who reduce them) and the parent (who checks the sums)


def _input(seed: int, rank: int, i: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, i])
    scale = 10.0 ** rng.integers(-3, 4, size=n)             # mixed magnitudes: summation order matters
    return (rng.standard_normal(n) * scale).astype(np.float32)


def _as(x: np.ndarray, dtype: str):
    import torch
    return torch.from_numpy(x.copy()).to(getattr(torch, dtype))


def _want(seed: int, tp: int, i: int, n: int, dtype: str) -> np.ndarray:
    """float32 sum in rank order of the (dtype-rounded) partials, cast once to dtype; as raw bytes."""
    import torch
    xs = [_as(_input(seed, r, i, n), dtype).float() for r in range(tp)]
    total = xs[0].clone()
    for r in range(1, tp):
        total += xs[r]
    return total.to(getattr(torch, dtype)).view(torch.uint8).numpy()


# --------------------------------------------------------------------------------------------------
# Children


def _child(fn, q, rank, *args) -> None:
    try:
        q.put((rank, "ok", fn(rank, *args)))
    except BaseException as e:                              # report, never hang the parent
        q.put((rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))


def _run(fn, args_per_rank: list[tuple], timeout: float = JOIN_S) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, q, r, *a), daemon=True) for r, a in enumerate(args_per_rank)]
    for p in procs:
        p.start()
    out = {}
    try:
        deadline = time.monotonic() + timeout
        for _ in procs:
            rank, status, value = q.get(timeout=max(1.0, deadline - time.monotonic()))
            assert status == "ok", f"rank {rank} raised {status}: {value}"
            out[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
    return out


def _rank_exactness(rank: int, name: str, seed: int, out_dir: str, dtypes: list[str], variant: str | None) -> dict:
    import torch
    torch.cuda.set_device(rank)
    mb = CudaMailbox(name, rank, device=rank, timeout_s=30.0, variant=variant)
    try:
        tp, guard = mb.tp, 8
        exchanges = 0
        for i, n in enumerate(SIZES):
            for dtype in dtypes:
                x = _as(_input(seed, rank, i, n), dtype).cuda()
                buf = torch.full((n + 2 * guard + 1,), float("nan"), dtype=x.dtype, device=x.device)
                off = guard + i % 2                     # every other size misaligned (2 or 4 bytes): scalar paths
                y = buf[off:off + n]
                y.copy_(x)
                assert mb.all_reduce(y) is y
                mb.synchronize()
                exchanges += len(pieces(n, mb.words, packed=dtype == "bfloat16"))
                assert bool(torch.isnan(buf[:off]).all()) and bool(torch.isnan(buf[off + n:]).all()), \
                    f"n={n} {dtype}: a guard element was overwritten"
                np.save(os.path.join(out_dir, f"r{rank}_{i}_{dtype}.npy"), y.cpu().view(torch.uint8).numpy())
            # all_gather into a poisoned buffer: exact rows, own row included
            x = _as(_input(seed, rank, i, n), "bfloat16").cuda()
            out = torch.full((tp, n), float("nan"), dtype=torch.float32, device=x.device)
            mb.all_gather(x, out=out)
            mb.synchronize()
            exchanges += len(pieces(n, mb.words, packed=True))
            want = torch.stack([_as(_input(seed, r, i, n), "bfloat16").float() for r in range(tp)])
            assert torch.equal(out.cpu(), want), f"all_gather n={n}: wrong rows"
        assert mb.epoch() == exchanges, (mb.epoch(), exchanges)
        return dict(epoch=mb.epoch())
    finally:
        mb.close()


_GRAPH_N = 5120                # elements per exchange in the graph test (a 10 KiB bf16 partial)
_GRAPH_K = 64                  # exchanges per graph
_GRAPH_V = 4                   # distinct inputs, cycled


def _rank_graph(rank: int, name: str, seed: int, replays: int, variant: str | None) -> dict:
    import torch
    torch.cuda.set_device(rank)
    mix = [make_variant(v) for v in MIX] if variant == "mix" else None
    mb = CudaMailbox(name, rank, device=rank, timeout_s=30.0, variant=None if mix else variant)
    try:
        tp, n, dev = mb.tp, _GRAPH_N, f"cuda:{rank}"
        xs = torch.stack([_as(_input(seed, rank, v, n), "bfloat16") for v in range(_GRAPH_V)]).to(dev)
        want = torch.stack([torch.from_numpy(_want(seed, tp, v, n, "bfloat16").copy()).view(torch.bfloat16)
                            for v in range(_GRAPH_V)]).to(dev)
        rows = torch.stack([torch.stack([_as(_input(seed, r, v, n), "bfloat16").float() for r in range(tp)])
                            for v in range(_GRAPH_V)]).to(dev)
        y = torch.empty(n, dtype=torch.bfloat16, device=dev)
        gathered = torch.empty((tp, n), dtype=torch.float32, device=dev)
        bad = torch.zeros((), dtype=torch.int64, device=dev)

        def body():
            for k in range(_GRAPH_K):
                v = k % _GRAPH_V
                if mix:                                        # the launch records the variant's kernel
                    mb.variant = mix[k % len(mix)]
                if k % 16 == 15:
                    mb.all_gather(xs[v], out=gathered)
                    bad.add_((gathered.view(torch.int32) != rows[v].view(torch.int32)).sum())
                else:
                    y.copy_(xs[v])
                    mb.all_reduce(y)
                    bad.add_((y.view(torch.int16) != want[v].view(torch.int16)).sum())

        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                             # warm up (compile, allocator) outside the capture
            body()
        torch.cuda.current_stream().wait_stream(s)
        mb.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        t0 = time.monotonic()
        for _ in range(replays):
            g.replay()
        mb.synchronize()
        elapsed = time.monotonic() - t0
        return dict(bad=int(bad.item()), epoch=mb.epoch(), exchanges=_GRAPH_K * (replays + 1),
                    us_per_exchange=elapsed * 1e6 / max(1, replays * _GRAPH_K))
    finally:
        mb.close()


def _rank_wrap(rank: int, name: str, seed: int, start: int, variant: str | None) -> dict:
    import torch
    torch.cuda.set_device(rank)
    mb = CudaMailbox(name, rank, device=rank, timeout_s=30.0, epoch=start, variant=variant)
    try:
        results, epochs = [], []
        for i in range(12):
            n = [5, 97, 1000, 3][i % 4]
            y = _as(_input(seed, rank, i, n), "float32").cuda()
            mb.all_reduce(y)
            mb.synchronize()
            results.append(y.cpu().view(torch.uint8).numpy().tobytes())
            epochs.append(mb.epoch())
        return dict(results=results, epochs=epochs)
    finally:
        mb.close()


def _rank_killed(rank: int, name: str, go, timeout_s: float, variant: str | None) -> dict:
    import torch
    torch.cuda.set_device(rank)
    mb = CudaMailbox(name, rank, device=rank, timeout_s=timeout_s, variant=variant)
    x = torch.ones(4096, dtype=torch.bfloat16, device=f"cuda:{rank}")
    done, last_ok = 0, time.monotonic()
    try:
        while True:
            mb.all_reduce(x.fill_(1.0))
            if rank == 1:
                if done == 100:
                    go.set()                                   # the parent kills this rank from now on
                done += 1
                continue                                       # keep launching exchanges until killed
            mb.synchronize()
            done += 1
            last_ok = time.monotonic()
            if done > 10**7:
                raise RuntimeError("rank 1 was never killed")
    except MailboxHang as e:
        return dict(hang=str(e), waited=time.monotonic() - last_ok, done=done, word=mb.hang())
    finally:
        if rank == 0:
            mb.close()


# --------------------------------------------------------------------------------------------------
# Fixtures


# --------------------------------------------------------------------------------------------------
# CPU-only


def test_epochs_wrap_with_an_even_period():
    assert next_epoch(0) == 1 and next_epoch(1) == 2 and next_epoch(PERIOD - 1) == PERIOD
    assert next_epoch(PERIOD) == 1
    e, seen = PERIOD - 5, []
    for _ in range(10):
        e = next_epoch(e)
        seen.append(e)
    assert 0 not in seen and all(a % 2 != b % 2 for a, b in zip(seen, seen[1:])), seen


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("words", [1, 2, 3, 97, 98, 4099, 131072])
def test_pieces_cover_the_payload(words, packed):
    step = piece_elements(words) * (2 if packed else 1)         # bf16 payloads: two elements per word
    assert 1 <= step <= words * (2 if packed else 1) and (words == 1 or step % 2 == 0)
    assert pieces(0, words, packed) == []
    for n in (1, 2, step - 1, step, step + 1, 3 * step + 1, 524288):
        if n < 1:
            continue
        ps = pieces(n, words, packed)
        assert ps[0][0] == 0 and sum(k for _, k in ps) == n
        assert all(a + k == b for (a, k), (b, _) in zip(ps, ps[1:]))
        assert all(1 <= k <= step for _, k in ps) and all(a % step == 0 for a, _ in ps)
    with pytest.raises(ValueError):
        piece_elements(0)


def test_start_epoch_must_not_be_older_than_the_segment(segment):
    shm = segment(2, 16)
    slots = np.ndarray((2, 2, 16), dtype=np.uint64, buffer=shm.buf, offset=64)
    check_start_epoch(slots, 0)
    slots[0, 1, :3] = (np.uint64(5) << np.uint64(32)) | np.uint64(7)
    for ok in (4, 5, 6, 1000, PERIOD - 1):               # a peer may be one exchange ahead
        check_start_epoch(slots, ok)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="epoch 5"):
            check_start_epoch(slots, bad)
    for bad in (-1, PERIOD + 1):
        with pytest.raises(ValueError, match="outside"):
            check_start_epoch(slots, bad)
    del slots


def test_arguments_are_checked_before_the_gpu_is_touched(segment):
    shm = segment(2, 16)
    with pytest.raises(ValueError, match="rank 2"):
        CudaMailbox(shm.name, 2)
    with pytest.raises(ValueError, match="timeout"):
        CudaMailbox(shm.name, 0, timeout_s=0)
    struct.pack_into("<Q", shm.buf, 64, (9 << 32) | 1)       # rank 0, slot 0, word 0 from epoch 9
    with pytest.raises(ValueError, match="epoch 9"):
        CudaMailbox(shm.name, 0, epoch=0)
    big = segment(9, 4)
    with pytest.raises(ValueError, match="up to 8 ranks"):
        CudaMailbox(big.name, 0)


def test_variants_parse_validate_and_name_their_kernels():
    assert Variant().kernel == "mailbox_lean_w2" and str(Variant()) == "lean16"          # the default
    assert make_variant("classic").kernel == "mailbox_exchange_f2" and str(make_variant("classic")) == "classic"
    assert make_variant("lean16").kernel == "mailbox_lean_w2" and make_variant("lean16").words_per_thread == 2
    assert make_variant("lean8").kernel == "mailbox_lean_w1" and make_variant("lean8").words_per_thread == 1
    assert make_variant("f3").kernel == "mailbox_exchange_f3" and make_variant("f3b16").blocks == 16
    v = make_variant("lean8t128d300")
    assert (v.flags, v.blocks, v.threads, v.delay_ns) == (12, 0, 128, 300) and str(v) == "lean8t128d300"
    assert make_variant(str(v)) == v
    # a name resets every field, bare fields keep the base's
    assert make_variant("lean16", v) == Variant(flags=4)
    assert make_variant("b8", v) == Variant(flags=12, blocks=8, threads=128, delay_ns=300)
    assert parse_variant("f12d5") == {"flags": 12, "delay_ns": 5}
    assert make_variant("f0", v) == Variant(flags=0, threads=128)          # the inherited delay is lean-only
    with pytest.raises(ValueError):
        make_variant("f0d300", v)
    for bad in ("", "x", "lean", "lean8x", "f2lean8", "f16", "f8", "t48", "t512", "t0", "lean8d100001", "classicd300"):
        with pytest.raises(ValueError):
            make_variant(bad) if bad else parse_variant(bad)
    assert variant_from_env({}) == Variant()
    assert variant_from_env({"TANDEM_MAILBOX_FLAGS": "3"}) == Variant(flags=3)
    assert variant_from_env({"TANDEM_MAILBOX_FLAGS": "3", "TANDEM_MAILBOX_VARIANT": "lean8d300"}) == \
        Variant(flags=12, delay_ns=300)


@pytest.mark.parametrize("variant", ["classic", "lean16", "lean8", "lean8t64", "lean16b3t32"])
def test_launch_shape_covers_the_payload_with_resident_blocks(variant):
    v, sms = make_variant(variant), 132
    for words in (1, 2, 3, 255, 256, 257, 2560, 10240, 131072, 10**7):
        blocks, threads = launch_shape(v, words, sms)
        units = -(-words // v.words_per_thread)
        cap = v.blocks or BLOCKS_PER_SM * THREADS * sms // threads   # the classic kernel's thread budget
        assert threads == v.threads and 1 <= blocks <= cap
        assert blocks * threads >= units or blocks == cap             # one unit per thread, grid-strided past the cap
        assert (blocks - 1) * threads < units                         # no block without a unit
        if not v.blocks:
            assert blocks * threads <= BLOCKS_PER_SM * THREADS * sms


def _kernel_params(src: str, macro: str, fn: str) -> list[str]:
    """Parameter types of a kernel defined by `#define <macro>(X) extern "C" ... <fn>##X(<params>) {`."""
    import re
    body = src[src.index(f"#define {macro}"):]
    m = re.search(re.escape(fn) + r"##\w+\((.*?)\)\s*\{", body, re.S)
    assert m, f"no {fn} in {macro}"
    params = [" ".join(p.replace("\\", " ").split()) for p in m.group(1).split(",")]
    return [p.rsplit(" ", 1)[0] for p in params]


@pytest.mark.parametrize("variant", ["classic", "f1", "lean16", "lean8d250"])
def test_launch_arguments_match_the_kernel_parameters(variant, segment):
    """What _exchange passes (count and width of every argument) is what the kernel takes, and the kernel
    exists: a mismatch would hand the kernel garbage timeouts or delays on its first GPU run."""
    import torch
    from kernels.launch import CUDA_DIR, is_pdl_kernel
    src = (CUDA_DIR / "exchange.cu").read_text()
    v = make_variant(variant)
    macro, fn = ("MB_LEAN_KERNEL", "mailbox_lean_w") if v.lean else ("MB_KERNEL", "mailbox_exchange_f")
    suffix = v.kernel[len(fn):]
    assert f"{macro}({suffix})" in src, f"{v.kernel} is not instantiated in exchange.cu"
    params = _kernel_params(src, macro, fn)
    calls = []
    mb = object.__new__(CudaMailbox)                      # no GPU: only what _exchange reads
    mb.rank, mb.tp, mb.words, mb.sms, mb.device, mb.clock_khz = 0, 2, 4096, 132, 0, 2_000_000
    mb._ptr, mb._timeout_ns, mb._variant = 1 << 40, np.uint64(30 * 10**9), v
    mb.state = torch.zeros(2, dtype=torch.int32)
    mb._kernel = lambda source, name, device: (source, name)
    mb._launch = lambda fn, grid, block, args, device, pdl: calls.append((fn, grid, block, args, pdl))
    x = torch.zeros(5120, dtype=torch.bfloat16)
    mb._exchange(x, 0, 5120, x, 0, gather=False, out_stride=0)
    (fn_got, grid, block, args, pdl), = calls
    assert fn_got == ("exchange", v.kernel)
    assert pdl and is_pdl_kernel(v.kernel)                # a registered dependent kernel (kernels/launch.py)
    assert (grid[0], block[0]) == launch_shape(v, 2560, 132)
    width = {"const void*": 8, "void*": 8, "u64_t*": 8, "unsigned*": 8, "int": 4, "long long": 8, "u64_t": 8}
    assert len(args) == len(params), (params, args)
    for p, a in zip(params, args):
        size = 8 if isinstance(a, torch.Tensor) else np.asarray(a).dtype.itemsize
        assert width[p] == size, f"{v.kernel}: parameter {p} gets {type(a).__name__}"
        if not isinstance(a, torch.Tensor) and p in ("int", "long long", "u64_t"):
            assert np.asarray(a).dtype.kind in "iu"
    if v.lean:
        assert int(args[-1]) == v.delay_ns * 2                # ns -> cycles at 2 GHz


# --------------------------------------------------------------------------------------------------
# GPU


@gpu
@pytest.mark.parametrize("variant", EXACT_VARIANTS, ids=_vid)
@pytest.mark.parametrize("words", [131072, 4099])              # even: 16-byte word pairs; odd: 8-byte words
@pytest.mark.parametrize("tp", [2, 3])
def test_all_reduce_is_exact_and_identical_on_every_rank(tp, words, variant, segment, seed, tmp_path):
    if _gpus() < tp:
        pytest.skip(f"needs {tp} GPUs")
    import torch
    dtypes = ["bfloat16", "float32"]
    shm = segment(tp, words)
    out = _run(_rank_exactness, [(shm.name, seed, str(tmp_path), dtypes, variant)] * tp)
    assert len({o["epoch"] for o in out.values()}) == 1
    for i, n in enumerate(SIZES):
        for dtype in dtypes:
            want = _want(seed, tp, i, n, dtype)
            for r in range(tp):
                have = np.load(tmp_path / f"r{r}_{i}_{dtype}.npy")
                if have.tobytes() != want.tobytes():
                    h = torch.from_numpy(have).view(getattr(torch, dtype)).float()
                    w = torch.from_numpy(want).view(getattr(torch, dtype)).float()
                    bad = int((h != w).sum())
                    pytest.fail(f"rank {r}, n={n}, {dtype}: {bad} elements differ from the float32 rank-order "
                                f"sum (first at {int((h != w).nonzero()[0])})")


def _graph_test(segment, seed, replays, variant):
    shm = segment(2, 8192)
    out = _run(_rank_graph, [(shm.name, seed, replays, variant)] * 2)
    for r in range(2):
        assert out[r]["bad"] == 0, f"rank {r}: {out[r]['bad']} mismatching elements over {replays} replays"
        assert out[r]["epoch"] == out[r]["exchanges"], f"rank {r}: epoch {out[r]['epoch']}, {out[r]}"
    print(f"graph replay ({_vid(variant)}): {out[0]['us_per_exchange']:.2f} us per exchange "
          f"(host-measured, with checks)")


@gpu
@needs_gpus(2)
@pytest.mark.parametrize("variant", GRAPH_VARIANTS, ids=_vid)
def test_captured_graph_replays_stay_exact(variant, segment, seed):
    _graph_test(segment, seed, 2000, variant)


@gpu
@pytest.mark.slow
@needs_gpus(2)
@pytest.mark.parametrize("variant", OTHER_VARIANTS, ids=_vid)
def test_captured_graph_replays_stay_exact_1e5(variant, segment, seed):
    _graph_test(segment, seed, 100_000, variant)


@gpu
@needs_gpus(2)
@pytest.mark.parametrize("variant", OTHER_VARIANTS, ids=_vid)
def test_exchanges_across_the_epoch_wrap(variant, segment, seed):
    import torch
    shm = segment(2, 1000)
    start = PERIOD - 5
    out = _run(_rank_wrap, [(shm.name, seed, start, variant)] * 2)
    assert out[0]["epochs"] == out[1]["epochs"]
    e, expect = start, []
    for _ in range(12):
        e = next_epoch(e)
        expect.append(e)
    assert out[0]["epochs"] == expect
    for i in range(12):
        n = [5, 97, 1000, 3][i % 4]
        want = _want(seed, 2, i, n, "float32").tobytes()
        for r in range(2):
            assert out[r]["results"][i] == want, f"rank {r}, exchange {i} (epoch {expect[i]}) is wrong"
    slots = np.ndarray((2, 2, 1000), dtype=np.uint64, buffer=shm.buf, offset=64)
    for r in range(2):                         # epochs 1 and 2 cleared every word past their payload
        for slot in (0, 1):
            assert not ((slots[r, slot] >> np.uint64(32)) > 12).any(), f"rank {r} slot {slot}: stale words"
    del slots, torch


@gpu
@needs_gpus(2)
@pytest.mark.parametrize("variant", OTHER_VARIANTS, ids=_vid)
def test_a_killed_rank_sets_the_hang_word_and_the_other_raises(variant, segment):
    shm = segment(2, 4096)
    timeout = 2.0
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_child, args=(_rank_killed, q, r, shm.name, go, timeout if r == 0 else 600.0,
                                              variant), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert go.wait(JOIN_S), "rank 1 never reached its 100th exchange"
        os.kill(procs[1].pid, signal.SIGKILL)               # mid-exchange: rank 1 keeps launching until killed
        killed = time.monotonic()
        rank, status, r0 = q.get(timeout=timeout + 60)
        assert (rank, status) == (0, "ok"), r0
        assert r0["hang"] and "rank 0 reported a mailbox hang" in r0["hang"], r0
        assert r0["word"] == 1, r0
        assert r0["waited"] <= timeout + 30 and time.monotonic() - killed <= timeout + 60, r0
        assert struct.unpack_from("<Q", shm.buf, _HANG_OFFSET)[0] == 1, "hang word must name the reporter"
    finally:
        go.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
