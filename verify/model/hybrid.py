"""Hybrid models (Gated DeltaNet or Mamba2 + attention) judged as whole models: tiny transformers models from their
configs, the truth they are compared with, and the step every rank of a pool runs.

- :func:`build_tiny_hybrid`: a tiny ``qwen3_next``, ``qwen3_5`` (text) or ``qwen3_5_moe`` (text) causal LM
  (hidden 32, layers linear-attention / full-attention / linear-attention, 2 key and 4 value heads of 8), or a tiny
  ``nemotron_h`` / ``nemotron_h_moe`` / ``bamba`` / ``granitemoehybrid`` (Mamba2 layers of 4 heads of 8, 2 groups,
  state 8, convolution width 4, SSD chunk 16 in the stock truth, with attention and MLP / MoE layers), random
  weights from a seed, blockdiag's attention registered; and the other hybrids of ``FAMILIES`` (KDA, Mamba1, LFM2,
  MiniMax's lightning attention: :func:`float64_decay_tables`);
- :func:`float64_kernel`: the truth's one substitution. The stock Gated DeltaNet computes its gates, its chunked
  kernel and its gated norm in float32 whatever the model's dtype; inside this context the Gated DeltaNet layers
  run every op in float64 (``verify.model``'s "mixers64" truth: :func:`verify.model.precision.float64_modules`),
  as blockdiag computes them in a float64 model. What the rest of the model computes in float32 it still does
  (its RMSNorms' ``x.float()`` and ``weight.float()``): elementwise roundings, identical in the truth and under CP,
  except the gradients of those norms' weights, which the model sums over tokens in float32
  (:func:`float32_reduced`);
- :func:`cp_parity_step`: the step under CP on this rank (optionally DP 2 x CP 2, bf16 autocast, activation
  checkpointing), the loss and every gradient summed over the mesh.

Shape legend: S packed length, L rows of one rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from blockdiag_dist.integrations import pack_documents, register_transformers_attention
from .harness import StepResult, cp_step, document_reference, text_forward
from .precision import float64_decay_tables

__all__ = [
    "DOC_LENGTHS",
    "FAMILIES",
    "FLOAT32_REDUCED",
    "SEQ_LEN",
    "build_tiny_hybrid",
    "cp_parity_step",
    "float32_reduced",
    "float64_decay_tables",
    "float64_kernel",
    "hybrid_batch",
    "hybrid_docs",
    "truth",
]

# family -> (config class, model class, modeling module)
FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "transformers.models.qwen3_next.modeling_qwen3_next"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "transformers.models.qwen3_5.modeling_qwen3_5"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", "transformers.models.nemotron_h.modeling_nemotron_h"),
    "nemotron_h_moe": ("NemotronHConfig", "NemotronHForCausalLM", "transformers.models.nemotron_h.modeling_nemotron_h"),
    "bamba": ("BambaConfig", "BambaForCausalLM", "transformers.models.bamba.modeling_bamba"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         "transformers.models.granitemoehybrid.modeling_granitemoehybrid"),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", "transformers.models.mamba2.modeling_mamba2"),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", "transformers.models.zamba2.modeling_zamba2"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", "transformers.models.falcon_h1.modeling_falcon_h1"),
    "falcon_h1_gate_first": ("FalconH1Config", "FalconH1ForCausalLM", "transformers.models.falcon_h1.modeling_falcon_h1"),
    "falcon_h1_nonorm": ("FalconH1Config", "FalconH1ForCausalLM", "transformers.models.falcon_h1.modeling_falcon_h1"),
    "jamba": ("JambaConfig", "JambaForCausalLM", "transformers.models.jamba.modeling_jamba"),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", "transformers.models.falcon_mamba.modeling_falcon_mamba"),
    "mamba": ("MambaConfig", "MambaForCausalLM", "transformers.models.mamba.modeling_mamba"),
    "zamba": ("ZambaConfig", "ZambaForCausalLM", "transformers.models.zamba.modeling_zamba"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", "transformers.models.lfm2.modeling_lfm2"),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", "transformers.models.lfm2_moe.modeling_lfm2_moe"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", "transformers.models.kimi_linear.modeling_kimi_linear"),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
                       "transformers.models.bailing_hybrid.modeling_bailing_hybrid"),
}
# Gated DeltaNet with other projections: OLMo-hybrid (separate projections, a gate projection, beta in [0, 2]) and
# Lara-mini (Qwen3.5's layer); built by the Qwen3-Next path below
FAMILIES.update({
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", "transformers.models.olmo_hybrid.modeling_olmo_hybrid"),
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", "transformers.models.lara_mini.modeling_lara_mini"),
})
# MiniMax (lightning attention, softmax attention, lightning attention; every feed-forward a MoE of 4 experts, 2 per
# token): lightning layers of 4 heads of 8, blocks of 16 tokens in the stock truth (documents over several blocks)
FAMILIES["minimax"] = ("MiniMaxConfig", "MiniMaxForCausalLM", "transformers.models.minimax.modeling_minimax")
MINIMAX_LAYERS = ("linear_attention", "full_attention", "linear_attention")
KDA_FAMILIES = ("kimi_linear", "bailing_hybrid")  # KDA, MLA attention (dense MLPs here), KDA
# LFM2: short convolution (width 3), attention, short convolution; the MoE variant's last layer sparse
SHORT_CONV_LAYERS = ("conv", "full_attention", "conv")
LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention")
# Nemotron-H's pattern "M*-M" (Mamba2, attention, MLP, Mamba2); with MoE "M*EM"
FAMILY_LAYERS = {
    "nemotron_h": ("linear_attention", "full_attention", "mlp", "linear_attention"),
    "nemotron_h_moe": ("linear_attention", "full_attention", "moe", "linear_attention"),
    "bamba": ("mamba", "attention", "mamba"),
    "granitemoehybrid": ("mamba", "attention", "mamba"),
    "mamba2": ("mamba", "mamba"),  # no attention layer
    "zamba2": ("mamba", "hybrid", "mamba"),
    "falcon_h1": ("hybrid", "hybrid"),  # attention and Mamba2 side by side in every layer
    "falcon_h1_gate_first": ("hybrid", "hybrid"),
    "falcon_h1_nonorm": ("hybrid", "hybrid"),
}
# Mamba1 (selective scan) models: Jamba's (Mamba, attention with a MoE, Mamba), Zamba's (Mamba, Mamba with the
# shared attention block, Mamba), Mamba's and Falcon-Mamba's (two Mamba layers)
MAMBA1_LAYERS = {"jamba": ("mamba", "attention", "mamba"), "zamba": ("mamba", "hybrid", "mamba"),
                 "mamba": ("mamba", "mamba"), "falcon_mamba": ("mamba", "mamba")}
NO_ATTENTION = ("mamba2", "mamba", "falcon_mamba")  # families whose steps route no attention call (expect_attention=False)
MAMBA2 = dict(ssm_heads=4, ssm_head_dim=8, groups=2, state=8, conv=4, chunk=16)
MAMBA1 = dict(expand=2, state=8, conv=4, dt_rank=4, zamba_heads=2)  # 64 channels of 8 states
SEQ_LEN = 64
# two rows of 64: documents over 3 ranks at CP 4 (37 tokens from 0; 40 tokens from 11), short ones, padding
DOC_LENGTHS = (37, 3, 19, 11, 40, 6)
# parameters whose gradient the model itself sums over tokens in float32 (its RMSNorms' `weight.float()`, outside
# the Gated DeltaNet layers): their float64 parity is float32 rounding of a sum, not 1e-10
FLOAT32_REDUCED = ("norm.weight",)


def float32_reduced(name: str) -> bool:
    return name.endswith(FLOAT32_REDUCED) and ".linear_attn." not in name


def _mamba2_config(family: str, layers: tuple[str, ...]):
    import transformers

    cfg_cls = getattr(transformers, FAMILIES[family][0])
    m = MAMBA2
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                  tie_word_embeddings=False, max_position_embeddings=4 * SEQ_LEN)
    if family.startswith("nemotron_h"):
        return cfg_cls(**common, head_dim=16, layers_block_type=list(layers), mamba_num_heads=m["ssm_heads"],
                       mamba_head_dim=m["ssm_head_dim"], n_groups=m["groups"], ssm_state_size=m["state"],
                       conv_kernel=m["conv"], chunk_size=m["chunk"], n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, use_conv_bias=True)
    mamba = dict(mamba_n_heads=m["ssm_heads"], mamba_d_head=m["ssm_head_dim"], mamba_n_groups=m["groups"],
                 mamba_d_state=m["state"], mamba_d_conv=m["conv"], mamba_chunk_size=m["chunk"], mamba_expand=1,
                 mamba_conv_bias=True)
    if family == "mamba2":
        return cfg_cls(vocab_size=64, hidden_size=32, num_hidden_layers=len(layers), num_heads=m["ssm_heads"],
                       head_dim=m["ssm_head_dim"], n_groups=m["groups"], state_size=m["state"], conv_kernel=m["conv"],
                       chunk_size=m["chunk"], expand=1, use_conv_bias=True, tie_word_embeddings=False)
    if family == "zamba2":
        return cfg_cls(**common, num_hidden_layers=len(layers), layers_block_type=list(layers), n_mamba_heads=m["ssm_heads"],
                       mamba_expand=1, mamba_ngroups=m["groups"], mamba_d_state=m["state"], mamba_d_conv=m["conv"],
                       chunk_size=m["chunk"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family.startswith("falcon_h1"):  # multipliers away from 1, so that a dropped one shows; the gated norm with
        # the gate after it (the default), before it, or no norm (only y * silu(z))
        rms = family != "falcon_h1_nonorm"
        return cfg_cls(**common, head_dim=16, num_hidden_layers=len(layers), mamba_d_ssm=m["ssm_heads"] * m["ssm_head_dim"],
                       mamba_n_heads=m["ssm_heads"], mamba_d_head=m["ssm_head_dim"], mamba_n_groups=m["groups"],
                       mamba_d_state=m["state"], mamba_d_conv=m["conv"], mamba_chunk_size=m["chunk"],
                       mamba_rms_norm=rms, mamba_norm_before_gate=family != "falcon_h1_gate_first", ssm_in_multiplier=0.7,
                       ssm_multipliers=[0.9, 1.3, 0.8, 1.2, 0.6], ssm_out_multiplier=1.1, attention_in_multiplier=0.9,
                       key_multiplier=1.2, mlp_multipliers=[0.8, 1.1], embedding_multiplier=1.5, lm_head_multiplier=0.9)
    if family == "bamba":
        return cfg_cls(**common, num_hidden_layers=len(layers), **mamba,
                       attn_layer_indices=[i for i, t in enumerate(layers) if t == "attention"])
    return cfg_cls(**common, num_hidden_layers=len(layers), layer_types=list(layers), **mamba, num_local_experts=0,
                   shared_intermediate_size=48)


def _kda_config(family: str, layers: tuple[str, ...]):
    """Tiny Kimi Linear / Ling (bailing_hybrid): KDA layers of 4 heads of 8 (convolution width 4), MLA attention of
    2 heads, dense MLPs (their MoE routes in float32); Ling with its safe gate (``lower_bound * sigmoid``)."""
    import transformers

    cfg_cls = getattr(transformers, FAMILIES[family][0])
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=len(layers), num_attention_heads=2 if family == "kimi_linear" else 4,
                  num_key_value_heads=2 if family == "kimi_linear" else 4, kv_lora_rank=16, qk_rope_head_dim=8,
                  v_head_dim=8, qk_nope_head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                  layer_types=list(layers), mlp_layer_types=["dense"] * len(layers), tie_word_embeddings=False,
                  max_position_embeddings=4 * SEQ_LEN, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "kimi_linear":
        return cfg_cls(**common, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4)
    return cfg_cls(**common, head_dim=8, short_conv_kernel_size=4, n_group=1, topk_group=1, first_k_dense_replace=len(layers))


def _mamba1_config(family: str, layers: tuple[str, ...]):
    """Mamba and Falcon-Mamba with ``residual_in_fp32=False``: their default casts each block's residual to float32
    (a float32 rounding of every hidden state, in a float64 model too: the model's own, not CP's)."""
    import transformers

    cfg_cls = getattr(transformers, FAMILIES[family][0])
    m = MAMBA1
    if family in ("mamba", "falcon_mamba"):
        return cfg_cls(vocab_size=64, hidden_size=32, num_hidden_layers=len(layers), state_size=m["state"],
                       expand=m["expand"], conv_kernel=m["conv"], time_step_rank=m["dt_rank"], use_conv_bias=True,
                       residual_in_fp32=False, tie_word_embeddings=False)
    attn = [i for i, t in enumerate(layers) if t != "mamba"]
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layers),
                  num_attention_heads=2, num_key_value_heads=1, mamba_d_state=m["state"], mamba_d_conv=m["conv"],
                  mamba_expand=m["expand"], mamba_dt_rank=m["dt_rank"], mamba_conv_bias=True,
                  max_position_embeddings=4 * SEQ_LEN, tie_word_embeddings=False)
    if family == "jamba":  # the attention layer's feed-forward a MoE of 4 experts, 2 per token
        return cfg_cls(**common, attn_layer_period=len(layers), attn_layer_offset=attn[0], num_experts=4,
                       num_experts_per_tok=2, expert_layer_period=len(layers), expert_layer_offset=attn[0])
    return cfg_cls(**common, layers_block_type=list(layers), n_mamba_heads=m["zamba_heads"])


def _minimax_config(layers: tuple[str, ...]):
    import transformers

    return transformers.MiniMaxConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layers), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=16,
        layer_types=list(layers), tie_word_embeddings=False, max_position_embeddings=4 * SEQ_LEN)


def _config(family: str, layers: tuple[str, ...]):
    import transformers

    if family == "minimax":
        return _minimax_config(layers)
    if family in MAMBA1_LAYERS:
        return _mamba1_config(family, layers)
    if family in FAMILY_LAYERS:
        return _mamba2_config(family, layers)
    cfg_cls = getattr(transformers, FAMILIES[family][0])
    if family in KDA_FAMILIES:
        return _kda_config(family, layers)
    if family.startswith("lfm2"):
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=2) if family == "lfm2_moe" else {}
        return cfg_cls(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layers),
                       num_attention_heads=2, num_key_value_heads=1, layer_types=list(layers), conv_L_cache=3,
                       conv_bias=True, tie_word_embeddings=False, max_position_embeddings=4 * SEQ_LEN, **moe)
    kw = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layers), num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=list(layers), tie_word_embeddings=False,
        max_position_embeddings=4 * SEQ_LEN,
    )
    if family == "qwen3_next":
        kw.update(num_experts=0, mlp_only_layers=list(range(len(layers))))
    if family == "qwen3_5_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    if family == "lara_mini":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                  eos_token_id=2, pad_token_id=0)
    if family == "olmo_hybrid":
        kw.update(pad_token_id=0, eos_token_id=2)
    return cfg_cls(**kw)


def build_tiny_hybrid(family: str, dtype: torch.dtype = torch.float64, *, seed: int = 0, checkpointing: str | None = None,
                      layers: tuple[str, ...] | None = None) -> nn.Module:
    """A tiny hybrid causal LM of ``family`` in ``dtype`` (initialised in float32 from ``seed``, then cast: the same
    weights in every dtype), blockdiag's attention registered, ``checkpointing`` None | "reentrant" |
    "non_reentrant"."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    if layers is None:
        layers = (SHORT_CONV_LAYERS if family.startswith("lfm2") else MINIMAX_LAYERS if family == "minimax" else
                  MAMBA1_LAYERS.get(family) or FAMILY_LAYERS.get(family, LAYER_TYPES))
    torch.manual_seed(seed)
    model_cls = getattr(transformers, FAMILIES[family][1])
    moe = family in ("qwen3_5_moe", "nemotron_h_moe", "lfm2_moe", "lara_mini", "jamba", "minimax")
    extra = {"experts_implementation": "eager"} if moe else {}  # grouped_mm has no float64
    model = model_cls._from_config(_config(family, layers), attn_implementation=register_transformers_attention(),
                                   **extra).to(dtype)
    float64_decay_tables(model)
    if checkpointing is not None:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": checkpointing == "reentrant"})
    return model.train()


def hybrid_docs(seed: int = 1, lengths: tuple[int, ...] = DOC_LENGTHS) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (n,), generator=g) for n in lengths]


def hybrid_batch(docs: list[Tensor]) -> dict[str, Tensor]:
    return pack_documents(docs, seq_len=SEQ_LEN)


@contextlib.contextmanager
def float64_kernel(model: nn.Module) -> Iterator[None]:
    """Inside: the Gated DeltaNet layers of ``model`` (the sequence mixers the guard knows) run every op in float64."""
    from blockdiag_dist.guard import KNOWN_MIXERS

    from .precision import float64_modules

    def is_mixer(m: nn.Module) -> bool:
        return any(c.__name__ in KNOWN_MIXERS for c in type(m).__mro__)

    with float64_modules(model, is_mixer):
        yield


def autocast_forward(model: nn.Module, batch) -> Tensor:
    """:func:`verify.model.harness.text_forward` under bf16 autocast (CPU)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return text_forward(model, batch)


def truth(family: str, docs: list[Tensor], *, stock_kernel: bool = False, dtype: torch.dtype = torch.float64,
          autocast: bool = False, seed: int = 0) -> StepResult:
    """Each document alone through the tiny model on one device: with the float64 kernel (the truth), or the
    model exactly as transformers ships it (``stock_kernel``, e.g. for the bf16 baseline)."""
    model = build_tiny_hybrid(family, dtype, seed=seed)
    forward = autocast_forward if autocast else text_forward
    with contextlib.nullcontext() if stock_kernel else float64_kernel(model):
        return document_reference(model, docs, forward)


_meshes: dict = {}


def _dp_cp_mesh():
    if "dp_cp" not in _meshes:
        from torch.distributed.device_mesh import init_device_mesh

        _meshes["dp_cp"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "cp"))
    return _meshes["dp_cp"]


def cp_parity_step(family: str, *, dtype: str = "float64", layout: str = "contiguous", checkpointing: str | None = None,
                   autocast: bool = False, dp: int = 1, doc_seed: int = 1, seed: int = 0) -> StepResult:
    """One step of the tiny model under CP on this rank (a pool worker; CP 1 with no pool), loss and gradients
    summed over the CP group, and over DP for ``dp=2`` (replica ``r`` takes every other document), so that every
    rank returns the step's total."""
    from verify.pool import worker_info

    env = worker_info()
    model = build_tiny_hybrid(family, getattr(torch, dtype), seed=seed, checkpointing=checkpointing)
    docs = hybrid_docs(doc_seed)
    forward = autocast_forward if autocast else text_forward
    opts = {"layout": layout}
    if family in NO_ATTENTION:
        opts["expect_attention"] = False
    if dp == 1:
        return cp_step(model, hybrid_batch(docs), env.get("cp_mesh"), forward, **opts)
    mesh = _dp_cp_mesh()
    replica = mesh.get_local_rank("dp")
    result = cp_step(model, hybrid_batch(docs[replica::2]), mesh["cp"], forward, **opts)
    names = sorted(result.grads)
    flat = torch.cat([torch.from_numpy(result.grads[n]).reshape(-1) for n in names]
                     + [torch.tensor([result.loss, float(result.targets)], dtype=torch.float64)])
    dist.all_reduce(flat, group=mesh["dp"].get_group())
    sizes = [result.grads[n].size for n in names]
    parts = flat[: sum(sizes)].split(sizes)
    grads = {n: p.numpy().reshape(result.grads[n].shape).copy() for n, p in zip(names, parts)}
    return StepResult(loss=float(flat[-2]), grads=grads, targets=int(flat[-1]), notes=result.notes)
