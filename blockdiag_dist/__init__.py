"""blockdiag_dist — block-diagonal context parallelism for packed sequences.

Main entry: :func:`make_cp_blockdiag_batch_and_ctx` shards a packed batch over a CP mesh and returns
``(train_ctx, batch)``; inside ``with train_ctx():`` route attention through :func:`cp_blockdiag_sdpa`
(or wrap an unmodified model in :func:`sdpa_routing`). Same code on CPU/gloo and CUDA/NCCL. Any other
sequence mixer reads the step's documents from ``current_state().docs`` (:class:`RankDocs`); the mixers of
hybrid models computed per document are the entries of :data:`FAMILIES`.
"""

from .compressed import CompressedIndex, Compression, compressed_attention
from .batch import _cp_blockdiag_doc_ids, make_cp_blockdiag_batch_and_ctx
from .docs import DocPlan, Piece, RankDocs, plan_documents
from .families import FAMILIES, MixerFamily, register_family
from .mixers import causal_conv, gated_delta_rule, kimi_delta_attention, lightning_attention, selective_scan, ssd
from .options import CPOptions, configure_cp_varlen
from .plan import ExchangePlan, ShardPlan, StepPlan, choose_layout, plan_exchange, plan_shards, plan_step
from .runtime import cp_blockdiag_sdpa, sdpa_routing
from .sparse import DsaIndex, dsa_attention
from .sharding import gather_sequence, shard_tensor, unshard
from .state import AttentionNotRoutedError, PlanMismatchError, StepState, current_state

__all__ = [
    "AttentionNotRoutedError",
    "CPOptions",
    "CompressedIndex",
    "Compression",
    "DocPlan",
    "DsaIndex",
    "FAMILIES",
    "ExchangePlan",
    "MixerFamily",
    "PlanMismatchError",
    "Piece",
    "RankDocs",
    "ShardPlan",
    "StepPlan",
    "StepState",
    "_cp_blockdiag_doc_ids",
    "choose_layout",
    "compressed_attention",
    "dsa_attention",
    "configure_cp_varlen",
    "causal_conv",
    "cp_blockdiag_sdpa",
    "current_state",
    "gated_delta_rule",
    "kimi_delta_attention",
    "lightning_attention",
    "gather_sequence",
    "make_cp_blockdiag_batch_and_ctx",
    "plan_documents",
    "plan_exchange",
    "plan_shards",
    "plan_step",
    "register_family",
    "sdpa_routing",
    "selective_scan",
    "shard_tensor",
    "ssd",
    "unshard",
]
