"""DeepSeek Sparse Attention models judged as whole models: tiny transformers models from their configs, the
truth they are compared with, and the step every rank of a pool runs.

- :func:`build_tiny_dsa`: a tiny DSA model of one of :data:`DSA_FAMILIES`: hidden 32, MLA with 2 heads (q_lora 16,
  kv_lora 16, nope 8 + rope 8, v 12), an indexer of 4 heads of 16 keeping ``index_topk = 5`` keys, dense MLPs (no
  MoE: its router computes in float32), random weights from a seed; ``deepseek_v32`` and ``axk2`` with 2 layers,
  ``glm_moe_dsa``, ``hy_v4`` and ``hy_v4_vl`` with 3 (indexer types full, shared, full), ``mistral_large4`` with 4
  (full, shared, full, full; the third a NoPE layer; the fourth reusing the third's latent: KV sharing), the two
  vision-language models with a one-block vision tower and run on text; with blockdiag's attention registered or,
  for the truth, the stock attention the class supports (``sdpa``, or ``eager`` for HY-V4's sinks);
- :func:`truth`: each document alone through the stock model on one device;
- :func:`cp_parity_step`: the step under CP on this rank, the loss and every gradient summed over the group.

What the models compute in float32 whatever their dtype (the same in the truth and under CP, op for op): the
indexer's scores (``q.float() @ k.float()``, its weights ``.float()``) and so its top-k; the RMSNorms
(``x.to(float32)``: the gradients of their weights are float32 sums over tokens, :func:`float32_reduced`); the
rotary embedding's angles (Mistral Large 4 learns a scale of them, ``alpha``); A.X-K2's gates
(``sigmoid(g.float())``); HY-V4's hyper-connections, which round the residual stream to float32 after every
sublayer (:data:`FLOAT32_STREAM`).

Shape legend: S packed length.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from blockdiag_dist.integrations import pack_documents, register_transformers_attention
from .harness import StepResult, cp_step, document_reference, text_forward

__all__ = ["ATTENTION_CLASSES", "DOC_LENGTHS", "DSA_FAMILIES", "FLOAT32_STREAM", "hyper_connection", "SEQ_LEN", "build_tiny_dsa", "cp_parity_step", "dsa_batch", "dsa_docs",
           "float32_reduced", "truth"]

DSA_FAMILIES = {  # family -> (config class, model class, its stock attention)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", "sdpa"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "sdpa"),
    "axk2": ("AXK2Config", "AXK2ForCausalLM", "sdpa"),
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", "eager"),  # sinks: eager only
    "hy_v4_vl": ("HYV4VLConfig", "HYV4VLForConditionalGeneration", "eager"),
    "mistral_large4": ("MistralLarge4Config", "MistralLarge4ForConditionalGeneration", "sdpa"),
}
ATTENTION_CLASSES = {"deepseek_v32": "DeepseekV32Attention", "glm_moe_dsa": "GlmMoeDsaAttention",
                     "axk2": "AXK2Attention", "hy_v4": "HYV4Attention", "hy_v4_vl": "HYV4VLAttention",
                     "mistral_large4": "MistralLarge4TextAttention"}
# per family: its layers' own config fields (shared indexers, NoPE and KV sharing), and its vision tower (tiny)
_LAYERS = {
    "glm_moe_dsa": dict(num_hidden_layers=3, indexer_types=["full", "shared", "full"]),
    "hy_v4": dict(num_hidden_layers=3, indexer_types=["full", "shared", "full"], mlp_layer_types=["dense"] * 3),
    "hy_v4_vl": dict(num_hidden_layers=3, indexer_types=["full", "shared", "full"], mlp_layer_types=["dense"] * 3,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
    "axk2": dict(mlp_layer_types=["dense"] * 2),
    "mistral_large4": dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "full"],
                           no_rope_layers=[1, 1, 0, 0], kv_source_layers=[0, 1, 2, 2],
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
_VISION = {
    "hy_v4_vl": dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1, out_hidden_size=32),
    "mistral_large4": dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1, head_dim=8),
}
SEQ_LEN = 64
TOPK = 5
# two rows of 64: documents over 3 ranks at CP 4 (37 tokens from 0; 40 from 11), short ones (below top-k), padding
DOC_LENGTHS = (37, 3, 19, 11, 40, 6)


FLOAT32_STREAM = ("hy_v4", "hy_v4_vl")  # families whose residual stream is rounded to float32 after every sublayer


def hyper_connection(name: str) -> bool:
    """HY-V4's hyper-connection parameters: computed in float32 throughout (autocast off, ``.float()``), their
    gradients are float32 sums over every token and residual stream."""
    return "_hc." in name or ".hc_head." in name


def float32_reduced(name: str, family: str | None = None) -> bool:
    """Parameters whose gradient passes through what the model computes in float32 whatever its dtype: its RMSNorms'
    weights (float32 sums over tokens), Mistral Large 4's rotary ``alpha`` (float32 angles) and, in HY-V4's models,
    every parameter (its hyper-connections mix the residual streams in float32 and round them to float32 after
    every sublayer: made float64, the same model matches to 2e-15)."""
    return family in FLOAT32_STREAM or name.endswith("norm.weight") or name.endswith("rotary_emb.alpha")


def tiny_dsa_config(family: str, topk: int = TOPK):
    import transformers

    if family not in DSA_FAMILIES:
        raise ValueError(f"family: expected one of {sorted(DSA_FAMILIES)}, got {family!r}")
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=12, index_n_heads=4, index_head_dim=16, index_topk=topk,
              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
              max_position_embeddings=4 * SEQ_LEN, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    kw.update(_LAYERS.get(family, {}))
    kw["first_k_dense_replace"] = kw["num_hidden_layers"]
    config_cls = getattr(transformers, DSA_FAMILIES[family][0])
    if family in _VISION:  # text in the text config, a one-block vision tower (run on text only)
        return config_cls(text_config=kw, vision_config=_VISION[family], image_token_id=63, tie_word_embeddings=False)
    return config_cls(**kw)


def build_tiny_dsa(family: str, dtype: torch.dtype = torch.float64, *, seed: int = 0, stock: bool = False,
                   topk: int = TOPK, checkpointing: str | None = None) -> nn.Module:
    """A tiny DSA model of ``family`` in ``dtype`` (initialised in float32 from ``seed``, then cast: the same
    weights in every dtype), blockdiag's attention registered, or with ``stock`` the stock attention of its class
    (``sdpa``, ``eager`` for HY-V4)."""
    import transformers

    torch.manual_seed(seed)
    model_cls = getattr(transformers, DSA_FAMILIES[family][1])
    attn = DSA_FAMILIES[family][2] if stock else register_transformers_attention()
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
    """Each document alone through the stock tiny model (its stock attention) on one device."""
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
