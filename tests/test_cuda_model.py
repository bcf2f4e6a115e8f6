"""The CUDA backend end to end on one GPU: CudaHybridModel (kernels, CUDA graphs) against the
float32 reference layer program, on random checkpoints of several shapes.

Teacher forcing: every sequence's tokens are fixed up front; the reference computes float32 logits
at every position in one pass; the CUDA model (bfloat16) prefills a prefix (long chunks: the eager long-step
program, prefill attention and chunked GDN), then decodes the rest one column per sequence per step (or 4 columns, as
in a speculation round), in a batch of sequences of different lengths. At every decoded position
the logits must agree within bfloat16 bounds and the argmax must agree wherever the reference's
top-2 margin is not a near-tie. For MoE configs the references route every token to the experts the
CUDA model chose, and those choices are checked against the float32 router (RouteRecorder).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ranks.model import Batch, HybridModel
from ranks.random_checkpoint import spec_for
from tests.util import page_table, random_weights, rel, tiny_spec

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SPECS = {
    "tiny-dense": lambda: tiny_spec(False),
    "tiny-moe": lambda: tiny_spec(True),
    # the shared expert as wide as the routed ones: folded into them for decode (model_cuda SHARED_FOLD)
    "tiny-moe-folded": lambda: tiny_spec(True, shared_expert_intermediate_size=32),
    "small": lambda: spec_for("small"),
    "27b-4layers": lambda: spec_for("27b", num_layers=4),
    "35b-4layers": lambda: spec_for("35b-a3b", num_layers=4),
}


def _models(spec, seed, graphs=True, ref_device="cpu", fmt="bf16"):
    """(float32 reference, bfloat16 reference, CUDA model) on the same random weights. fmt: the CUDA
    model's weight format; quantised, the references take its weights dequantised (_dequantised)."""
    from ranks.model_cuda import CudaHybridModel
    w32 = random_weights(spec, seed, dtype=torch.float32)
    wb = {k: v.to(device="cuda", dtype=torch.bfloat16) for k, v in w32.items()}
    model = CudaHybridModel(spec, wb, cuda_graphs=graphs, weight_format=fmt)
    if fmt != "bf16":
        w32 = _dequantised(w32, model.w)
    ref = HybridModel(spec, {k: v.to(ref_device) for k, v in w32.items()})
    ref16 = HybridModel(spec, {k: v.to(device=ref_device, dtype=torch.bfloat16) for k, v in w32.items()})
    return ref, ref16, model


def _dequantised(w32, w):
    """The reference's weights for a quantised CUDA model: every weight the model holds quantised (its
    fused projections' parts are row slices of the fused weight's quantised form; gate and up are rows
    of gate_up_proj) dequantised to float32, the others as they were."""
    from kernels.quant import QuantWeight
    out = {}
    for name, t in w32.items():
        q, deq = w.get(name), None
        if isinstance(q, QuantWeight):
            deq = q.dequantize(torch.float32)
        elif q is None and name.endswith(("gate_proj.weight", "up_proj.weight")) and "gate_up_proj" not in name:
            half = "gate_proj.weight" if name.endswith("gate_proj.weight") else "up_proj.weight"
            fused = w.get(name[: -len(half)] + "gate_up_proj.weight")
            if isinstance(fused, QuantWeight):
                both = fused.dequantize(torch.float32)
                F = both.shape[0] // 2
                deq = both[:F] if half == "gate_proj.weight" else both[F:]
        out[name] = t if deq is None else deq.to(t.device)
    return out


def _reference_logits(ref, seqs, routes=None, forced=None):
    """Every position's logits of each sequence (one pass each). routes: a list that receives, per
    sequence, every MoE layer's router logits in layer order (float32 [len, experts] each). forced:
    per sequence and MoE layer, the experts each position is routed to ([len, top_k] ids, -1 where
    the reference keeps its own choice); their weights are still the reference's softmax over its
    own router logits, renormalised over the forced experts (RouteRecorder)."""
    import kernels.reference as R
    out = []
    for s, ids in enumerate(seqs):
        st = ref.new_state(1, (len(ids) + 63) // 64 + 1)
        b = Batch(torch.tensor(ids), [len(ids)], [0], [0], page_table(1, (len(ids) + 63) // 64 + 1))
        seen, route = [], R.moe_route

        def routed(x, w_router, top_k):
            logits = torch.nn.functional.linear(x, w_router)
            layer = len(seen)
            seen.append(logits.float().cpu())
            weights, own = route(x, w_router, top_k)
            if forced is None:
                return weights, own
            pick = forced[s][layer].to(own.device)
            pick = torch.where(pick >= 0, pick, own)
            probs = torch.softmax(logits, dim=-1, dtype=R._acc_dtype(logits)).gather(-1, pick)
            return (probs / probs.sum(-1, keepdim=True)).to(logits.dtype), pick

        R.moe_route = routed
        try:
            out.append(ref.forward(b, st, logits="all").logits.float().cpu())
        finally:
            R.moe_route = route
        if routes is not None:
            routes.append(seen)
    return out


def _forced_references(ref, ref16, seqs, routing, name):
    """(float32, bfloat16, perturbed) references of every sequence: the logits of the first two, and a
    PerturbedReferences on the float32 one; with a RouteRecorder (MoE), all run on the experts the
    CUDA model chose, and its choices are checked against the float32 router."""
    forced = routing.ids if routing else None
    routes, routes16 = [], []
    want = _reference_logits(ref, seqs, routes, forced)
    want16 = _reference_logits(ref16, seqs, routes16, forced)
    if routing:
        routing.check(routes, routes16)
        print(f"{name}: routed unlike the float32 reference at a near-tie: {routing.flips or 'nowhere'}")
    return want, want16, PerturbedReferences(ref, seqs, forced)


class PerturbedReferences:
    """How well conditioned a position is: the float32 reference's logits on its own weights with
    bfloat16-sized relative noise (each weight times 1 + 2^-8 N(0, 1)), `samples` draws, on the same
    experts as the other references; built only when some position goes past Agreement's
    per-position bound, and judged there (Agreement.add).

    The bf16 reference's error at a position is one sample of how far bf16 rounding moves it. At most
    positions that sample is typical, but a random hot model has ill-conditioned positions where
    rounding-sized changes move the logits by ~1: test_teacher_forced[1-tiny-moe-folded] at base seed
    1612353068, position 67 of its third sequence, CUDA 0.988 off the float32 reference where the bf16
    reference was 0.056 off, and six noisy float32 references 0.21-1.27 off (0.02-0.12 at the positions
    around it; a float64 reference 4e-5 off, so float32 itself is not the problem there)."""

    def __init__(self, ref, seqs, forced, samples: int = 2):
        self.ref, self.seqs, self.forced, self.samples, self._logits = ref, seqs, forced, samples, None

    def error(self, b: int, at: int, want: torch.Tensor) -> float:
        """The largest relative error of the noisy references' rows at..at+len(want) of sequence b."""
        if self._logits is None:
            self._logits = []
            for s in range(self.samples):
                g = torch.Generator().manual_seed(1000 + s + sum(self.seqs[0][:8]))
                noisy = {k: v * (1 + 2.0 ** -8 * torch.randn(v.shape, generator=g).to(v.device, v.dtype))
                         if v.is_floating_point() else v for k, v in self.ref.w.items()}
                self._logits.append(_reference_logits(HybridModel(self.ref.spec, noisy), self.seqs, None, self.forced))
                del noisy
        return max(rel(logits[b][at:at + want.shape[0]], want) for logits in self._logits)


class RouteRecorder:
    """The experts the CUDA model routes every (sequence, position, MoE layer) to, so that the references
    can take the same ones (_reference_logits(forced=...)).

    Top-k routing is discontinuous: where the float32 router's k-th and (k+1)-th logits nearly tie, a
    bfloat16 model may pick the other expert, which changes that position's output and, through the
    GDN state and the KV, every later position of its sequence. Tiny random MoE models do this in
    nearly every sequence (the bf16 reference itself does), so comparing logits per position against
    references that route on their own mixes kernel error with discrete flips. Forcing the references
    onto the CUDA model's experts leaves only continuous error in the logits; the choices themselves
    are checked here: where the CUDA model's experts differ from the float32 reference's own top-k on
    that same path, the reference's gap between its k-th and (k+1)-th router logit must be below
    `factor` times the router logits' error at that point (the largest over the experts): the larger
    of the bfloat16 reference's and the CUDA model's own. The bf16 reference's error alone is one
    sample of the noise, and the CUDA model's can be several times it at a point: with it alone, two
    positions past 4x failed 2 of 5 fresh seeds of the twenty-second session (gap 0.907 against 0.19,
    0.296 against 0.053; 0.664 against 0.062, 0.566 against 0.075), on the kernels of two sessions.
    The CUDA model's router logits are held to the bf16 reference's the way Agreement holds the
    logits: over every routed point, their error sums to at most twice the bf16 reference's (plus
    1%), so a wrong router projection cannot excuse its own flips. One position may still go past
    `factor` (up to `hard`); a second, or any choice past `hard`, is a routing bug (a wrong rule or
    tie-break flips many positions at clear margins, not one).

    Records kernels.cuda_misc.moe_route's logits and results (wrapped; eager forwards only, where
    every call runs the wrapper). One call per MoE layer per forward, columns in batch order."""

    def __init__(self, monkeypatch, top_k, lengths, module=None):
        import kernels.cuda_misc as cm
        cm = cm if module is None else module             # another moe_route to wrap (a CPU dry run)
        self.k, self.lengths, self.ids, self.logits, self.calls, self.flips = top_k, lengths, None, None, [], []
        self.shared: dict[int, int] = {}
        route = cm.moe_route

        def recording(logits, top_k, *args, **kwargs):
            weights, ids = route(logits, top_k, *args, **kwargs)
            routed = logits[:, :logits.shape[1] - int(kwargs.get("shared", False))]   # not the shared gate
            self.calls.append((ids[:, :self.k].long().cpu(), routed.float().cpu()))
            return weights, ids

        monkeypatch.setattr(cm, "moe_route", recording)

    def step(self, *parts):
        """After one forward: each part = (sequence, position) of each column of one pass over the layers,
        in order: one part for a plain step; a step the model runs in parts (forward_in_parts) makes one
        pass per part, in the order it runs them."""
        calls, self.calls = self.calls, []
        if self.ids is None:
            L, X = len(calls) // len(parts), calls[0][1].shape[1]
            self.ids = [[torch.full((n, self.k), -1, dtype=torch.long) for _ in range(L)] for n in self.lengths]
            self.logits = [[torch.full((n, X), float("nan")) for _ in range(L)] for n in self.lengths]
        L = len(self.ids[0])
        assert len(calls) == L * len(parts), f"{len(calls)} router calls for {len(parts)} passes of {L} MoE layers"
        for p, rows in enumerate(parts):
            for layer, (ids, logits) in enumerate(calls[p * L:(p + 1) * L]):
                assert ids.shape[0] == len(rows), (tuple(ids.shape), len(rows))
                for i, (b, t) in enumerate(rows):
                    self.ids[b][layer][t] = ids[i]
                    self.logits[b][layer][t] = logits[i]

    def share(self, dst: int, src: int, n: int):
        """Sequence `dst` took sequence `src`'s experts at its first n positions (one computation seen
        by two teacher-forced sequences that share those tokens)."""
        for layer in range(len(self.ids[dst])):
            self.ids[dst][layer][:n] = self.ids[src][layer][:n]
            self.logits[dst][layer][:n] = self.logits[src][layer][:n]
        self.shared[dst] = n                    # check() counts those choices once, as src's

    def check(self, routes, routes16, factor=4.0, hard=16.0):
        """routes / routes16: the float32 / bfloat16 references' router logits on the forced path."""
        clear, own_sum, bf16_sum = [], 0.0, 0.0
        for b, layers in enumerate(self.ids):
            for layer, ids in enumerate(layers):
                for t in torch.nonzero(ids[:, 0] >= 0).flatten().tolist():
                    if t < self.shared.get(b, 0):
                        continue
                    ref = routes[b][layer][t]
                    err16 = float((routes16[b][layer][t] - ref).abs().max())
                    own = float((self.logits[b][layer][t] - ref).abs().max())
                    own_sum, bf16_sum = own_sum + own, bf16_sum + err16
                    want = set(ref.topk(self.k).indices.tolist())
                    got = set(ids[t].tolist())
                    if got == want:
                        continue
                    top = ref.topk(self.k + 1).values
                    gap = float(top[self.k - 1] - top[self.k])
                    noise = max(err16, own)
                    where = f"seq {b} position {t} MoE layer {layer}: experts {sorted(got)}, float32 reference {sorted(want)}"
                    what = f"{where} (gap {gap:.3g}, router error: bf16 reference {err16:.3g}, CUDA {own:.3g})"
                    assert gap < hard * noise, f"{what}: at a clear margin"
                    if gap >= factor * noise:
                        clear.append(((b, t), what))
                    self.flips.append(what)
        assert own_sum <= 2 * bf16_sum * 1.01, (f"router logits: the CUDA model's error sums to {own_sum:.4g} over "
                                                f"the routed points, the bf16 reference's to {bf16_sum:.4g}")
        positions = {where for where, _ in clear}
        assert len(positions) <= 1, (f"{len(positions)} positions with routing choices past {factor}x the router "
                                     f"error: {[what for _, what in clear]}")


class Agreement:
    """Collects (CUDA, float32 reference, bfloat16 reference) logits over all checked positions.

    The bf16 bound: over all positions, the CUDA model may be off the float32 reference by at most
    twice what the reference program itself is off in bfloat16 (plus 1%); per position, by at most
    6x (plus 2%), which still catches a broken position without failing on the chaotic
    single-position noise of hot random tiny models. Argmax must agree at >= 99% of the positions
    whose float32 top-2 margin exceeds twice the bfloat16 reference's largest error in that row,
    with one miss allowed (a sample of a few clear positions cannot resolve 99%).

    `allowed` (the hottest model, tiny-dense, on quantised weights only; see
    test_quantised_teacher_forced_logits_match_the_float32_reference) chunks may go past the
    per-position bound. Such a chunk is left out of the overall bound and the argmax count (one
    chunk at 0.875 against a 0.05 bf16 reference error put a 48-position decode aggregate at 0.284
    against its 0.222 bound, twenty-first session), and each allowance is one more argmax miss too:
    the same amplification flips argmaxes at margins the bf16 reference calls clear (tiny-dense
    ct-fp8-channel prefill, 54/56, no chunk past its bound, that session). MoE comparisons put the
    references on the CUDA model's experts (RouteRecorder), so none of this is theirs."""

    def __init__(self, name, allowed: int = 0):
        self.name, self.got, self.want, self.want16 = name, [], [], []
        self.agree = self.total = 0
        self.outliers, self.allowed, self.conditioned, self.chunks = [], allowed, [], 0

    def add(self, got, want, want16, where, noise=None):
        """noise: a callable giving the perturbed references' error on these rows (PerturbedReferences),
        asked only for a chunk past the per-position bound: within 6x that (plus 2%) the chunk is an
        ill-conditioned one, reported and left out like an allowed chunk, for at most 1 + 5% of the
        chunks; past that, such chunks count against `allowed` as any other."""
        got, want, want16 = got.float().cpu(), want.float().cpu(), want16.float().cpu()
        assert torch.isfinite(got).all(), f"{where}: non-finite logits"
        self.chunks += 1
        e, e16 = rel(got, want), rel(want16, want)
        if e > 6 * e16 + 0.02:
            en = noise(want) if noise is not None else 0.0
            if e <= 6 * en + 0.02 and len(self.conditioned) + 1 <= 1 + 0.05 * self.chunks:
                self.conditioned.append(f"{where}: relative error {e:.3g} (bf16 reference: {e16:.3g}, "
                                        f"perturbed float32 references: up to {en:.3g})")
                return
            self.outliers.append(f"{where}: relative error {e:.3g} (bf16 reference: {e16:.3g}"
                                 + (f", perturbed float32 references: up to {en:.3g})" if noise else ")"))
            assert len(self.outliers) <= self.allowed, "; ".join(self.outliers)
            return                                          # allowed: excused from the rest
        top2 = want.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 2 * (want16 - want).abs().amax(dim=-1)
        agree = (got.argmax(-1) == want.argmax(-1))[clear]
        self.agree += int(agree.sum())
        self.total += int(agree.numel())
        self.got.append(got)
        self.want.append(want)
        self.want16.append(want16)

    def check(self):
        assert self.got, f"{self.name}: every chunk was an allowed outlier ({self.outliers})"
        got, want, want16 = (torch.cat(t) for t in (self.got, self.want, self.want16))
        e, e16 = rel(got, want), rel(want16, want)
        print(f"{self.name}: relative error {e:.3g} over {got.shape[0]} positions (bf16 reference {e16:.3g}); "
              f"argmax {self.agree}/{self.total} at clear margins; outliers: {self.outliers or 'none'}; "
              f"ill-conditioned: {self.conditioned or 'none'}")
        assert e <= 2 * e16 + 0.01, f"{self.name}: relative error {e:.3g} (bf16 reference: {e16:.3g})"
        misses = self.total - self.agree
        assert misses <= 1 + self.allowed + 0.01 * self.total, \
            f"argmax agreement {self.agree}/{self.total} at clear margins"
        return self.total


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("columns", [1, 4])
def test_teacher_forced_logits_match_the_float32_reference(name, columns, seed, monkeypatch):
    """MoE configs run eagerly so that their routing can be recorded; the references then take the
    CUDA model's experts (RouteRecorder), and the choices are checked on their own. (Their CUDA
    graphs are the bit-exact replay test's.)"""
    spec = SPECS[name]()
    g = torch.Generator().manual_seed(seed)
    big = name.startswith(("27b", "35b"))
    ref, ref16, model = _models(spec, seed, graphs=not spec.is_moe, ref_device="cuda" if big else "cpu")
    # the big random models have flat output distributions (248k vocabulary): ~6% of positions have
    # a clear top-2 margin, so they need ~190 positions for the argmax check to see some (49 saw none
    # for one seed of 35b-4layers)
    lengths = [41, 23, 70] if not big else [100, 90]
    prefix = [17, 5, 33] if not big else [17, 5]
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]
    B = len(seqs)
    pages = 4
    state = model.new_state(B, B * pages)
    tables = page_table(B, pages)
    routing = RouteRecorder(monkeypatch, spec.num_experts_per_tok, lengths) if spec.is_moe else None
    outs = []                                 # (prefill?, sequence, first position, logits rows, where)
    # prefill each prefix (long chunks: the eager long-step program; short ones: the decode kernels)
    for b, (ids, p) in enumerate(zip(seqs, prefix)):
        out = model.forward(Batch(torch.tensor(ids[:p]), [p], [0], [b], tables[b:b + 1]), state, logits="all")
        if routing:
            routing.step([(b, t) for t in range(p)])
        outs.append((True, b, 0, out.logits.float().cpu(), f"{name} prefill seq {b}"))
    pos = list(prefix)
    while True:
        live = [b for b in range(B) if pos[b] + columns <= lengths[b]]
        if not live:
            break
        ids = sum((seqs[b][pos[b]:pos[b] + columns] for b in live), [])
        batch = Batch(torch.tensor(ids), [columns] * len(live), [pos[b] for b in live], live, tables[live])
        out = model.forward(batch, state, logits="all" if columns > 1 else "last")
        if routing:
            routing.step([(b, pos[b] + c) for b in live for c in range(columns)])
        for i, b in enumerate(live):
            rows = out.logits[i * columns:(i + 1) * columns] if columns > 1 else out.logits[i:i + 1]
            outs.append((False, b, pos[b], rows.float().cpu(), f"{name} seq {b} at {pos[b]}"))
            pos[b] += columns
    want, want16, noisy = _forced_references(ref, ref16, seqs, routing, name)
    # with the references on the CUDA model's experts, MoE logits are as continuous as dense ones
    _check_prefill_and_decode(outs, want, want16, f"{name} prefill", f"{name} T={columns}", noisy=noisy)


def _check_prefill_and_decode(outs, want, want16, prefill_name, decode_name, allowed: int = 0, noisy=None):
    """outs: (prefill?, sequence, first position, logits rows, where); each row against the references'
    rows of that sequence, prefill and decode rows as two Agreements (each allowing `allowed` positions
    past the per-position bound, and ill-conditioned ones by the PerturbedReferences `noisy`); some
    position must have been clear."""
    prefill, decode = Agreement(prefill_name, allowed), Agreement(decode_name, allowed)
    for is_prefill, b, at, rows, where in outs:
        n = rows.shape[0]
        noise = (lambda w, b=b, at=at: noisy.error(b, at, w)) if noisy is not None else None
        (prefill if is_prefill else decode).add(rows, want[b][at:at + n], want16[b][at:at + n], where, noise)
    assert prefill.check() + decode.check() > 0, "no position with a clear top-2 margin: the test checked no argmax"


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4"])
@pytest.mark.parametrize("name", ["tiny-dense", "small", "27b-4layers"])
def test_quantised_teacher_forced_logits_match_the_float32_reference(name, fmt, seed):
    """A quantised CUDA model (--weights fp8 / fp8-block / nvfp4) against the references on its own
    weights dequantised: prefill chunks of 9..64 tokens (the dequantising GEMM), of more (dequantise +
    cuBLAS), of a few (the GEMV), then decode steps of 1 and 3 columns; the same bounds as bf16."""
    spec = SPECS[name]()
    big = name.startswith("27b")
    ref, ref16, model = _models(spec, seed, ref_device="cuda" if big else "cpu", fmt=fmt)
    # tiny-dense (hidden 64, the hottest random model) puts a chunk or two past the per-position bound
    # on 4-bit weights now and then, through the GEMV as often as through the GEMM: over 48 seeds
    # (seventeenth session, tests/gpu-runs.md) the GEMM had such chunks at 4 seeds, the GEMV at 3 (the
    # same 3 among them), at most 2 per run, at most 1.69x the bound; every other chunk within it, and
    # both kernels pass their own tests at these shapes. So it is the hot model's amplification of bf16
    # rounding on nvfp4 weights, not a kernel's error: two such chunks are allowed there (one for fp8,
    # where none was seen), none for the other models.
    allowed = (2 if fmt == "nvfp4" else 1) if name == "tiny-dense" else 0
    _teacher_forced_chunks(spec, model, ref, ref16, f"{name} {fmt}", allowed, seed)


def _teacher_forced_chunks(spec, model, ref, ref16, label: str, allowed: int, seed: int) -> None:
    """Prefill chunks of 9..64 tokens (the dequantising GEMM), of more (dequantise + cuBLAS), of a few
    (the GEMV), then decode steps of 1 and 3 columns, against the references' logits."""
    name = label
    g = torch.Generator().manual_seed(seed)
    lengths = [100, 90, 80]
    chunks = [[33, 7, 24], [70], [12, 40, 3]]           # per sequence: prefill chunk lengths
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]
    B, pages = len(seqs), 4
    state = model.new_state(B, B * pages)
    tables = page_table(B, pages)
    outs, pos = [], [0] * B
    for b, cs in enumerate(chunks):
        for n in cs:
            ids = seqs[b][pos[b]:pos[b] + n]
            out = model.forward(Batch(torch.tensor(ids), [n], [pos[b]], [b], tables[b:b + 1]), state, logits="all")
            outs.append((True, b, pos[b], out.logits.float().cpu(), f"{label} prefill seq {b} at {pos[b]}"))
            pos[b] += n
    for columns in (1, 3):
        for _ in range(4):
            live = [b for b in range(B) if pos[b] + columns <= lengths[b]]
            ids = sum((seqs[b][pos[b]:pos[b] + columns] for b in live), [])
            out = model.forward(Batch(torch.tensor(ids), [columns] * len(live), [pos[b] for b in live], live,
                                      tables[live]), state, logits="all")
            for i, b in enumerate(live):
                outs.append((False, b, pos[b], out.logits[i * columns:(i + 1) * columns].float().cpu(),
                             f"{label} seq {b} at {pos[b]}"))
                pos[b] += columns
    want, want16, noisy = _forced_references(ref, ref16, seqs, None, name)
    _check_prefill_and_decode(outs, want, want16, f"{label} prefill", f"{label} decode", allowed=allowed,
                              noisy=noisy)


@pytest.mark.parametrize("name,fmt", [(n, f) for f in ["fp8", "modelopt", "compressed-tensors", "ct-fp8-channel",
                                                        "modelopt-fp8"]
                                      for n in (["small"] if f in ("modelopt", "compressed-tensors")
                                                else ["tiny-dense", "small"])])
def test_pre_quantised_checkpoint_teacher_forced_logits_match_the_float32_reference(tmp_path, name, fmt, seed):
    """A pre-quantised checkpoint (FP8 block-scaled, ModelOpt / compressed-tensors NVFP4) loaded for the
    CUDA backend keeps its linear weights quantised (QuantWeight, fused where exact) and matches the
    references on the checkpoint's weights dequantised, with the --weights bounds of that format.

    The NVFP4 checkpoints run on `small` only: on tiny-dense (hidden 64, the hottest random model) the
    48-position decode aggregate went past its bound at one seed twice (2.2x the bf16 reference's error
    with the allowed chunk left out, twenty-first session) while `small` stays at ~1x; the loading is
    shape-generic and checked on the CPU at tiny shapes and tp 2 slices (test_checkpoint_quant.py), and
    the kernels at tiny-dense's shapes are test_quantised_teacher_forced_logits's."""
    from kernels.quant import QuantWeight
    from ranks.model_cuda import CudaHybridModel
    from ranks.weights import Checkpoint, load_weights
    from tests.test_checkpoint_quant import KIND, write_quantised

    cfg = tiny_config_for(name)
    spec, _ = write_quantised(str(tmp_path), cfg, fmt, seed)
    w32 = load_weights(Checkpoint(tmp_path), spec)
    wq = load_weights(Checkpoint(tmp_path), spec, dtype=torch.bfloat16, device="cuda", keep_quantised=True)
    model = CudaHybridModel(spec, wq)
    kinds = {q.kind for q in model.w.values() if isinstance(q, QuantWeight)}
    assert kinds == {KIND[fmt]}
    assert isinstance(model.w["layers.0.mlp.gate_up_proj.weight"], QuantWeight)
    ref = HybridModel(spec, w32)
    ref16 = HybridModel(spec, {k: v.to(torch.bfloat16) for k, v in w32.items()})
    allowed = 1 if name == "tiny-dense" else 0
    _teacher_forced_chunks(spec, model, ref, ref16, f"{name} {fmt} checkpoint", allowed, seed)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "small"])
def test_prefill_resumed_from_a_snapshot_matches_the_whole_prefill(name, seed):
    """The prefix cache's path on the CUDA backend: sequence A prefills past a frontier F, its slot's
    GDN state is saved to a snapshot at F; B (A's first F tokens, then its own) loads it into a slot
    that held garbage, shares A's pages [0, F) and prefills from F. Its logits are as close to the
    float32 reference's whole prefill of B as the CUDA model's own whole prefill of B is."""
    spec = SPECS[name]()
    ref, _, model = _models(spec, seed)
    g = torch.Generator().manual_seed(seed)
    F = 128
    a = torch.randint(0, spec.vocab_size, (F + 40,), generator=g)
    b = torch.cat([a[:F], torch.randint(0, spec.vocab_size, (70,), generator=g)])
    state = model.new_state(2, 8)
    state.reserve_snapshots(1)
    for t in state.conv + state.recurrent:
        t[1].normal_()
    ta = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    model.forward(Batch(a[:90], [90], [0], [0], ta), state, logits="none")
    model.forward(Batch(a[90:F], [F - 90], [90], [0], ta), state, logits="none")
    state.save_snapshot(0, 0)
    model.forward(Batch(a[F:], [40], [F], [0], ta), state, logits="none")
    state.load_snapshot(0, 1)
    got = model.forward(Batch(b[F:], [70], [F], [1], torch.tensor([[0, 1, 4, 5]], dtype=torch.int32)), state,
                        logits="all").logits.float().cpu()
    fresh = model.new_state(1, 4)
    whole = model.forward(Batch(b, [len(b)], [0], [0], torch.arange(4, dtype=torch.int32)[None]), fresh,
                          logits="all").logits[F:].float().cpu()
    want = _reference_logits(ref, [b.tolist()])[0][F:]
    e_got, e_whole = rel(got, want), rel(whole, want)
    print(f"{name}: resumed {e_got:.3g}, whole {e_whole:.3g} from the float32 reference")
    assert e_got <= 1.5 * e_whole + 1e-3


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "small"])
def test_snapshots_saved_inside_a_prefill_step_resume_like_the_whole_prefill(name, seed):
    """Batch.saves on the CUDA backend (the rule in launches split at the save points, the conv windows
    copied before the conv): sequence A, resumed part-way, prefills 230 columns in one step with saves
    at two frontiers, one 2 columns into the step (its conv window reaches back into the slot's). Its
    own logits stay as close to the float32 reference as the same step without saves; each snapshot
    resumes a sequence B as closely as B's whole prefill on the CUDA model."""
    spec = SPECS[name]()
    ref, _, model = _models(spec, seed)
    g = torch.Generator().manual_seed(seed)
    start, F1, F2 = 62, 64, 192
    a = torch.randint(0, spec.vocab_size, (start + 230,), generator=g)
    want_a = _reference_logits(ref, [a.tolist()])[0][start:]
    outs = []
    for saves in ([], [(0, F1 - start, 0), (0, F2 - start, 1)]):
        state = model.new_state(2, 10)
        state.reserve_snapshots(2)
        for t in state.conv + state.recurrent + state.snap_conv + state.snap_recurrent:
            t.normal_()                                             # garbage the step must not read
        ta = torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32)
        model.forward(Batch(a[:start], [start], [0], [0], ta), state, logits="none")
        out = model.forward(Batch(a[start:], [230], [start], [0], ta, saves), state, logits="all")
        outs.append(out.logits.float().cpu())
    e_plain, e_saving = rel(outs[0], want_a), rel(outs[1], want_a)
    print(f"{name}: A with saves {e_saving:.3g}, without {e_plain:.3g}")
    assert e_saving <= 1.5 * e_plain + 1e-3
    for F, snap in ((F1, 0), (F2, 1)):
        b = torch.cat([a[:F], torch.randint(0, spec.vocab_size, (70,), generator=g)])
        state.load_snapshot(snap, 1)
        pages = F // 64
        tb = torch.tensor([list(range(pages)) + list(range(5, 5 + 5 - pages))], dtype=torch.int32)
        got = model.forward(Batch(b[F:], [70], [F], [1], tb), state, logits="all").logits.float().cpu()
        fresh = model.new_state(1, 5)
        whole = model.forward(Batch(b, [len(b)], [0], [0], torch.arange(5, dtype=torch.int32)[None]), fresh,
                              logits="all").logits[F:].float().cpu()
        want = _reference_logits(ref, [b.tolist()])[0][F:]
        e_got, e_whole = rel(got, want), rel(whole, want)
        print(f"{name}: resumed at {F} {e_got:.3g}, whole {e_whole:.3g}")
        assert e_got <= 1.5 * e_whole + 1e-3, F


def tiny_config_for(name: str) -> dict:
    from ranks.random_checkpoint import text_config
    from tests.util import tiny_config
    return tiny_config(False) if name == "tiny-dense" else text_config("small")


def test_generate_cli_runs_a_pre_quantised_checkpoint_on_cuda(tmp_path, seed):
    from tests.test_checkpoint_quant import write_quantised
    write_quantised(str(tmp_path), tiny_config_for("small"), "fp8", seed)
    r = subprocess.run([sys.executable, "-m", "server.cli", "generate", str(tmp_path), "--device", "cuda",
                        "--dtype", "bfloat16", "--greedy", "--max-new-tokens", "16", "--prompt-ids", "1,2,3,4,5",
                        "--print-token-ids", "--ignore-eos"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-moe-folded", "small"])
def test_mixed_prefill_and_decode_steps_match_the_float32_reference(name, seed, monkeypatch):
    """Steps that carry decode columns (1-3 per sequence) beside other sequences' prefill chunks run
    the long-step program: the leading decodes through the split decode kernel, the rest through the
    prefill kernel. In the scheduler's order (decodes first), the other way round, and with a short
    sequence after a chunk, every column's logits agree with the float32 reference."""
    spec = SPECS[name]()
    ref, ref16, model = _models(spec, seed, graphs=False)
    g = torch.Generator().manual_seed(seed)
    lengths = [210, 50, 160]
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]
    B, pages = len(seqs), 4
    state, tables = model.new_state(B, B * pages), page_table(B, pages)
    routing = RouteRecorder(monkeypatch, spec.num_experts_per_tok, lengths) if spec.is_moe else None
    plan = [[(0, 200)],                        # a long context for sequence 0 to decode against
            [(0, 1), (1, 40)],                 # a decode, then a fresh prompt's chunk
            [(0, 3), (1, 1), (2, 60)],         # two short sequences (3 and 1 columns) before a chunk
            [(2, 50), (0, 1)],                 # a chunk before a decode (all through the prefill kernel)
            [(0, 1), (2, 17), (1, 2)],         # a decode, a 17-column chunk, then a short sequence
            [(1, 1), (0, 1), (2, 30)]]
    pos = [0] * B
    outs = []                                           # (sequence, first position, logits rows, where)
    for step in plan:
        ids = sum((seqs[b][pos[b]:pos[b] + c] for b, c in step), [])
        rows = [b for b, _ in step]
        batch = Batch(torch.tensor(ids), [c for _, c in step], [pos[b] for b in rows], rows, tables[rows])
        out = model.forward(batch, state, logits="all")
        if routing:
            routing.step([(b, pos[b] + t) for b, c in step for t in range(c)])
        at = 0
        for b, c in step:
            outs.append((b, pos[b], out.logits[at:at + c].float().cpu(), f"{name} step {step}: seq {b} at {pos[b]}"))
            at, pos[b] = at + c, pos[b] + c
    want, want16, noisy = _forced_references(ref, ref16, seqs, routing, name)
    check = Agreement(f"{name} mixed")        # the references on the CUDA model's experts (RouteRecorder)
    for b, at, rows, where in outs:
        check.add(rows, want[b][at:at + rows.shape[0]], want16[b][at:at + rows.shape[0]], where,
                  lambda w, b=b, at=at: noisy.error(b, at, w))
    assert check.check() > 0, "no position with a clear top-2 margin: the test checked no argmax"


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-moe-folded", "small"])
def test_speculation_step_with_a_prompt_chunk_matches_the_float32_reference(name, seed, monkeypatch):
    """A verification step that also carries a prompt chunk, as the engine plans one when a request
    arrives during speculation: the CUDA model runs it in two parts (forward_in_parts: the verification
    on the fast program, the chunk as a long step). Every column's logits agree with the references'
    teacher-forced logits of what each sequence holds at that step, and after the commit (drafts
    rejected: the kept state is the one after the accepted columns) so do the next step's. MoE configs
    run eagerly and the references take the CUDA model's experts (RouteRecorder): a routing flip at one
    near-tie moves that position and every later one of its sequence, which an argmax check at a few
    verification columns cannot tell from a kernel error (twice in ~8 runs of the twenty-first session
    before the references were forced)."""
    spec = SPECS[name]()
    ref, ref16, model = _models(spec, seed, graphs=not spec.is_moe)
    g = torch.Generator().manual_seed(seed)
    B, pages = 3, 3
    tables = page_table(B, pages)
    prefix = {0: 20, 2: 30}
    pre = {b: torch.randint(0, spec.vocab_size, (n,), generator=g) for b, n in prefix.items()}
    columns, starts, flags = [4, 70, 4], [20, 0, 30], [True, False, True]
    ids = torch.randint(0, spec.vocab_size, (sum(columns),), generator=g)
    nxt = torch.randint(0, spec.vocab_size, (B,), generator=g)
    accepted = [2, 0]                                   # for the kept sequences 0 and 2
    held = [prefix[0] + accepted[0] + 1, columns[1], prefix[2] + accepted[1] + 1]   # tokens kept per sequence
    chunk = [ids[:4], ids[4:74], ids[74:]]
    at_step = [torch.cat([pre[0], chunk[0]]), chunk[1], torch.cat([pre[2], chunk[2]])]
    after = [torch.cat([s[:n], nxt[b:b + 1]]) for b, (s, n) in enumerate(zip(at_step, held))]
    seqs = [s.tolist() for s in at_step + after]        # the references' sequences: 0-2 at the step, 3-5 after
    routing = RouteRecorder(monkeypatch, spec.num_experts_per_tok, [len(s) for s in seqs]) if spec.is_moe else None
    st = model.new_state(B, B * pages)
    for b, p in pre.items():
        model.forward(Batch(p, [len(p)], [0], [b], tables[b:b + 1]), st, logits="none")
        if routing:
            routing.step([(b, t) for t in range(len(p))])
    out = model.forward(Batch(ids, columns, starts, [0, 1, 2], tables), st, logits="all", keep_columns=flags)
    if routing:                 # forward_in_parts: the kept sequences' verification first, then the chunk
        routing.step([(b, starts[b] + t) for b in (0, 2) for t in range(columns[b])],
                     [(1, t) for t in range(columns[1])])
    assert out.kept.seqs == [0, 2], out.kept.seqs
    step = out.logits.float().cpu()
    model.commit(out.kept, st, accepted)
    nxt_at = [len(s) - 1 for s in after]
    then = model.forward(Batch(nxt, [1] * B, nxt_at, [0, 1, 2], tables), st, logits="last").logits.float().cpu()
    if routing:
        routing.step([(3 + b, t) for b, t in enumerate(nxt_at)])
        for b in range(B):
            routing.share(3 + b, b, held[b])
    want, want16, noisy = _forced_references(ref, ref16, seqs, routing, name)
    check = Agreement(f"{name} verification + prompt chunk")
    at = 0
    for b, c in enumerate(columns):
        s = starts[b]
        check.add(step[at:at + c], want[b][s:s + c], want16[b][s:s + c], f"{name} step, seq {b}",
                  lambda w, b=b, s=s: noisy.error(b, s, w))
        at += c
    for b in range(B):
        t = nxt_at[b]
        check.add(then[b:b + 1], want[3 + b][t:t + 1], want16[3 + b][t:t + 1], f"{name} the step after the commit, seq {b}",
                  lambda w, b=b, t=t: noisy.error(3 + b, t, w))
    assert check.check() > 0, "no position with a clear top-2 margin: the test checked no argmax"


@pytest.mark.parametrize("name,folded", [("tiny-moe", False), ("tiny-moe-folded", True), ("35b-4layers", True)])
def test_shared_expert_is_folded_where_shapes_allow(name, folded, seed):
    """The decode path routes the shared expert as one more expert exactly where its shapes match the
    routed experts' (else the teacher-forced tests above would pass on the unfolded path alone)."""
    from ranks.model_cuda import SHARED_FOLD, CudaHybridModel
    spec = SPECS[name]()
    w = {k: v.to(device="cuda", dtype=torch.bfloat16) for k, v in random_weights(spec, seed).items()}
    m = CudaHybridModel(spec, w, cuda_graphs=False)
    prefixes = [n[: -len("shared_expert_gate.weight")] for n in m.w if n.endswith("mlp.shared_expert_gate.weight")]
    assert prefixes
    for q in prefixes:
        assert all((q + n in m.w) == folded for n in SHARED_FOLD), q


def _model_pair(spec, seed, graphs: tuple[bool, bool]):
    """Two CUDA models on the same random bfloat16 weights (CUDA graphs on or off for each)."""
    from ranks.model_cuda import CudaHybridModel
    w = {k: v.to(device="cuda", dtype=torch.bfloat16) for k, v in random_weights(spec, seed).items()}
    return [CudaHybridModel(spec, dict(w), cuda_graphs=g) for g in graphs]


def _assert_same_states(a, b) -> None:
    for x, y in zip(a.recurrent + a.k, b.recurrent + b.k):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-moe-folded", "small"])
def test_graph_replay_equals_eager_bit_for_bit(name, seed):
    spec = SPECS[name]()
    eager, graphed = _model_pair(spec, seed, (False, True))
    g = torch.Generator().manual_seed(seed)
    B, steps = 3, 12
    states = [m.new_state(B, B * 2) for m in (eager, graphed)]
    tables = page_table(B, 2)
    for t in range(steps):
        ids = torch.randint(0, spec.vocab_size, (B,), generator=g)
        outs = [m.forward(Batch(ids, [1] * B, [t] * B, list(range(B)), tables), s) for m, s in zip((eager, graphed), states)]
        assert torch.equal(outs[0].logits, outs[1].logits), f"step {t}"
    assert graphed.graphs.replays >= steps - 2
    _assert_same_states(*states)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "small"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "temperature-penalties"])
def test_device_fed_steps_equal_host_fed_steps_without_a_host_sync(name, graphs, sampling, seed):
    """Device-fed steps (ranks/worker.py): the ids chosen on the device (local_candidates left on the
    device, merge_on_device) are written into the next step's uploaded metadata (forward's feed)
    instead of coming from the host. Decoding that way must give the host-fed decoding's logits bit
    for bit and the host sampler's ids (sample_rows: greedy, or seeded temperatures with penalties),
    and, once the graphs are captured, launching a fed step and choosing its ids must not wait for
    the device (torch's sync debug mode raises on a synchronising call)."""
    from ranks.sampler import SeqSampler, local_candidates, merge_on_device, sample_rows
    spec = SPECS[name]()
    host_fed, dev_fed = _model_pair(spec, seed, (graphs, graphs))
    g = torch.Generator().manual_seed(seed)
    B, steps = 3, 12
    states = [m.new_state(B, B * 2) for m in (host_fed, dev_fed)]
    tables = page_table(B, 2)
    ids = torch.randint(0, spec.vocab_size, (B,), generator=g)
    feed = None
    cols = torch.arange(B, device="cuda")
    if sampling == "greedy":
        samplers = [SeqSampler(temperature=0.0) for _ in range(B)]
    else:
        # banned ids and a logit_bias too: their -inf / added values must not wait for the device either
        samplers = [SeqSampler(temperature=0.6 + 0.4 * b, seed=seed + b, repetition_penalty=1.3, presence_penalty=0.5,
                               frequency_penalty=0.2, banned=(b + 1, spec.vocab_size - 1),
                               bias=((b + 3, 2.5), (spec.vocab_size - 2, -1.5), (7, 4.0))) for b in range(B)]
    for t in range(steps):
        for b, s in enumerate(samplers):
            s.observe([int(ids[b])], t)
        a = host_fed.forward(Batch(ids, [1] * B, [t] * B, list(range(B)), tables), states[0])
        placeholder = torch.full((B,), 1, dtype=torch.int64) if feed is not None else ids
        strict = graphs and t >= 3                     # keys seen and captured: replays only
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        try:
            b = dev_fed.forward(Batch(placeholder, [1] * B, [t] * B, list(range(B)), tables), states[1], feed=feed)
            cand = local_candidates(b.logits.float(), samplers, [t + 1] * B, list(range(B)), 0, batched=True,
                                    on_host=False)
            picked = merge_on_device(cand, 0, 1, None)
            feed = (cols, picked[:, 1].long())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(a.logits, b.logits), f"step {t}"
        # the host path as a rank runs it on this device (the noise's log is the device's own)
        ids = torch.tensor(sample_rows(a.logits.float(), samplers, [t + 1] * B, rank=0, tp=1, gather=None))
        assert torch.equal(feed[1].cpu(), ids), f"step {t}: device ids {feed[1].tolist()} != host {ids.tolist()}"
    _assert_same_states(*states)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-folded", "small"])
@pytest.mark.parametrize("graphs", [False, True])
def test_dependent_launches_do_not_change_a_step(name, graphs, seed, monkeypatch):
    """TANDEM_PDL=all (every decode kernel a programmatic dependent launch) against 0 (none): the same
    decode steps give bit-identical logits and states. A kernel that touched memory before its
    griddepcontrol.wait would read its predecessor's half-written output here."""
    from kernels import launch as L
    from ranks.model_cuda import CudaHybridModel
    if not L.pdl_enabled():
        pytest.skip("programmatic dependent launch needs sm_90")
    spec = SPECS[name]()
    w = {k: v.to(device="cuda", dtype=torch.bfloat16) for k, v in random_weights(spec, seed).items()}
    B, steps = 3, 10
    runs = []
    for mode in ("all", "0"):
        monkeypatch.setenv("TANDEM_PDL", mode)
        L.pdl_reset()
        m = CudaHybridModel(spec, dict(w), cuda_graphs=graphs)
        g = torch.Generator().manual_seed(seed)
        st, tables = m.new_state(B, B * 2), page_table(B, 2)
        logits = []
        for t in range(steps):
            ids = torch.randint(0, spec.vocab_size, (B,), generator=g)
            logits.append(m.forward(Batch(ids, [1] * B, [t] * B, list(range(B)), tables), st).logits.float().cpu())
        runs.append((torch.stack(logits), [s.float().cpu() for s in st.recurrent + st.k]))
        del m
    monkeypatch.delenv("TANDEM_PDL")
    L.pdl_reset()
    (la, sa), (lb, sb) = runs
    assert torch.isfinite(la).all()
    assert torch.equal(la, lb), f"logits differ at {int((la != lb).sum())} of {la.numel()} values"
    for a, b in zip(sa, sb):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["tiny-dense", "small"])
@pytest.mark.parametrize("route", ["gemv", "production"])
def test_verification_commit_equals_plain_decoding(name, route, seed, monkeypatch):
    """keep_columns on the fast path: after commit(a) the GDN/conv state equals decoding a+1 columns.

    With every linear on the GEMV kernels (whose columns do not interact) the states are equal bit
    for bit; with the production route table a 4-column verification runs its projections on cuBLAS
    and single-column decode on the GEMV, so they differ by bf16 rounding: there the committed state
    must be about as close to the float32 reference's (plain decoding of the same tokens, on the
    same bf16-rounded weights) as plain decoding's state is."""
    spec = SPECS[name]()
    from kernels import cuda_linear
    from ranks.model_cuda import CudaHybridModel
    if route == "gemv":
        monkeypatch.setattr(cuda_linear, "GEMV_COLUMNS", {k: 16 for k in cuda_linear.GEMV_COLUMNS})
        monkeypatch.setattr(cuda_linear, "TC_MAX_COLUMNS", 0)
    w = {k: v.to(device="cuda", dtype=torch.bfloat16) for k, v in random_weights(spec, seed).items()}
    model = CudaHybridModel(spec, w, cuda_graphs=False)
    ref = HybridModel(spec, {k: v.float().cpu() for k, v in w.items()}) if route == "production" else None
    g = torch.Generator().manual_seed(seed)
    B, T, start = 3, 4, 9
    tables = page_table(B, 2)
    prompt = torch.randint(0, spec.vocab_size, (B, start), generator=g)
    cols = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    accepted = [0, 2, 3]

    def prefilled(m=model):
        st = m.new_state(B, B * 2)
        for b in range(B):
            m.forward(Batch(prompt[b], [start], [0], [b], tables[b:b + 1]), st)
        return st
    s1 = prefilled()
    out = model.forward(Batch(cols.reshape(-1), [T] * B, [start] * B, list(range(B)), tables), s1,
                        logits="all", keep_columns=True)
    model.commit(out.kept, s1, accepted)
    def decoded(m):
        st = prefilled(m)
        for t in range(T):
            live = [b for b in range(B) if t <= accepted[b]]
            m.forward(Batch(cols[live, t], [1] * len(live), [start + t] * len(live), live, tables[live]), st)
        return st
    s2 = decoded(model)
    s3 = decoded(ref) if ref is not None else None
    for j in range(len(spec.linear_attention_layers)):
        if route == "gemv":
            assert rel(s1.recurrent[j], s2.recurrent[j]) < 1e-6
            assert torch.equal(s1.conv[j], s2.conv[j])
        else:
            # bf16 rounding drift between cuBLAS (verification) and the GEMV (decode) through the
            # layers (s1 against s2 reached 0.0318 on small, GPU run of b21caaf); the exact-route case
            # above is the check of the state logic, this one that the committed state is as accurate
            # as the decoded one (a wrong column's state would be O(1) away)
            for got, dec, want in ((s1.recurrent[j], s2.recurrent[j], s3.recurrent[j]),
                                   (s1.conv[j], s2.conv[j], s3.conv[j])):
                e1, e2 = rel(got.float().cpu(), want), rel(dec.float().cpu(), want)
                assert e1 <= 2 * e2 + 1e-2, f"GDN layer {j}: committed {e1:.3g} vs decoded {e2:.3g} from float32"


def test_generate_cli_runs_the_demo_model_on_cuda():
    from ranks.demo import default_model_dir
    r = subprocess.run([sys.executable, "-m", "server.cli", "generate", default_model_dir(), "--device", "cuda",
                        "--dtype", "bfloat16", "--greedy", "--max-new-tokens", "8", "--prompt",
                        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
                        "<think>\n\n</think>\n\n"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout, r.stdout


def test_generate_cli_runs_a_random_checkpoint_on_cuda(tmp_path):
    from ranks.random_checkpoint import write_random_checkpoint
    write_random_checkpoint(tmp_path, "small", seed=3, dtype="bfloat16", progress=False)
    r = subprocess.run([sys.executable, "-m", "server.cli", "generate", str(tmp_path), "--device", "cuda",
                        "--dtype", "bfloat16", "--greedy", "--max-new-tokens", "16", "--prompt-ids", "1,2,3,4,5",
                        "--print-token-ids", "--ignore-eos"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_speculation_on_the_cuda_backend_keeps_greedy_output(draft_tokens):
    """MTP rounds (verification on the fast path, MTP layer on the reference path, GDN commit from
    kept per-column states) give the same greedy ids as plain decoding, on the embedded model."""
    from ranks.demo import default_model_dir
    from runtime import Engine, EngineOptions, SamplingParams
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir())
    prompt = tok.encode("def fibonacci(n):\n")
    # a prompt of several prefill chunks, alone: its first chunks' rounds sample nothing and draft
    # nothing (this crashed the CUDA head with an empty batch until the fourteenth session)
    long_prompt = tok.encode("def f(x):\n" + "    x = x + 1\n" * 60 + "    return x\n")
    assert len(long_prompt) > 2 * 64
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    outs, longs, stats = [], [], None
    for k in (0, draft_tokens):
        opts = EngineOptions(max_concurrency=2, spec_draft_tokens=k, prefill_chunk=64)
        with Engine.start(default_model_dir(), tp=1, device="cuda", dtype="bfloat16", options=opts) as engine:
            evs = list(engine.submit(prompt, params))
            assert not evs[-1].error, evs[-1].error
            outs.append(sum((e.tokens for e in evs), []))
            r = engine.submit(long_prompt, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)).result()
            assert r.error is None, r.error
            longs.append(r.tokens)
            assert engine.stats()["ranks"][0]["backend"] == "cuda"
            if k:
                stats = evs[-1].spec
                assert engine.stats()["ranks"][0]["spec_rounds"] == "gpu"
    assert outs[1] == outs[0] and longs[1] == longs[0]
    assert stats["rounds"] > 0 and stats["accepted"] > 0
    print(f"K={draft_tokens}: {stats['tokens_per_round']:.2f} tokens per round on the CUDA backend")


def test_engine_feeds_steps_from_the_device_by_default_at_tp1():
    """EngineOptions.device_feed unset: on for the cuda backend at tp 1; the same greedy ids as with
    it off (two concurrent prompts, so fed steps carry two rows), and most steps fed."""
    from ranks.demo import default_model_dir
    from runtime import Engine, EngineOptions, SamplingParams
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir())
    prompts = [tok.encode("def fibonacci(n):\n"), tok.encode("The capital of France is")]
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    outs = {}
    for feed in (None, False):
        opts = EngineOptions(max_concurrency=2, device_feed=feed)
        with Engine.start(default_model_dir(), tp=1, device="cuda", dtype="bfloat16", options=opts) as engine:
            streams = [engine.submit(p, params) for p in prompts]
            outs[feed] = [s.result(timeout=300).tokens for s in streams]
            st = engine.stats()
            assert st["ranks"][0]["device_feed"] is (feed is None)
            # how many are fed depends on timing (16 of ~31 on an H200 with this small model, 94-98% on
            # the 27B): a plan that reaches the rank after the pending tokens is filled on the host
            assert (st["steps_fed"] > 0) if feed is None else st["steps_fed"] == 0, st["steps_fed"]
    assert outs[None] == outs[False]


def test_gpu_rounds_equal_eager_rounds_with_stops_and_concurrency(monkeypatch):
    """Greedy rounds as one GPU program (ranks/spec_cuda.py) and the eager round emit the same ids as
    plain decoding for two requests at once that end on their stop token (inside a round), with a
    draft hook that makes drafts right half of the time."""
    from ranks.demo import default_model_dir
    from runtime import Engine, EngineOptions, SamplingParams
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir())
    prompts = [tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
                          "<think>\n\n</think>\n\n"), tok.encode("def fibonacci(n):\n")]
    params = [SamplingParams(temperature=0, max_new_tokens=24), SamplingParams(temperature=0, max_new_tokens=40)]

    def hook(seq, drafts):                         # every other draft replaced by a wrong id
        return [d if (seq.id + i) % 2 == 0 or d < 0 else (d + 1) % 1000 for i, d in enumerate(drafts)]

    def generate(k, gpu_rounds):
        monkeypatch.setenv("TANDEM_SPEC_GPU_ROUNDS", "1" if gpu_rounds else "0")
        opts = EngineOptions(max_concurrency=2, spec_draft_tokens=k, spec_draft_hook=hook if k else None)
        with Engine.start(default_model_dir(), tp=1, device="cuda", dtype="bfloat16", options=opts) as engine:
            import threading
            outs, reasons = [None, None], [None, None]

            def one(i):
                evs = list(engine.submit(prompts[i], params[i]))
                assert not evs[-1].error, evs[-1].error
                outs[i], reasons[i] = sum((e.tokens for e in evs), []), evs[-1].finish_reason
            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if k:
                assert engine.stats()["ranks"][0]["spec_rounds"] == ("gpu" if gpu_rounds else "eager")
            return outs, reasons
    plain, reasons = generate(0, False)
    assert reasons[0] == "stop", "the first prompt should end on its stop token"
    for k in (1, 3):
        assert generate(k, True)[0] == plain, f"GPU rounds, K={k}"
    assert generate(3, False)[0] == plain, "eager rounds, K=3"


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-moe-folded", "small"])
def test_mtp_layer_matches_the_float32_reference(name, seed):
    """CudaHybridModel.mtp_forward (drafting columns on the kernels, MTP KV pools) against the float32
    reference's mtp_forward on the same weights, after the same target prefill."""
    spec = SPECS[name]()
    ref, ref16, model = _models(spec, seed, graphs=False)
    g = torch.Generator().manual_seed(seed)
    B, start, T = 3, 12, 3
    tables = page_table(B, 2)
    prompt = torch.randint(0, spec.vocab_size, (B, start), generator=g)
    nxt = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    check = Agreement(f"{name} MTP")
    got = []
    for m in (ref, ref16, model):
        st = m.new_state(B, B * 2)
        outs = [m.forward(Batch(prompt[b], [start], [0], [b], tables[b:b + 1]), st, logits="none").hidden
                for b in range(B)]
        # MTP columns: for each sequence its last T positions (ids = the tokens after them)
        hid = torch.cat([o[start - T:] for o in outs])
        mb = Batch(nxt.reshape(-1), [T] * B, [start - T] * B, list(range(B)), tables)
        got.append(m.mtp_forward(mb, hid, st, logits="all").logits.float().cpu())
    want, want16, cuda = got
    for b in range(B):
        rows = slice(b * T, (b + 1) * T)
        check.add(cuda[rows], want[rows], want16[rows], f"{name} MTP seq {b}")
    check.check()


@pytest.mark.parametrize("name", ["tiny-dense", "small"])
def test_graphed_verification_rounds_equal_eager(name, seed):
    """Speculation-shaped steps (verification of T = 4 columns per sequence, commit of random accepted
    lengths, one plain column) with CUDA graphs equal the eager run bit for bit, and the graphs are
    used: the batched keep form works inside a capture."""
    spec = SPECS[name]()
    from ranks.model_cuda import CudaHybridModel
    w = {k: v.to(device="cuda", dtype=torch.bfloat16) for k, v in random_weights(spec, seed).items()}
    eager = CudaHybridModel(spec, dict(w), cuda_graphs=False)
    graphed = CudaHybridModel(spec, dict(w), cuda_graphs=True)
    g = torch.Generator().manual_seed(seed)
    B, T, start = 3, 4, 9
    tables = page_table(B, 2)
    states = []
    prompt = torch.randint(0, spec.vocab_size, (B, start), generator=g)
    for m in (eager, graphed):
        st = m.new_state(B, B * 2)
        for b in range(B):
            m.forward(Batch(prompt[b], [start], [0], [b], tables[b:b + 1]), st)
        states.append(st)
    pos = [start] * B
    for r in range(5):
        cols = torch.randint(0, spec.vocab_size, (B * T,), generator=g)
        accepted = torch.randint(0, T, (B,), generator=g).tolist()
        outs = []
        for m, st in zip((eager, graphed), states):
            out = m.forward(Batch(cols, [T] * B, list(pos), list(range(B)), tables), st, logits="none",
                            keep_columns=True)
            outs.append(out.hidden.clone())
            m.commit(out.kept, st, accepted)
        assert torch.equal(outs[0], outs[1]), f"round {r}"
        pos = [p + a + 1 for p, a in zip(pos, accepted)]
    assert graphed.graphs.replays >= 3
    for a, b in zip(states[0].recurrent + states[0].conv + states[0].k, states[1].recurrent + states[1].conv + states[1].k):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["tiny-dense", "small", "27b-4layers"])
@pytest.mark.parametrize("columns", [1, 4])
def test_teacher_forced_with_tensor_core_decode_attention(name, columns, seed, monkeypatch):
    """The teacher-forced check with decode and verification attention on decode_attention_tc (the
    default from TC_DECODE_MIN_LEN keys) from the first key on; tiny-dense's head dim has no tensor-core kernel,
    so it checks the fallback to the CUDA-core kernel."""
    from ranks import model_cuda
    monkeypatch.setattr(model_cuda, "TC_DECODE_ATTENTION", True)
    monkeypatch.setattr(model_cuda, "TC_DECODE_MIN_LEN", 0)
    test_teacher_forced_logits_match_the_float32_reference(name, columns, seed, monkeypatch)
