"""Planted bug `mixer_expand_unused` (see ``verify.mutants``): blockdiag_dist with one mistake in its DeepSeek
Sparse Attention: a rank holding only padding expands the keys and values it received outside the autograd graph,
so the expansion's weights get no gradient on that rank (a data-parallel reduction over the ranks then breaks:
FSDP2's reduce-scatter, DDP without ``find_unused_parameters``)."""

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx  # noqa: F401

from ._mixers import mixer_module

globals().update(mixer_module("expand_unused"))  # every family's function (causal_conv, gated_delta_rule, ssd, ...)
