"""What the planted bugs of the mixer families share: wrong documents (every run of real tokens one document; a
document reset one token late) and the recurrence plan built from them."""

from __future__ import annotations

import torch

from blockdiag_dist.docs import plan_documents
from blockdiag_dist.mixers.recurrence import plan_recurrence
from blockdiag_ref import DocLayout

__all__ = ["WRONG_LAYOUTS", "merged", "reset_late", "wrong_recurrence_plan"]


def merged(layout: DocLayout) -> DocLayout:
    """Every run of real tokens one document (a boundary only where padding intervenes)."""
    return DocLayout.from_doc_ids((layout.doc_ids != 0).to(torch.int64))


def reset_late(layout: DocLayout) -> DocLayout:
    """A document that starts right after another starts one token later (its first token joins the other)."""
    seg = layout.segment_ids
    prev = torch.nn.functional.pad(seg[:, :-1], (1, 0))
    start = (seg != prev) & (seg != 0) & (prev != 0)
    return DocLayout.from_doc_ids(torch.where(start, prev, seg))


WRONG_LAYOUTS = {"state_leak": merged, "reset_late": reset_late}  # recurrence bugs made of wrong documents


def wrong_recurrence_plan(state, bug: str, tag: str):
    """This rank's recurrence plan over the documents bug ``bug`` sees (cached on the step under ``tag``)."""
    wrong = WRONG_LAYOUTS[bug]
    return state.mixer_plan((tag, bug), lambda: plan_recurrence(
        plan_documents(wrong(state.plan.layout), state.plan.shards), state.rank, state.device))
