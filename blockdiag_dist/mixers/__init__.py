"""Sequence mixers of hybrid models, per document across CP ranks.

Main entries: :func:`causal_conv` (short causal depthwise convolution, history from other ranks),
:func:`gated_delta_rule` (Gated DeltaNet's recurrence, summaries from other ranks), :func:`kimi_delta_attention`
(KDA: the gated delta rule with a decay per key channel), :func:`ssd` (Mamba2's SSD), :func:`lightning_attention` (MiniMax's: the SSD with a fixed decay per
head), :func:`selective_scan` (Mamba1's), and the extension point for
any other linear recurrence, :class:`Recurrence` with :func:`run_recurrence` (see :mod:`.recurrence`). Each
reads the step's documents (``state.docs``) and plans; each raises ``ValueError`` before any collective on
input that is not this rank's shard.
"""

from .conv import ConvPlan, causal_conv, plan_conv
from .gated_delta import GatedDeltaRule, gated_delta_rule
from .kda import KimiDeltaAttention, kimi_delta_attention
from .lightning import Lightning, lightning_attention
from .selective_scan import SelectiveScan, selective_scan
from .ssd import SSD, ssd
from .recurrence import STATE_DTYPES, Recurrence, RecurrencePlan, plan_recurrence, run_recurrence

__all__ = [
    "STATE_DTYPES",
    "ConvPlan",
    "GatedDeltaRule",
    "KimiDeltaAttention",
    "Lightning",
    "Recurrence",
    "RecurrencePlan",
    "SSD",
    "SelectiveScan",
    "causal_conv",
    "gated_delta_rule",
    "kimi_delta_attention",
    "lightning_attention",
    "plan_conv",
    "plan_recurrence",
    "run_recurrence",
    "selective_scan",
    "ssd",
]
