"""Planted bug `late_layer` (see ``verify.mutants``): right in a step's first attention call, wrong (each query
sees one future key) from the second on. One attention block passes; a model's second layer is wrong."""

from ._toy import make_toy

make_cp_blockdiag_batch_and_ctx, cp_blockdiag_sdpa = make_toy("late_layer")
