"""Planted bugs in the per-document mixers: blockdiag_dist's own mixer families, each with one mistake that CP
systems for hybrid models are known to make. Attention (and everything else) is blockdiag_dist's.

The wrong functions are the families' (``verify.families``: each spec's ``mutants``); a bug applies to every family
that plants it (the recurrence bugs to every recurrence). ``mixer_module(bug)`` returns every family's function by
name (``{"causal_conv": ..., "gated_delta_rule": ..., "ssd": ...}``), the wrong one where the family plants
``bug``, blockdiag_dist's elsewhere; ``verify.mutants.mixer_<bug>`` exposes them beside blockdiag_dist's seed
functions.
"""

from __future__ import annotations

from collections.abc import Callable

from verify.families import SPECS

__all__ = ["MIXER_BUGS", "mixer_functions", "mixer_module"]

MIXER_BUGS = {
    "state_leak": "the recurrence runs over each row's real tokens as one sequence: state leaks across documents",
    "reset_late": "a document's state is reset one token late: its first token still sees the previous document's",
    "summary_bf16": "continuing documents' summaries are merged (exchanged and folded) in bfloat16",
    "conv_unmasked": "the convolution's history is not masked by document: a document reads the previous one's tail",
    "history_wrong_rank": "the convolution's history is the previous rank's last rows, whatever the layout holds there",
    "ssd_no_decay": "the SSD's fold drops the transitions: a state crossing a piece held elsewhere is not decayed by it",
    "decay_per_rank": "KDA's and lightning attention's decay is counted from the rank's first row, not the document's: "
                      "a continuing document's entering state is also decayed by the tokens the rank holds before it",
    "topk_over_row": "the DSA indexer's candidates are the row's earlier tokens (a global causal mask, as NeMo Automodel's "
                     "packed path), not the query's document: top-k slots and attention go to other documents",
    "expand_unused": "a DSA rank whose rows use none of the keys it received (padding only) expands them outside the "
                     "graph: the sum over the ranks is right, the expansion's weights get no gradient on that rank",
    "scan_decay_per_rank": "the selective scan's entering state is decayed per rank, not per document: by every token "
                           "the rank holds before the piece in its row, other documents' included",
}


def mixer_functions() -> tuple[str, ...]:
    """The names of the families' functions an implementation module may expose."""
    return tuple(s.function_name for s in SPECS.values())


def mixer_module(bug: str) -> dict[str, Callable]:
    """Every family's function by name, with bug ``bug`` planted where the family has it."""
    if bug not in MIXER_BUGS:
        raise ValueError(f"mixer_module: expected a bug of {sorted(MIXER_BUGS)}, got {bug!r}")
    planted = {s.function_name: s.mutants[bug]() for s in SPECS.values() if bug in s.mutants}
    assert planted, f"no family plants {bug}"
    return {s.function_name: planted.get(s.function_name) or s.family.load("function") for s in SPECS.values()}
