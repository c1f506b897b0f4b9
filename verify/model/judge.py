"""Judging one model step against the truth: each quantity's limit from its baseline, and the verdict.

:func:`compare_all` compares a step's loss, every parameter's gradient and every recorded module output and input
with the truth (:class:`Truth`), each within the limit :func:`limit` gives from the baseline's error of its module
class (:class:`Baseline`; the rule is :mod:`verify.model.check`'s docstring), and names the first wrong module in
forward order, or the first wrong gradient in backward order. Used by the case judge
(:func:`verify.model.check.judge`) and by the stock packed run's verdict (:class:`verify.model.reference.Reference`).

Shape legend: N real positions of the packed batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch import nn

from ..tolerances import TOLERANCES, judge as judge_tolerance
from .harness import KINDS, StepResult, _rel, compare, module_kind
from .precision import LowPrecisionUse
from .record import Key, module_name

__all__ = ["Baseline", "Judged", "Truth", "compare_all", "limit", "module_errors"]


@dataclass
class Truth:
    step: StepResult
    out: dict[Key, np.ndarray]  # [N, ...] at the packed batch's real positions
    inp: dict[Key, np.ndarray]
    order: list[Key]
    cls: dict[str, str]


@dataclass
class Baseline:
    """Errors of the baseline against the truth: per parameter, loss, per module output and input; what it is."""

    what: str
    params: dict[str, float]
    loss: float
    out: dict[Key, float]
    inp: dict[Key, float]


def module_errors(got: dict[Key, np.ndarray], ref: dict[Key, np.ndarray]) -> dict[Key, float]:
    """Relative error of each recorded module tensor present in both with the same shape."""
    return {k: _rel(got[k], ref[k]) for k in ref if k in got and got[k].shape == ref[k].shape}


class Judged(Protocol):
    """What judging asks of the truth's owner (:class:`verify.model.reference.Reference`)."""

    def baseline(self, rows, dtype: str, variant: str = "stock") -> Baseline | None: ...

    def float32_ops(self) -> list[LowPrecisionUse]: ...

    def rounding_params(self, rows, variant: str = "stock") -> set[str]: ...

    def cast_cost(self, rows, variant: str = "stock") -> dict[str, float]: ...

    def chunking_cost(self, rows, variant: str = "stock") -> dict[str, float]: ...

    def loss_cast_cost(self, rows, variant: str = "stock") -> float: ...


def limit(dtype: str, base: float | None, low_ops: bool, spread: float = 1.0) -> float:
    """The limit of one relative error (see the module docstring). Below float64, ``spread`` (at least 1: the
    condition of a gradient as a sum over the documents, :attr:`~verify.model.harness.StepResult.spread`) scales
    the floor: a sum whose terms cancel has a relative rounding error that many times a single term's."""
    if dtype == "float64":
        rel = TOLERANCES["float64"].rel
        return max(rel, TOLERANCES["float32"].factor * base) if low_ops and base is not None else rel
    return judge_tolerance(dtype, 0.0, max(1.0, spread), base if base is not None else 0.0)[0]


def compare_all(ref: Judged, rows, dtype: str, truth: Truth, got: StepResult, got_out: dict[Key, np.ndarray],
                 got_inp: dict[Key, np.ndarray], model: nn.Module, variant: str = "stock") -> dict[str, Any]:
    """Loss, gradients and module outputs of ``got`` against the truth, each with its limit."""
    base = ref.baseline(rows, dtype, variant)
    low = bool(ref.float32_ops()) and variant != "exact"
    rounding = ref.rounding_params(rows, variant) if dtype == "float64" else set()
    # a baseline error stands for every quantity of the same module class: rounding below float64 (a float32
    # sum over the rows in a norm's weight gradient) is as large in one instance as in another, and the
    # orders in which CP and the baseline add differ from each other
    owners = {n: _owner_class(model, n) for n in truth.step.grads}
    bp = _pooled(base.params if base else {}, owners)
    spread = truth.step.spread if dtype != "float64" else {}
    limits = {n: limit(dtype, bp.get(n), low or n in rounding, spread.get(n, 1.0)) for n in truth.step.grads}
    if dtype == "float64" and variant != "exact":  # a gradient the model sums in float32 may be off by that rounding
        for n, e in ref.cast_cost(rows, variant).items():
            limits[n] = max(limits[n], TOLERANCES["float32"].factor * e)
    if dtype == "float64":  # a gradient that moves with the chunking of a recurrence moves with a rank boundary too
        for n, e in ref.chunking_cost(rows, variant).items():
            limits[n] = max(limits[n], TOLERANCES["float32"].factor * e)
    loss_limit = limit(dtype, base.loss if base else None, low)
    if dtype == "float64" and variant != "exact":  # a loss the model computes below float64 (float32 logits)
        loss_limit = max(loss_limit, TOLERANCES["float32"].factor * ref.loss_cast_cost(rows, variant))
    c = compare(truth.step, got, model, limit(dtype, None, low), limits=limits, loss_limit=loss_limit)
    out_err = module_errors(got_out, truth.out)
    inp_err = module_errors(got_inp, truth.inp)
    classes = {k: truth.cls.get(module_name(k[0]), "?") for k in set(truth.out) | set(truth.inp)}
    bo, bi = (_pooled(base.out, classes), _pooled(base.inp, classes)) if base else ({}, {})
    out_lim = {k: limit(dtype, bo.get(k), low) for k in out_err}
    inp_lim = {k: limit(dtype, bi.get(k), low) for k in inp_err}
    first = next((k for k in truth.order if k in out_err and out_err[k] > out_lim[k]), None)
    verdict: dict[str, Any] = {
        "loss_rel": c.loss_rel, "loss_limit": loss_limit, "worst_grad": max(c.per_param.values(), default=0.0),
        "per_kind": {}, "ok": c.ok and first is None, "modules_compared": len(out_err),
        "baseline": base.what if base else "none (the model computes everything in float64)",
    }
    for kind in KINDS:
        names = [n for n in c.per_param if c.kinds[n] == kind]
        if not names:
            continue
        worst = max(names, key=lambda n: c.per_param[n])
        bad = [n for n in names if c.per_param[n] > c.limit_of(n)]
        verdict["per_kind"][kind] = {"worst": c.per_param[worst], "param": worst, "limit": c.limit_of(worst),
                                     "failing": len(bad), "params": len(names)}
    if first is not None:
        name, call = first
        name = module_name(name)
        culprit, via = name, None
        if first in inp_err and inp_err[first] > inp_lim[first] and "." in name:
            culprit, via = name.rsplit(".", 1)[0], name  # its input came wrong from the code of its parent
        verdict["first_wrong_module"] = {
            "module": culprit, "class": _class_of(model, culprit, truth.cls), "kind": module_kind(model, culprit + ".x"),
            "err": out_err[first], "limit": out_lim[first], "call": call,
            "via": via and f"{via} ({truth.cls.get(via, '?')}) got a wrong input from it (err {inp_err[first]:.2e})",
        }
    elif c.failing or not c.loss_ok:
        order = [n for n, _ in model.named_parameters() if n in c.per_param]
        back = next((n for n in reversed(order) if c.per_param[n] > c.limit_of(n)), None)
        verdict["first_wrong_grad_backward"] = back
    verdict["failing_params"] = c.failing[:8]
    return verdict


def _owner_class(model: nn.Module, param: str) -> str:
    owner = param.rsplit(".", 1)[0] if "." in param else ""
    try:
        return type(model.get_submodule(owner)).__name__ + ("." + param.rsplit(".", 1)[-1])
    except AttributeError:
        return param


def _pooled(errors: dict, groups: dict) -> dict:
    """Each quantity's baseline error raised to the largest of its group's."""
    worst: dict = {}
    for k, e in errors.items():
        g = groups.get(k, k)
        worst[g] = max(worst.get(g, 0.0), e)
    return {k: worst[groups.get(k, k)] for k in errors}


def _class_of(model: nn.Module, name: str, known: dict[str, str]) -> str:
    if name in known:
        return known[name]
    try:
        return type(model.get_submodule(name)).__name__
    except AttributeError:
        return "?"
