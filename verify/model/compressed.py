"""DeepSeek-V4 (attention over compressed blocks) judged as a whole model: a tiny transformers model from its
config, the truth it is compared with, and the step every rank of a pool runs.

- :func:`build_tiny_dsv4`: a tiny ``deepseek_v4`` causal LM with its three layer kinds (sliding, CSA: overlapping
  windows of 4 and an indexer keeping 3 entries, HCA: windows of 8), sliding window 8, 2 hyper-connection streams,
  hash-routed MoE (routing by token id: no learned top-k); random weights from a seed, the parameters the model
  initialises to zero (sinks, the compressors' position biases, the hyper-connections' biases) drawn too, so that
  they matter; transformers' ``eager`` attention (the only one DeepSeek-V4 supports) for the truth, blockdiag's
  registered attention otherwise;
- :func:`truth`: each document alone through the stock model on one device;
- :func:`cp_parity_step`: the step under CP on this rank, the loss and every gradient summed over the group.

What the model computes in float32 whatever its dtype: the compressors' gate softmax, the indexer's scores (hence
its top-k), its RMSNorms and the hyper-connections' weights (``fn.float()``: every token's streams pass through
float32 matrix products, whose results depend on the batch's shape). They carry float32 error into every gradient
(measured up to 1.5e-4 on the final hyper-connection's scalar scale, 6e-8 on the attention's weights; under CP an
entry's gate gradient is the sum of each rank's float32 softmax backward, once it is one float32 backward: 7.5e-8),
so both sides run ``exact`` by default: those modules in float64 (:data:`FLOAT32_ISLANDS`,
:func:`~verify.model.precision.float64_islands`), the float64 limit of 1e-10 then judging CP alone.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from blockdiag_dist.integrations import register_transformers_attention
from .harness import StepResult, cp_step, document_reference, text_forward
from .precision import float64_islands
from .sparse import DOC_LENGTHS, SEQ_LEN, dsa_batch, dsa_docs
from .zoo import DSV4_FLOAT32_ISLANDS

__all__ = ["DOC_LENGTHS", "FLOAT32_ISLANDS", "SEQ_LEN", "build_tiny_dsv4", "cp_parity_step", "dsv4_batch", "dsv4_docs",
           "truth"]

TOPK = 3
# the DSA models' documents and rows (verify.model.sparse): two rows of 64, documents over 3 ranks at CP 4 (37 tokens
# from 0; 40 from 11), short ones (below a window), padding
dsv4_docs, dsv4_batch = dsa_docs, dsa_batch


def tiny_dsv4_config(topk: int = TOPK):
    import transformers

    return transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
        head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=2,
        hc_sinkhorn_iters=3, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
        index_topk=topk, mlp_layer_types=["hash_moe"] * 3, max_position_embeddings=4 * SEQ_LEN,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_tiny_dsv4(dtype: torch.dtype = torch.float64, *, seed: int = 0, stock: bool = False, topk: int = TOPK,
                    checkpointing: str | None = None) -> nn.Module:
    """The tiny DeepSeek-V4 causal LM in ``dtype`` (initialised in float32 from ``seed``, then cast: the same
    weights in every dtype), blockdiag's attention registered, or transformers' ``eager`` with ``stock``."""
    import transformers

    torch.manual_seed(seed)
    attn = "eager" if stock else register_transformers_attention()
    model = transformers.DeepseekV4ForCausalLM._from_config(tiny_dsv4_config(topk), attn_implementation=attn,
                                                            experts_implementation="eager")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the parameters initialised to zero (or one) get values of their own
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", "hc.base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for m in model.modules():  # hash routing: a fixed random table of experts per token id
            if hasattr(m, "tid2eid"):
                m.tid2eid.copy_(torch.randint(0, m.num_experts, m.tid2eid.shape, generator=g))
    model = model.to(dtype)
    if checkpointing is not None:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    return model.train()




FLOAT32_ISLANDS = DSV4_FLOAT32_ISLANDS  # the deepseek_v4 preset of verify model runs the same islands in float64


def _exactly(model: nn.Module, exact: bool):
    """With ``exact``, the modules of :data:`FLOAT32_ISLANDS` run in float64 in a float64 model, as the
    ``deepseek_v4`` preset runs them (:func:`~verify.model.precision.float64_islands`)."""
    return float64_islands(model, FLOAT32_ISLANDS if exact else ())


def truth(docs: list[Tensor] | None = None, *, dtype: torch.dtype = torch.float64, seed: int = 0,
          topk: int = TOPK, exact: bool = True) -> StepResult:
    """Each document alone through the stock tiny model (``eager``) on one device; ``exact``: the model's
    hyper-connections and RMSNorms in float64 (:data:`FLOAT32_ISLANDS`)."""
    model = build_tiny_dsv4(dtype, seed=seed, stock=True, topk=topk)
    with _exactly(model, exact):
        return document_reference(model, dsv4_docs() if docs is None else docs, text_forward)


def cp_parity_step(*, dtype: str = "float64", layout: str = "contiguous", seed: int = 0, topk: int = TOPK,
                   checkpointing: str | None = None, doc_seed: int = 1, exact: bool = True) -> StepResult:
    """One step of the tiny model under CP on this rank (a pool worker; CP 1 with no pool): loss and gradients
    summed over the CP group, so that every rank returns the step's total; ``exact`` as :func:`truth`."""
    from verify.pool import worker_info

    env = worker_info()
    model = build_tiny_dsv4(getattr(torch, dtype), seed=seed, topk=topk, checkpointing=checkpointing)
    with _exactly(model, exact):
        return cp_step(model, dsv4_batch(dsv4_docs(doc_seed)), env.get("cp_mesh"), text_forward, layout=layout)
