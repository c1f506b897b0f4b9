"""Hugging Face transformers' Gated DeltaNet, KDA, Mamba2, Mamba1, lightning-attention and short-convolution layers per
document under CP.

The installers of the mixer families (:data:`blockdiag_dist.families.FAMILIES` names the classes each installs
on; nothing of transformers is imported here): the first time a step meets one of these classes, the guard
installs a forward on the class that, **under a step**, computes the layer per document across CP ranks — its short convolution through
:func:`blockdiag_dist.mixers.causal_conv`, its recurrence through :func:`blockdiag_dist.mixers.gated_delta_rule`
— and **outside a step** calls the class's own forward, unchanged. Everything else is the stock code's math: the
projections, the gates ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``, the gated RMSNorm
and the output projection. Precision: the stock layer computes its gates, its kernel and its gated norm in
float32 whatever the model's dtype; here they are computed in the model's dtype, float32 at least — exactly the
stock rounding for float32 and bfloat16 models, float64 for a float64 model (the truth ``verify.model`` calls
"mixers64", the layer all in float64).

| class | model types | projections |
| --- | --- | --- |
| ``Qwen3NextGatedDeltaNet`` | ``qwen3_next`` | ``in_proj_qkvz`` + ``in_proj_ba``, grouped per key head |
| ``Qwen3_5GatedDeltaNet`` | ``qwen3_5`` (text) | ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` |
| ``Qwen3_5MoeGatedDeltaNet`` | ``qwen3_5_moe`` (text) | as ``qwen3_5`` |
| ``LaraMiniGatedDeltaNet`` | ``lara_mini`` | as ``qwen3_5`` |
| ``OlmoHybridGatedDeltaNet`` | ``olmo_hybrid`` | ``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``, ``b_proj``, ``g_proj`` (beta x 2 with ``allow_neg_eigval``) |

The KDA layers (:data:`KDA_CLASSES`: ``KimiLinearDeltaAttention`` of ``kimi_linear``, ``BailingHybridDeltaAttention``
of ``bailing_hybrid``; :func:`install_kda`): the convolution of ``q, k, v`` through
:func:`~blockdiag_dist.mixers.causal_conv`, the recurrence through :func:`blockdiag_dist.mixers.kimi_delta_attention`;
their forget gates and sigmoid-gated RMSNorm are the stock math in the model's dtype, float32 at least.

The Mamba2 layers (:data:`MAMBA2_CLASSES`: ``NemotronHMamba2Mixer`` of ``nemotron_h``, ``BambaMixer`` of
``bamba``, ``GraniteMoeHybridMambaLayer`` of ``granitemoehybrid``, ``Zamba2MambaMixer`` of ``zamba2``,
``Mamba2Mixer`` of ``mamba2``, ``FalconH1Mixer`` of ``falcon_h1`` with its multipliers and optional norm; one
forward, :func:`install_mamba2`) likewise: the convolution of ``xBC``
through :func:`~blockdiag_dist.mixers.causal_conv`, the SSD through :func:`blockdiag_dist.mixers.ssd`; the stock
math elsewhere (``in_proj``; ``dt = clamp(softplus(dt + dt_bias), *time_step_limit)`` in the model's dtype;
``A = -exp(A_log)``; the gated group RMSNorm of ``y * silu(z)``; ``out_proj``). The stock layer computes its SSD
(``mamba2_chunk_scan``: x, B, C, dt cast to float32) and its gated norm in float32; here they are computed in the
model's dtype, float32 at least, as for Gated DeltaNet.

The Mamba1 layers (:data:`MAMBA1_CLASSES`: ``MambaMixer`` of ``mamba``, ``FalconMambaMixer`` of ``falcon_mamba``,
``JambaMambaMixer`` of ``jamba``, ``ZambaMambaMixer`` of ``zamba``; one forward, :func:`install_mamba1`): the
convolution of ``x`` through :func:`~blockdiag_dist.mixers.causal_conv`, the selective scan through
:func:`blockdiag_dist.mixers.selective_scan`; the stock math elsewhere (``in_proj`` -> ``x, z``, interleaved in
Zamba; ``x_proj`` -> ``dt, B, C``, one per head in Zamba; Falcon-Mamba's weightless and Jamba's weighted RMSNorms
of ``dt, B, C``; ``dt = softplus(dt_proj(dt))`` in the model's dtype; ``A = -exp(A_log)``; ``y * silu(z)``;
``out_proj``). The stock layer computes its norms of ``dt, B, C`` and its decays and state updates in float32
(its torch path keeps the state in the model's dtype); here they are computed in the model's dtype, float32 at
least, as for the other families.

MiniMax's lightning attention (``MiniMaxLightningAttention`` of ``minimax``; :func:`install_lightning`): the core
through :func:`blockdiag_dist.mixers.lightning_attention` with the layer's ``slope_rate``; the stock math elsewhere
(``act_fn(qkv_proj(h))`` split per head into q, k, v; the RMSNorm over all heads; ``sigmoid(output_gate(h))``;
``out_proj``). The stock layer computes its core in the model's dtype from decay tables made once at init in float32
(``query_decay``, ``key_decay``, ``diagonal_decay``: float32-rounded in a float64 model too) and its RMSNorm in
float32; here the core and the norm are computed in the model's dtype, float32 at least, the decays
``exp(-slope n)`` from the slope itself.

LFM2's short convolutions (:data:`SHORT_CONV_CLASSES`: ``Lfm2ShortConv`` of ``lfm2`` / ``lfm2_vl``,
``Lfm2MoeShortConv`` of ``lfm2_moe``, ``Lfm3ShortConv`` of ``lfm3``; one forward in transformers 5.24,
:func:`install_short_conv`): ``B, C, x = in_proj(h)``, the depthwise causal convolution of ``B * x`` through
:func:`~blockdiag_dist.mixers.causal_conv` (the history of documents continuing from other ranks), times ``C``,
``out_proj``; the same ops and dtypes as the stock forward.

Under a step the layer takes no cache (``use_cache=False`` in training) and no ``attention_mask`` (the
documents and the padding come from the step); either raises ``ValueError`` on every rank before any collective.

Shape legend: B rows, L rows of this rank, Hk key heads, Hv value heads, K / V head dims; Mamba2: H heads, Dh
head dim, G groups, N state size, E hidden size; Mamba1: I channels, R the time step's rank, H Zamba's heads.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..mixers import causal_conv, gated_delta_rule, kimi_delta_attention, lightning_attention, selective_scan, ssd

__all__ = [
    "GATED_DELTA_NET_CLASSES", "KDA_CLASSES", "LIGHTNING_CLASSES", "MAMBA1_CLASSES", "MAMBA2_CLASSES",
    "SHORT_CONV_CLASSES", "install_gated_delta_net", "install_kda", "install_lightning", "install_mamba1",
    "install_mamba2", "install_short_conv",
]

CONV_ACTIVATIONS = ("silu", "swish")  # computed inside causal_conv; any other is applied after it, as ACT2FN does


def _project_qwen3_next(self: nn.Module, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mixed_qkv [B, L, 2 Hk K + Hv V], z [B, L, Hv, V], b, a [B, L, Hv])`` as Qwen3NextGatedDeltaNet.forward."""
    query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(h), self.in_proj_ba(h))
    query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
    return torch.cat((query, key, value), dim=-1), z, b, a


def _project_qwen3_5(self: nn.Module, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The same for Qwen3_5GatedDeltaNet / Qwen3_5MoeGatedDeltaNet (separate projections)."""
    B, L, _ = h.shape
    return self.in_proj_qkv(h), self.in_proj_z(h).reshape(B, L, -1, self.head_v_dim), self.in_proj_b(h), self.in_proj_a(h)


def _project_olmo_hybrid(self: nn.Module, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """OlmoHybridGatedDeltaNet: separate ``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``, ``b_proj``; its output gate
    is ``g_proj`` (read by :func:`_per_document_forward` through ``z``)."""
    B, L, _ = h.shape
    mixed = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
    return mixed, self.g_proj(h).reshape(B, L, -1, self.head_v_dim), self.b_proj(h), self.a_proj(h)


# Gated DeltaNet layers -> their projections. Lara-mini's layer is Qwen3.5's line for line in transformers 5.24
# (its checkpoints fuse the projections, split at loading). OLMo-hybrid's has separate projections, a gate
# projection, `allow_neg_eigval` (beta times 2) and its gated norm named o_norm, read by _per_document_forward.
GATED_DELTA_NET_CLASSES = {
    "Qwen3NextGatedDeltaNet": _project_qwen3_next,
    "Qwen3_5GatedDeltaNet": _project_qwen3_5,
    "Qwen3_5MoeGatedDeltaNet": _project_qwen3_5,
    "LaraMiniGatedDeltaNet": _project_qwen3_5,
    "OlmoHybridGatedDeltaNet": _project_olmo_hybrid,
}


def _refuse_cache_and_mask(self: nn.Module, cache: Any, attention_mask: Any) -> None:
    what = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
    if cache is not None:
        raise ValueError(f"{what}: expected no cache under a CP step (use_cache=False in training), got {type(cache).__name__}")
    if attention_mask is not None:
        raise ValueError(
            f"{what}: expected no attention_mask under a CP step (documents and padding come from the step), got "
            f"{'a tensor of shape ' + str(tuple(attention_mask.shape)) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__}"
        )


def _per_document_forward(
    self: nn.Module, state, hidden_states: Tensor, cache: Any, attention_mask: Any, *, project
) -> Tensor:
    """The layer's forward under ``state``: the stock forward with the convolution and the recurrence per document."""
    _refuse_cache_and_mask(self, cache, attention_mask)
    B, L, _ = hidden_states.shape
    mixed_qkv, z, b, a = project(self, hidden_states)
    act = self.activation if self.activation in CONV_ACTIVATIONS else None
    mixed_qkv = causal_conv(mixed_qkv, self.conv1d.weight, self.conv1d.bias, act, state=state)
    if act is None and self.activation is not None:
        from transformers.activations import ACT2FN

        mixed_qkv = ACT2FN[self.activation](mixed_qkv)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(B, L, -1, self.head_k_dim)
    key = key.reshape(B, L, -1, self.head_k_dim)
    value = value.reshape(B, L, -1, self.head_v_dim)
    beta = b.sigmoid()
    if getattr(self, "allow_neg_eigval", False):  # OLMo-hybrid: beta in [0, 2]
        beta = beta * 2.0
    dt = torch.promote_types(a.dtype, torch.float32)  # the stock forward: .float() (fp16 would overflow exp)
    g = -self.A_log.to(dt).exp() * F.softplus(a.to(dt) + self.dt_bias)
    core = gated_delta_rule(query, key, value, g, beta, use_qk_l2norm=True, state=state)
    norm, out = (self.o_norm, self.o_proj) if hasattr(self, "o_norm") else (self.norm, self.out_proj)
    core = _gated_norm(norm, core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return out(core.reshape(B, L, -1))


def _gated_norm(norm: nn.Module, x: Tensor, gate: Tensor) -> Tensor:
    """The layer's gated RMSNorm (``Qwen3NextRMSNormGated.forward``: normalise, scale, times ``silu(gate)``) in
    ``x``'s dtype, float32 at least (the stock module: float32 always)."""
    dt = torch.promote_types(x.dtype, torch.float32)
    h = x.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    h = norm.weight * h.to(x.dtype)
    act = F.silu if norm.activation in ("silu", "swish") else _act(norm.activation)
    return (h * act(gate.to(dt))).to(x.dtype)


def _act(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _adapter(table, cls: type, installer: str):
    """The entry of ``table`` (a dict, or a tuple of names: then the name) for ``cls`` or the nearest class of its
    MRO that ``table`` names; ``installer`` raises ``ValueError`` naming the classes it installs on otherwise."""
    name = next((c.__name__ for c in cls.__mro__ if c.__name__ in table), None)
    if name is None:
        raise ValueError(f"{installer}: expected one of {sorted(table)}, got {cls.__name__}")
    return table[name] if isinstance(table, dict) else name


def install_gated_delta_net(cls: type) -> str:
    """Give ``cls`` (a Gated DeltaNet class of :data:`GATED_DELTA_NET_CLASSES`, or a subclass) a forward that is
    per document under a CP step and the class's own outside one; returns how (for the guard's notes)."""
    project = _adapter(GATED_DELTA_NET_CLASSES, cls, "install_gated_delta_net")
    how = ("convolution with the history of documents continuing from other ranks and the gated delta rule with "
           "their states (blockdiag_dist.mixers: causal_conv, gated_delta_rule)")
    return _install(cls, functools.partial(_per_document_forward, project=project), how)


def _mamba2_forward(self: nn.Module, state, hidden_states: Tensor, cache: Any, attention_mask: Any) -> Tensor:
    """A Mamba2 layer's forward under ``state`` (the stock torch path with the convolution and the SSD per
    document): ``hidden_states [B, L, E]`` -> ``[B, L, E]``."""
    _refuse_cache_and_mask(self, cache, attention_mask)
    project, gated_norm = _mamba2_adapter(type(self))
    B, L, _ = hidden_states.shape
    H, Dh, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    projected = project(self, hidden_states)
    gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, H], dim=-1)
    act = self.activation if self.activation in CONV_ACTIVATIONS else None
    xbc = causal_conv(xbc, self.conv1d.weight, self.conv1d.bias, act, state=state)
    if act is None and self.activation is not None:
        xbc = _act(self.activation)(xbc)
    x, Bm, Cm = xbc.split([self.intermediate_size, G * N, G * N], dim=-1)
    lo, hi = self.time_step_limit
    dt = torch.clamp(F.softplus(dt + self.dt_bias.to(dt.dtype)), min=lo, max=hi)  # the stock: dt's dtype
    compute = torch.promote_types(projected.dtype, torch.float32)
    A = -torch.exp(self.A_log.to(compute))
    y = ssd(x.reshape(B, L, H, Dh), dt, A, Bm.reshape(B, L, G, N), Cm.reshape(B, L, G, N), self.D, state=state)
    y = gated_norm(self, y.reshape(B, L, -1), gate)
    return self.out_proj(y.to(hidden_states.dtype))


def _project_mamba2(self: nn.Module, h: Tensor) -> Tensor:
    return self.in_proj(h)


def _project_falcon_h1(self: nn.Module, h: Tensor) -> Tensor:
    """``FalconH1Mixer``: its input multiplier, then its mup multipliers on ``z``, ``x``, ``B``, ``C``, ``dt``."""
    return self.in_proj(h * self.ssm_in_multiplier) * self.mup_vector


def _gated_group_norm(self: nn.Module, y: Tensor, gate: Tensor) -> Tensor:
    """``NemotronHRMSNormGated.forward`` (and its copies) in ``y``'s dtype, float32 at least: ``y * silu(gate)``,
    normalised over each group of ``norm.group_size`` channels, times the weight."""
    norm = self.norm
    dt = torch.promote_types(y.dtype, torch.float32)
    h = y.to(dt) * F.silu(gate.to(dt))
    *prefix, width = h.shape
    grouped = h.view(*prefix, width // norm.group_size, norm.group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * grouped.view(*prefix, width).to(y.dtype)


def _falcon_h1_norm(self: nn.Module, y: Tensor, gate: Tensor) -> Tensor:
    """``FalconH1Mixer``'s output gate: without ``mamba_rms_norm`` ``y * silu(gate)``; with it
    ``FalconH1RMSNormGated`` (the gate before or after the group norm, ``norm_before_gate``), in ``y``'s dtype,
    float32 at least."""
    if not self.mamba_rms_norm:
        return y * F.silu(gate)
    norm = self.norm
    dt = torch.promote_types(y.dtype, torch.float32)
    h, g = y.to(dt), F.silu(gate.to(dt))
    if not norm.norm_before_gate:
        h = h * g
    *prefix, width = h.shape
    grouped = h.view(*prefix, norm.n_groups, width // norm.n_groups)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    h = (norm.weight.view(norm.n_groups, -1) * grouped).view(*prefix, width)
    if norm.norm_before_gate:
        h = h * g
    return h.to(y.dtype)


# Mamba2 layers -> (projection, output gate). The first five have NemotronHMamba2Mixer's forward, torch path
# (mamba2_chunk_scan, causal_conv1d_fn) and gated norm line for line in transformers 5.24 (their differences are
# attributes read here: time_step_limit, the norm's eps); FalconH1Mixer adds its multipliers and its optional,
# configurable norm. Each is checked by tests/test_hf_mamba2.py against each document alone.
MAMBA2_CLASSES = {
    "NemotronHMamba2Mixer": (_project_mamba2, _gated_group_norm),
    "BambaMixer": (_project_mamba2, _gated_group_norm),
    "GraniteMoeHybridMambaLayer": (_project_mamba2, _gated_group_norm),
    "Mamba2Mixer": (_project_mamba2, _gated_group_norm),
    "Zamba2MambaMixer": (_project_mamba2, _gated_group_norm),
    "FalconH1Mixer": (_project_falcon_h1, _falcon_h1_norm),
}


def _mamba2_adapter(cls: type):
    return _adapter(MAMBA2_CLASSES, cls, "install_mamba2")


def install_mamba2(cls: type) -> str:
    """Give ``cls`` (a Mamba2 class of :data:`MAMBA2_CLASSES`, or a subclass) a forward that is per document under
    a CP step and the class's own outside one; returns how (for the guard's notes)."""
    _mamba2_adapter(cls)
    how = ("convolution with the history of documents continuing from other ranks and Mamba2's SSD with their "
           "states (blockdiag_dist.mixers: causal_conv, ssd)")
    return _install(cls, _mamba2_forward, how)


def _kimi_gates(self: nn.Module, h: Tensor, dt: torch.dtype) -> tuple[Tensor, Tensor]:
    """``KimiLinearDeltaAttention``'s decay ``g [B, L, H, K]`` (``KimiLinearForgetGate.forward`` in ``dt``: the
    stock module computes in float32) and output gate ``[B, L, H, K]``."""
    B, L, _ = h.shape
    f = self.forget_gate
    gate_in = (f.f_b_proj(f.f_a_proj(h)).to(dt) + f.dt_bias.to(dt).view(1, 1, -1)).view(B, L, -1, self.head_dim)
    softplus = torch.where(gate_in > 20.0, gate_in, torch.log(1.0 + torch.exp(gate_in)))  # the stock's softplus
    g = -torch.exp(f.A_log.to(dt)) * softplus
    return g, self.g_b_proj(self.g_a_proj(h)).view(B, L, -1, self.head_dim)


def _bailing_gates(self: nn.Module, h: Tensor, dt: torch.dtype) -> tuple[Tensor, Tensor]:
    """``BailingHybridDeltaAttention``'s decay (``BailingHybridForgetGate.forward`` in ``dt``, its safe gate
    ``lower_bound * sigmoid(.)`` or ``-exp(A_log) softplus(.)``, cast to the model's dtype as the stock does) and
    output gate."""
    B, L, _ = h.shape
    f = self.forget_gate
    gate_in = f.f_proj(h).to(dt).view(B, L, f.num_heads, f.head_dim) + f.dt_bias.to(dt).view(1, 1, f.num_heads, f.head_dim)
    decay = f.A_log.to(dt).exp().view(1, 1, f.num_heads, 1)
    g = f.lower_bound * torch.sigmoid(decay * gate_in) if f.safe_gate else -decay * F.softplus(gate_in)
    return g.to(h.dtype), self.g_proj(h).view(B, L, -1, self.head_dim)


# KDA layers -> their gates (decay and output gate); the rest of their forward is one in transformers 5.24:
# q, k, v projections, the causal convolution of their concatenation with its activation, beta = sigmoid(b_proj),
# KDA (chunk_kimi_delta_attention, use_qk_l2norm_in_kernel=True), the sigmoid-gated RMSNorm per head, o_proj
KDA_CLASSES = {"KimiLinearDeltaAttention": _kimi_gates, "BailingHybridDeltaAttention": _bailing_gates}


def _kda_forward(self: nn.Module, state, hidden_states: Tensor, cache: Any, attention_mask: Any, *, gates) -> Tensor:
    """A KDA layer's forward under ``state``: the stock forward with the convolution and KDA per document."""
    _refuse_cache_and_mask(self, cache, attention_mask)
    B, L, _ = hidden_states.shape
    h = hidden_states
    mixed = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
    act = self.activation if self.activation in CONV_ACTIVATIONS else None
    mixed = causal_conv(mixed, self.conv1d.weight, self.conv1d.bias, act, state=state)
    if act is None and self.activation is not None:
        mixed = _act(self.activation)(mixed)
    q, k, v = (t.reshape(B, L, -1, self.head_dim) for t in mixed.split([self.qkv_dim] * 3, dim=-1))
    dt = torch.promote_types(h.dtype, torch.float32)
    g, out_gate = gates(self, h, dt)
    beta = torch.sigmoid(self.b_proj(h))
    core = kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm=True, state=state)
    norm = self.o_norm  # the sigmoid-gated RMSNorm over each head, in dt (the stock: float32 always)
    x = core.to(dt)
    x = norm.weight.to(dt) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    x = (x * torch.sigmoid(out_gate.to(dt))).to(core.dtype)
    return self.o_proj(x.reshape(B, L, -1))


def install_kda(cls: type) -> str:
    """Give ``cls`` (a KDA class of :data:`KDA_CLASSES`, or a subclass) a forward that is per document under a CP
    step and the class's own outside one; returns how (for the guard's notes)."""
    gates = _adapter(KDA_CLASSES, cls, "install_kda")
    how = ("convolution with the history of documents continuing from other ranks and Kimi Delta Attention with "
           "their states (blockdiag_dist.mixers: causal_conv, kimi_delta_attention)")
    return _install(cls, functools.partial(_kda_forward, gates=gates), how)


def _rms_norm(h: Tensor, eps: float, weight: Tensor | None) -> Tensor:
    """An RMSNorm over the last dim as Jamba's (``weight`` times the normalised ``h`` cast back to ``h``'s dtype)
    and Falcon-Mamba's weightless one compute it, normalised in ``h``'s dtype, float32 at least (the stock: float32)."""
    dt = torch.promote_types(h.dtype, torch.float32)
    n = h.to(dt)
    n = (n * torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return n if weight is None else weight * n


def _ssm_params_mamba(self: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dt before its bias [B, L, I], B, C [B, L, 1, N], A_log [I, N], D [I])`` of ``MambaMixer``."""
    R, N = self.time_step_rank, self.ssm_state_size
    ts, Bm, Cm = self.x_proj(x).split([R, N, N], dim=-1)
    return ts @ self.dt_proj.weight.t(), Bm[:, :, None], Cm[:, :, None], self.A_log, self.D


def _ssm_params_normed(self: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The same with ``dt, B, C`` normalised: Falcon-Mamba without weights (``rms_eps``), Jamba with
    (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``)."""
    R, N = self.time_step_rank, self.ssm_state_size
    ts, Bm, Cm = self.x_proj(x).split([R, N, N], dim=-1)
    weighted = hasattr(self.dt_layernorm, "variance_epsilon")  # JambaRMSNorm; FalconMamba's has `eps`, no weight
    eps = self.dt_layernorm.variance_epsilon if weighted else self.rms_eps
    ts, Bm, Cm = (_rms_norm(t, eps, norm.weight if weighted else None)
                  for t, norm in ((ts, self.dt_layernorm), (Bm, self.b_layernorm), (Cm, self.c_layernorm)))
    return ts @ self.dt_proj.weight.t(), Bm[:, :, None], Cm[:, :, None], self.A_log, self.D


def _ssm_params_zamba(self: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``ZambaMambaMixer``: per head its own ``x_proj_weight [H, R + 2 N, I / H]`` and ``dt_proj_weight
    [H, I / H, R]``; ``B, C [B, L, H, N]`` (one group per head)."""
    B, L, I = x.shape
    H, R, N = self.n_mamba_heads, self.time_step_rank, self.ssm_state_size
    ssm = torch.einsum("hrd,blhd->blhr", self.x_proj_weight, x.reshape(B, L, H, I // H))
    ts, Bm, Cm = ssm.split([R, N, N], dim=-1)
    dt = torch.einsum("hdr,blhr->blhd", self.dt_proj_weight, ts).reshape(B, L, I)
    return dt, Bm, Cm, self.A_log.reshape(I, N), self.D.reshape(I)


# Mamba1 layers -> (x and gate from in_proj, ssm parameters, dt_proj's bias). MambaMixer, FalconMambaMixer and
# JambaMambaMixer share the torch path (causal_conv1d_fn, mamba_selective_scan) in transformers 5.24 and differ in
# the norms of dt, B, C; ZambaMambaMixer splits its channels into heads. Each is checked by tests/test_hf_mamba1.py
# against each document alone.
MAMBA1_CLASSES = {
    "MambaMixer": ("chunk", _ssm_params_mamba, "dt_proj.bias"),
    "FalconMambaMixer": ("chunk", _ssm_params_normed, "dt_proj.bias"),
    "JambaMambaMixer": ("chunk", _ssm_params_normed, "dt_proj.bias"),
    "ZambaMambaMixer": ("interleaved", _ssm_params_zamba, "dt_proj_bias"),
}


def _mamba1_adapter(cls: type):
    return _adapter(MAMBA1_CLASSES, cls, "install_mamba1")


def _mamba1_forward(self: nn.Module, state, hidden_states: Tensor, cache: Any, attention_mask: Any) -> Tensor:
    """A Mamba1 layer's forward under ``state`` (the stock torch path with the convolution and the selective scan
    per document): ``hidden_states [B, L, E]`` -> ``[B, L, E]``."""
    _refuse_cache_and_mask(self, cache, attention_mask)
    split, ssm_params, bias_name = _mamba1_adapter(type(self))
    projected = self.in_proj(hidden_states)  # [B, L, 2 I]
    if split == "interleaved":  # Zamba: channel c of x is output 2 c, of the gate 2 c + 1
        x, gate = projected[..., 0::2], projected[..., 1::2]
    else:
        x, gate = projected.chunk(2, dim=-1)
    act = self.activation if self.activation in CONV_ACTIVATIONS else None
    x = causal_conv(x, self.conv1d.weight, self.conv1d.bias, act, state=state)
    if act is None and self.activation is not None:
        x = _act(self.activation)(x)
    dt, Bm, Cm, A_log, D = ssm_params(self, x)
    bias = self.get_parameter(bias_name)
    dt = F.softplus(dt + bias.reshape(-1).to(dt.dtype))  # the stock: in dt's dtype
    compute = torch.promote_types(projected.dtype, torch.float32)
    y = selective_scan(x, dt, -torch.exp(A_log.to(compute)), Bm, Cm, D, state=state)
    y = y * F.silu(gate.to(y.dtype))
    return self.out_proj(y.to(hidden_states.dtype))


def install_mamba1(cls: type) -> str:
    """Give ``cls`` (a Mamba1 class of :data:`MAMBA1_CLASSES`, or a subclass) a forward that is per document under
    a CP step and the class's own outside one; returns how (for the guard's notes)."""
    _mamba1_adapter(cls)
    how = ("convolution with the history of documents continuing from other ranks and Mamba1's selective scan with "
           "their states (blockdiag_dist.mixers: causal_conv, selective_scan)")
    return _install(cls, _mamba1_forward, how)


LIGHTNING_CLASSES = ("MiniMaxLightningAttention",)


def _lightning_forward(self: nn.Module, state, hidden_states: Tensor, cache: Any, attention_mask: Any):
    """``MiniMaxLightningAttention.forward`` under ``state``: ``hidden_states [B, L, E]`` -> ``(out [B, L, E], None)``
    (the stock returns the final state second; its decoder layer discards it)."""
    _refuse_cache_and_mask(self, cache, attention_mask)
    B, L, _ = hidden_states.shape
    H, D = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(B, L, H, 3 * D)
    q, k, v = torch.split(qkv, D, dim=3)
    core = lightning_attention(q, k, v, self.slope_rate, state=state)  # [B, L, H, D], float32 at least
    dt = torch.promote_types(hidden_states.dtype, torch.float32)  # MiniMaxRMSNorm: float32 always
    x = core.reshape(B, L, H * D).to(dt)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
    x = self.norm.weight * x.to(hidden_states.dtype)
    return self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * x), None


def install_lightning(cls: type) -> str:
    """Give ``cls`` (``MiniMaxLightningAttention``, or a subclass) a forward that is per document under a CP step and
    the class's own outside one; returns how (for the guard's notes)."""
    _adapter(LIGHTNING_CLASSES, cls, "install_lightning")
    return _install(cls, _lightning_forward, "lightning attention with the states of documents continuing from other "
                    "ranks (blockdiag_dist.mixers.lightning_attention)")


SHORT_CONV_CLASSES = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")  # one forward in transformers 5.24


def _short_conv_forward(self: nn.Module, state, hidden_states: Tensor, cache: Any, attention_mask: Any) -> Tensor:
    """``Lfm2ShortConv.forward`` under ``state``: the gated depthwise convolution per document."""
    _refuse_cache_and_mask(self, cache, attention_mask)
    b, c, x = self.in_proj(hidden_states).chunk(3, dim=-1)  # [B, L, E] each
    return self.out_proj(c * causal_conv(b * x, self.conv.weight, self.conv.bias, None, state=state))


def install_short_conv(cls: type) -> str:
    """Give ``cls`` (a class of :data:`SHORT_CONV_CLASSES`, or a subclass) a forward that is per document under a
    CP step and the class's own outside one; returns how (for the guard's notes)."""
    _adapter(SHORT_CONV_CLASSES, cls, "install_short_conv")
    return _install(cls, _short_conv_forward, "the gated short convolution with the history of documents continuing "
                    "from other ranks (blockdiag_dist.mixers.causal_conv)")


# transformers' names for a layer's cache: ``cache`` in 5.24, whose deprecation decorators rename ``cache_params``
# (Mamba, Gated DeltaNet, KDA layers) or ``past_key_values`` (MiniMax, LFM2) to it
CACHE_NAMES = ("cache", "cache_params", "past_key_values")


def _install(cls: type, per_document, how: str) -> str:
    """``cls.forward`` becomes ``per_document(self, state, hidden_states, cache, attention_mask)`` under a CP step
    and the stock forward, called as it was called, outside one (installed once; the stock forward kept as
    ``_blockdiag_stock``). Under a step the arguments are bound by the stock forward's own signature (read here,
    from the class installed: a subclass's forward may order them differently), so a call the stock forward
    refuses (an argument given twice, too many) raises the same ``TypeError``; a deprecated name of the cache
    is the cache (refused like it)."""
    stock = cls.forward
    if getattr(stock, "_blockdiag_stock", None) is not None:
        return stock._blockdiag_how
    signature = inspect.signature(stock)  # through functools.wraps: the def's own parameters, self first
    params = signature.parameters
    cache_name = next((n for n in CACHE_NAMES if n in params), None)
    aliases = tuple(n for n in CACHE_NAMES if n not in params)
    var_kw = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    names = ", ".join(("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else "") + n
                      for n, p in params.items())

    @functools.wraps(stock)
    def forward(self, hidden_states, *args, **kwargs):
        from ..runtime import _step_of_call

        state = _step_of_call(hidden_states) if torch.is_tensor(hidden_states) else None
        if state is None:
            return stock(self, hidden_states, *args, **kwargs)
        aliased = [kwargs.pop(a) for a in aliases if a in kwargs]
        if aliased and cache_name is not None and cache_name not in kwargs:
            kwargs[cache_name] = aliased.pop(0)  # renamed as the stock decorator does: bound like the cache
        try:
            bound = signature.bind(self, hidden_states, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{type(self).__name__}.forward: {exc} (expected the parameters of {cls.__name__}.forward: "
                            f"({names}); got hidden_states, {len(args)} more positional and the keywords "
                            f"{sorted(kwargs)})") from None
        given = {**bound.arguments.get(var_kw, {}), **bound.arguments} if var_kw else bound.arguments
        caches = [given.get(n) for n in CACHE_NAMES] + aliased
        cache = next((c for c in caches if c is not None), None)
        return per_document(self, state, hidden_states, cache, given.get("attention_mask"))

    forward._blockdiag_stock = stock
    forward._blockdiag_how = how
    cls.forward = forward
    return how
