"""The truth for the recurrent mixers of hybrid models: float64, token by token, one document at a time.

Slow and obvious on purpose (float64 unless told otherwise), and differentiable (plain torch ops: the gradients of the float64 reference are
the truth for gradients too). A document's state (its convolution window, its recurrent state) starts at zero
at the document's first token and never sees another document; padding rows output exactly 0 and their inputs
get exactly 0 gradient (they take part in no document).

- :func:`reference_causal_conv`: the short causal depthwise convolution of width ``W`` (with the activation
  transformers applies after it, ``silu`` in Qwen3-Next / Qwen3.5), as transformers' ``causal_conv1d_fn``
  computes it on one document;
- :func:`reference_gated_delta_rule`: the gated delta rule as transformers' Qwen3-Next / Qwen3.5 compute it
  (``torch_recurrent_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=True``): per head a state
  ``S [K, V]``, and per token ``S = exp(g) S``, ``S = S + k (beta (v - k^T S))^T``, ``o = S^T q``, with q and
  k l2-normalised (``x / sqrt(sum(x^2) + 1e-6)``) and q scaled by ``K ** -0.5``;
- :func:`reference_kda`: Kimi Delta Attention (Kimi Linear, Ling / Bailing hybrid) as transformers'
  ``recurrent_kimi_delta_attention`` / ``chunk_kimi_delta_attention`` compute it (``use_qk_l2norm_in_kernel=True``):
  the gated delta rule with a decay per key channel, ``S = diag(exp(g)) S`` with ``g [K]`` per head and token,
  then the same delta update and read-out;
- :func:`reference_lightning_attention`: MiniMax's lightning attention as transformers' ``MiniMaxLightningAttention``
  computes its core: per head a state ``S [K, V]`` and a fixed decay ``slope`` (``slope_rate``, one number per head
  and layer, not learned), per token ``S = exp(-slope) S + k v^T``, ``o = q S`` (no normalisation of q or k);
- :func:`reference_ssd`: Mamba2's SSD as transformers' ``mamba2_chunk_scan`` computes it: per head a state
  ``S [Dh, N]``, and per token ``S = exp(dt A) S + dt x B^T``, ``y = S C + D x``;
- :func:`reference_mamba2_mixer`: the whole Mamba2 layer as transformers' ``NemotronHMamba2Mixer`` (and
  ``BambaMixer``, ``Mamba2Mixer``, ...) computes it on their torch path: ``in_proj`` -> gate ``z``, ``xBC``, ``dt``;
  the causal depthwise convolution of ``xBC`` and its activation; ``x, B, C`` split (``G`` groups);
  ``dt = clamp(softplus(dt + dt_bias), *time_step_limit)``; ``A = -exp(A_log)``; the SSD; the gated RMSNorm
  (``y * silu(z)``, normalised over each group's channels, times its weight); ``out_proj``;
- :func:`reference_selective_scan`: Mamba1's selective scan as transformers' ``mamba_selective_scan`` computes it
  on its torch path: per channel a state ``h [N]``, and per token ``h = exp(dt A) h + dt x B``, ``y = h . C + D x``
  (``A [I, N]``: one decay per channel and state entry; ``dt`` per channel; ``B, C`` per token, shared by the
  channels of a group);
- :func:`reference_mamba1_mixer`: the whole Mamba1 layer of ``MambaMixer`` (``mamba``), ``FalconMambaMixer``
  (``falcon_mamba``: weightless RMSNorms on ``dt, B, C``), ``JambaMambaMixer`` (``jamba``: RMSNorms with weights
  on them) and ``ZambaMambaMixer`` (``zamba``: its channels in heads, each with its own ``x_proj`` and
  ``dt_proj``, the input projection interleaving ``x`` and the gate): ``in_proj`` -> ``x, z``; the causal
  depthwise convolution of ``x`` and its activation; ``x_proj`` -> ``dt, B, C``; the norms; ``dt = softplus(
  dt_proj(dt))``; ``A = -exp(A_log)``; the scan; ``y * silu(z)``; ``out_proj``.

Shape legend: B rows, S positions, C channels, W convolution width, Hk query/key heads, Hv value heads,
K key head dim, V value head dim; for Mamba2: H heads, Dh head dim, G groups, N state size, E hidden size; for
Mamba1: I channels (the intermediate size), R the time step's rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .layout import DocLayout

__all__ = [
    "ACTIVATIONS", "MAMBA1_VARIANTS", "reference_causal_conv", "reference_gated_delta_rule", "reference_kda",
    "reference_lightning_attention",
    "reference_mamba1_mixer", "reference_mamba2_mixer", "reference_selective_scan", "reference_ssd",
]

ACTIVATIONS = {None: lambda t: t, "silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu}


def _segments(doc_ids: Tensor, shape: tuple[int, int], what: str) -> Tensor:
    if not isinstance(doc_ids, Tensor) or tuple(doc_ids.shape) != shape:
        got = tuple(doc_ids.shape) if isinstance(doc_ids, Tensor) else type(doc_ids).__name__
        raise ValueError(f"{what}: expected doc_ids of shape [B, S] = {list(shape)}, got {got}")
    return DocLayout.from_doc_ids(doc_ids.cpu()).segment_ids


def reference_causal_conv(
    x: Tensor, doc_ids: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None,
    *, dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Per-document causal depthwise convolution, float64: ``x [B, S, C]``, ``weight [C, W]``, ``bias [C]``
    -> ``[B, S, C]``.

    ``out[b, t, c] = act(bias[c] + sum_i weight[c, i] * x[b, t - (W - 1) + i, c])``, the sum over taps ``i``
    whose position lies in ``t``'s document (the others are zero: history of another document is never read);
    0 on padding. ``activation``: None or ``"silu"``. ``dtype``: what it computes in (the same computation in
    float32 is the verifier's single-device baseline).

    >>> x = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]])
    >>> reference_causal_conv(x, torch.tensor([[1, 1, 2, 2]]), torch.tensor([[10.0, 1.0]])).flatten().tolist()
    [1.0, 12.0, 3.0, 34.0]
    """
    if x.dim() != 3:
        raise ValueError(f"reference_causal_conv: expected x [B, S, C], got shape {tuple(x.shape)}")
    B, S, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"reference_causal_conv: expected weight [C, W] with C = {C}, got {tuple(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"reference_causal_conv: activation expected one of {sorted(map(str, ACTIVATIONS))}, got {activation!r}")
    seg = _segments(doc_ids, (B, S), "reference_causal_conv")
    x64, w64 = x.to(dtype), weight.to(dtype)
    b64 = None if bias is None else bias.to(dtype)
    act = ACTIVATIONS[activation]
    W = w64.shape[1]
    zero = x64.new_zeros(C)
    rows = []
    for b in range(B):
        row = []
        for t in range(S):
            if seg[b, t] == 0:
                row.append(zero)
                continue
            acc = zero if b64 is None else b64
            for i in range(W):
                p = t - (W - 1) + i
                if p >= 0 and seg[b, p] == seg[b, t]:
                    acc = acc + w64[:, i] * x64[b, p]
            row.append(act(acc))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def _l2norm(t: Tensor, eps: float) -> Tensor:
    return t / torch.sqrt((t * t).sum(-1, keepdim=True) + eps)


def reference_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc_ids: Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The gated delta rule per document, float64: ``q, k [B, S, Hk, K]``, ``v [B, S, Hv, V]``, ``g, beta
    [B, S, Hv]`` -> ``[B, S, Hv, V]``; 0 on padding.

    Each query/key head serves ``Hv / Hk`` consecutive value heads (transformers' grouped value attention).
    ``g`` is the log decay (``exp(g)`` multiplies the state), ``beta`` the write strength. ``scale`` defaults
    to ``K ** -0.5``. The state of each head, ``S [K, V]``, is zero at a document's first token. ``dtype``: what
    it computes in (float64; float32 for the verifier's single-device baseline).
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"reference_gated_delta_rule: expected q, k [B, S, Hk, K] and v [B, S, Hv, V] with the same B, S; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, S, Hk, K = q.shape
    Hv = v.shape[2]
    if Hv % Hk:
        raise ValueError(f"reference_gated_delta_rule: expected Hv a multiple of Hk, got Hv={Hv}, Hk={Hk}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, S, Hv):
            raise ValueError(f"reference_gated_delta_rule: {name} expected [B, S, Hv] = {[B, S, Hv]}, got {tuple(t.shape)}")
    seg = _segments(doc_ids, (B, S), "reference_gated_delta_rule")
    q64, k64, v64, g64, b64 = (t.to(dtype) for t in (q, k, v, g, beta))
    q64, k64 = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q64, k64))
    if use_qk_l2norm:
        q64, k64 = _l2norm(q64, eps), _l2norm(k64, eps)
    q64 = q64 * (K ** -0.5 if scale is None else scale)
    Vd = v.shape[-1]
    zero = v64.new_zeros(Hv, Vd)
    rows = []
    for b in range(B):
        row, state = [], None
        for t in range(S):
            if seg[b, t] == 0:
                row.append(zero)
                continue
            if t == 0 or seg[b, t] != seg[b, t - 1]:
                state = v64.new_zeros(Hv, K, Vd)  # a document starts: its state starts at zero
            state = state * torch.exp(g64[b, t])[:, None, None]
            kt = k64[b, t]  # [Hv, K]
            read = torch.einsum("hk,hkv->hv", kt, state)
            delta = (v64[b, t] - read) * b64[b, t][:, None]
            state = state + kt[:, :, None] * delta[:, None, :]
            row.append(torch.einsum("hk,hkv->hv", q64[b, t], state))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def reference_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc_ids: Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Kimi Delta Attention per document, float64: ``q, k [B, S, Hk, K]``, ``v [B, S, Hv, V]``, ``g [B, S, Hv, K]``
    (the log decay of each key channel), ``beta [B, S, Hv]`` -> ``[B, S, Hv, V]``; 0 on padding.

    Per head a state ``S [K, V]``, zero at a document's first token; per token ``S = diag(exp(g)) S``,
    ``S = S + k (beta (v - k^T S))^T``, ``o = S^T q``, q and k l2-normalised (``x / sqrt(sum(x^2) + eps)``), q
    scaled by ``scale`` (default ``K ** -0.5``). Each query/key head serves ``Hv / Hk`` consecutive value heads
    (transformers' KDA has ``Hk = Hv``). ``dtype``: what it computes in.
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"reference_kda: expected q, k [B, S, Hk, K] and v [B, S, Hv, V] with the same B, S; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, S, Hk, K = q.shape
    Hv = v.shape[2]
    if Hv % Hk:
        raise ValueError(f"reference_kda: expected Hv a multiple of Hk, got Hv={Hv}, Hk={Hk}")
    if tuple(g.shape) != (B, S, Hv, K):
        raise ValueError(f"reference_kda: g expected [B, S, Hv, K] = {[B, S, Hv, K]}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, S, Hv):
        raise ValueError(f"reference_kda: beta expected [B, S, Hv] = {[B, S, Hv]}, got {tuple(beta.shape)}")
    seg = _segments(doc_ids, (B, S), "reference_kda")
    q64, k64, v64, g64, b64 = (t.to(dtype) for t in (q, k, v, g, beta))
    q64, k64 = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q64, k64))
    if use_qk_l2norm:
        q64, k64 = _l2norm(q64, eps), _l2norm(k64, eps)
    q64 = q64 * (K ** -0.5 if scale is None else scale)
    Vd = v.shape[-1]
    zero = v64.new_zeros(Hv, Vd)
    rows = []
    for b in range(B):
        row, state = [], None
        for t in range(S):
            if seg[b, t] == 0:
                row.append(zero)
                continue
            if t == 0 or seg[b, t] != seg[b, t - 1]:
                state = v64.new_zeros(Hv, K, Vd)  # a document starts: its state starts at zero
            state = state * torch.exp(g64[b, t])[:, :, None]  # each key channel decays by its own factor
            kt = k64[b, t]  # [Hv, K]
            read = torch.einsum("hk,hkv->hv", kt, state)
            delta = (v64[b, t] - read) * b64[b, t][:, None]
            state = state + kt[:, :, None] * delta[:, None, :]
            row.append(torch.einsum("hk,hkv->hv", q64[b, t], state))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def reference_lightning_attention(
    q: Tensor, k: Tensor, v: Tensor, slope: Tensor, doc_ids: Tensor, *, dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Lightning attention (MiniMax) per document, float64: ``q, k [B, S, H, K]``, ``v [B, S, H, V]``, ``slope [H]``
    (the fixed decay rate of each head, positive) -> ``[B, S, H, V]``; 0 on padding.

    Per head a state ``S [K, V]``, zero at a document's first token; per token ``S = exp(-slope) S + k v^T`` and
    ``o = q S`` (the token's own key included, with weight 1). ``dtype``: what it computes in.

    >>> one = torch.ones(1, 3, 1, 1)
    >>> reference_lightning_attention(one, one, one, torch.tensor([0.0]), torch.tensor([[1, 1, 2]])).flatten().tolist()
    [1.0, 2.0, 1.0]
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"reference_lightning_attention: expected q, k [B, S, H, K] and v [B, S, H, V] with the same B, S, H; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, S, H, K = q.shape
    if not isinstance(slope, Tensor) or tuple(slope.reshape(-1).shape) != (H,):
        got = tuple(slope.shape) if isinstance(slope, Tensor) else type(slope).__name__
        raise ValueError(f"reference_lightning_attention: slope expected H = {H} numbers (one per head), got {got}")
    seg = _segments(doc_ids, (B, S), "reference_lightning_attention")
    q64, k64, v64 = (t.to(dtype) for t in (q, k, v))
    decay = torch.exp(-slope.reshape(H).to(dtype))[:, None, None]
    zero = v64.new_zeros(H, v.shape[-1])
    rows = []
    for b in range(B):
        row, state = [], None
        for t in range(S):
            if seg[b, t] == 0:
                row.append(zero)
                continue
            if t == 0 or seg[b, t] != seg[b, t - 1]:
                state = v64.new_zeros(H, K, v.shape[-1])  # a document starts: its state starts at zero
            state = decay * state + k64[b, t][:, :, None] * v64[b, t][:, None, :]
            row.append(torch.einsum("hk,hkv->hv", q64[b, t], state))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def reference_ssd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, doc_ids: Tensor, *, D: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Mamba2's SSD per document, float64: ``x [B, S, H, Dh]``, ``dt [B, S, H]`` (the time step, positive: after
    the softplus and the clamp), ``A [H]`` (negative), ``B, C [B, S, G, N]`` (each group serves ``H / G``
    consecutive heads), ``D [H]`` -> ``[B, S, H, Dh]``; 0 on padding.

    The state of each head, ``S [Dh, N]``, is zero at a document's first token; per token
    ``S = exp(dt A) S + (dt x) B^T`` and ``y = S C + D x``. ``dtype``: what it computes in.

    >>> one = torch.ones(1, 3, 1, 1)
    >>> reference_ssd(one, torch.ones(1, 3, 1), torch.tensor([-1e9]), one, one, torch.tensor([[1, 1, 2]])).flatten().tolist()
    [1.0, 1.0, 1.0]
    """
    if x.dim() != 4 or B.dim() != 4 or C.shape != B.shape or B.shape[:2] != x.shape[:2]:
        raise ValueError(
            f"reference_ssd: expected x [B, S, H, Dh] and B, C [B, S, G, N] with the same B, S; got x {tuple(x.shape)}, "
            f"B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    Bsz, S, H, Dh = x.shape
    G, N = B.shape[2], B.shape[3]
    if H % G:
        raise ValueError(f"reference_ssd: expected H a multiple of G, got H={H}, G={G}")
    if tuple(dt.shape) != (Bsz, S, H):
        raise ValueError(f"reference_ssd: dt expected [B, S, H] = {[Bsz, S, H]}, got {tuple(dt.shape)}")
    for name, t in (("A", A), ("D", D)):
        if t is not None and tuple(t.shape) != (H,):
            raise ValueError(f"reference_ssd: {name} expected [H] = [{H}], got {tuple(t.shape)}")
    seg = _segments(doc_ids, (Bsz, S), "reference_ssd")
    x64, dt64, A64 = x.to(dtype), dt.to(dtype), A.to(dtype)
    B64, C64 = (t.to(dtype).repeat_interleave(H // G, dim=2) for t in (B, C))
    D64 = None if D is None else D.to(dtype)
    zero = x64.new_zeros(H, Dh)
    rows = []
    for b in range(Bsz):
        row, h = [], None
        for t in range(S):
            if seg[b, t] == 0:
                row.append(zero)
                continue
            if t == 0 or seg[b, t] != seg[b, t - 1]:
                h = x64.new_zeros(H, Dh, N)  # a document starts: its state starts at zero
            step = dt64[b, t]  # [H]
            h = torch.exp(step * A64)[:, None, None] * h + (step[:, None] * x64[b, t])[:, :, None] * B64[b, t][:, None, :]
            y = torch.einsum("hpn,hn->hp", h, C64[b, t])
            row.append(y if D64 is None else y + D64[:, None] * x64[b, t])
        rows.append(torch.stack(row))
    return torch.stack(rows)


def reference_mamba2_mixer(
    hidden: Tensor,
    doc_ids: Tensor,
    params: dict[str, Tensor],
    *,
    heads: int,
    head_dim: int,
    groups: int,
    state_size: int,
    time_step_limit: tuple[float, float] = (0.0, float("inf")),
    eps: float = 1e-6,
    activation: str | None = "silu",
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The Mamba2 layer per document, float64: ``hidden [B, S, E]`` -> ``[B, S, E]``; the rows of padding see only
    their own token (``in_proj`` and ``out_proj`` are per token), their convolution and SSD output 0.

    ``params`` (the layer's parameters by their transformers names): ``in_proj.weight [2 I + 2 G N + H, E]``
    (``I = H * Dh``; ``in_proj.bias`` optional), ``conv1d.weight [I + 2 G N, 1, W]`` (``conv1d.bias`` optional),
    ``dt_bias``, ``A_log``, ``D [H]``, ``norm.weight [I]``, ``out_proj.weight [E, I]`` (``out_proj.bias``
    optional). ``eps``: the gated norm's (normalised over each group's ``I / G`` channels).
    """
    p = {k: v.to(dtype) for k, v in params.items()}
    I, GN = heads * head_dim, groups * state_size
    Bsz, S, _ = hidden.shape
    proj = torch.nn.functional.linear(hidden.to(dtype), p["in_proj.weight"], p.get("in_proj.bias"))
    z, xbc, dt = proj.split([I, I + 2 * GN, heads], dim=-1)
    w = p["conv1d.weight"]
    xbc = reference_causal_conv(xbc, doc_ids, w.reshape(w.shape[0], w.shape[-1]), p.get("conv1d.bias"), activation,
                                dtype=dtype)
    x, B, C = xbc.split([I, GN, GN], dim=-1)
    dt = torch.nn.functional.softplus(dt + p["dt_bias"]).clamp(time_step_limit[0], time_step_limit[1])
    y = reference_ssd(x.reshape(Bsz, S, heads, head_dim), dt, -torch.exp(p["A_log"]),
                      B.reshape(Bsz, S, groups, state_size), C.reshape(Bsz, S, groups, state_size), doc_ids,
                      D=p["D"], dtype=dtype).reshape(Bsz, S, I)
    g = (y * torch.nn.functional.silu(z)).reshape(Bsz, S, groups, I // groups)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return torch.nn.functional.linear(p["norm.weight"] * g.reshape(Bsz, S, I), p["out_proj.weight"], p.get("out_proj.bias"))


def reference_selective_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, doc_ids: Tensor, *, D: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Mamba1's selective scan per document, float64: ``x [B, S, I]``, ``dt [B, S, I]`` (the time step, positive:
    after ``dt_proj``'s bias and the softplus), ``A [I, N]`` (negative), ``B, C [B, S, G, N]`` (each group serves
    ``I / G`` consecutive channels; transformers' Mamba, Falcon-Mamba and Jamba have ``G = 1``, Zamba one group per
    head), ``D [I]`` -> ``[B, S, I]``; 0 on padding.

    The state of each channel, ``h [N]``, is zero at a document's first token; per token
    ``h = exp(dt A) h + dt x B`` and ``y = h . C + D x``. ``dtype``: what it computes in.

    >>> one = torch.ones(1, 3, 1)
    >>> B1 = torch.ones(1, 3, 1, 1)
    >>> reference_selective_scan(one, one, torch.tensor([[-1e9]]), B1, B1, torch.tensor([[1, 1, 2]])).flatten().tolist()
    [1.0, 1.0, 1.0]
    """
    if x.dim() != 3 or B.dim() != 4 or C.shape != B.shape or B.shape[:2] != x.shape[:2]:
        raise ValueError(
            f"reference_selective_scan: expected x [B, S, I] and B, C [B, S, G, N] with the same B, S; got x "
            f"{tuple(x.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    Bsz, S, I = x.shape
    G, N = B.shape[2], B.shape[3]
    if I % G:
        raise ValueError(f"reference_selective_scan: expected I a multiple of G, got I={I}, G={G}")
    if tuple(dt.shape) != (Bsz, S, I):
        raise ValueError(f"reference_selective_scan: dt expected [B, S, I] = {[Bsz, S, I]}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (I, N):
        raise ValueError(f"reference_selective_scan: A expected [I, N] = {[I, N]}, got {tuple(A.shape)}")
    if D is not None and tuple(D.shape) != (I,):
        raise ValueError(f"reference_selective_scan: D expected [I] = [{I}], got {tuple(D.shape)}")
    seg = _segments(doc_ids, (Bsz, S), "reference_selective_scan")
    x64, dt64, A64 = x.to(dtype), dt.to(dtype), A.to(dtype)
    B64, C64 = (t.to(dtype).repeat_interleave(I // G, dim=2) for t in (B, C))  # [B, S, I, N]
    D64 = None if D is None else D.to(dtype)
    zero = x64.new_zeros(I)
    rows = []
    for b in range(Bsz):
        row, h = [], None
        for t in range(S):
            if seg[b, t] == 0:
                row.append(zero)
                continue
            if t == 0 or seg[b, t] != seg[b, t - 1]:
                h = x64.new_zeros(I, N)  # a document starts: its state starts at zero
            step = dt64[b, t]  # [I]
            h = torch.exp(step[:, None] * A64) * h + (step * x64[b, t])[:, None] * B64[b, t]
            y = (h * C64[b, t]).sum(-1)
            row.append(y if D64 is None else y + D64 * x64[b, t])
        rows.append(torch.stack(row))
    return torch.stack(rows)


MAMBA1_VARIANTS = ("mamba", "falcon_mamba", "jamba", "zamba")


def _rms(t: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return t if weight is None else weight * t


def reference_mamba1_mixer(
    hidden: Tensor,
    doc_ids: Tensor,
    params: dict[str, Tensor],
    *,
    variant: str,
    time_step_rank: int,
    state_size: int,
    heads: int = 1,
    eps: float = 1e-6,
    activation: str | None = "silu",
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The Mamba1 layer per document, float64: ``hidden [B, S, E]`` -> ``[B, S, E]``; the rows of padding see only
    their own token (the projections are per token), their convolution and scan output 0.

    ``variant`` (:data:`MAMBA1_VARIANTS`) and ``params`` by their transformers names: ``in_proj.weight [2 I, E]``
    (``in_proj.bias`` optional), ``conv1d.weight [I, 1, W]`` (``conv1d.bias`` optional), ``A_log [I, N]``,
    ``D [I]``, ``out_proj.weight [E, I]`` (``out_proj.bias`` optional), and

    - ``mamba``, ``falcon_mamba``, ``jamba``: ``x_proj.weight [R + 2 N, I]``, ``dt_proj.weight [I, R]``,
      ``dt_proj.bias [I]``; ``falcon_mamba`` normalises ``dt, B, C`` (before ``dt_proj``) by an RMSNorm without
      weight, ``jamba`` by ones with weights ``dt_layernorm.weight [R]``, ``b_layernorm.weight``,
      ``c_layernorm.weight [N]``; ``eps`` theirs;
    - ``zamba`` (``heads`` heads of ``I / heads`` channels): ``x_proj_weight [H, R + 2 N, I / H]``,
      ``dt_proj_weight [H, I / H, R]``, ``dt_proj_bias``, ``D [H, I / H]``, ``A_log [H, I / H, N]``; channel ``c``
      of ``x`` is ``in_proj``'s output ``2 c``, of the gate ``2 c + 1``.
    """
    if variant not in MAMBA1_VARIANTS:
        raise ValueError(f"reference_mamba1_mixer: variant expected one of {list(MAMBA1_VARIANTS)}, got {variant!r}")
    p = {k: v.to(dtype) for k, v in params.items()}
    F = torch.nn.functional
    Bsz, S, _ = hidden.shape
    R, N = time_step_rank, state_size
    proj = F.linear(hidden.to(dtype), p["in_proj.weight"], p.get("in_proj.bias"))
    I = proj.shape[-1] // 2
    x, z = (proj[..., 0::2], proj[..., 1::2]) if variant == "zamba" else proj.split([I, I], dim=-1)
    w = p["conv1d.weight"]
    x = reference_causal_conv(x, doc_ids, w.reshape(w.shape[0], w.shape[-1]), p.get("conv1d.bias"), activation,
                              dtype=dtype)
    if variant == "zamba":
        H = heads
        xh = x.reshape(Bsz, S, H, I // H)
        ssm = torch.einsum("hrd,bshd->bshr", p["x_proj_weight"], xh)  # [B, S, H, R + 2 N]
        dt, Bm, Cm = ssm.split([R, N, N], dim=-1)
        dt = torch.einsum("hdr,bshr->bshd", p["dt_proj_weight"], dt) + p["dt_proj_bias"]
        dt, A, D = dt.reshape(Bsz, S, I), -torch.exp(p["A_log"]).reshape(I, N), p["D"].reshape(I)
    else:
        dt, Bm, Cm = F.linear(x, p["x_proj.weight"]).split([R, N, N], dim=-1)
        if variant != "mamba":
            norm = {n: p.get(f"{n}_layernorm.weight") if variant == "jamba" else None for n in ("dt", "b", "c")}
            dt, Bm, Cm = _rms(dt, norm["dt"], eps), _rms(Bm, norm["b"], eps), _rms(Cm, norm["c"], eps)
        dt = F.linear(dt, p["dt_proj.weight"], p["dt_proj.bias"])
        A, D = -torch.exp(p["A_log"]), p["D"]
        Bm, Cm = Bm[:, :, None], Cm[:, :, None]
    y = reference_selective_scan(x, F.softplus(dt), A, Bm, Cm, doc_ids, D=D, dtype=dtype)
    return F.linear(y * F.silu(z), p["out_proj.weight"], p.get("out_proj.bias"))
