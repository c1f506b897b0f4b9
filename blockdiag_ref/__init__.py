"""blockdiag_ref — the single-device truth for block-diagonal (per-document causal) attention.

Main entries: :class:`DocLayout` (documents of packed rows), :func:`doc_ids_from_batch` (doc ids from a
training batch; :func:`layout_from_batch` its documents) and :func:`reference_attention` (float64 per-document
causal attention); for hybrid models
:func:`reference_causal_conv`, :func:`reference_gated_delta_rule`, :func:`reference_kda`, :func:`reference_lightning_attention`, :func:`reference_ssd`,
:func:`reference_mamba2_mixer`, :func:`reference_selective_scan` and :func:`reference_mamba1_mixer` (float64, token by
token per document); for indexer-selected sparse attention (DeepSeek-V3.2's DSA) :func:`reference_dsa_attention`
(:mod:`blockdiag_ref.sparse`); for DeepSeek-V4's attention over compressed blocks
:func:`reference_compressed_attention` (:mod:`blockdiag_ref.compressed`).
"""

from .attention import reference_attention, temperature_scale
from .compressed import reference_compressed_attention, reference_pool_windows
from .batch import doc_ids_from_4d_mask, doc_ids_from_batch, doc_ids_from_position_ids, layout_from_batch
from .layout import DocLayout, normalize_chunk, normalize_temperature, normalize_window
from .recurrence import (
    reference_causal_conv,
    reference_gated_delta_rule,
    reference_kda,
    reference_lightning_attention,
    reference_mamba1_mixer,
    reference_mamba2_mixer,
    reference_selective_scan,
    reference_ssd,
)
from .sparse import reference_dsa_attention, reference_dsa_select, reference_sparse_attention

__all__ = [
    "DocLayout",
    "doc_ids_from_4d_mask",
    "doc_ids_from_batch",
    "doc_ids_from_position_ids",
    "layout_from_batch",
    "normalize_chunk",
    "normalize_temperature",
    "normalize_window",
    "reference_attention",
    "reference_causal_conv",
    "reference_compressed_attention",
    "reference_dsa_attention",
    "reference_dsa_select",
    "reference_gated_delta_rule",
    "reference_kda",
    "reference_lightning_attention",
    "reference_mamba1_mixer",
    "reference_mamba2_mixer",
    "reference_pool_windows",
    "reference_selective_scan",
    "reference_sparse_attention",
    "reference_ssd",
    "temperature_scale",
]
