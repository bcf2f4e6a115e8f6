"""Reference implementation of every op of the Qwen3.5/3.6 hybrid model, in plain torch.

This is the CPU backend and the oracle the CUDA kernels are tested against. Every function is pure
(state goes in and comes out explicitly) and works on any device and float dtype; intermediate maths
follows the numerics of Hugging Face transformers (norms and gates in fp32, GDN recurrence in fp32).

Shape legend: N columns (tokens of all sequences, flattened), T columns of one sequence, E hidden,
H attention heads, KV key/value heads, D head dim, R rotary dim, HK/HV GDN key/value heads,
DK/DV GDN head dims, C conv channels, K conv kernel, X experts, A active experts, I FFN width,
V vocabulary, P KV pages, PG page size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _acc(x: Tensor) -> Tensor:
    """x in the accumulation dtype: fp32, or fp64 when x is fp64 (then the reference is a float64 oracle)."""
    return x if x.dtype == torch.float64 else x.float()


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32

# --------------------------------------------------------------------------------------------------
# Norms


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast to x's dtype.

    x [..., E], weight [E] (stored ~0). Used for layer norms, the final norm, q/k norms, MTP norms.
    """
    xf = _acc(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.to(xf.dtype))).to(x.dtype)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """GDN output norm: normalise x in fp32, cast back, times the plain weight, times silu(gate) in fp32.

    x [..., DV], gate [..., DV], weight [DV] (stored ~1; no +1).
    """
    xf = _acc(x)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * y
    return (y * F.silu(_acc(gate))).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (GDN q and k; eps on the sum)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# --------------------------------------------------------------------------------------------------
# Rotary embedding (partial, rotate-half)


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [N, R] for integer positions [N]; computed in fp32, cast to `dtype`.

    ``inv_freq_j = theta^(-2j/R)``, j < R/2, duplicated over both halves (NeoX layout). Text positions
    make the three M-RoPE rows equal, so M-RoPE reduces to this 1-D rotation.
    """
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device)
                                .to(acc) / rotary_dim))
    freqs = positions.to(acc)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate dims [0, R) of every head: ``r*cos + rotate_half(r)*sin``; dims [R, D) pass through.

    x [N, heads, D], cos/sin [N, R].
    """
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1)


# --------------------------------------------------------------------------------------------------
# Dense pieces


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x W^T``: x [N, in], weight [out, in] -> [N, out]."""
    return F.linear(x, weight)


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """Rows of table [V, E] for ids [N] -> [N, E] (no scaling)."""
    return F.embedding(ids, table)


def lm_head(h: Tensor, weight: Tensor) -> Tensor:
    """Logits [N, V] from final-norm hidden [N, E] and weight [V, E] (lm_head or the tied embedding)."""
    return F.linear(h, weight)


def swiglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """``W_down(silu(W_gate x) * W_up x)``: x [N, E], gate/up [I, E], down [E, I]."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


# --------------------------------------------------------------------------------------------------
# Mixture of experts


def moe_route(x: Tensor, w_router: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Softmax over all experts in fp32, top-k, renormalise to sum 1.

    x [N, E], w_router [X, E] -> (weights [N, A] in x's dtype, expert ids [N, A] int64).
    Ties in probability go to the lower expert id (torch.topk on CPU is stable in practice; the
    CUDA router must match this rule).
    """
    logits = F.linear(x, w_router)
    probs = torch.softmax(logits, dim=-1, dtype=_acc_dtype(logits))
    top, ids = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    return top.to(logits.dtype), ids


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """``sum_a w_a * down_e(silu(gate_e x) * up_e x)`` over each token's chosen experts.

    x [N, E], ids/weights [N, A], gate_up [X, 2I, E] (gate rows then up rows), down [X, E, I].
    """
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def moe_block(x: Tensor, w_router: Tensor, top_k: int, gate_up: Tensor, down: Tensor,
              shared: tuple[Tensor, Tensor, Tensor] | None, w_shared_gate: Tensor | None) -> Tensor:
    """Sparse MoE FFN: routed experts plus the sigmoid-gated shared expert.

    shared = (gate [S, E], up [S, E], down [E, S]) or None; w_shared_gate [1, E].
    """
    weights, ids = moe_route(x, w_router, top_k)
    y = moe_experts(x, ids, weights, gate_up, down)
    if shared is not None:
        y = y + torch.sigmoid(F.linear(x, w_shared_gate)) * swiglu_mlp(x, *shared)
    return y


# --------------------------------------------------------------------------------------------------
# Gated attention over a paged KV cache


def split_q_gate(qg: Tensor, num_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """q_proj output [N, H*2*D] (per head [q | gate]) -> q [N, H, D], gate [N, H*D]."""
    qg = qg.view(qg.shape[0], num_heads, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:]
    return q, gate.reshape(qg.shape[0], num_heads * head_dim)


# int8 KV: symmetric per (token, kv head, group of KV_INT8_GROUP channels), fp32 scales.
KV_INT8_GROUP = 64
KV_INT8_MIN_AMAX = 2.0 ** -100     # groups with a smaller max |x| (zero groups) store codes 0, scale 0


def quantize_kv_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] (D a multiple of 64) -> (codes int8 [..., D], scale fp32 [..., D / 64]).

    Per group of 64 channels: scale = amax(|x|) / 127 in fp32, code = round-half-even(x / scale)
    (fp32 IEEE division) clamped to [-127, 127]. A group whose amax is below KV_INT8_MIN_AMAX
    (all zeros in practice) gets codes 0 and scale 0 (no NaN; dequantises to 0). The CUDA write
    kernel computes exactly this from the same fp32 values.
    """
    D = x.shape[-1]
    if D % KV_INT8_GROUP:
        raise ValueError(f"int8 KV needs a head dim that is a multiple of {KV_INT8_GROUP}, got {D}")
    xf = x.float().reshape(*x.shape[:-1], D // KV_INT8_GROUP, KV_INT8_GROUP)
    amax = xf.abs().amax(-1)
    zero = amax < KV_INT8_MIN_AMAX
    # A tensor divisor, not a Python float: torch's CUDA division by a CPU scalar multiplies by the
    # reciprocal, which is 1 ulp off IEEE division for some amax and then moves codes.
    scale = torch.where(zero, torch.zeros_like(amax), amax / torch.full_like(amax, 127.0))
    safe = torch.where(zero, torch.ones_like(scale), scale)
    q = torch.round(xf / safe[..., None]).clamp_(-127, 127)
    q = torch.where(zero[..., None], torch.zeros_like(q), q)
    return q.to(torch.int8).reshape(x.shape), scale


def dequantize_kv_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes int8 [..., D] and scale fp32 [..., D / 64] -> code * scale (fp32 product) in `dtype`."""
    D = q.shape[-1]
    qf = q.float().reshape(*q.shape[:-1], D // KV_INT8_GROUP, KV_INT8_GROUP)
    return (qf * scale.float()[..., None]).reshape(q.shape).to(dtype)


def paged_kv_write(k_pool: Tensor, v_pool: Tensor, page_table: Tensor, positions: Tensor,
                   k: Tensor, v: Tensor, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Store k/v [T, KV, D] at `positions` [T] of one sequence (in place).

    k_pool/v_pool [P, PG, KV, D]; page_table [pages] int32 maps position // PG to a page id.
    int8 pools take their scale pools k_scale/v_scale [P, PG, KV, D / 64] fp32: k and v are
    quantised (quantize_kv_int8) and codes and scales stored.
    """
    page_size = k_pool.shape[1]
    pages = page_table.long()[positions // page_size]
    offsets = positions % page_size
    for pool, scale, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        if scale is None:
            pool[pages, offsets] = x.to(pool.dtype)
        else:
            pool[pages, offsets], scale[pages, offsets] = quantize_kv_int8(x)


def paged_kv_read(pool: Tensor, page_table: Tensor, length: int, scale: Tensor | None = None) -> Tensor:
    """The first `length` positions of one sequence: [length, KV, D] (int8 pools with their scale
    pool: dequantised, fp32)."""
    page_size = pool.shape[1]
    pos = torch.arange(length, device=pool.device)
    pages, offsets = page_table.long()[pos // page_size], pos % page_size
    if scale is None:
        return pool[pages, offsets]
    return dequantize_kv_int8(pool[pages, offsets], scale[pages, offsets])


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, page_table: Tensor, positions: Tensor,
                    scale: float, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """Causal GQA attention of one sequence's query columns against its paged KV.

    q [T, H, D] at positions [T]; key j is visible to query t when j <= positions[t]. The KV for
    every visible position must already be written. Softmax in fp32, probabilities cast to q's dtype
    (transformers' eager path). Returns [T, H, D]. `scale` is the softmax scale; k_scale/v_scale are
    the scale pools of int8 KV pools (dequantised on read in fp32, then cast to q's dtype).
    """
    length = int(positions.max()) + 1
    k = paged_kv_read(k_pool, page_table, length, k_scale).to(q.dtype)       # [L, KV, D]
    v = paged_kv_read(v_pool, page_table, length, v_scale).to(q.dtype)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * scale              # [H, T, L]
    visible = torch.arange(length, device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=_acc_dtype(q)).to(q.dtype)
    return torch.einsum("htl,lhd->thd", probs, v)


# --------------------------------------------------------------------------------------------------
# Gated DeltaNet


def causal_conv1d(x: Tensor, weight: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time followed by SiLU, continuing from `state`.

    x [T, C] pre-conv inputs; weight [C, K]; state [C, K-1] = the previous K-1 inputs (None or
    zeros at a sequence start). Returns (y [T, C] in x's dtype, new state [C, K-1]).
    ``y_t = silu(sum_j w[:, j] * x_{t-K+1+j})``; accumulated in fp32 (fp64 for fp64 inputs) and
    rounded once to the weight's dtype, as F.conv1d and the causal-conv1d kernels do.
    """
    T, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(C, K - 1)
    xs = torch.cat([state.to(weight.dtype).T, x.to(weight.dtype)], dim=0)       # [K-1+T, C]
    windows = xs.unfold(0, K, 1)                                                 # [T, C, K]
    y = F.silu((_acc(windows) * _acc(weight)[None]).sum(-1).to(weight.dtype))
    return y.to(x.dtype), xs[T:].T.to(state.dtype).contiguous()


def causal_conv1d_update(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One decode column: x [C] -> (y [C], new state [C, K-1])."""
    y, new_state = causal_conv1d(x[None], weight, state)
    return y[0], new_state


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """Per column and value head: decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32, log space)
    and write strength ``beta = sigmoid(b)``. a, b [N, HV] -> g [N, HV] fp32, beta [N, HV]."""
    g = -_acc(A_log).exp() * F.softplus(_acc(a) + _acc(dt_bias))
    return g, torch.sigmoid(b)


def gdn_prepare_qk(q: Tensor, k: Tensor, ratio: int) -> tuple[Tensor, Tensor]:
    """L2-normalise q/k [T, HK, DK] in fp32, scale q by DK^-0.5, expand to value heads [T, HV, DK]
    (value head h reads key head h // ratio)."""
    q = l2norm(_acc(q)) * (q.shape[-1] ** -0.5)
    k = l2norm(_acc(k))
    return q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)


def gated_delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor | None) -> tuple[Tensor, Tensor]:
    """The gated delta rule one column at a time (decode), in fp32.

    q, k [T, HV, DK] (prepared by gdn_prepare_qk), v [T, HV, DV], g, beta [T, HV],
    state [HV, DK, DV] or None (zeros). Per column::

        S <- exp(g) S;  u = k^T S;  S <- S + k (beta (v - u))^T;  o = q^T S

    Returns (o [T, HV, DV] fp32, final state [HV, DK, DV] fp32).
    """
    T, HV, DK = k.shape
    DV = v.shape[-1]
    acc = _acc_dtype(v)
    S = torch.zeros(HV, DK, DV, dtype=acc, device=v.device) if state is None else state.to(acc)
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    out = torch.empty(T, HV, DV, dtype=acc, device=v.device)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        u = torch.einsum("hk,hkv->hv", k[t], S)
        delta = beta[t][:, None] * (v[t] - u)
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return out, S


def gated_delta_rule_states(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            state: Tensor | None) -> tuple[Tensor, Tensor]:
    """gated_delta_rule_recurrent that also keeps the state after every column (speculative
    verification: the committed state is the one after the accepted columns, without a re-run).

    Same arguments; returns (o [T, HV, DV], states [T, HV, DK, DV]); states[-1] is the final state.
    Column by column with exactly the ops of the one-column decode step, so committing states[a]
    equals decoding the first a+1 columns one at a time, bit for bit.
    """
    T = q.shape[0]
    outs, states = [], []
    S = state
    for t in range(T):
        o, S = gated_delta_rule_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], S)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 0), torch.stack(states, 0)


def gated_delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             state: Tensor | None, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """The same rule as gated_delta_rule_recurrent, computed chunk by chunk (prefill, verification).

    Within a chunk, with cumulative log decay G_i and D_ij = exp(G_i - G_j) for j <= i:
    ``A = strict_lower((beta k) k^T * D)``, ``(I + A) U = beta v``, ``(I + A) W = beta k e^G``;
    per chunk ``V' = U - W S``, ``O = (q e^G) S + (q k^T * D) V'``,
    ``S <- e^{G_last} S + (k e^{G_last - G})^T V'``. T is padded to a multiple of `chunk` with
    columns that have beta = 0 and g = 0 (they change nothing). Same arguments and results.
    """
    T, HV, DK = k.shape
    DV = v.shape[-1]
    acc = _acc_dtype(v)
    S = torch.zeros(HV, DK, DV, dtype=acc, device=v.device) if state is None else state.to(acc)
    chunk = min(chunk, T)                          # a short block needs no padding to 64
    pad = (-T) % chunk

    def heads_first(x: Tensor) -> Tensor:                                # [T, HV, ..] -> [HV, n, chunk, ..]
        x = F.pad(x.to(acc), (0, 0) * (x.dim() - 1) + (0, pad))
        return x.transpose(0, 1).reshape(HV, -1, chunk, *x.shape[2:])

    q, k, v, g, beta = (heads_first(x) for x in (q, k, v, g, beta))
    n = q.shape[1]
    G = g.cumsum(-1)                                                     # [HV, n, c]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()   # [HV, n, c, c]
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * D).tril(-1)
    eye = torch.eye(chunk, dtype=acc, device=v.device)
    U = torch.linalg.solve_triangular(eye + A, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(eye + A, kb * G.exp()[..., None], upper=False, unitriangular=True)
    qk = q @ k.transpose(-1, -2) * D                                    # diagonal included
    q_dec = q * G.exp()[..., None]
    k_dec = k * (G[..., -1:] - G).exp()[..., None]
    last = G[..., -1].exp()                                              # [HV, n]
    out = torch.empty(HV, n, chunk, DV, dtype=acc, device=v.device)
    for i in range(n):
        v_new = U[:, i] - W[:, i] @ S
        out[:, i] = q_dec[:, i] @ S + qk[:, i] @ v_new
        S = S * last[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(HV, n * chunk, DV)[:, :T].transpose(0, 1)
    return out.contiguous(), S


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor | None) -> tuple[Tensor, Tensor]:
    """Recurrent form for one column, chunked form for more (transformers' choice of path)."""
    if q.shape[0] == 1:
        return gated_delta_rule_recurrent(q, k, v, g, beta, state)
    return gated_delta_rule_chunked(q, k, v, g, beta, state)


# --------------------------------------------------------------------------------------------------
# MTP


def mtp_fuse(next_embeds: Tensor, hidden: Tensor, w_norm_embed: Tensor, w_norm_hidden: Tensor,
             w_fc: Tensor, eps: float) -> Tensor:
    """The MTP input: ``fc(concat(norm_e(embed(x_{i+1})), norm_h(h_i)))``.

    next_embeds [N, E] (embeddings of the following tokens), hidden [N, E] (the main model's
    final-norm output, or the previous MTP output m), w_fc [E, 2E]. Returns [N, E]; it then goes
    through one full-attention decoder layer and ``mtp.norm`` to give m, whose lm_head logits
    predict x_{i+2}.
    """
    e = rms_norm(next_embeds, w_norm_embed, eps)
    h = rms_norm(hidden, w_norm_hidden, eps)
    return F.linear(torch.cat([e, h], dim=-1), w_fc)


# --------------------------------------------------------------------------------------------------
# Sampling (rank 0 decides the tokens)


def greedy(logits: Tensor) -> Tensor:
    """argmax over the last axis, ties to the lower token id. logits [B, V] -> [B] int64."""
    return torch.argmax(logits, dim=-1)


def sampling_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> Tensor:
    """The distribution a sampler draws from: temperature, then top-k, top-p, min-p filters.

    logits [B, V] -> probs [B, V] fp32 (zeros outside the kept set, renormalised).
    """
    x = logits.float() / max(temperature, 1e-6)
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p                  # mass strictly before each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row; temperature 0 means greedy. logits [B, V] -> [B] int64."""
    if temperature <= 0.0:
        return greedy(logits)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
