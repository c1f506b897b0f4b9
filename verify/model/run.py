"""Run model-level cases over persistent pools (one per CP size, spawned once, respawned only after a failure
that strands a rank), the parent computing each model's truth and baselines while the ranks run.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..pool import PoolsByWorld, TaskFailure, WorkerPool
from .check import ModelCase, ModelResult, failure_result, judge, run_model_case
from .reference import Reference
from .zoo import Prepared

__all__ = ["UNAVAILABLE_NOTE", "ModelSession", "warm_up", "with_exact_run"]

UNAVAILABLE_NOTE = "the model's own per-document reference does not run here either"


def warm_up() -> None:
    """Pool start-up: transformers and the integration imported once per worker, not in the first case."""
    import transformers  # noqa: F401

    import blockdiag_dist.integrations.hf  # noqa: F401
    from verify.runner import warm_up as attention_warm_up

    attention_warm_up()


class ModelSession(PoolsByWorld):
    """Pools per CP size and a :class:`~verify.model.check.Reference` per model, reused across runs."""

    def __init__(self, *, case_timeout: float = 180.0, backend: str = "gloo") -> None:
        self.case_timeout = case_timeout
        self.backend = backend
        super().__init__()
        self.references: dict[str, Reference] = {}
        self._refused: set[tuple[str, int, str]] = set()  # (model, CP size) refused on every rank in an earlier case
        self._packed_seen: set[tuple[str, int, str]] = set()  # (model, CP size) whose packed-rows verdict a failure has

    def _spawn(self, cp: int) -> WorkerPool:
        return WorkerPool(cp, backend=self.backend, collective_timeout=max(60.0, 2 * self.case_timeout), init=warm_up,
                          keep_after_uniform_error=True, start_timeout=180.0)

    def reference(self, prepared: Prepared, seed: int = 0) -> Reference:
        key = f"{prepared.name}|{seed}"
        if key not in self.references:
            self.references[key] = Reference(prepared, seed)
        return self.references[key]

    def run(self, cases: Sequence[ModelCase], prepared: dict[str, Prepared],
            on_result: Callable[[ModelResult], None] | None = None, *, exact_again: bool = True) -> list[ModelResult]:
        """Every case (grouped by CP size, order kept within a size); ``prepared[case.model]`` builds its model.
        Every CP size's cases are queued on its pool before any is collected: the pools compute side by side
        while the parent computes the truths.

        A float64 case that fails at the model's own precision, of a model that computes some ops below float64, is
        judged again with every op in float64 (the same case with ``exact``; :func:`with_exact_run`): its result
        then comes after the others. ``exact_again=False`` leaves it as it is."""
        by_cp: dict[int, list[ModelCase]] = {}
        for c in cases:
            by_cp.setdefault(c.cp, []).append(c)
        queued = [(cp, self._submit(cp, by_cp[cp], prepared)) for cp in sorted(by_cp)]
        out: list[ModelResult] = []
        held: list[ModelResult] = []
        for cp, batch in queued:
            for r in self._collect(cp, batch, prepared):
                if exact_again and self._rounding_may_explain(r, prepared):
                    held.append(r)
                    continue
                out.append(r)
                if on_result:
                    on_result(r)
        if held:
            exact = [dataclasses.replace(r.case, exact=True) for r in held]
            again = {a.case: a for a in self.run(exact, prepared, exact_again=False)}
            for r, case in zip(held, exact):
                r = with_exact_run(r, again[case])
                out.append(r)
                if on_result:
                    on_result(r)
        return out

    def _rounding_may_explain(self, r: ModelResult, prepared: dict[str, Prepared]) -> bool:
        """A failure judged by its numbers (not a structural one) of a float64 case at the model's own precision, of
        a model that computes some ops below float64: their rounding may be all it is."""
        c = r.case
        if r.cls != "bug" or not r.verdict or c.dtype != "float64" or c.exact:
            return False
        return bool(self.reference(prepared[c.model], c.seed).float32_ops())

    def _submit(self, cp: int, cases: list[ModelCase], prepared: dict[str, Prepared]) -> dict[str, Any]:
        """Queue ``cases`` on the pool of size ``cp``; cases that cannot be queued are answered now (``early``)."""
        pool = self.pool(cp)
        submitted, refs, early = [], [], []
        for case in cases:  # weights first: the workers check theirs against the reference's
            ref = self.reference(prepared[case.model], case.seed)
            try:
                ref.model("float64")
            except ValueError as exc:
                early.append(ModelResult(case, "unavailable", why="the model does not build here", message=str(exc)))
                continue
            submitted.append(case)
            refs.append(ref)
        ids: list[int] = []
        if submitted:
            slim = {m: _slim(p) for m, p in prepared.items()}
            try:
                ids = pool.submit(run_model_case, [((c.to_dict(), slim[c.model], r.weights), {}) for c, r in zip(submitted, refs)])
            except Exception as exc:  # noqa: BLE001 - the pool could not start: every case says so
                early += [ModelResult(case, "crash", why="the pool could not start", message=f"{type(exc).__name__}: {exc}")
                          for case in submitted]
                submitted, refs = [], []
        return {"submitted": submitted, "refs": refs, "ids": ids, "early": early}

    def _collect(self, cp: int, batch: dict[str, Any], prepared: dict[str, Prepared]):
        pool = self.pool(cp)
        while True:
            yield from batch["early"]
            pending: list[ModelCase] = []
            for i, (case, ref, task) in enumerate(zip(batch["submitted"], batch["refs"], batch["ids"])):
                t0 = time.perf_counter()
                # the truth while the ranks compute; not for a model refused at this CP size already (refused again,
                # most likely: its truth would only feed one packed-rows verdict, taken once per model and size)
                refused = (case.model, cp, case.impl) in self._refused
                unavailable = None if refused else _prepare(ref, case)
                item = pool.collect(task, timeout=self.case_timeout, name=case.label())
                seconds = time.perf_counter() - t0
                if isinstance(item, TaskFailure):
                    result = failure_result(case, item, cp)
                    if result.cls == "unsupported":
                        self._refused.add((case.model, cp, case.impl))
                    if unavailable is None and (case.model, cp, case.impl) not in self._packed_seen:
                        unavailable = _prepare(ref, case)
                        if unavailable is None:
                            self._packed_seen.add((case.model, cp, case.impl))
                            result.packed = ref.packed_stock(case.rows)
                    if result.packed.get("status") == "wrong":
                        result.why += ("; the stock model on the packed rows on one device is wrong already (worst "
                                       f"gradient {result.packed['worst']:.2e}): not packing-safe")
                    if not pool.alive:  # the group was killed: the cases queued behind this one run again
                        pending = batch["submitted"][i + 1:]
                else:
                    if unavailable is None:
                        unavailable = _prepare(ref, case, baseline=True)
                    if unavailable is not None:
                        result = unavailable
                    else:
                        try:
                            result = judge(case, ref, item)
                        except Exception as exc:  # noqa: BLE001 - a judging error is the verifier's: a crash
                            import traceback

                            result = ModelResult(case, "crash", why="judging failed", message=f"{type(exc).__name__}: {exc}",
                                                 details=traceback.format_exc())
                result.seconds = seconds
                if unavailable is not None and result.cls != "unsupported":
                    result = unavailable
                elif unavailable is not None:  # refused first; the reference would not have run either
                    result.notes.append(f"{UNAVAILABLE_NOTE}: {unavailable.message}")
                yield result
                if pending:
                    break
            if not pending:
                return
            batch = self._submit(cp, pending, prepared)


def with_exact_run(stock: ModelResult, exact: ModelResult) -> ModelResult:
    """A float64 case that failed at the model's own precision, with the same case run with every op in float64
    (``exact``: the truth's and the step's). The model's float32 ops (norms, rotary angles, routers, a vision tower's
    rotation) round differently once CP changes what reaches them: a rank's batch shape (a float32 matrix product
    rounds a row differently beside other rows), the order of a sum, a replicated module's gradient summed over the
    ranks. No single-device baseline reproduces all of it, while with every op in float64 a CP error stays above the
    limit of 1e-10. So a pass there makes the case a pass, the difference at the model's precision named in its notes
    (``verdict["rounding_only"]``); a failure there too keeps the case a bug, the exact run's reason added. Either
    way ``again`` holds the exact run."""
    if exact.cls == "pass":
        worst = exact.verdict.get("worst_grad", 0.0)
        note = (f"at the model's own precision it differs by the rounding of its float32 ops only ({stock.why}); with "
                f"every op in float64 it passes (worst gradient {worst:.1e}): {exact.case.command()}")
        return dataclasses.replace(stock, cls="pass", why="", notes=[*stock.notes, note],
                                   verdict={**stock.verdict, "rounding_only": True}, again=exact.to_dict())
    why = f"{stock.why}; with every op in float64 too: {exact.cls}" + (f" ({exact.why})" if exact.why else "")
    return dataclasses.replace(stock, why=why, again=exact.to_dict())


def _slim(p: Prepared) -> Prepared:
    """What a worker needs to build the model (not the shrinking record)."""
    s = copy.copy(p)
    s.tiny = None
    return s


def _prepare(ref: Reference, case: ModelCase, baseline: bool = False) -> ModelResult | None:
    """Compute the case's truth and packed stock run (and with ``baseline``, its baseline) now (cached); a model
    whose own reference does not run here is ``unavailable``, its reason quoted."""
    try:
        ref.truth(case.rows)
        ref.packed_stock(case.rows)
        if baseline:
            ref.baseline(case.rows, case.dtype)
    except Exception as exc:  # noqa: BLE001 - any failure of the model itself on one device
        import traceback

        text = str(exc).strip().splitlines()
        return ModelResult(case, "unavailable", why="the model's own per-document reference does not run here",
                           message=f"{type(exc).__name__}: {text[0] if text else ''}", details=traceback.format_exc())
    return None


def model_info(ref: Reference) -> dict[str, Any]:
    """What the report says of a model as a whole: its reference attention, what it computes below float64 and
    what that costs, and how it was shrunk."""
    from .zoo import config_summary

    p = ref.prepared
    info: dict[str, Any] = {"reference_attention": p.reference_attention + (" (computed in float64)" if p.reference_attention == "eager" else ""),
                            "config": config_summary(p)}
    if p.preset:
        info["what"] = p.preset.what
        info["model_type"] = p.preset.model_type
    if p.tiny:
        info["tiny"] = p.tiny.describe()
    if ref.islands():
        info["float64_islands"] = list(ref.islands())
    try:
        ops = ref.float32_ops()
    except Exception as exc:  # noqa: BLE001
        info["float32_ops"] = [f"(not measured: {type(exc).__name__}: {exc})"]
        return info
    by_class: dict[str, list] = {}
    for use in ops:
        by_class.setdefault(use.cls, []).append(use)
    info["float32_ops"] = [
        f"{cls} x{len(uses)} ({uses[0].module}{', ...' if len(uses) > 1 else ''}): "
        + ", ".join(sorted({op for u in uses for op in u.ops}))
        for cls, uses in by_class.items()
    ]
    info["float32_cost"] = ref.cost
    return info
