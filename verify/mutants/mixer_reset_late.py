"""Planted bug `mixer_reset_late` (see ``verify.mutants``): blockdiag_dist with one mistake in a per-document mixer."""

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx  # noqa: F401

from ._mixers import mixer_module

globals().update(mixer_module("reset_late"))  # every family's function (causal_conv, gated_delta_rule, ssd, ...)
