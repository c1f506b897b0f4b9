"""One model-level case: a training step of a whole model under CP against each document run alone, classed.

A case is (model, CP size, document layout, dtype, sharding layout, implementation). The parent computes the
truth and the baselines once per model and layout (:class:`~verify.model.reference.Reference`); the pool's
ranks run the step under CP (:func:`run_model_case`) and send back the loss, the gradients (summed over the group) and every module's output
and first input at their real rows; :func:`judge` compares and classes:

- **pass**: the loss, every parameter's gradient and every module's output within their limits;
- **bug**: something is not; the first wrong module in forward order is named (from the outputs: a bug anywhere
  makes every earlier gradient wrong), or, when every output is right, the first wrong gradient in backward
  order;
- **unsupported**: refused on every rank with a clear error (``UnsupportedLayerError``,
  ``UnsupportedAttentionError``, ``AttentionNotRoutedError``, a ``ValueError`` ...), the message quoted;
- **crash**, **hang**: any other exception or a dead rank; the case's deadline passed (the group is killed);
- **unavailable**: the model's own reference does not run here (e.g. a CUDA-only kernel), the reason quoted.

Apart from the class, every case says whether the stock model on the packed rows on one device (no CP) computes
the truth (``packed``: ok / wrong, with its first wrong module / refused): a model wrong there already is not
packing-safe by itself (positions taken from its rows, a mixer that does not see documents), which separates
"wrong under CP" from "wrong once packed, whatever CP does".

Limits (verify/tolerances.py's rule, the baseline being the same model per document in the case's dtype):
float32: ``2 x baseline + 4e-6`` relative per quantity, the baseline being the model per document in float32
(on every CPU SDPA backend that takes the inputs, the worst; and, text models, each document as 2 to 8 identical
rows: the same step, its sums over the tokens over that many times the terms, and as 9 to 16 rows where a gradient
of at most 16 numbers has its limit set by the baseline) against the float64 truth; a gradient's floor is
scaled by its condition as a sum over the documents (``StepResult.spread``: float32 rounding of a sum whose terms
cancel is that many times larger relative to it). float64: 1e-10, unless
the model computes some ops below float64 (:mod:`verify.model.precision` names them): then
``max(1e-10, 2 x baseline)``, the baseline being the difference between single-device float64 computations of
the same documents that differ only in batching (one by one vs right-padded together, in two orders, to a little
more than the packed length; the worse of the two): the rounding those ops add when the same numbers are summed
in another order and among padding rows, which CP cannot avoid either. A baseline error stands for every
quantity of its module class (every RMSNorm weight, say): the largest sets their limit. A parameter the model
itself casts below float64 in its forward (Gemma's norm weights, DeepSeek's router) has its gradient summed in
float32 by the model: its float64 limit is at least twice that rounding, measured as the stock gradient's error
against the same model computed all in float64 (:class:`~verify.model.precision.Promote`).

Shape legend: B rows, S packed length, L rows of a rank, N real positions.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .harness import _VISION, StepResult, cp_step
from .judge import compare_all, limit
from .layouts import batch_for_source, make_packed, model_rows
from .multimodal import make_multimodal, multimodal_forward
from .precision import Promote, float64_islands
from .record import Key, ModuleRecorder, rows_of
from .reference import Reference, _vocab, checksum, recorder_of
from .zoo import Prepared, build

__all__ = ["MODEL_CLASSES", "ModelCase", "ModelResult", "forget_models", "judge", "limit", "run_model_case"]

MODEL_CLASSES = ("pass", "bug", "unsupported", "crash", "hang", "unavailable")
REFUSALS = ("ValueError", "NotImplementedError", "Unsupported", "UnsupportedLayerError", "UnsupportedAttentionError",
            "AttentionNotRoutedError", "PlanMismatchError")
OURS = "blockdiag_dist"


@dataclass(frozen=True)
class ModelCase:
    """One case; ``args`` name the model on the command line (``--model llama`` or ``--model X --tiny``)."""

    model: str
    args: tuple[str, ...]
    cp: int
    layout: str
    dtype: str = "float64"
    sharding: str | None = None  # contiguous | balanced | auto (when the implementation offers layouts)
    impl: str = OURS
    seed: int = 0
    exact: bool = False  # every op in float64 (Promote), the truth's and the step's: no float32 rounding anywhere
    source: str = "packed"  # how the documents reach the batch function (verify.model.layouts.MODEL_SOURCES)

    @property
    def rows(self):
        return model_rows(self.layout, self.cp)

    def label(self) -> str:
        shard = f" {self.sharding}" if self.sharding else ""
        return f"{self.model} cp{self.cp} {self.layout} {self.source} {self.dtype}{shard}" + (" exact" if self.exact else "")

    def command(self) -> str:
        a = ["python", "-m", "verify", "model", *self.args, "--cp", str(self.cp), "--layouts", self.layout,
             "--dtypes", self.dtype, "--sources", self.source]
        if self.sharding:
            a += ["--sharding", self.sharding]
        if self.impl != OURS:
            a += ["--impl", self.impl]
        if self.seed:
            a += ["--seed", str(self.seed)]
        if self.exact:
            a += ["--exact"]
        return " ".join(shlex.quote(x) for x in a)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "args": list(self.args)}


# ---- the step under CP, on each rank ----------------------------------------------------------------------
_worker_models: dict[tuple, tuple[nn.Module, ModuleRecorder]] = {}


def _attention_name(impl) -> str:
    """The transformers attention name that routes to ``impl``: ours through
    :func:`~blockdiag_dist.integrations.register_transformers_attention`; any other module through a function of
    the same shape calling its ``cp_blockdiag_sdpa`` (the same refusals of variants the seed's signature cannot
    carry: sinks, softcap, biases, chunks)."""
    from blockdiag_dist.integrations import register_transformers_attention

    if impl.name == OURS:
        return register_transformers_attention()
    from transformers import AttentionInterface

    from blockdiag_dist.integrations.hf import UnsupportedAttentionError, _check_layer

    name = "verify_" + impl.name.replace(".", "_")

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                softcap=None, is_causal=None, **kwargs):
        _check_layer(module, kwargs, softcap)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if not causal:
            raise UnsupportedAttentionError(f"{name} attention in {type(module).__name__}: expected a causal layer, got is_causal=False")
        kw: dict[str, Any] = {"is_causal": True, "scale": scaling, "enable_gqa": query.shape[1] != key.shape[1]}
        if sliding_window is not None:
            if not impl.windows:
                raise UnsupportedAttentionError(f"{name}: expected an implementation with window_size, got "
                                                f"{impl.name} without it (layer sliding_window={sliding_window})")
            kw["window_size"] = (sliding_window - 1, 0)
        out = impl.sdpa(query, key, value, **kw)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, forward)
    return name


def has_attention(model: nn.Module) -> bool:
    """Whether the model (outside a vision tower) holds an attention module: a class named ``*Attention*``. A model
    without one (pure Mamba2, say) routes no attention call, so its step is built with ``expect_attention=False``;
    a wrong guess cannot pass a case silently, since the step is judged against the truth either way."""
    return any("Attention" in type(m).__name__ for name, m in model.named_modules() if not _VISION.search(name))


def run_model_case(case: dict, prepared: Prepared, weights: float) -> dict[str, Any]:
    """The step under CP on this rank (inside a pool worker); see the module docstring."""
    from ..pool import worker_info
    from ..runner import impl_info

    env = worker_info()
    case = ModelCase(**{**case, "args": tuple(case["args"])})
    if case.cp != env["world"]:
        raise ValueError(f"case needs CP {case.cp}, this group has {env['world']} ranks")
    impl = impl_info(case.impl)
    key = (case.model, case.dtype, case.impl)
    if key not in _worker_models:
        model = build(prepared, getattr(torch, case.dtype), _attention_name(impl), case.seed)
        _worker_models[key] = (model, recorder_of(model))
    model, recorder = _worker_models[key]
    if checksum(model) != weights:
        raise RuntimeError(f"verify model: rank {env['rank']} built other weights than the reference "
                           f"({checksum(model)!r} != {weights!r})")
    options: dict[str, Any] = {}
    if case.sharding and "layout" in impl.options:
        options["layout"] = case.sharding
    if "expect_attention" in impl.make_params and not has_attention(model):
        options["expect_attention"] = False  # a pure state-space model: nothing to route (judged like any model)
    # exact: every op in float64, in a float64 model (in a lower dtype the model's dtype is its precision: Promote's
    # float64 outputs would meet its float32 gradients); otherwise the preset's float32 islands in float64, as the truth
    if case.exact and case.dtype == "float64":
        promote = Promote()
    else:
        promote = float64_islands(model, prepared.preset.float64_islands if prepared.preset else ())
    with promote:
        return _step_on_rank(case, prepared, model, recorder, impl, options, env)


def _step_on_rank(case: ModelCase, prepared: Prepared, model: nn.Module, recorder, impl, options: dict[str, Any],
                  env: dict[str, Any]) -> dict[str, Any]:
    if prepared.multimodal:  # the model's own forward on the whole multimodal batch: no pre-embedding
        if "shard_primary" in impl.make_params:  # keep the model's inputs whole: it embeds and splices on full rows
            options["shard_primary"] = False
        if case.source != "packed":  # the CLI builds no such case; a hand-made one is refused before any step
            raise ValueError(f"source: expected packed for a vision-language model, got {case.source}")
        packed = make_multimodal(model, case.rows, _vocab(prepared), case.seed)
        res = cp_step(model, packed.batch, env["cp_mesh"], multimodal_forward, make_batch_and_ctx=impl.make,
                      track_rows=True, recorder=recorder, **options)
    else:
        packed = make_packed(case.rows, _vocab(prepared), case.seed)
        res = cp_step(model, batch_for_source(packed, case.source), env["cp_mesh"], make_batch_and_ctx=impl.make,
                      embed=case.impl != OURS, track_rows=True, recorder=recorder, **options)
    out: dict[str, Any] = {"rank": env["rank"], "loss": res.loss, "targets": res.targets, "notes": res.notes,
                           "exercised": res.exercised}
    if env["rank"] == 0:
        out["grads"] = res.grads
    if res.rows is None or not res.records:
        out["rows"] = None
        return out
    rows = torch.from_numpy(res.rows)  # [B, L] global positions, -1 = CP padding
    seq = packed.batch["_packed_seq_ids"]
    B = rows.shape[0]
    b_idx = torch.arange(B)[:, None].expand_as(rows)
    real = (rows >= 0) & (seq[b_idx, rows.clamp_min(0)] != 0)
    rec = res.records[0]
    out["rows"] = np.stack([b_idx[real].numpy(), rows[real].numpy()], 1)
    out["out"] = rows_of(rec, rows, real, "out")
    out["inp"] = rows_of(rec, rows, real, "inp")
    out["order"] = rec.order
    out["calls"] = rec.calls
    return out


@dataclass
class ModelResult:
    case: ModelCase
    cls: str  # one of MODEL_CLASSES
    why: str = ""  # one line
    message: str = ""  # the refusal or exception, quoted
    verdict: dict[str, Any] = field(default_factory=dict)  # numbers (see _compare_all)
    packed: dict[str, Any] = field(default_factory=dict)  # the packed stock run on one device
    notes: list[str] = field(default_factory=list)
    exercised: dict[str, Any] = field(default_factory=dict)  # what the step computed (harness.exercised)
    seconds: float = 0.0
    details: str = ""  # tracebacks of a crash
    again: dict[str, Any] = field(default_factory=dict)  # the same case with every op in float64 (run.with_exact_run)

    @property
    def ok(self) -> bool:
        return self.cls == "pass"

    def to_dict(self) -> dict[str, Any]:
        v = {k: (list(val) if isinstance(val, tuple) else val) for k, val in self.verdict.items()}
        return {"case": self.case.to_dict(), "label": self.case.label(), "class": self.cls, "why": self.why,
                "message": self.message, "verdict": v, "packed": self.packed, "notes": self.notes,
                "exercised": self.exercised,
                "seconds": round(self.seconds, 3), "reproduce": self.case.command(),
                "details": self.details[-4000:] if self.details else "", "again": self.again}


def judge(case: ModelCase, ref: Reference, per_rank: list[dict[str, Any]]) -> ModelResult:
    """Class one case from every rank's result."""
    rows = case.rows
    variant = "exact" if case.exact else "stock"
    truth = ref.truth(rows, variant)
    model, _ = ref.model("float64")
    first = per_rank[0]
    got = StepResult(loss=first["loss"], grads=first["grads"], targets=first["targets"], notes=first["notes"])
    got_out: dict[Key, np.ndarray] = {}
    got_inp: dict[Key, np.ndarray] = {}
    notes = list(first["notes"])
    p = ref.packed(rows)
    if getattr(p, "pixels", None) is not None and not any(px is not None for px in p.pixels):
        notes.append("no document of this layout has room for an image: text only")
    if all(r.get("rows") is not None for r in per_rank):
        index = {(int(b), int(s)): i for i, (b, s) in enumerate(zip(*p.real))}
        seen = np.concatenate([r["rows"] for r in per_rank]) if per_rank else np.zeros((0, 2), dtype=np.int64)
        where = [index.get((int(b), int(s)), -1) for b, s in seen]
        if sorted(where) != list(range(len(index))):
            return ModelResult(case, "bug", why=f"the ranks' real rows are not the batch's real tokens once each "
                               f"({len(where)} rows for {len(index)} tokens)")
        want = truth.step.records[0].calls if truth.step.records else {}
        for which, into in (("out", got_out), ("inp", got_inp)):
            keys = set.intersection(*[set(r[which]) for r in per_rank]) if per_rank else set()
            keys = {k for k in keys if all(r.get("calls", {}).get(k[0]) == want.get(k[0]) for r in per_rank)}
            for k in keys:
                parts = [r[which][k] for r in per_rank]
                if len({part.shape[1:] for part in parts}) != 1:
                    continue
                stacked = np.concatenate(parts)
                arranged = np.empty_like(stacked)
                arranged[where] = stacked
                into[k] = arranged
    else:
        notes.append("module outputs not compared: the implementation reports no row positions")
    v = compare_all(ref, rows, case.dtype, truth, got, got_out, got_inp, model, variant)
    v["targets"] = (got.targets, truth.step.targets)
    v["truth"] = variant
    if got.targets != truth.step.targets:
        v["ok"] = False
    if not v["ok"] and not case.exact and "mixers64" in ref.variants():  # below float64 too: the stock truth
        # carries the mixer's own float32 rounding, which an implementation computing it in its own order cannot reproduce
        other = compare_all(ref, rows, case.dtype, ref.truth(rows, "mixers64"), got, got_out, got_inp, model, "mixers64")
        if other["ok"] and got.targets == truth.step.targets:
            other["targets"], other["truth"] = v["targets"], "mixers64"
            notes.append("matches the truth with " + ", ".join(ref.mixer_classes()) + " computed in float64 (the "
                         "stock path computes it in float32)")
            v = other
        else:
            v["other_truth"] = {"truth": "mixers64", "worst_grad": other["worst_grad"],
                                "first_wrong_module": other.get("first_wrong_module")}
    stock = ref.packed_stock(rows)
    exercised = first.get("exercised") or {}
    if v["ok"]:
        return ModelResult(case, "pass", verdict=v, packed=stock, notes=notes, exercised=exercised)
    return ModelResult(case, "bug", why=_why(v, stock), verdict=v, packed=stock, notes=notes, exercised=exercised)


def _why(v: dict[str, Any], stock: dict[str, Any] | None) -> str:
    parts = []
    fw = v.get("first_wrong_module")
    if fw:
        via = f"; {fw['via']}" if fw.get("via") else ""
        parts.append(f"first wrong module {fw['module']} ({fw['class']}, {fw['kind']}): output err {fw['err']:.2e} > "
                     f"{fw['limit']:.2e}{via}")
    elif v.get("first_wrong_grad_backward"):
        parts.append(f"every module output right; first wrong gradient in backward order: {v['first_wrong_grad_backward']}")
    bad = {k: e for k, e in v["per_kind"].items() if e["failing"]}
    if bad:
        parts.append("gradients: " + ", ".join(f"{k} {e['worst']:.2e} ({e['failing']}/{e['params']} over)" for k, e in bad.items()))
    if v["loss_rel"] > v["loss_limit"]:
        parts.append(f"loss {v['loss_rel']:.2e} > {v['loss_limit']:.2e}")
    if v.get("targets") and v["targets"][0] != v["targets"][1]:
        parts.append(f"targets {v['targets'][0]} != {v['targets'][1]}")
    if stock and stock.get("status") == "wrong":
        where = (stock.get("first_wrong") or {}).get("module")
        same = " (the same module: the model may not be packing-safe)" if fw and where == fw["module"] else ""
        parts.append(f"the stock model on the packed rows on one device is wrong too (worst gradient "
                     f"{stock['worst']:.2e}" + (f", first wrong module {where}{same}" if where else "") + ")")
    return "; ".join(parts)


def failure_result(case: ModelCase, failure, world: int) -> ModelResult:
    """A case whose step raised, hung or died on some rank (a :class:`~verify.pool.TaskFailure`)."""
    from ..classify import _last_exception, _rank_tracebacks

    details = str(failure)
    if failure.kind == "timeout":
        return ModelResult(case, "hang", why=f"deadline passed on rank(s) {failure.ranks}", details=details)
    if failure.kind == "crash":
        return ModelResult(case, "crash", why=f"rank(s) {failure.ranks} died", details=details)
    excs = [_last_exception(tb) for tb in _rank_tracebacks(details)]
    every_rank = sorted(failure.ranks) == list(range(world))
    if excs and every_rank and all(t in REFUSALS and msg for t, msg in excs):
        t, msg = excs[0]
        return ModelResult(case, "unsupported", why=f"{t} on every rank", message=f"{t}: {msg}", details=details)
    t, msg = excs[0] if excs else ("", "")
    return ModelResult(case, "crash", why=f"raised on rank(s) {failure.ranks}" + ("" if every_rank else " only"),
                       message=f"{t}: {msg}" if t else details.splitlines()[0], details=details)


def forget_models() -> int:
    """Drop every model this worker built (a sweep over many models keeps none); returns how many."""
    n = len(_worker_models)
    for _, recorder in _worker_models.values():
        recorder.close()
    _worker_models.clear()
    return n
