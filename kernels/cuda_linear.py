"""Decode linear layers on the GPU: y[T, O] = x[T, I] @ W[O, I]^T, bf16 or quantised weights.

Few columns run the GEMV kernels of kernels/cuda/gemv.cu (weights dequantised in registers, each
weight byte read once for all the columns of a launch): bf16 up to GEMV_COLUMNS["bf16"], quantised
weights up to 64 columns (GEMV or GEMM kernels, below). More columns (prefill)
dequantise row slabs into a bf16 scratch with a kernel and call torch.matmul (cuBLAS). Everything
launches on torch's current stream without host syncs, so it captures into CUDA graphs.

    linear(x, w, out=None, residual=None)   w: bf16 [O, I] tensor or QuantWeight
    linear_swiglu(x, w_gate_up, out=None)   w_gate_up: [2F, I] (gate rows then up rows) -> [T, F]
    linear_split(x, w, sizes, outs=None)    w fused from parts of `sizes` rows -> one [T, size] per part
    dequantize(w) -> bf16 [O, I]
    route(O, I, T, kind, sm_count, swiglu=False, variant=None) -> dict
    bytes_read(O, I, T, kind) -> int        (the traffic floor a benchmark divides by)

Variants (TANDEM_GEMV_VARIANT, read by route() at every launch plan, so also at CUDA graph capture):
"tc" is the route table below; "pipelined" sends launches of <= 8 columns to the cp.async-pipelined
tensor-core kernels gemv_{bf16,fp8row,fp8blk,nvfp4}_pipe wherever they apply (bf16: I % 8 == 0, fp8:
I % 16 == 0, nvfp4: I % 64 == 0), small layers included, and bf16 layers of 3-8 columns there
instead of to cuBLAS; "auto" (the default) uses the quantised ones where they were measured faster
(pipe_wins), and gemv_bf16_pipe for mid-sized bf16 weights at 3..8 columns (below); "bf16pipe" is
"auto" with bf16 launches of 3-8 columns on gemv_bf16_pipe instead of cuBLAS (the lm_head
at C = 8 reached 48% of the read bandwidth through cuBLAS on an H200, docs/perf.md; measured 14% slower
over the whole step with bf16 weights, eleventh and twelfth sessions); "pipe4" is "auto" with the
pipelined kernels' layer rule stopped at 4 columns (the default until the twelfth session: 27B fp8 at
C = 8 7.7% slower than auto, nvfp4 the same, docs/perf.md).
scripts/bench/linear.py --variants times tc against pipelined. Under "auto", bf16 weights between
SMALL_BF16_ELEMS and $TANDEM_GEMV_BF16_PIPE_ELEMS elements (BF16_PIPE_ELEMS, 100M: every bf16 layer but
the 27B's gate|up and the lm_heads) take gemv_bf16_pipe at 3..8 columns instead of cuBLAS: the 35B-A3B's
C = 4 / 8 steps 4-6% faster, the 27B's 3-7% (nineteenth session; the 27B with every bf16 launch on it,
gate|up and lm_head too, was 14% slower, eleventh).

Quantised launches of 9..64 columns run the dequantising GEMM gemm_*_n16 / n32 / n64 where it measured
faster (MM_ENV, mm_wins: nvfp4 from 9 columns in launches of up to 32, fp8 from 17 in launches of up
to 64): blocks of 128 or 256 rows times every column, x staged once per block in the A fragments'
order, I split over the grid's y axis with an fp32 workspace and a last-block reduction. The other
quantised launches of 9..32 columns (fp8 at 9..16; all of them with TANDEM_GEMV_MM=0) run the GEMV
kernels gemv_*_tc16 / tc32, or gemv_*_xs16 / xs32 (the same arithmetic with x staged per block in
shared memory) per TANDEM_GEMV_STAGED (STAGED_ENV below; default: nvfp4 at 17..32), 33..64 columns
in two launches.

The GEMV launches are programmatic dependent launches on sm_90+ (kernels/launch.py, pdl=True): a
GEMV's blocks start streaming their first weights under the previous kernel's tail.
"""

from __future__ import annotations

import torch

from . import cuda_misc
from . import launch as L
from .quant import QuantWeight

MAX_GEMV_COLUMNS = 16                  # columns per launch of the CUDA-core GEMV kernels
# Per weight kind, the most columns routed to the GEMV / GEMM kernels (in launches of launch_columns());
# beyond it bf16 goes to cuBLAS and quantised weights are dequantised in slabs for cuBLAS. From
# scripts/bench/linear.py and decode.py on an H200 (docs/perf.md): the CUDA-core GEMV beats cuBLAS for
# bf16 only at T <= 2 (it is FMA-bound beyond); quantised weights stay on their kernels up to 64 columns
# (the dequantising GEMM from 9 / 17 columns: the 27B nvfp4 step at C = 64 40.7 ms against 53.5 through
# dequantise + cuBLAS, fifteenth session). With the GEMM off (TANDEM_GEMV_MM=0) nvfp4 keeps the
# fourteenth session's 32 (gemv_columns): two 32-column GEMV passes cost more than the dequantised copy.
GEMV_COLUMNS = {"bf16": 2, "fp8_row": 64, "fp8_block": 64, "nvfp4": 64}
# A small bf16 weight (at most this many elements: the GDN a|b projections a quantised model keeps in
# bf16, 96 x 5120 on the 27B) stays on the GEMV up to MAX_GEMV_COLUMNS: its few FMAs cost less than
# cuBLAS's split-K launch pair (27B nvfp4 C = 8 step, docs/perf.md thirteenth session: a|b on cuBLAS
# 0.58 ms per step, ~12 us a layer).
SMALL_BF16_ELEMS = 1 << 21
# bf16 weights of more than SMALL_BF16_ELEMS and at most this many elements run launches of 3..8 columns on
# the pipelined tensor-core GEMV (gemv_bf16_pipe) instead of cuBLAS under the "auto" variant;
# $TANDEM_GEMV_BF16_PIPE_ELEMS overrides it (read at every launch plan; 0: never). 100M elements takes the
# 27B's q_proj, GDN in_proj and down (63-89M) and every 35B-A3B bf16 layer but the lm_head, and leaves
# the 27B's gate|up (178M) and both lm_heads on cuBLAS (docs/perf.md, nineteenth session).
BF16_PIPE_ELEMS = 100 << 20
BF16_PIPE_ENV = "TANDEM_GEMV_BF16_PIPE_ELEMS"
# Benchmarks: another bound than GEMV_COLUMNS for the quantised kinds (1..64; read at every launch plan).
QCOLUMNS_ENV = "TANDEM_GEMV_QCOLUMNS"
WARPS = 8
ROWS_PER_WARP = 2
_NT_BUCKETS = (1, 2, 4, 8, 16)
_KIND_TAG = {"bf16": "bf16", "fp8_row": "fp8row", "fp8_block": "fp8blk", "nvfp4": "nvfp4"}
_EPC = {"bf16": 8, "fp8_row": 16, "fp8_block": 16, "nvfp4": 32, "nvfp4h": 16}
_DEQUANT_KIND = {"fp8_row": 1, "fp8_block": 2, "nvfp4": 3}
# Quantised kinds whose decode GEMV runs on tensor cores (gemv_*_tc, _tc16, _tc32: mma.sync bf16, sm_80+;
# every target of kernels/launch.py is sm_80 or newer), up to TC_MAX_COLUMNS columns per launch.
# nvfp4 with I % 32 == 16 keeps the CUDA-core path.
_TC_KINDS = ("fp8_row", "fp8_block", "nvfp4")
TC_MAX_COLUMNS = 32
_TC_TILES = {1: "", 2: "16", 4: "32"}     # column tiles of 8 -> kernel suffix
PREFILL_SLAB_ELEMS = 1 << 26          # dequantised rows per cuBLAS call: <= 128 MiB of bf16 scratch
VARIANT_ENV = "TANDEM_GEMV_VARIANT"
VARIANTS = ("auto", "tc", "pipelined", "bf16pipe", "pipe4")
# The I-split (ks) rule (TANDEM_GEMV_KS, read at every launch plan, so at graph capture too; for
# benchmarks): "blocks" (the default) is _pick_ks's everywhere; "tc8" gives single-column launches of
# the tensor-core kernels (gemv_*_tc: the 27B's gate|up, 2 blocks per SM) the widest split their rows
# allow; "wide" does that and the same for the nvfp4 pipelined kernel (tried in the ninth session:
# slower on the whole 27B step, docs/perf.md).
KS_ENV = "TANDEM_GEMV_KS"
KS_RULES = ("blocks", "tc8", "wide")
PIPE_MAX_COLUMNS = 8                   # gemv_*_pipe: one column tile of 8
# gemv_*_pipe: ks is the smallest of 1, 2, 4, 8 giving at least this many blocks per SM. An SM holds up
# to 4 of its blocks (64 registers, 44 KiB of shared memory each; 2 on sm_86/89/120), and a warp keeps
# its loads in flight for as long as it has steps, so fewer, longer warps should beat the old rule's 4
# blocks per SM as long as every SM gets two. Measured in the ninth session (docs/perf.md, 27B nvfp4
# step, TANDEM_GEMV_PIPE_BLOCKS): 2 beat 4 (tp 1: 9.52 against 9.68 ms; tp 2: 7.20 against 7.39) and 1
# (tp 1: 11.42 ms).
PIPE_BLOCKS_PER_SM = 2
PIPE_BLOCKS_ENV = "TANDEM_GEMV_PIPE_BLOCKS"   # benchmarks: another PIPE_BLOCKS_PER_SM (read at every launch plan)
# The CUDA-core GEMV (gemv_*_t1..t16): ks is the smallest of 1, 2, 4, 8 giving at least this many blocks per
# SM, by weight kind; TANDEM_GEMV_BLOCKS overrides it for every kind (benchmarks, read at every launch
# plan). bf16 1 (4 until the nineteenth session): gemv_bf16_t1 takes 70 registers, so 3 of its blocks fit
# an SM, and 4 per SM made the 27B's 5120-row layers 640 blocks (1.6 waves; 320 at 1, one wave) and the
# 35B-A3B's 2048 x 4096 ones ks 8 (256 blocks at ks 2 with 1): measured on an H200, the 27B bf16 C = 1
# step 1.1-1.4% faster, the 35B-A3B's GEMV kernel time per step 1.337 -> 1.293 ms (docs/perf.md). The
# quantised kinds' CUDA-core kernels (small layers at T = 1 only) keep 4: not measured.
BLOCKS_PER_SM = {"bf16": 1, "fp8_row": 4, "fp8_block": 4, "nvfp4": 4}
BLOCKS_ENV = "TANDEM_GEMV_BLOCKS"
# gemv_*_xs16 / xs32 stage x in shared memory per block (gemv.cu) where gemv_*_tc16 / tc32 read it from
# L1 / L2 in every warp. TANDEM_GEMV_STAGED (read at every launch plan): "auto" (the default) sends nvfp4
# launches of 17..32 columns to gemv_nvfp4_xs32, "all" every quantised launch of 9..32 columns to the
# xs kernels, "0" none. Either way only where the block rule's I-split fits the staging buffer (ks * 4
# chunks * elements per chunk <= XS_KT: ks <= 2 for nvfp4, <= 4 for fp8; capping ks instead left the
# wide-I, narrow-O layers a fraction of the SMs). Measured on an H200 (docs/perf.md, fourteenth
# session): nvfp4 at 32 columns gate|up 121.5 against 164.8 us, the 27B step at C = 32 30.4 against
# 32.7 ms; nvfp4 at 16 columns even; fp8 slower at 16 columns (gate|up 116 against 75 us, the C = 16
# step 19.9 against 17.2 ms) and at 32 (31.4 against 30.5 ms).
STAGED_ENV = "TANDEM_GEMV_STAGED"
XS_KT = 256
# The dequantising GEMM for quantised launches of 9..64 columns (gemm_{fp8row,fp8blk,nvfp4}_n16 / n32 / n64,
# gemv.cu). TANDEM_GEMV_MM (read at every launch plan): "1" (the default: where mm_wins), "all" (every
# launch it serves; benchmarks) or "0" (the GEMV kernels above, nvfp4 beyond 32 columns dequantised).
# A block owns 8 warps x MT tiles of rows; the grid's y axis splits I into S slices (_mm_splits), whose
# fp32 partials meet in a per-device workspace (MM_WS_FLOATS floats, counters for MM_COUNTERS row tiles)
# kept for the life of the process (CUDA graphs hold its address).
MM_ENV = "TANDEM_GEMV_MM"
MM_SPLITS_ENV = "TANDEM_GEMM_SPLITS"   # benchmarks: every GEMM launch's slice count (1..32, capped as usual)
MM_MAX_COLUMNS = 64
# name -> (kind, column tiles, row tiles per warp, steps per iteration, blocks per SM, ring stages); as
# gemv.cu's GEMM_Q_KERNEL / GEMM_Q_RING_KERNEL lines (tests/test_linear_route.py checks). The route's
# kernel per (kind, column tiles) and layer is _route_mm's; MM_SHAPE_ENV (benchmarks) picks the _m1 /
# _p4 / _r shapes where they exist.
_MM_KERNELS = {
    # the route's shapes (_route_mm): two row tiles per warp where they fit, one for fp8-block at 32 and
    # every 64-column kernel; nvfp4 has no 64-column kernel (launch_columns)
    "gemm_fp8row_n16": ("fp8_row", 2, 2, 2, 2, 0), "gemm_fp8blk_n16": ("fp8_block", 2, 2, 2, 2, 0),
    "gemm_nvfp4_n16": ("nvfp4", 2, 2, 2, 2, 0),
    "gemm_fp8row_n32": ("fp8_row", 4, 2, 2, 2, 0), "gemm_fp8blk_n32": ("fp8_block", 4, 1, 2, 2, 0),
    "gemm_nvfp4_n32": ("nvfp4", 4, 2, 1, 2, 0),
    "gemm_fp8row_n64": ("fp8_row", 8, 1, 1, 2, 0), "gemm_fp8blk_n64": ("fp8_block", 8, 1, 1, 1, 0),
    # one row tile per warp (_m1), four steps per iteration (_p4)
    "gemm_fp8row_n16_m1": ("fp8_row", 2, 1, 2, 2, 0), "gemm_fp8blk_n16_m1": ("fp8_block", 2, 1, 2, 2, 0),
    "gemm_nvfp4_n16_m1": ("nvfp4", 2, 1, 2, 2, 0),
    "gemm_fp8row_n32_m1": ("fp8_row", 4, 1, 2, 2, 0), "gemm_nvfp4_n32_m1": ("nvfp4", 4, 1, 2, 2, 0),
    "gemm_fp8row_n16_p4": ("fp8_row", 2, 1, 4, 2, 0), "gemm_fp8blk_n16_p4": ("fp8_block", 2, 1, 4, 2, 0),
    "gemm_nvfp4_n16_p4": ("nvfp4", 2, 1, 4, 2, 0),
    "gemm_fp8row_n32_p4": ("fp8_row", 4, 1, 4, 2, 0), "gemm_fp8blk_n32_p4": ("fp8_block", 4, 1, 4, 2, 0),
    # the weight ring in dynamic shared memory (_r)
    "gemm_fp8row_n16_r": ("fp8_row", 2, 1, 2, 2, 3), "gemm_fp8blk_n16_r": ("fp8_block", 2, 1, 2, 2, 3),
    "gemm_nvfp4_n16_r": ("nvfp4", 2, 1, 2, 2, 3),
    "gemm_fp8row_n32_r": ("fp8_row", 4, 1, 2, 2, 3), "gemm_fp8blk_n32_r": ("fp8_block", 4, 1, 2, 2, 3),
    "gemm_nvfp4_n32_r": ("nvfp4", 4, 1, 2, 2, 3),
    "gemm_fp8row_n64_r": ("fp8_row", 8, 1, 1, 2, 4),
}


def mm_static_bytes(name: str) -> int:
    """Static shared memory of a GEMM kernel: x staged twice in fragment order (2 x 8 NB columns x
    (P x 4 x WD + MM_PAD) 16-byte units) and the last-block flag (tests/test_cuda_compile.py checks it
    against ptxas's report)."""
    kind, nb, _, p, _, _ = _MM_KERNELS[name]
    wd = 4 if kind == "nvfp4" else 2
    return 2 * 8 * nb * (p * 4 * wd + 4) * 16 + 16


def mm_ring_fits(name: str, smem_sm: int) -> bool:
    """Whether a ring kernel keeps its blocks per SM (the register shapes' residency) in `smem_sm` bytes
    of shared memory per SM: static + ring + the 1 KiB the runtime reserves per block, times blocks.
    True on H100 / H200 (228 KiB per SM); false on 100 KiB boards (sm_86 / 89 / 120), which would run
    one block per SM."""
    per_sm = _MM_KERNELS[name][4]
    return per_sm * (mm_static_bytes(name) + mm_ring_bytes(name) + 1024) <= smem_sm


def mm_ring_bytes(name: str) -> int:
    """Dynamic shared memory of a GEMM kernel: its weight ring (D stages x P steps x MT tiles x 2 rows x
    256 threads x 16 bytes, + 4 bytes per slot for nvfp4's scale words); 0 without one."""
    kind, _, mt, p, _, d = _MM_KERNELS[name]
    return d * p * mt * 2 * 256 * (20 if kind == "nvfp4" else 16)


MM_SHAPE_ENV = "TANDEM_GEMM_SHAPE"     # "base", "m1", "p4" or "r" everywhere; "reg" the register shapes by
                                       # rule; default "auto": _route_mm (the ring where it keeps residency)
MM_WS_FLOATS = 1 << 22                 # 16 MiB of fp32 partials per device
MM_COUNTERS = 1 << 13
MM_MIN_ITERATIONS = 4                  # a slice covers at least this many iterations of P steps
MM_WIDE_ROWS = 20480                   # from this many rows the two-row-tile shape (27B gate|up), below _m1 / _p4
_mm_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def gemv_variant() -> str:
    """The GEMV variant from $TANDEM_GEMV_VARIANT ("auto" when unset or empty)."""
    v = L.getenv(VARIANT_ENV) or "auto"
    if v not in VARIANTS:
        raise L.KernelError(f"{VARIANT_ENV}={v!r}: expected one of {', '.join(VARIANTS)}")
    return v


def ks_rule() -> str:
    """The I-split rule from $TANDEM_GEMV_KS ("blocks" when unset or empty)."""
    v = L.getenv(KS_ENV) or "blocks"
    if v not in KS_RULES:
        raise L.KernelError(f"{KS_ENV}={v!r}: expected one of {', '.join(KS_RULES)}")
    return v


def staged_x() -> str:
    """Which launches of 9..32 columns take the x-staging kernels: $TANDEM_GEMV_STAGED, "auto" (nvfp4 at
    17..32 columns), "all" or "0" (see STAGED_ENV)."""
    v = L.getenv(STAGED_ENV) or "auto"
    if v not in ("auto", "all", "0"):
        raise L.KernelError(f"{STAGED_ENV}={v!r}: expected auto, all or 0")
    return v


def _mm_setting() -> str:
    v = L.getenv(MM_ENV) or "1"
    if v not in ("0", "1", "all"):
        raise L.KernelError(f"{MM_ENV}={v!r}: expected 1, all or 0")
    return v


def mm_on() -> bool:
    """Whether quantised launches of 9..64 columns may take the dequantising GEMM ($TANDEM_GEMV_MM: 1, the
    default, where mm_wins; all; 0 never)."""
    return _mm_setting() != "0"


def mm_applies(kind: str, I: int, T: int) -> bool:
    """The GEMM serves fp8 and nvfp4 (I % 32 == 0) launches of 9..64 columns when mm_on() (whether it
    takes one is mm_wins')."""
    return (kind in _TC_KINDS and not (kind == "nvfp4" and I % 32) and PIPE_MAX_COLUMNS < T <= MM_MAX_COLUMNS
            and mm_on())


def mm_wins(T: int, kind: str) -> bool:
    """Where the GEMM was measured faster than the GEMV kernels (scripts/bench/linear.py, 27B, H200,
    docs/perf.md fifteenth session): nvfp4 at 9..32 columns on every layer (at 32: gate|up 94 against
    121 us, down 55 against 84), fp8 from 17 columns (at 32: 44-114 against 73-144 us; at 9..16 the
    GEMV stayed ahead: gate|up 75 against 91 us)."""
    if _mm_setting() == "all":
        return True
    return kind == "nvfp4" or T > 16


def pipe_applies(kind: str, I: int, T: int) -> bool:
    """Whether gemv_*_pipe serves a launch of T columns: T <= 8, and I % 8 == 0 (bf16), I % 16 == 0
    (fp8) or I % 64 == 0 (nvfp4: each lane copies 4-byte words of a scale row, so rows must be 4-byte
    aligned)."""
    if kind not in ("bf16",) + _TC_KINDS or not 1 <= T <= PIPE_MAX_COLUMNS:
        return False
    return I % {"bf16": 8, "nvfp4": 64}.get(kind, 16) == 0


def pipe_wins(O: int, T: int, tc: dict, max_columns: int = 8) -> bool:
    """The "auto" rule, from scripts/bench/linear.py --variants on an H200 (27B shapes, docs/perf.md):
    the pipelined kernel was 1.1-1.4x faster for T <= 4 on every layer where the tensor-core kernel
    splits I over 4 or more warps (q, o, GDN qkv / z / out, down), and slower on the widest layer
    (gate|up, split over 2: 0.7-0.9x) and on the smallest (k / v, O = 1024: 0.8-0.9x). At T = 8 the
    layers timed alone were within noise, but the whole 27B step at C = 8 was 7.7% faster with the
    rule applied up to 8 columns for fp8 and the same for nvfp4 (decode.py in one process, twelfth
    session), so it applies up to max_columns = 8 (4: the variant "pipe4", the earlier rule)."""
    return T <= max_columns and O >= 4096 and tc.get("kernel", "").startswith("gemv_") and "_tc" in tc["kernel"] \
        and tc.get("ks_blocks", tc.get("ks", 0)) >= 4


def _kind_of(w) -> str:
    return w.kind if isinstance(w, QuantWeight) else "bf16"


def _vector_rule(kind: str) -> int:
    return {"bf16": 8, "fp8_row": 16, "fp8_block": 16, "nvfp4": 16}[kind]


def route(O: int, I: int, T: int, kind: str, sm_count: int, swiglu: bool = False,
          variant: str | None = None, smem_sm: int | None = None) -> dict:
    """The launch plan for one linear: which kernel, how many warps split a row pair, the grid.

    A unit is two weight rows (gate row f and up row F+f for SwiGLU); a block of 8 warps covers
    8/ks units, ks warps splitting I. ks is the smallest of 1, 2, 4, 8 that gives >= BLOCKS_PER_SM[kind]
    blocks per SM (so small-O layers still fill the GPU; bf16 1, the rest 4), capped so that each of the
    ks warps gets at least one 16-byte chunk per lane (ks * 32 <= chunks per row). More than GEMV_COLUMNS[kind] columns route to
    dequantise + cuBLAS; between launch_columns() and that, the GEMV runs in launches of
    launch_columns() columns (this plan is then the one of a full launch).

    variant: one of VARIANTS (None: $TANDEM_GEMV_VARIANT); with "pipelined", quantised launches of
    <= 8 columns go to gemv_*_pipe wherever pipe_applies(); "auto" where pipe_wins() too; "bf16pipe" as
    "auto", and bf16 launches of 3-8 columns to gemv_bf16_pipe; "pipe4" as "auto" with pipe_wins' rule
    stopped at 4 columns.

    smem_sm: shared memory per SM in bytes (the GEMM's weight ring is taken where it fits; None: the
    current CUDA device's, 0 without one).
    """
    if kind not in ("bf16",) + tuple(_DEQUANT_KIND):
        raise L.KernelError(f"route: unknown weight kind {kind!r}")
    if variant is None:
        variant = gemv_variant()
    elif variant not in VARIANTS:
        raise L.KernelError(f"route: unknown GEMV variant {variant!r}")
    if not _on_gemv(kind, I, T, variant, O):
        return {"path": "dequant_matmul", "kind": kind, "T": T,
                "slab_rows": max(1, min(O, PREFILL_SLAB_ELEMS // max(I, 1)))}
    T = min(T, launch_columns(kind, I))
    if mm_applies(kind, I, T) and mm_wins(T, kind):
        if smem_sm is None:
            smem_sm = L.smem_per_sm() if torch.cuda.is_available() else 0
        return _route_mm(O, I, T, kind, sm_count, swiglu, smem_sm)
    if variant == "pipelined" and pipe_applies(kind, I, T):
        return _route_pipe(O, I, T, kind, sm_count, swiglu)
    if variant == "bf16pipe" and kind == "bf16" and T > GEMV_COLUMNS["bf16"] and pipe_applies(kind, I, T):
        return _route_pipe(O, I, T, kind, sm_count, swiglu)
    if _bf16_pipe_auto(kind, O, I, T, variant):
        return _route_pipe(O, I, T, kind, sm_count, swiglu)
    if variant in ("auto", "bf16pipe", "pipe4") and kind != "bf16" and pipe_applies(kind, I, T):
        tc = route(O, I, T, kind, sm_count, swiglu, variant="tc")
        wins = pipe_wins(O, T, tc, max_columns=4 if variant == "pipe4" else 8)
        return _route_pipe(O, I, T, kind, sm_count, swiglu) if wins else tc
    ekind = "nvfp4h" if (kind == "nvfp4" and I % 32) else kind
    if ekind in _TC_KINDS and T <= TC_MAX_COLUMNS:
        r = _route_tc(O, I, T, ekind, sm_count, swiglu)
        if T >= 2 or r["grid"][0] >= sm_count:       # a T = 1 layer too small to fill the GPU keeps the old path
            return r
    nt = next(b for b in _NT_BUCKETS if b >= T)
    if ekind == "nvfp4h":
        nt = 16                                       # slow path for I % 32 == 16: one instantiation
    units = O // 2 if swiglu else (O + 1) // 2
    chunks = I // _EPC[ekind]
    ks_cap = 1
    while ks_cap < WARPS and (ks_cap * 2) * 32 <= chunks:
        ks_cap *= 2
    ks = _pick_ks(units, ks_cap, sm_count, L.env_int(BLOCKS_ENV, 1, 8) or BLOCKS_PER_SM[kind])
    blocks = -(-units // (WARPS // ks))
    tag = _KIND_TAG.get(ekind, ekind)
    return {"path": "gemv", "kind": kind, "kernel": f"gemv_{tag}_t{nt}", "nt": nt, "ks": ks,
            "units": units, "rows_per_warp": ROWS_PER_WARP, "block": (32 * WARPS,), "grid": (blocks,),
            "T": T}


FORCE_KS: int | None = None            # benchmarks only (scripts/bench/linear.py --ks): every launch's ks


def _pick_ks(units: int, ks_cap: int, sm_count: int, blocks_per_sm: int = 4) -> int:
    """Warps splitting I per unit: the smallest of 1, 2, 4, 8 (<= ks_cap) giving >= blocks_per_sm
    blocks per SM. Tried and reverted (docs/perf.md, ninth session): ks 8 for every single-column
    launch, which won per layer in linear.py's ks table (27B nvfp4 gate|up 48 -> 55% of floor), made
    the whole 27B decode step slower (nvfp4 C=1 9.48 -> 10.08 ms, fp8 10.54 -> 11.23 ms)."""
    if FORCE_KS is not None:
        return max(1, min(FORCE_KS, ks_cap))
    for cand in (1, 2, 4, 8):
        if cand > ks_cap:
            break
        if -(-units // (WARPS // cand)) >= blocks_per_sm * sm_count:
            return cand
    return ks_cap


def launch_columns(kind: str, I: int) -> int:
    """The most columns one GEMV launch takes for this weight kind and in_features."""
    if mm_applies(kind, I, MM_MAX_COLUMNS):
        return 32 if kind == "nvfp4" else MM_MAX_COLUMNS   # nvfp4: two 32-column GEMMs beat one of 64
    if kind in _TC_KINDS and not (kind == "nvfp4" and I % 32) and TC_MAX_COLUMNS >= 8:
        return TC_MAX_COLUMNS
    return MAX_GEMV_COLUMNS


def _route_tc(O: int, I: int, T: int, kind: str, sm_count: int, swiglu: bool) -> dict:
    """Tensor-core GEMV (gemv_*_tc, gemv.cu): a warp owns a tile of 16 rows (SwiGLU: 8 gate rows and
    their 8 up rows) times 1, 2 or 4 tiles of 8 columns, and steps through I 64 bytes of each row at
    a time (4 lanes x 16 bytes); ks warps of a block split the steps. ks: the smallest giving >= 4
    blocks per SM (route()'s rule for the quantised kinds), capped so that each of the ks warps gets at
    least one step."""
    tiles = -(-(O // 2) // 8) if swiglu else -(-O // 16)
    steps = -(-(I // _EPC[kind]) // 4)
    ks_cap = 1
    while ks_cap < WARPS and ks_cap * 2 <= steps:
        ks_cap *= 2
    ks_blocks = _pick_ks(tiles, ks_cap, sm_count)
    ks = ks_cap if T == 1 and FORCE_KS is None and ks_rule() != "blocks" else ks_blocks
    nb = next(n for n in _TC_TILES if 8 * n >= T)
    name = f"gemv_{_KIND_TAG[kind]}_tc{_TC_TILES[nb]}"
    staged = staged_x()
    if nb > 1 and ks * 4 * _EPC[kind] <= XS_KT and (staged == "all" or (staged == "auto" and nb == 4
                                                                         and kind == "nvfp4")):
        name = f"gemv_{_KIND_TAG[kind]}_xs{_TC_TILES[nb]}"
    blocks = -(-tiles // (WARPS // ks))
    return {"path": "gemv", "kind": kind, "kernel": name, "nt": 8 * nb, "ks": ks,
            "ks_blocks": ks_blocks, "units": tiles, "rows_per_warp": 16, "block": (32 * WARPS,), "grid": (blocks,),
            "T": T}


def _route_pipe(O: int, I: int, T: int, kind: str, sm_count: int, swiglu: bool) -> dict:
    """Pipelined tensor-core GEMV (gemv_*_pipe, gemv.cu): the tiles and steps of _route_tc with one
    column tile; ks from PIPE_BLOCKS_PER_SM, capped so that each of the ks warps gets a step."""
    tiles = -(-(O // 2) // 8) if swiglu else -(-O // 16)
    steps = -(-(I // _EPC[kind]) // 4)
    ks_cap = 1
    while ks_cap < WARPS and ks_cap * 2 <= steps:
        ks_cap *= 2
    per_sm = L.env_int(PIPE_BLOCKS_ENV, 1, 8)
    ks = _pick_ks(tiles, ks_cap, sm_count, per_sm or PIPE_BLOCKS_PER_SM)
    if kind == "nvfp4" and T == 1 and FORCE_KS is None and ks_rule() == "wide":
        ks = ks_cap
    blocks = -(-tiles // (WARPS // ks))
    return {"path": "gemv", "kind": kind, "kernel": f"gemv_{_KIND_TAG[kind]}_pipe", "nt": 8, "ks": ks,
            "units": tiles, "rows_per_warp": 16, "block": (32 * WARPS,), "grid": (blocks,), "T": T,
            "variant": "pipelined"}


def _route_mm(O: int, I: int, T: int, kind: str, sm_count: int, swiglu: bool, smem_sm: int = 0) -> dict:
    """The dequantising GEMM (gemm_*_n16 / n32 / n64, gemv.cu): 8 warps of MT 16-row tiles (SwiGLU: 8 gate
    rows and their 8 up rows per tile) per block on the grid's x axis, S slices of I on its y axis.

    Shape "auto": the weight ring (_r) where the kernel has one, I suits it and smem_sm keeps its blocks
    per SM (27B step on an H200, sixteenth session: nvfp4 2.7-3.2% and fp8 0.5-10% faster at C = 16 /
    32 / 64 than the register shapes); otherwise "reg", the register shapes by rule."""
    nb = 2 if T <= 16 else 4 if T <= 32 else 8
    name = f"gemm_{_KIND_TAG[kind]}_n{8 * nb}"
    shape = L.getenv(MM_SHAPE_ENV) or "auto"
    if shape not in ("auto", "reg", "base", "m1", "p4", "r"):
        raise L.KernelError(f"{MM_SHAPE_ENV}={shape!r}: expected auto, reg, base, m1, p4 or r")
    ring_ok = not (kind == "nvfp4" and I % 64)        # the ring's 4-byte scale words
    if shape == "r" and not ring_ok:
        shape = "reg"
    if shape == "auto":
        shape = "r" if ring_ok and f"{name}_r" in _MM_KERNELS and mm_ring_fits(f"{name}_r", smem_sm) else "reg"
    if shape == "reg":                                # measured (linear.py, fifteenth session): the base shape
        wide = O >= MM_WIDE_ROWS                      # on 27B gate|up, _m1 (nvfp4) / _p4 (fp8) on the others
        shape = "base" if wide else ("m1" if kind == "nvfp4" else "p4")
    if shape != "base" and f"{name}_{shape}" in _MM_KERNELS:
        name = f"{name}_{shape}"
    _, _, mt, p, per_sm, _ = _MM_KERNELS[name]
    tiles = -(-(O // 2) // 8) if swiglu else -(-O // 16)
    bm = -(-tiles // (WARPS * mt))
    steps = -(-(I // _EPC[kind]) // 4)
    S = _mm_splits(bm, -(-steps // p), per_sm * sm_count, mt * nb * 4 * 32 * WARPS)
    return {"path": "gemv", "kind": kind, "kernel": name, "nt": 8 * nb, "ks": S,
            "units": tiles, "rows_per_warp": 16 * mt, "block": (32 * WARPS,), "grid": (bm, S), "T": T,
            "mm": True, "smem": mm_ring_bytes(name)}


def _mm_splits(bm: int, iterations: int, slots: int, floats_per_block: int) -> int:
    """Slices of I for a GEMM of bm row blocks: the S in 1..16 with the least modelled time, waves of
    `slots` resident blocks times a slice's share of the work, plus 2% of a pass per slice for the
    workspace; each slice keeps >= MM_MIN_ITERATIONS iterations, and the partials fit the workspace."""
    cap = max(1, min(16, iterations // MM_MIN_ITERATIONS, MM_WS_FLOATS // max(1, bm * floats_per_block)))
    if bm > MM_COUNTERS:
        cap = 1
    forced = L.env_int(MM_SPLITS_ENV, 1, 32)
    if FORCE_KS is not None or forced is not None:
        return max(1, min(cap, forced if forced is not None else FORCE_KS))
    best, best_cost = 1, None
    for S in range(1, cap + 1):
        cost = -(-(bm * S) // slots) / S + (0.02 * S if S > 1 else 0.0)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = S, cost
    return best


def mm_buffers(device: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GEMM's workspace (fp32 partials) and per-row-tile counters on `device`, made on first use;
    None while a CUDA graph is being captured and they do not exist yet (the launch then runs one slice)."""
    bufs = _mm_buffers.get(device)
    if bufs is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        with torch.cuda.device(device):
            bufs = (torch.empty(MM_WS_FLOATS, dtype=torch.float32, device=f"cuda:{device}"),
                    torch.zeros(MM_COUNTERS, dtype=torch.int32, device=f"cuda:{device}"))
        _mm_buffers[device] = bufs
    return bufs


def bytes_read(O: int, I: int, T: int, kind: str) -> int:
    """Bytes a decode linear must move: weights (+scales) + x + y (bf16)."""
    if kind == "bf16":
        w = O * I * 2
    elif kind == "fp8_row":
        w = O * I + 4 * O
    elif kind == "fp8_block":
        w = O * I + 4 * (-(-O // 128)) * (-(-I // 128))
    elif kind == "nvfp4":
        w = O * I // 2 + O * (I // 16) + 4
    else:
        raise L.KernelError(f"bytes_read: unknown weight kind {kind!r}")
    return w + T * I * 2 + T * O * 2


def _aligned(t: torch.Tensor, name: str, n: int) -> None:
    if t.data_ptr() % n:
        raise L.KernelError(f"{name}: data pointer must be {n}-byte aligned (got offset {t.data_ptr() % n})")


def _check_weight(w, name: str):
    """-> (kind, O, I, data, scale, gscale, sb)"""
    if isinstance(w, QuantWeight):
        O, I = w.out_features, w.in_features
        L.check(w.data, f"{name}.data", torch.uint8)
        if w.kind == "nvfp4":
            L.check(w.scale, f"{name}.scale", torch.uint8, (O, I // 16))
            L.check(w.global_scale, f"{name}.global_scale", torch.float32, (1,))
        elif w.kind == "fp8_row":
            L.check(w.scale, f"{name}.scale", torch.float32, (O,))
        else:
            L.check(w.scale, f"{name}.scale", torch.float32, (-(-O // 128), -(-I // 128)))
        rule = _vector_rule(w.kind)
        if I % rule:
            raise L.KernelError(f"{name}: {w.kind} needs in_features % {rule} == 0, got {I}")
        _aligned(w.data, f"{name}.data", 8 if (w.kind == "nvfp4" and I % 32) else 16)
        _aligned(w.scale, f"{name}.scale", 4)
        for t, n in ((w.scale, "scale"), (w.global_scale, "global_scale")):
            if t is not None and t.device != w.data.device:
                raise L.KernelError(f"{name}.{n}: on {t.device}, data on {w.data.device}")
        return w.kind, O, I, w.data, w.scale, w.global_scale, -(-I // 128)
    L.check(w, name, torch.bfloat16)
    if w.dim() != 2:
        raise L.KernelError(f"{name}: expected [O, I], got shape {tuple(w.shape)}")
    O, I = w.shape
    if I % 8:
        raise L.KernelError(f"{name}: bf16 weights need in_features % 8 == 0, got {I}")
    _aligned(w, name, 16)
    return "bf16", O, I, w, None, None, 0


def _check_x(x: torch.Tensor, I: int, dev) -> int:
    L.check(x, "x", torch.bfloat16)
    if x.dim() != 2 or x.shape[1] != I:
        raise L.KernelError(f"x: shape {tuple(x.shape)}, expected [T, {I}]")
    if x.shape[0] < 1:
        raise L.KernelError("x: needs at least one column (T >= 1)")
    if x.device != dev:
        raise L.KernelError(f"x: on {x.device}, weight on {dev}")
    _aligned(x, "x", 16)
    return x.shape[0]


def _out(out, shape, dev, name="out"):
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=dev)
    L.check(out, name, torch.bfloat16, shape)
    if out.device != dev:
        raise L.KernelError(f"{name}: on {out.device}, expected {dev}")
    return out


def _gemv(x, w, out, residual, swiglu: bool, parts: list | None = None):
    """parts: the outputs of a fused weight's row ranges (out = parts[0]; see linear_split)."""
    kind, O, I, data, scale, gscale, sb = _check_weight(w, "w")
    dev = data.device
    T = _check_x(x, I, dev)
    mode = 2 if swiglu else (1 if residual is not None else 0)
    Fh = O // 2 if swiglu else 0
    d = L.device_of(x)
    sms, step, variant, smem_sm = L.sm_count(d), launch_columns(kind, I), gemv_variant(), L.smem_per_sm(d)
    extra = list(parts[1:]) if parts else []
    bounds, at = [], 0
    for p in (parts or [])[:-1]:
        at += p.shape[1]
        bounds.append(at)
    bounds += [O] * (3 - len(bounds))                 # o1, o2, o3 (rows where outputs 1, 2, 3 start)
    for a in range(0, T, step):                       # columns in launches of up to `step`
        b = min(T, a + step)
        r = route(O, I, b - a, kind, sms, swiglu=swiglu, variant=variant, smem_sm=smem_sm)
        whole = a == 0 and b == T                     # one launch: no views to make (host time, eager steps)
        ys = (extra if whole else [e[a:b] for e in extra]) + [None] * (3 - len(extra))
        res = residual if residual is None or whole else residual[a:b]
        args = [out if whole else out[a:b], x if whole else x[a:b], data, scale, gscale, res,
                O, I, b - a, r["ks"], mode, Fh, sb, *ys, *bounds]
        grid = r["grid"]
        if r.get("mm"):
            bufs = mm_buffers(d) if grid[1] > 1 else None
            if bufs is None:
                grid = (grid[0], 1)
            args += list(bufs) if bufs is not None else [None, None]
        smem = r.get("smem", 0)                       # the GEMM's weight ring (_r kernels)
        L.launch(L.kernel("gemv", r["kernel"], d, dynamic_smem=smem), grid, r["block"], tuple(args),
                 shared_mem=smem, device=d, pdl=True)  # the GEMV kernels call pdl_wait (gemv.cu)
    return out


def dequantize(w, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 [O, I] weight, computed by the dequant kernel (bit-exact with QuantWeight.dequantize)."""
    if not isinstance(w, QuantWeight):
        L.check(w, "w", torch.bfloat16)
        return w
    kind, O, I, data, scale, gscale, sb = _check_weight_any_i16(w)
    out = _out(out, (O, I), data.device)
    _aligned(out, "out", 16)
    dev = L.device_of(data)
    blocks = max(1, min(-(-O // 8), L.sm_count(dev) * 8))    # a warp per row, 8 per block
    L.launch(L.kernel("gemv", "dequant_bf16", dev), (blocks,), (256,),
             (out, data, scale, gscale, O, I, _DEQUANT_KIND[kind], sb), device=dev)
    return out


def _check_weight_any_i16(w: QuantWeight):
    """Dequantisation works for any I % 16 == 0 (nvfp4 included)."""
    O, I = w.out_features, w.in_features
    L.check(w.data, "w.data", torch.uint8)
    if I % 16:
        raise L.KernelError(f"w: {w.kind} dequantisation needs in_features % 16 == 0, got {I}")
    if w.kind == "nvfp4":
        L.check(w.scale, "w.scale", torch.uint8, (O, I // 16))
        L.check(w.global_scale, "w.global_scale", torch.float32, (1,))
    elif w.kind == "fp8_row":
        L.check(w.scale, "w.scale", torch.float32, (O,))
    else:
        L.check(w.scale, "w.scale", torch.float32, (-(-O // 128), -(-I // 128)))
    _aligned(w.data, "w.data", 8 if w.kind == "nvfp4" else 16)
    return w.kind, O, I, w.data, w.scale, w.global_scale, -(-I // 128)


def _slab(w: QuantWeight, a: int, b: int) -> QuantWeight:
    """Rows [a, b) of a quantised weight (a multiple of 128 for fp8_block) as a QuantWeight view."""
    if w.kind == "fp8_block":
        return QuantWeight(w.kind, b - a, w.in_features, w.data[a:b], w.scale[a // 128:-(-b // 128)], None)
    if w.kind == "fp8_row":
        return QuantWeight(w.kind, b - a, w.in_features, w.data[a:b], w.scale[a:b], None)
    return QuantWeight(w.kind, b - a, w.in_features, w.data[a:b], w.scale[a:b], w.global_scale)


def _prefill(x, w):
    """T > 16: dequantised slabs of rows through cuBLAS. Returns y [T, O] bf16 (a new tensor)."""
    if not isinstance(w, QuantWeight):
        return torch.matmul(x, w.t())
    O, I = w.out_features, w.in_features
    rows = max(128, (PREFILL_SLAB_ELEMS // max(I, 1)) // 128 * 128)
    if rows >= O:
        return torch.matmul(x, dequantize(w).t())
    y = torch.empty((x.shape[0], O), dtype=torch.bfloat16, device=x.device)
    scratch = torch.empty((rows, I), dtype=torch.bfloat16, device=x.device)
    for a in range(0, O, rows):
        b = min(O, a + rows)
        wb = dequantize(_slab(w, a, b), out=scratch[: b - a])
        y[:, a:b] = torch.matmul(x, wb.t())
    return y


def linear(x: torch.Tensor, w, out: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (bf16 [T, O]); with residual: bf16(residual + bf16(y)). out may be residual itself."""
    O, I = _shape(w)
    dev = w.data.device if isinstance(w, QuantWeight) else w.device
    T = _check_x(x, I, dev)
    on_gemv = _on_gemv(_kind_of(w), I, T, O=O)
    if out is None and residual is None and not on_gemv:
        return _prefill(x, w)                          # cuBLAS's own output: no copy
    out = _out(out, (T, O), dev)
    if residual is not None:
        residual = _out(residual, (T, O), dev, "residual")
    if on_gemv:
        return _gemv(x, w, out, residual, swiglu=False)
    y = _prefill(x, w)
    if residual is not None:
        torch.add(residual, y, out=out)
    else:
        out.copy_(y)
    return out


def linear_split(x: torch.Tensor, w, sizes, outs: list | None = None) -> list[torch.Tensor]:
    """x @ W^T for a weight fused from up to four parts of `sizes` rows (q|k|v, GDN qkv|z, a|b):
    one bf16 [T, size] output per part. On the GEMV one launch writes each part's rows to its own
    output; on cuBLAS each part is a matmul over its rows of W (so no copies either way)."""
    O, I = _shape(w)
    sizes = [int(n) for n in sizes]
    if not 1 <= len(sizes) <= 4 or min(sizes) < 1 or sum(sizes) != O:
        raise L.KernelError(f"linear_split: sizes {sizes} must be 1 to 4 positive counts summing to {O}")
    dev = w.data.device if isinstance(w, QuantWeight) else w.device
    T = _check_x(x, I, dev)
    outs = list(outs) if outs is not None else [None] * len(sizes)
    if len(outs) != len(sizes):
        raise L.KernelError(f"linear_split: {len(outs)} outputs for {len(sizes)} parts")
    outs = [_out(o, (T, n), dev, f"outs[{i}]") for i, (o, n) in enumerate(zip(outs, sizes))]
    if len(sizes) > 1 and _on_gemv(_kind_of(w), I, T, O=O):
        _gemv(x, w, outs[0], None, swiglu=False, parts=outs)
        return outs
    a = 0
    for o, n in zip(outs, sizes):
        linear(x, weight_rows(w, a, a + n), out=o)
        a += n
    return outs


def weight_rows(w, a: int, b: int):
    """Rows [a, b) of a bf16 or quantised weight, as a view (fp8_block: a % 128 == 0)."""
    if isinstance(w, QuantWeight):
        if w.kind == "fp8_block" and a % 128:
            raise L.KernelError(f"fp8_block weight rows from {a}: must start at a multiple of 128")
        return _slab(w, a, b)
    return w[a:b]


def _on_gemv(kind: str, I: int, T: int, variant: str | None = None, O: int | None = None) -> bool:
    """Whether a launch of T columns goes to the GEMV kernels (else cuBLAS): up to GEMV_COLUMNS[kind];
    a bf16 weight of at most SMALL_BF16_ELEMS elements (O given) up to MAX_GEMV_COLUMNS; and bf16 up
    to 8 columns under the pipelined variant (gemv_bf16_pipe); variant None: the environment's."""
    if T <= gemv_columns(kind, I):
        return True
    if kind == "bf16" and O is not None and O * I <= SMALL_BF16_ELEMS and T <= MAX_GEMV_COLUMNS:
        return True
    variant = variant or gemv_variant()
    if _bf16_pipe_auto(kind, O, I, T, variant):
        return True
    return kind == "bf16" and variant in ("pipelined", "bf16pipe") and pipe_applies(kind, I, T)


def bf16_pipe_elems() -> int:
    """The largest bf16 weight (O * I) whose launches of 3..8 columns take gemv_bf16_pipe under "auto"."""
    v = L.env_int(BF16_PIPE_ENV, 0)
    return BF16_PIPE_ELEMS if v is None else v


def _bf16_pipe_auto(kind: str, O: int | None, I: int, T: int, variant: str) -> bool:
    return (variant == "auto" and kind == "bf16" and O is not None and T > GEMV_COLUMNS["bf16"]
            and SMALL_BF16_ELEMS < O * I <= bf16_pipe_elems() and pipe_applies(kind, I, T))


def gemv_columns(kind: str, I: int) -> int:
    """The most columns of a `kind` weight of in_features I on the GEMV / GEMM: GEMV_COLUMNS[kind], or
    $TANDEM_GEMV_QCOLUMNS for the quantised kinds. nvfp4 without the GEMM (TANDEM_GEMV_MM=0, or rows of an
    odd number of 16-element groups) keeps 32, as before the GEMM existed."""
    q = L.env_int(QCOLUMNS_ENV, 1, 64) if kind != "bf16" else None
    if q is not None:
        return q
    return 32 if kind == "nvfp4" and not mm_applies(kind, I, MM_MAX_COLUMNS) else GEMV_COLUMNS[kind]


def _shape(w):
    if isinstance(w, QuantWeight):
        return w.out_features, w.in_features
    L.check(w, "w", torch.bfloat16)
    if w.dim() != 2:
        raise L.KernelError(f"w: expected [O, I], got shape {tuple(w.shape)}")
    return tuple(w.shape)


def linear_swiglu(x: torch.Tensor, w_gate_up, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[T, F] = silu(x W_gate^T) * (x W_up^T), rows [0, F) of w_gate_up gate and [F, 2F) up, with
    the reference's roundings: gate and up to bf16, silu in fp32 to bf16, the product to bf16."""
    O, I = _shape(w_gate_up)
    if O % 2:
        raise L.KernelError(f"w_gate_up: needs an even number of rows (gate | up), got {O}")
    Fh = O // 2
    dev = w_gate_up.data.device if isinstance(w_gate_up, QuantWeight) else w_gate_up.device
    T = _check_x(x, I, dev)
    out = _out(out, (T, Fh), dev)
    if _on_gemv(_kind_of(w_gate_up), I, T, O=O):
        return _gemv(x, w_gate_up, out, None, swiglu=True)
    return cuda_misc.swiglu(_prefill(x, w_gate_up).contiguous(), out=out)
