"""The mailbox, GPU flavor: the segment of transport/mailbox.py registered as mapped pinned host memory,
exchanged by a kernel (kernels/cuda/exchange.cu) that writes its words and polls its peers' words.

Same layout, same word format for float32 payloads (float32 bits low, epoch high; bf16 payloads are
packed two elements to a word, which halves the PCIe traffic), same alternating slots, same sticky hang
word, same float32 rank-order sums; what differs is who keeps the epoch. Here it lives in device memory
(`state`, u32 [64]: last epoch used, and block / warp counters) and the kernel advances it, so a captured
CUDA graph replays with fresh epochs and no host involvement. The host never knows the current epoch
without a sync (`epoch()` reads it). All ranks must start from the same epoch: `epoch=` names the last
epoch used on the segment (0 for a fresh one; a CPU Mailbox's `.epoch` when handing a segment over), and
no exchange may be in flight on the segment while a rank attaches. Do not interleave CPU and GPU flavors
on one segment without handing the epoch over.

    mb = CudaMailbox(name, rank, device=0, timeout_s=60.0)
    mb.all_reduce(x)          # in place, x bf16 or float32 CUDA [..]; capturable
    mb.all_gather(x)          # [tp, *x.shape] float32
    mb.synchronize()          # stream sync, then MailboxHang if any rank reported a hang

Payloads larger than a slot go in pieces of `piece_elements(words)` elements (twice that for bf16; one
epoch each).

Kernel variants (`Variant`; all speak the same words and epochs and keep the same device state, so any
variant may follow any other on one mailbox, but both ranks should use the same one): the classic kernel
mailbox_exchange_f<flags & 3> (flags 2) and the lean kernel mailbox_lean_w1 / _w2 (flag 4; flag 8 for one
8-byte word per thread instead of a 16-byte pair; kernels/cuda/exchange.cu says what it does
differently). The default is lean16 (flags 4): faster than classic at every payload from 4 bytes to
128 KiB on two H200s, by 0.4-0.9 us (docs/perf.md, eighth session); lean8 stalls for 0.3-1 ms per
exchange from 40 KiB on and stays opt-in. A variant is written as in scripts/bench/allreduce.py --mailbox-variants: an optional
name (classic = f2, lean16 = f4, lean8 = f12) followed by optional fields f<flags> b<grid cap in blocks>
t<threads per block> d<first-poll delay in ns, lean only>, e.g. `lean8`, `lean8t128d300`, `f2b16`.
TANDEM_MAILBOX_VARIANT selects one for every CudaMailbox of a process (TANDEM_MAILBOX_FLAGS=<int> still
sets the flags alone); `CudaMailbox(..., variant=...)` and `mb.variant = ...` override it.

Under TANDEM_PDL=all every exchange is a programmatic dependent launch on sm_90+ (kernels/launch.py): it
may be scheduled while the kernel that produced its input is finishing and waits for it at entry, and
the norm and GEMV after it launch (the GEMV's weight loads start) while it waits for its peers; the
measured gain is in docs/perf.md (seventh session).
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import torch

from transport.mailbox import HEADER_BYTES, Mailbox, MailboxHang, segment_bytes

PERIOD = 0xFFFF_FFFE                 # epochs run 1 .. PERIOD, then wrap to 1 (as in the CPU flavor)
THREADS = 256                        # kernel block size (MB_THREADS in exchange.cu)
MAX_TP = 8                           # MB_MAX_TP in exchange.cu
STATE_WORDS = 64                     # MB_STATE_WORDS: device u32 state ([0] last epoch, [1] and [32] counters)
BLOCKS_PER_SM = 2                    # grid cap: every block resident (launch bounds of the lean kernel: 2 per SM)
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 0x01, 0x02
PROBE_BYTES = 4096
# Kernel tuning flags (MB_FLAG_* in exchange.cu): 1 system fence after publishing, 2 only lane 0 of a warp
# polls the hang word (the other lanes rely on their own timeout). 2 was as fast as 0 or faster at every
# payload on two H200s, and keeps thousands of waiting threads off one host word; the fence was slower
# (docs/perf.md). TANDEM_MAILBOX_FLAGS / TANDEM_MAILBOX_VARIANT override (benchmarks).
FLAGS = 2                            # the classic kernel's flags
FLAG_FENCE, FLAG_HANG_LANE0 = 1, 2   # classic kernel only (the lean one never fences; its lane 0 polls the hang word)
FLAG_LEAN = 4                        # the lean kernel (mailbox_lean_w2: 16-byte word pairs per thread)
FLAG_LEAN_W1 = 8                     # with FLAG_LEAN: one 8-byte word per thread (mailbox_lean_w1)
ALL_FLAGS = FLAG_FENCE | FLAG_HANG_LANE0 | FLAG_LEAN | FLAG_LEAN_W1
VARIANT_NAMES = {"classic": FLAGS, "lean16": FLAG_LEAN, "lean8": FLAG_LEAN | FLAG_LEAN_W1}
DEFAULT_FLAGS = FLAG_LEAN            # lean16 (module docstring)
MAX_DELAY_NS = 100_000
_DEFAULT_CLOCK_KHZ = 1_980_000       # H200 boost clock: first-poll delay ns -> cycles if the device does not say
_CUDA_DEV_ATTR_CLOCK_RATE = 13       # cudaDevAttrClockRate (kHz)
_VARIANT_RE = re.compile(r"(?P<name>classic|lean16|lean8)?(?:f(?P<f>\d+))?(?:b(?P<b>\d+))?(?:t(?P<t>\d+))?"
                         r"(?:d(?P<d>\d+))?")


@dataclasses.dataclass(frozen=True)
class Variant:
    """Which exchange kernel runs and how it is launched (see the module docstring)."""
    flags: int = DEFAULT_FLAGS
    blocks: int = 0                  # grid cap; 0: BLOCKS_PER_SM x SMs blocks of THREADS (in threads)
    threads: int = THREADS           # threads per block: a multiple of 32, at most THREADS
    delay_ns: int = 0                # lean kernel: spin this long after publishing before the first poll

    def __post_init__(self):
        if not 0 <= self.flags <= ALL_FLAGS:
            raise ValueError(f"mailbox flags {self.flags}: expected 0 .. {ALL_FLAGS}")
        if self.blocks < 0:
            raise ValueError(f"mailbox grid cap {self.blocks}: expected >= 0 (0: automatic)")
        if not (32 <= self.threads <= THREADS and self.threads % 32 == 0):
            raise ValueError(f"mailbox threads per block {self.threads}: expected a multiple of 32 in 32 .. "
                             f"{THREADS}")
        if not 0 <= self.delay_ns <= MAX_DELAY_NS:
            raise ValueError(f"mailbox first-poll delay {self.delay_ns} ns: expected 0 .. {MAX_DELAY_NS}")
        if self.flags & FLAG_LEAN_W1 and not self.lean:
            raise ValueError(f"mailbox flags {self.flags}: flag 8 (one word per thread) needs flag 4 (the lean "
                             f"kernel)")
        if self.delay_ns and not self.lean:
            raise ValueError("a first-poll delay (d<ns>) needs the lean kernel (flag 4: lean8, lean16)")

    @property
    def lean(self) -> bool:
        return bool(self.flags & FLAG_LEAN)

    @property
    def words_per_thread(self) -> int:
        """Words a thread owns per unit: 1 for mailbox_lean_w1, else 2 (a 16-byte pair)."""
        return 1 if self.lean and self.flags & FLAG_LEAN_W1 else 2

    @property
    def kernel(self) -> str:
        if self.lean:
            return f"mailbox_lean_w{self.words_per_thread}"
        return f"mailbox_exchange_f{self.flags & (FLAG_FENCE | FLAG_HANG_LANE0)}"

    def __str__(self) -> str:
        name = {v: k for k, v in VARIANT_NAMES.items()}.get(self.flags)
        out = name if name is not None else f"f{self.flags}"
        if self.blocks:
            out += f"b{self.blocks}"
        if self.threads != THREADS:
            out += f"t{self.threads}"
        if self.delay_ns:
            out += f"d{self.delay_ns}"
        return out


def parse_variant(text: str) -> dict:
    """The fields a variant string sets, e.g. 'f12t128d300' -> {flags: 12, threads: 128, delay_ns: 300}; a
    name sets every field (its flags, the other fields' defaults) before the fields after it, so
    'lean8t128' -> {flags: 12, blocks: 0, threads: 128, delay_ns: 0}. Apply them with
    `dataclasses.replace(base, **fields)` (fields not set keep the base's value). ValueError for a
    malformed string."""
    m = _VARIANT_RE.fullmatch(text.strip()) if text and text.strip() else None
    if m is None:
        raise ValueError(f"mailbox variant {text!r}: expected [classic|lean16|lean8][f<flags>][b<blocks>]"
                         f"[t<threads>][d<delay ns>], e.g. lean8, lean8t128d300, f2b16")
    fields: dict = {}
    if m.group("name") is not None:
        fields = dataclasses.asdict(Variant(flags=VARIANT_NAMES[m.group("name")]))
    for key, group in (("flags", "f"), ("blocks", "b"), ("threads", "t"), ("delay_ns", "d")):
        if m.group(group) is not None:
            fields[key] = int(m.group(group))
    return fields


def make_variant(text: str | None = None, base: Variant | None = None) -> Variant:
    """`base` (default: Variant()) with the fields of `text` applied; validated. A delay inherited from the
    base is dropped when the flags select the classic kernel (it has none); a delay given is kept (error)."""
    base = Variant() if base is None else base
    if not text:
        return base
    fields = parse_variant(text)
    if "delay_ns" not in fields and not fields.get("flags", base.flags) & FLAG_LEAN:
        fields["delay_ns"] = 0
    return dataclasses.replace(base, **fields)


def variant_from_env(environ=None) -> Variant:
    """TANDEM_MAILBOX_FLAGS (an int: the flags alone), then TANDEM_MAILBOX_VARIANT (a variant string)."""
    environ = os.environ if environ is None else environ
    base = Variant()
    flags = environ.get("TANDEM_MAILBOX_FLAGS")
    if flags:
        base = dataclasses.replace(base, flags=int(flags))
    return make_variant(environ.get("TANDEM_MAILBOX_VARIANT") or None, base)


def launch_shape(v: Variant, words: int, sms: int) -> tuple[int, int]:
    """(blocks, threads) of one exchange of `words` payload words: one unit (words_per_thread words) per
    thread, the grid capped so that every block stays resident (BLOCKS_PER_SM blocks of THREADS per SM,
    counted in threads) unless the variant names its own cap."""
    units = -(-words // v.words_per_thread)
    cap = v.blocks or max(1, BLOCKS_PER_SM * sms * THREADS // v.threads)
    return max(1, min(-(-units // v.threads), cap)), v.threads


def next_epoch(e: int) -> int:
    """The epoch of the exchange after one at epoch e (0: none yet)."""
    return e % PERIOD + 1


def piece_elements(words: int) -> int:
    """Elements per exchange for a slot of `words` words: one word per element, kept even when more than
    one fits so that every piece but the last starts 4-byte aligned."""
    if words < 1:
        raise ValueError(f"a slot needs at least one word, got {words}")
    return words if words == 1 else words & ~1


def pieces(n: int, words: int, packed: bool = False) -> list[tuple[int, int]]:
    """(start, count) of each exchange that carries n elements (none for n == 0); packed: bf16
    elements, two to a word."""
    step = piece_elements(words) * (2 if packed else 1)
    return [(at, min(step, n - at)) for at in range(0, n, step)]


def check_start_epoch(slots: np.ndarray, epoch: int) -> None:
    """Refuse a start epoch older than what the segment's words carry: such words would pass for current
    in a later exchange. A peer may already be one exchange ahead (it wrote epoch + 1), not more."""
    if not 0 <= epoch <= PERIOD:
        raise ValueError(f"epoch {epoch} outside 0 .. {PERIOD}")
    if epoch == 1 or epoch >= PERIOD - 2:
        return                                   # at the wrap: words of the last pass remain (the kernel clears them)
    newest = int((slots >> np.uint64(32)).max()) if slots.size else 0
    if newest > epoch + 1:
        raise ValueError(f"the segment holds words of epoch {newest}, after start epoch {epoch}: pass the "
                         f"last epoch used on it (a CPU Mailbox's .epoch)")


class CudaMailbox:
    """One rank's GPU view of the segment."""

    def __init__(self, name: str, rank: int, device: int | None = None, timeout_s: float = 60.0, epoch: int = 0,
                 variant: Variant | str | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._mb = Mailbox(name, rank, timeout_s)        # attach, check magic/version/rank; CPU views
        self.name, self.rank, self.tp, self.words = name, rank, self._mb.tp, self._mb.words
        self.timeout_s = timeout_s
        try:
            if self.tp > MAX_TP:
                raise ValueError(f"the GPU mailbox supports up to {MAX_TP} ranks, the segment has {self.tp}")
            check_start_epoch(self._mb.slots, epoch)
            base = variant_from_env()
            self._variant = (variant if isinstance(variant, Variant)
                             else make_variant(variant, base) if variant else base)
        except BaseException:
            self._mb.close()
            raise
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.piece = piece_elements(self.words)
        self._host = self._ptr = 0
        try:
            import cupy
            from kernels import launch
            host = self._mb.slots.ctypes.data - HEADER_BYTES
            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.hostRegister(host, segment_bytes(self.tp, self.words),
                                               _HOST_REGISTER_MAPPED | _HOST_REGISTER_PORTABLE)
                self._host = host
                try:
                    self._ptr = int(cupy.cuda.runtime.pointerGetAttributes(host).devicePointer) or host
                except Exception:                        # measured: the host address is the device address
                    self._ptr = host
            self._kernel = launch.kernel
            self._launch = launch.launch
            self.sms = launch.sm_count(self.device)
            state = np.zeros(STATE_WORDS, dtype=np.uint32)
            state[0] = epoch
            self.state = torch.tensor(state.view(np.int32), device=f"cuda:{self.device}")
            self._timeout_ns = np.uint64(int(timeout_s * 1e9))
            self.clock_khz = _clock_khz(self.device)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t <- sum over ranks (float32 in rank order, one rounding to t's dtype); in place, returns t.
        t: bf16 or float32, contiguous, on this mailbox's device. No host sync: capturable."""
        self._check(t, "all_reduce")
        if self.tp > 1:
            for at, n in pieces(t.numel(), self.words, packed=t.dtype == torch.bfloat16):
                self._exchange(t, at, n, t, at, gather=False, out_stride=0)
        return t

    def all_gather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[tp, *t.shape] float32: row r is rank r's t (exact for bf16 and float32 inputs)."""
        self._check(t, "all_gather")
        if out is None:
            out = torch.empty((self.tp, *t.shape), dtype=torch.float32, device=t.device)
        elif (out.dtype != torch.float32 or tuple(out.shape) != (self.tp, *t.shape) or not out.is_contiguous()
              or out.device != t.device):
            raise ValueError(f"all_gather: out must be contiguous float32 {(self.tp, *t.shape)} on {t.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        n = t.numel()
        if self.tp == 1:
            out[0].copy_(t)
            return out
        for at, k in pieces(n, self.words, packed=t.dtype == torch.bfloat16):
            self._exchange(t, at, k, out, at, gather=True, out_stride=n)
        return out

    @property
    def variant(self) -> Variant:
        """The exchange kernel and launch shape (see the module docstring). Both ranks must switch together,
        between exchanges (a capture records the variant of each launch)."""
        return self._variant

    @variant.setter
    def variant(self, v: Variant | str) -> None:
        self._variant = v if isinstance(v, Variant) else make_variant(v, self._variant)

    def barrier(self) -> None:
        """One exchange of one element, then a stream sync (raises MailboxHang)."""
        self.all_reduce(torch.zeros(1, dtype=torch.float32, device=f"cuda:{self.device}"))
        self.synchronize()

    def hang(self) -> int:
        """The hang word as the host sees it: 0, or 1 + the rank that gave up waiting."""
        return int(self._mb.hang[0])

    def check(self) -> None:
        """Raise MailboxHang if any rank reported a hang (reads host memory; no sync)."""
        h = self.hang()
        if h:
            raise MailboxHang(f"rank {self.rank}: rank {h - 1} reported a mailbox hang")

    def synchronize(self) -> None:
        """Wait for this device's current stream, then check the hang word."""
        torch.cuda.current_stream(self.device).synchronize()
        self.check()

    def epoch(self) -> int:
        """The last epoch used (reads device memory: syncs)."""
        return int(self.state.cpu().numpy().view(np.uint32)[0])

    def probe(self, iters: int = 200, per_graph: int = 20) -> float:
        """Microseconds per 4 KiB bf16 all-reduce inside a captured CUDA graph (median of `iters` replays
        of `per_graph` exchanges). Collective: every rank calls it with the same arguments."""
        dev = f"cuda:{self.device}"
        x = torch.zeros(PROBE_BYTES // 2, dtype=torch.bfloat16, device=dev)
        with torch.cuda.device(self.device):
            self.all_reduce(x)                            # compile and warm up outside the capture
            self.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(per_graph):
                    self.all_reduce(x)
            g.replay()
            self.synchronize()
            start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            stop = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            for a, b in zip(start, stop):
                a.record()
                g.replay()
                b.record()
            self.synchronize()
        ms = sorted(a.elapsed_time(b) for a, b in zip(start, stop))
        return ms[len(ms) // 2] * 1e3 / per_graph

    def close(self) -> None:
        if self._mb is None:
            return
        if self._host:
            import cupy
            try:
                torch.cuda.synchronize(self.device)    # no kernel may touch the segment after this
            finally:
                with cupy.cuda.Device(self.device):
                    cupy.cuda.runtime.hostUnregister(self._host)
                self._host = 0
        self._mb.close()
        self._mb = None  # type: ignore[assignment]

    # ----------------------------------------------------------------------------------------------

    def _check(self, t: torch.Tensor, what: str) -> None:
        if self._mb is None:
            raise RuntimeError(f"{what}: the mailbox is closed")
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.device.index != self.device:
            raise ValueError(f"{what}: expected a tensor on cuda:{self.device}, got "
                             f"{getattr(t, 'device', type(t).__name__)}")
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{what}: dtype {t.dtype}, expected bfloat16 or float32")
        if not t.is_contiguous():
            raise ValueError(f"{what}: must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
        if not torch.cuda.is_current_stream_capturing():
            self.check()                                  # fail fast; inside a capture the host reads it later

    def _exchange(self, src: torch.Tensor, at: int, n: int, dst: torch.Tensor, dst_at: int, gather: bool,
                  out_stride: int) -> None:
        words = (n + 1) // 2 if src.dtype == torch.bfloat16 else n
        v = self._variant
        blocks, threads = launch_shape(v, words, self.sms)
        args = (np.uint64(src.data_ptr() + at * src.element_size()),
                np.uint64(dst.data_ptr() + dst_at * dst.element_size()),
                np.uint64(self._ptr), self.state,
                np.int32(self.rank), np.int32(self.tp), np.int64(self.words), np.int32(n),
                np.int32(src.dtype == torch.float32), np.int32(dst.dtype == torch.float32),
                np.int32(gather), np.int64(out_stride), self._timeout_ns)
        if v.lean:
            args += (np.int64(v.delay_ns * self.clock_khz // 1_000_000),)
        fn = self._kernel("exchange", v.kernel, self.device)
        self._launch(fn, (blocks,), (threads,), args, device=self.device, pdl=True)   # exchange.cu: pdl_enter


def _clock_khz(device: int) -> int:
    """The SM clock in kHz (for the lean kernel's first-poll delay, a clock64 spin)."""
    try:
        import cupy
        khz = int(cupy.cuda.runtime.deviceGetAttribute(_CUDA_DEV_ATTR_CLOCK_RATE, device))
        return khz if khz > 0 else _DEFAULT_CLOCK_KHZ
    except Exception:                                    # noqa: BLE001 - an approximate delay is fine
        return _DEFAULT_CLOCK_KHZ
