"""DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5) judged as whole models: tiny transformers models from
their configs, the truth they are compared with, and the step every rank of a pool runs.

- :func:`build_tiny_dsa`: a tiny ``deepseek_v32`` (2 layers) or ``glm_moe_dsa`` (3 layers: indexer types full,
  shared, full) causal LM: hidden 32, MLA with 2 heads (q_lora 16, kv_lora 16, nope 8 + rope 8, v 12), an indexer
  of 4 heads of 16 keeping ``index_topk = 5`` keys, dense MLPs (no MoE: its router computes in float32), random
  weights from a seed; with blockdiag's attention registered or, for the truth, transformers' ``sdpa``;
- :func:`truth`: each document alone through the stock model (``sdpa``) on one device;
- :func:`cp_parity_step`: the step under CP on this rank, the loss and every gradient summed over the group.

What the model computes in float32 whatever its dtype (the same in the truth and under CP, op for op): the
indexer's scores (``q.float() @ k.float()``, its weights ``.float()``) and so its top-k; its RMSNorms
(``x.to(float32)``: the gradients of their weights are float32 sums over tokens, :func:`float32_reduced`); the
rotary embedding's angles.

Shape legend: S packed length.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from blockdiag_dist.integrations import pack_documents, register_transformers_attention
from .harness import StepResult, cp_step, document_reference, text_forward

__all__ = ["DOC_LENGTHS", "DSA_FAMILIES", "SEQ_LEN", "build_tiny_dsa", "cp_parity_step", "dsa_batch", "dsa_docs",
           "float32_reduced", "truth"]

DSA_FAMILIES = {  # family -> (config class, model class)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
}
SEQ_LEN = 64
TOPK = 5
# two rows of 64: documents over 3 ranks at CP 4 (37 tokens from 0; 40 from 11), short ones (below top-k), padding
DOC_LENGTHS = (37, 3, 19, 11, 40, 6)


def float32_reduced(name: str) -> bool:
    """Parameters whose gradient the model sums over tokens in float32 (its RMSNorms' weights)."""
    return name.endswith("norm.weight")


def tiny_dsa_config(family: str, topk: int = TOPK):
    import transformers

    if family not in DSA_FAMILIES:
        raise ValueError(f"family: expected one of {sorted(DSA_FAMILIES)}, got {family!r}")
    layers = 3 if family == "glm_moe_dsa" else 2
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=layers,
              num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=12, index_n_heads=4, index_head_dim=16, index_topk=topk,
              first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
              max_position_embeddings=4 * SEQ_LEN, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    if family == "glm_moe_dsa":
        kw["indexer_types"] = ["full", "shared", "full"]
    return getattr(transformers, DSA_FAMILIES[family][0])(**kw)


def build_tiny_dsa(family: str, dtype: torch.dtype = torch.float64, *, seed: int = 0, stock: bool = False,
                   topk: int = TOPK, checkpointing: str | None = None) -> nn.Module:
    """A tiny DSA causal LM of ``family`` in ``dtype`` (initialised in float32 from ``seed``, then cast: the same
    weights in every dtype), blockdiag's attention registered, or transformers' ``sdpa`` with ``stock``."""
    import transformers

    torch.manual_seed(seed)
    model_cls = getattr(transformers, DSA_FAMILIES[family][1])
    attn = "sdpa" if stock else register_transformers_attention()
    model = model_cls._from_config(tiny_dsa_config(family, topk), attn_implementation=attn).to(dtype)
    if checkpointing is not None:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    return model.train()


def dsa_docs(seed: int = 1, lengths: tuple[int, ...] = DOC_LENGTHS) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g) for n in lengths]


def dsa_batch(docs: list[Tensor]) -> dict[str, Tensor]:
    return pack_documents(docs, seq_len=SEQ_LEN)


def truth(family: str, docs: list[Tensor] | None = None, *, dtype: torch.dtype = torch.float64, seed: int = 0,
          topk: int = TOPK) -> StepResult:
    """Each document alone through the stock tiny model (``sdpa``) on one device."""
    model = build_tiny_dsa(family, dtype, seed=seed, stock=True, topk=topk)
    return document_reference(model, dsa_docs() if docs is None else docs, text_forward)


def cp_parity_step(family: str, *, dtype: str = "float64", layout: str = "contiguous", seed: int = 0,
                   topk: int = TOPK, checkpointing: str | None = None, doc_seed: int = 1) -> StepResult:
    """One step of the tiny model under CP on this rank (a pool worker; CP 1 with no pool): loss and gradients
    summed over the CP group, so that every rank returns the step's total."""
    from verify.pool import worker_info

    env = worker_info()
    model = build_tiny_dsa(family, getattr(torch, dtype), seed=seed, topk=topk, checkpointing=checkpointing)
    return cp_step(model, dsa_batch(dsa_docs(doc_seed)), env.get("cp_mesh"), text_forward, layout=layout)
