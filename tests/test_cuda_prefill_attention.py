"""prefill_attention_batched (kernels/cuda_attention.py, kernels/cuda/prefill_attention.cu) against
kernels/reference.paged_attention computed in float32 from the same pools.

Batches mix sequences of different lengths (1, 63, 64, 65, 300, 2048 columns; none a multiple of 64
beyond those), chunks that continue a cached prompt (keys before the chunk already in the pool, so
positions start past 0, mid-page), and a sequence with no columns. Pages are shuffled; every pool slot
that is not written holds NaN (bf16 pools) or NaN scales (int8 pools), and page table entries past a
sequence's pages point at such a page, so a key read past a tile's last position shows as NaN. Outputs
are poisoned with NaN. Inputs are fresh random values each run (the session seed).

Bounds. The kernel rounds three things the float32 reference does not: the probabilities (bf16, for
the P.V mma), the attention output (bf16, before the gate, as the model's epilogue does) and
sigmoid(gate) (bf16); int8 K/V are also rounded to bf16 after dequantisation. Each is a relative error
of at most 2^-9 per element, uncorrelated between elements, so the relative L2 error of the output is
a few 1e-3 (a CPU emulation of the kernel's arithmetic gave 2.5e-3 .. 3.2e-3). The whole-output bound
is TOL = 1e-2; since one wrong (column, head) row would hardly move the whole-output norm of a large
batch, every row of D values is also held to ROW_TOL = 3e-2 (bf16 noise over 64+ values stays below
~1e-2).
"""

import pytest
import torch

from kernels import reference as ops
from tests.util import rel

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF = torch.bfloat16
TOL = 1e-2
ROW_TOL = 3e-2

SHAPES = {              # H, KV, D
    "27b": (24, 4, 256),
    "27b-tp2": (12, 2, 256),
    "35b": (16, 2, 256),
    "35b-tp2": (8, 1, 256),
    "h8kv2d128": (8, 2, 128),
    "demo": (6, 2, 64),
    "h3kv1d64": (3, 1, 64),          # G = 3: a column's heads straddle warps
    "h10kv5d128": (10, 5, 128),
    "h12kv1d128": (12, 1, 128),
    "h4kv2d32": (4, 2, 32),          # D 32: the torch path
}

# (start, columns): keys 0 .. start - 1 cached before the step, the columns at start .. start + columns - 1
MIXED = [(0, 1), (0, 63), (0, 0), (0, 64), (0, 65), (400, 300), (37, 129), (64, 1)]


def _ca():
    from kernels import cuda_attention
    return cuda_attention


class Batch:
    def __init__(self, shape: str, seqs: list[tuple[int, int]], seed: int, int8: bool = False, spare_pages: int = 2):
        self.H, self.KV, self.D = SHAPES[shape]
        H, KV, D = self.H, self.KV, self.D
        self.seqs, self.int8 = seqs, int8
        g = torch.Generator().manual_seed(seed)
        self.gen = g
        need = [-(-(s + t) // 64) for s, t in seqs]
        max_pages = max(need) + 1
        P = sum(need) + spare_pages
        perm = torch.randperm(P, generator=g)
        table = torch.full((len(seqs), max_pages), int(perm[-1]), dtype=torch.int32)    # never assigned
        at = 0
        for b, n in enumerate(need):
            table[b, :n] = perm[at:at + n].to(torch.int32)
            at += n
        self.tables = table.to(DEV)
        pos, cu = [], [0]
        for s, t in seqs:
            pos += list(range(s, s + t))
            cu.append(cu[-1] + t)
        self.N = len(pos)
        self.cu = cu
        self.positions = torch.tensor(pos, dtype=torch.int32, device=DEV)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=DEV)
        self.max_columns = max(t for _, t in seqs)
        if int8:
            self.k_pool = torch.randint(-127, 128, (P, 64, KV, D), generator=g, dtype=torch.int8).to(DEV)
            self.v_pool = torch.randint(-127, 128, (P, 64, KV, D), generator=g, dtype=torch.int8).to(DEV)
            self.k_scale = torch.full((P, 64, KV, D // 64), float("nan"), device=DEV)
            self.v_scale = torch.full((P, 64, KV, D // 64), float("nan"), device=DEV)
        else:
            self.k_pool = torch.full((P, 64, KV, D), float("nan"), dtype=BF, device=DEV)
            self.v_pool = torch.full((P, 64, KV, D), float("nan"), dtype=BF, device=DEV)
            self.k_scale = self.v_scale = None
        for b, (s, t) in enumerate(seqs):                       # history and the chunk's own keys
            if s + t == 0:
                continue
            p = torch.arange(s + t, device=DEV, dtype=torch.int32)
            ops.paged_kv_write(self.k_pool, self.v_pool, self.tables[b], p, self.randn(s + t, KV, D),
                               self.randn(s + t, KV, D), self.k_scale, self.v_scale)

    def randn(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.gen) * scale).to(BF).to(DEV)

    def reference(self, q: torch.Tensor, gate: torch.Tensor, scale: float) -> torch.Tensor:
        """float32 gated output [N, H*D]."""
        outs = []
        for b in range(len(self.seqs)):
            lo, hi = self.cu[b], self.cu[b + 1]
            if hi > lo:
                outs.append(ops.paged_attention(q[lo:hi].float(), self.k_pool, self.v_pool, self.tables[b],
                                                self.positions[lo:hi], scale, k_scale=self.k_scale,
                                                v_scale=self.v_scale))
        o = torch.cat(outs).reshape(self.N, self.H * self.D)
        return o * torch.sigmoid(gate.reshape(self.N, -1).float())


def _check(out: torch.Tensor, ref: torch.Tensor, H: int, D: int) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} NaN outputs (unwritten, or a key read past a position)"
    err = rel(out, ref)
    assert err <= TOL, f"relative error {err:.3g}"
    a, b = out.double().view(-1, H, D), ref.double().view(-1, H, D)
    row = ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()
    worst = int(row.argmax())
    assert float(row[worst]) <= ROW_TOL, \
        f"row (column {worst // H}, head {worst % H}) relative error {float(row[worst]):.3g} (whole output {err:.3g})"


def _run(c: Batch, strided_gate: bool = True, warps: int | None = None, max_columns: int | None = None,
         q_scale: float = 1.0) -> torch.Tensor:
    ca = _ca()
    H, D, N = c.H, c.D, c.N
    qg = c.randn(N, H * 2 * D, scale=q_scale)
    q, gate2 = ops.split_q_gate(qg, H, D)
    q = q.contiguous()
    gate = qg.view(N, H, 2 * D)[..., D:] if strided_gate else gate2.contiguous()
    scale = D ** -0.5
    out = torch.full((N, H * D), float("nan"), dtype=BF, device=DEV)
    res = ca.prefill_attention_batched(q, c.k_pool, c.v_pool, c.tables, c.positions, c.cu_seqlens, scale, gate,
                                       max_columns or c.max_columns, max_len=max(s + t for s, t in c.seqs),
                                       out=out, k_scale=c.k_scale, v_scale=c.v_scale, warps=warps)
    torch.cuda.synchronize()
    assert res is out
    _check(out, c.reference(q, gate2, scale), H, D)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_batched(shape, seed):
    _run(Batch(shape, MIXED, seed))


@pytest.mark.parametrize("shape", ["27b", "35b-tp2", "demo"])
def test_prefill_batched_long(shape, seed):
    """A 2048-column prompt from position 0 next to a 2048-column chunk continuing a 1000-token prefix."""
    _run(Batch(shape, [(0, 2048), (1000, 2048), (5, 3)], seed))


@pytest.mark.parametrize("shape", ["27b", "27b-tp2", "35b-tp2", "h8kv2d128", "demo", "h3kv1d64"])
def test_prefill_batched_int8(shape, seed):
    _run(Batch(shape, MIXED, seed, int8=True))


def test_prefill_batched_int8_long(seed):
    _run(Batch("35b", [(0, 2048), (300, 700)], seed, int8=True))


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("shape", ["27b-tp2", "h12kv1d128", "demo"])
def test_prefill_batched_warps(shape, warps, int8, seed):
    """Both CTA sizes, with a contiguous gate and a grid sized for N columns (CTAs past a sequence's
    tiles exit). A variant that does not fit this device's shared memory takes the torch path."""
    c = Batch(shape, [(0, 300), (130, 70), (0, 1)], seed, int8=int8)
    _run(c, strided_gate=False, warps=warps, max_columns=c.N)


def test_prefill_batched_sharp_softmax(seed):
    """Large scores (q scaled by 8): the online softmax rescales often and the row max matters."""
    _run(Batch("27b-tp2", [(0, 500), (200, 129)], seed), q_scale=8.0)


def test_prefill_batched_graph_capture(seed):
    """Captured once and replayed with new queries written in place: nothing is read on the host."""
    ca = _ca()
    c = Batch("27b-tp2", [(100, 200), (0, 77)], seed)
    H, D, N = c.H, c.D, c.N
    q, gate = c.randn(N, H, D), c.randn(N, H * D)
    scale = D ** -0.5
    out = torch.full((N, H * D), float("nan"), dtype=BF, device=DEV)
    args = (q, c.k_pool, c.v_pool, c.tables, c.positions, c.cu_seqlens, scale, gate, c.max_columns)
    ca.prefill_attention_batched(*args, out=out)                          # compile, set the smem attribute
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ca.prefill_attention_batched(*args, out=out)
    for _ in range(2):
        q.copy_(c.randn(N, H, D))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, c.reference(q, gate, scale), H, D)


def test_prefill_batched_rejects(seed):
    ca = _ca()
    from kernels.launch import KernelError
    c = Batch("demo", [(0, 10), (3, 4)], seed)
    H, D, N = c.H, c.D, c.N
    q, gate = c.randn(N, H, D), c.randn(N, H * D)
    args = dict(q=q, k_pool=c.k_pool, v_pool=c.v_pool, page_tables=c.tables, positions=c.positions,
                cu_seqlens=c.cu_seqlens, scale=D ** -0.5, gate=gate, max_columns=c.max_columns)
    bad = [
        dict(max_columns=0),
        dict(max_columns=N + 1),
        dict(max_len=c.tables.shape[1] * 64 + 1),
        dict(cu_seqlens=c.cu_seqlens.long()),
        dict(positions=c.positions[:-1]),
        dict(page_tables=c.tables[:1]),
        dict(q=c.randn(N, H + 1, D)),                                        # H not a multiple of KV
        dict(gate=c.randn(N, H * D + 8)),
        dict(scale=0.0),
        dict(k_scale=torch.ones(1, device=DEV)),                              # scales with bf16 pools
    ]
    for change in bad:
        with pytest.raises(KernelError):
            ca.prefill_attention_batched(**{**args, **change})
    with pytest.raises(KernelError):
        ca.prefill_attention_batched(**args, warps=2)


def test_prefill_warps_choice():
    ca = _ca()
    big, small = 227 * 1024, 99 * 1024
    assert ca.prefill_warps(256, False, 1000, 132, big) == 8
    assert ca.prefill_warps(256, False, 10, 132, big) == 4              # 8-warp CTAs would leave SMs idle
    assert ca.prefill_warps(256, False, 1000, 132, small) == 4          # 8 warps: 128 KiB
    assert ca.prefill_warps(256, True, 1000, 132, small) is None        # int8 at D 256 needs ~130 KiB
    assert ca.prefill_warps(32, False, 1000, 132, big) is None
    assert ca.prefill_warps(128, True, 1000, 132, big, warps=4) == 4
    assert ca.prefill_smem_bytes(256, 8, False) == 2 * 256 * (128 + 128) + 32
