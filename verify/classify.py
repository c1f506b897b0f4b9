"""One class per case, decided by the verifier from a case's result and the adapter's declared conventions.

- ``pass``: agrees with our reference.
- ``contract``: fails against our reference, passes when re-checked against a reference built under the
  implementation's declared conventions (:class:`verify.adapters.Conventions`); the verdict names them.
- ``unsupported``: refused the input with a clear error (``ValueError``, ``NotImplementedError`` or an
  adapter's ``Unsupported``, with a message) on every rank; the message is quoted. A refusal on some ranks
  only (the others left waiting in a collective) is a ``crash``.
- ``bug``: real rows' outputs or gradients wrong even under the declared conventions.
- ``crash``: any other exception, or a rank that died. ``hang``: the case's deadline passed.

The convention reference keeps everything of the case (inputs, labels, weights) and changes only which
tokens form a document: ``document="id"`` groups every token of a row sharing an id (computed exactly by the
float64 reference on a permutation that makes each id's tokens contiguous, order kept, then un-permuted:
the block is per token except for attention, so this is the same function); ``document="row"`` makes the whole
row one causal sequence, padding positions included; ``mask4d="validity"`` reads a 4-D mask as real vs
padding. ``padding="free"`` drops the exactly-zero checks of padding rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .adapters import OURS, Conventions
from .case_io import failed_row_text
from .cases import Case
from .session import CaseResult

__all__ = ["CLASSES", "Verdict", "classify", "convention_expected", "convention_groups"]

CLASSES = ("pass", "contract", "unsupported", "bug", "crash", "hang")
REFUSALS = ("ValueError", "NotImplementedError", "Unsupported")
PADDING_METRICS = ("out_padding_rows", "dq_padding_rows", "dk_padding_rows", "dv_padding_rows")


@dataclass
class Verdict:
    cls: str
    why: str  # one line: failing quantities with numbers, or the exception
    conventions: list[str] = field(default_factory=list)  # the declared conventions this case needed
    message: str = ""  # the refusal or exception line, quoted
    recheck: CaseResult | None = None  # the re-run under the conventions, when one was needed
    failing: list[str] = field(default_factory=list)  # a bug's failing quantities, under its conventions

    def to_dict(self) -> dict[str, Any]:
        return {"class": self.cls, "why": self.why, "conventions": self.conventions, "message": self.message,
                "failing": self.failing, "recheck": None if self.recheck is None else self.recheck.to_dict()}


# ---- the reference under declared conventions -----------------------------------------------------------
def _effective_ids(case: Case, conv: Conventions) -> Tensor:
    ids = torch.tensor(case.doc_ids(), dtype=torch.int64)
    if case.source == "mask4d" and conv.mask4d == "validity":
        ids = (ids != 0).to(torch.int64)
    if conv.document == "row":
        ids = torch.ones_like(ids)
    return ids


def convention_groups(case: Case, conv: Conventions) -> Tensor:
    """``[B, S]`` labels of the documents the implementation sees under ``conv`` (0 = padding), numbered by
    first appearance in each row, so two conventions agree on a case iff their labels are equal."""
    ids = _effective_ids(case, conv)
    raw = DocLayout.from_doc_ids(ids).segment_ids if conv.document == "run" else ids
    out = torch.zeros_like(raw)
    for b in range(raw.shape[0]):
        seen: dict[int, int] = {}
        for s, v in enumerate(raw[b].tolist()):
            if v:
                out[b, s] = seen.setdefault(v, len(seen) + 1)
    return out


def convention_expected(case: Case, conv: Conventions) -> dict:
    """:func:`verify.runner.expected_results` of ``case`` with documents as ``conv`` declares them."""
    from .runner import expected_results, make_inputs

    if conv.document == "id" and case.window >= 0:
        raise ValueError(f"document='id' re-check: expected no window, got window {case.window}")
    inputs = make_inputs(case)
    ids = _effective_ids(case, conv)
    S = ids.shape[1]
    key = torch.where(ids == 0, ids.max() + 1, ids) * S + torch.arange(S)  # each id's tokens together, in order
    perm = key.argsort(dim=1)  # [B, S]
    inv = perm.argsort(dim=1)
    rows = torch.arange(ids.shape[0])[:, None]
    permuted = dict(inputs, doc_ids=ids[rows, perm], x=inputs["x"][rows, perm], labels=inputs["labels"][rows, perm])

    def unpermute(res: dict[str, Tensor]) -> dict[str, Tensor]:
        out = dict(res)
        for name in ("out", "dq", "dk", "dv"):  # [B, H, S, D]
            out[name] = res[name].transpose(1, 2)[rows, inv].transpose(1, 2)
        out["x"] = res["x"][rows, inv]  # [B, S, E]
        return out

    return expected_results(case, "cpu", inputs=permuted, restore=unpermute)


# ---- classification --------------------------------------------------------------------------------------
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?:: (.*))?$")


def _last_exception(traceback_text: str) -> tuple[str, str]:
    """(exception type without its module, the first line of its message) from a traceback: the first unindented
    line after the last frame (a message may run over several lines, e.g. the dispatcher's list of backends)."""
    lines = [ln for ln in traceback_text.splitlines() if ln.strip()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("  File ")]
    after = lines[frames[-1] + 1:] if frames else lines
    for ln in (after if frames else reversed(after)):
        m = _EXC_LINE.match(ln)
        if m and not ln[0].isspace():
            return m.group(1).rsplit(".", 1)[-1], (m.group(2) or "").strip()
    return "", ""


def _rank_tracebacks(details: str) -> list[str]:
    parts = re.split(r"^--- rank \d+ ---$", details, flags=re.M)
    return [p for p in parts[1:] if "Traceback" in p] or [details]


def _in_play(case: Case, conv: Conventions) -> list[str]:
    """The declared document conventions that change which tokens form a document in this case."""
    import dataclasses

    ours = convention_groups(case, OURS)
    used = []
    only_mask = dataclasses.replace(OURS, mask4d=conv.mask4d)
    if not torch.equal(convention_groups(case, only_mask), ours):
        used.append(f"mask4d={conv.mask4d}")
    if not torch.equal(convention_groups(case, conv), convention_groups(case, only_mask)):
        used.append(f"document={conv.document}")
    return used


def _failing(result: CaseResult, exempt: tuple[str, ...]) -> list[str]:
    return [n for n in result.failed_metrics if n not in exempt]


def _numbers(result: CaseResult, names: list[str], most: int = 4) -> str:
    """The worst failing quantities (by error over limit), with their numbers."""
    rows = sorted(names, key=lambda n: -result.metrics[n]["err"] / max(result.metrics[n]["limit"], 1e-300))
    parts = [failed_row_text(n, result.metrics[n]) for n in rows[:most]]
    return "; ".join(parts) + (f"; +{len(rows) - most} more" if len(rows) > most else "")


def classify(
    result: CaseResult,
    conv: Conventions = OURS,
    recheck: Callable[[Case, Callable[[Case], dict]], CaseResult] | None = None,
) -> Verdict:
    """The class of ``result``. ``recheck(case, reference)`` re-runs the case against another reference (a
    function of the case returning :func:`verify.runner.expected_results`-like tensors); without it, a case
    whose documents differ under ``conv`` cannot be re-checked and stays a ``bug``."""
    status = result.status
    if status == "pass":
        return Verdict("pass", "")
    if status == "timeout":
        return Verdict("hang", f"deadline passed on rank(s) {result.ranks}")
    if status in ("error", "crash"):
        excs = [_last_exception(tb) for tb in _rank_tracebacks(result.details)] if status == "error" else []
        every_rank = sorted(result.ranks) == list(range(result.case.cp))  # a refusal on some ranks strands the others
        if excs and every_rank and all(t in REFUSALS and msg for t, msg in excs):
            t, msg = excs[0]
            return Verdict("unsupported", f"{t} on rank(s) {result.ranks}", message=f"{t}: {msg}")
        line = f"{excs[0][0]}: {excs[0][1]}" if excs else (result.details.splitlines()[-1] if result.details else status)
        return Verdict("crash", f"{status} on rank(s) {result.ranks}", message=line)
    # a failed comparison: wrong, or different only by a declared convention?
    exempt = PADDING_METRICS if conv.padding == "free" else ()
    used = _in_play(result.case, conv)
    changed = bool(used)
    if exempt and any(n in exempt for n in result.failed_metrics):
        used.append(f"padding={conv.padding}")
    if not changed:
        left = _failing(result, exempt)
        if not left:
            return Verdict("contract", "differs only by " + ", ".join(used), conventions=used)
        return Verdict("bug", _numbers(result, left), conventions=used, failing=left)
    if recheck is None or (conv.document == "id" and result.case.window >= 0):
        return Verdict("bug", _numbers(result, result.failed_metrics) + " (not re-checked under its conventions)",
                       failing=list(result.failed_metrics))
    again = recheck(result.case, lambda case: convention_expected(case, conv))
    if again.status != "pass" and again.status != "fail":
        sub = classify(again, OURS)
        return Verdict(sub.cls, sub.why + " (on the re-check)", conventions=used, message=sub.message, recheck=again)
    left = _failing(again, exempt)
    if not left:
        return Verdict("contract", "differs only by " + ", ".join(used), conventions=used, recheck=again)
    return Verdict("bug", _numbers(again, left) + " (under " + ", ".join(used) + ")", conventions=used, recheck=again,
                   failing=left)
