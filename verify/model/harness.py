"""One training step of a whole model, three ways, and their comparison.

- **the truth** (:func:`document_reference`): each document alone through the same model on one device, with
  the model's stock attention and the same weights; the loss is the cross-entropy summed over every document's
  next-token targets, and the gradients are those of that sum;
- **packed on one device** (:func:`packed_reference`): the packed rows through the stock model, no CP. A model
  that differs from the truth here is wrong once packed whatever CP does (e.g. positions from ``torch.arange``
  of the rows instead of ``position_ids``);
- **under CP** (:func:`cp_step`): the packed rows sharded by an implementation's
  ``make_cp_blockdiag_batch_and_ctx``, forward and backward inside its ``train_ctx()``, the loss summed over the
  step's targets and the gradients summed over the CP group (every rank returns the same result).

:func:`compare` gives the loss's and every parameter's relative error (Frobenius), grouped by module kind
(:func:`module_kind`), and names the first parameter, in module order, whose error exceeds a limit.

Shape legend: B rows, S packed length, L rows of one rank, V vocabulary.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from blockdiag_dist.integrations import IGNORE_INDEX, causal_lm_loss, pack_documents

__all__ = [
    "Comparison",
    "StepResult",
    "compare",
    "cp_step",
    "document_reference",
    "module_kind",
    "padded_batch_step",
    "packed_reference",
    "param_grads",
    "text_forward",
]

Forward = Callable[[nn.Module, Mapping[str, Tensor]], Tensor]  # (model, batch) -> logits [B, L, V]


def text_forward(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """A transformers causal LM on ``input_ids`` (or ``inputs_embeds`` when the batch holds them) with
    per-document ``position_ids``: logits ``[B, L, V]``. No labels (the model would shift them; the targets are
    pre-shifted) and no cache."""
    if batch.get("inputs_embeds") is not None:
        return model(inputs_embeds=batch["inputs_embeds"], position_ids=batch["position_ids"], use_cache=False).logits
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits


@dataclass
class StepResult:
    """One step's summed loss and every parameter's gradient (float64 host copies, by parameter name; zeros for
    a parameter that received none)."""

    loss: float
    grads: dict[str, np.ndarray]
    targets: int
    notes: list[str] = field(default_factory=list)  # what the implementation recorded (fallbacks, substitutions)
    # cp_step: global positions [B, L] of this rank's rows (-1: CP padding), when the step state or a tracked
    # tensor gives them; records: what a ModuleRecorder kept (one Records per forward)
    rows: np.ndarray | None = None
    records: list[Any] = field(default_factory=list)
    exercised: dict[str, Any] = field(default_factory=dict)  # cp_step: what the step computed (see exercised())
    # document_reference: per parameter, sum over documents of |its gradient from that document| / |the sum| (1 when
    # the documents' gradients do not cancel): the condition of the gradient as a sum, what float32 rounding is
    # amplified by
    spread: dict[str, float] = field(default_factory=dict)


def param_grads(model: nn.Module) -> dict[str, np.ndarray]:
    """Every trainable parameter's gradient as a float64 numpy array (zeros where ``.grad`` is None)."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = np.zeros(tuple(p.shape)) if g is None else g.detach().to(torch.float64).cpu().numpy().copy()
    return out


def _recording(recorder: Any, B: int, L: int, into: list):
    """``recorder.forward(B, L)`` appending its Records to ``into``, or a null context."""
    if recorder is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def ctx():
        with recorder.forward(B, L) as rec:
            yield
        into.append(rec)

    return ctx()


def document_reference(
    model: nn.Module, docs: Sequence[Tensor], forward: Forward = text_forward, *, recorder: Any = None, copies: int = 1
) -> StepResult:
    """The truth: each document ``docs[i]`` (int64 token ids ``[n_i]``) alone as a row ``[1, n_i]`` with positions
    ``0 .. n_i - 1``; the summed next-token cross-entropy of every document, and its gradients. ``recorder`` (a
    :class:`~verify.model.record.ModuleRecorder`): one Records per document in ``records``. ``copies``: each
    document as that many identical rows ``[copies, n_i]``, its loss divided by ``copies`` (a power of two: exact),
    the same step with every sum over the tokens taken over ``copies`` times the terms, in another order."""
    model.zero_grad(set_to_none=True)
    total, targets, records = 0.0, 0, []
    before: dict[str, Tensor] = {}
    parts: dict[str, float] = {}  # per parameter: sum over documents of its gradient's norm from that document
    for doc in docs:
        batch = pack_documents([doc], seq_len=len(doc))
        if copies > 1:
            batch = {k: v.expand(copies, *v.shape[1:]).contiguous() if isinstance(v, Tensor) and v.dim() >= 1 else v
                     for k, v in batch.items()}
        with _recording(recorder, copies, len(doc), records):
            logits = forward(model, batch)
        loss = causal_lm_loss(logits, batch["labels"], 1) / copies  # a sum: divided by 1 (copies)
        loss.backward()
        total += float(loss.detach())
        targets += int((batch["labels"] != IGNORE_INDEX).sum()) // copies
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad.detach().to(torch.float64)
                    parts[n] = parts.get(n, 0.0) + float(torch.linalg.vector_norm(g - before[n]) if n in before else torch.linalg.vector_norm(g))
                    before[n] = g.clone()
    grads = param_grads(model)
    spread = {n: parts[n] / norm for n in parts if (norm := float(np.linalg.norm(grads[n]))) > 0}
    return StepResult(loss=total, grads=grads, targets=targets, records=records, spread=spread)


def packed_reference(
    model: nn.Module, batch: Mapping[str, Tensor], forward: Forward = text_forward, *, recorder: Any = None
) -> StepResult:
    """The packed rows ``batch`` (``input_ids``, ``labels``, ``position_ids`` ``[B, S]``) through ``model`` on one
    device, no CP: what the model computes once packed, with whatever attention it was built with."""
    model.zero_grad(set_to_none=True)
    records: list = []
    with _recording(recorder, *batch["labels"].shape, records):
        logits = forward(model, batch)
    loss = causal_lm_loss(logits, batch["labels"], 1)
    loss.backward()
    return StepResult(loss=float(loss.detach()), grads=param_grads(model), targets=int((batch["labels"] != IGNORE_INDEX).sum()),
                      records=records)


def padded_batch_step(
    model: nn.Module, recorder: Any, docs: Sequence[Tensor], length: int, positions: Sequence[Tensor] | None = None,
    **inputs: Any,
) -> tuple[StepResult, list]:
    """The documents right-padded into one batch ``[k, n]`` (``n = max(length, longest)``, an attention mask),
    one forward and backward: the same sums as one by one, in another order and with padding rows among them, as
    in a packed row. ``positions``: each document's position ids (``[n_i]``, or ``[3, n_i]`` for mRoPE; default
    ``0 .. n_i - 1``); ``inputs``: more model inputs (images). Returns the step and, from ``recorder`` (a
    :class:`~verify.model.record.ModuleRecorder`), one Records per document."""
    from .record import Records

    model.zero_grad(set_to_none=True)
    k, n = len(docs), max(length, max(int(d.numel()) for d in docs))
    ids = torch.zeros(k, n, dtype=torch.int64)
    labels = torch.full((k, n), IGNORE_INDEX, dtype=torch.int64)
    mask = torch.zeros(k, n, dtype=torch.int64)
    lead = () if positions is None else tuple(positions[0].shape[:-1])  # () or (3,) for mRoPE
    pos = torch.zeros(*lead, k, n, dtype=torch.int64)
    for i, d in enumerate(docs):
        m = d.numel()
        ids[i, :m], labels[i, : m - 1], mask[i, :m] = d, d[1:], 1
        pos[..., i, :m] = torch.arange(m) if positions is None else positions[i]
    with recorder.forward(k, n) as r:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **inputs).logits
    loss = causal_lm_loss(logits, labels, 1)
    loss.backward()
    step = StepResult(loss=float(loss.detach()), grads=param_grads(model), targets=int((labels != IGNORE_INDEX).sum()))
    per_doc = []
    for i, d in enumerate(docs):
        m = int(d.numel())
        per_doc.append(Records(order=r.order, out={key: t[i : i + 1, :m] for key, t in r.out.items()},
                               inp={key: t[i : i + 1, :m] for key, t in r.inp.items()}, cls=r.cls))
    return step, per_doc


def cp_step(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    cp_mesh: Any,
    forward: Forward = text_forward,
    *,
    make_batch_and_ctx: Callable | None = None,
    embed: bool = False,
    track_rows: bool = False,
    recorder: Any = None,
    **options: Any,
) -> StepResult:
    """The step under CP on this rank: ``make_batch_and_ctx(cp_mesh, None, batch, **options)`` (default
    blockdiag_dist's), forward and backward inside ``train_ctx()``, then the loss and the gradients summed over
    the CP group (``cp_mesh`` a 1-D DeviceMesh, a ProcessGroup or None for one rank). Same result on every rank.

    ``embed``: give the batch function ``inputs_embeds`` (the model's input embeddings of the whole rows, as the
    seed's API shards them) instead of ``input_ids``. ``track_rows``: find the global positions of this rank's rows
    (``rows``): from the step state's ``positions`` when it has them, else from a position tensor added to the
    batch (``_verify_rows``, sharded like any ``[B, S]`` tensor). ``recorder``: record the forward's modules
    (``records``)."""
    if make_batch_and_ctx is None:
        from blockdiag_dist import make_cp_blockdiag_batch_and_ctx as make_batch_and_ctx
    model.zero_grad(set_to_none=True)
    batch = dict(batch)
    B, S = batch["labels"].shape
    if embed:
        batch["inputs_embeds"] = model.get_input_embeddings()(batch.pop("input_ids"))
    if track_rows:
        batch["_verify_rows"] = torch.arange(1, S + 1).expand(B, S).clone()  # 0 = padding added by the batch function
    train_ctx, local = make_batch_and_ctx(cp_mesh, None, batch, **options)
    tagged = local.pop("_verify_rows", None)
    records: list = []
    with train_ctx():
        with _recording(recorder, *local["labels"].shape, records):
            logits = forward(model, local)
        loss = causal_lm_loss(logits, local["labels"], 1)
        loss.backward()
    rows = None
    if track_rows:
        positions = getattr(getattr(train_ctx, "state", None), "positions", None)
        if positions is not None:
            pos = positions.to(torch.int64).cpu()
            rows = torch.where(pos < S, pos, -1).expand(*local["labels"].shape).numpy().copy()
        elif isinstance(tagged, Tensor) and tagged.shape == local["labels"].shape:  # sharded like the batch
            rows = (tagged.to(torch.int64).cpu() - 1).numpy()
    group = None if cp_mesh is None else (cp_mesh if isinstance(cp_mesh, dist.ProcessGroup) else cp_mesh.get_group())
    grads = param_grads(model)
    summed = torch.tensor([float(loss.detach()), float((local["labels"] != IGNORE_INDEX).sum())], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        names = sorted(grads)
        flat = torch.from_numpy(np.concatenate([grads[n].ravel() for n in names] + [summed.numpy()]))
        dist.all_reduce(flat, group=group)
        sizes = [grads[n].size for n in names]
        parts = flat[: sum(sizes)].split(sizes)
        grads = {n: part.numpy().reshape(grads[n].shape).copy() for n, part in zip(names, parts)}
        summed = flat[sum(sizes):]
    state = getattr(train_ctx, "state", None)
    return StepResult(loss=float(summed[0]), grads=grads, targets=int(summed[1]), notes=list(getattr(state, "notes", [])),
                      rows=rows, records=records, exercised=exercised(state))


def exercised(state: Any) -> dict[str, Any]:
    """What a step computed, from its state (empty for an implementation whose state does not say): the windows,
    chunk lengths, sinks and softcaps of its attention calls, and the sequence mixers it computed per document."""
    kinds = getattr(state, "attention_kinds", None)
    if kinds is None:
        return {}
    return {
        "attention_calls": int(getattr(state, "attention_calls", 0)),
        "windows": sorted({left for left, _, _, _ in kinds}),  # window left; -1 = none (causal over the document)
        "chunks": sorted({chunk for _, chunk, _, _ in kinds if chunk > 0}),
        "sinks": any(sinks for _, _, sinks, _ in kinds),
        "softcaps": sorted({cap for _, _, _, cap in kinds if cap is not None}),
        "mixers": list(getattr(getattr(state, "guard", None), "per_document", [])),
    }


def describe_exercised(ex: dict[str, Any]) -> str:
    """'causal, window 7; chunks of 8; sinks; softcap 50; mixers Qwen3NextGatedDeltaNet' ('' when unknown)."""
    if not ex:
        return ""
    parts = []
    if ex.get("windows"):
        parts.append(", ".join("causal" if w < 0 else f"window {w}" for w in ex["windows"]))
    if ex.get("chunks"):
        parts.append("chunks of " + ", ".join(map(str, ex["chunks"])))
    if ex.get("sinks"):
        parts.append("sinks")
    if ex.get("softcaps"):
        parts.append("softcap " + ", ".join(f"{c:g}" for c in ex["softcaps"]))
    if ex.get("mixers"):
        parts.append("mixers " + ", ".join(ex["mixers"]))
    if not ex.get("attention_calls"):
        parts.insert(0, "no attention call")
    return "; ".join(parts)


# ---- grouping and comparison ------------------------------------------------------------------------------
KINDS = ("attention", "linear attention / state space", "convolution", "mlp", "norm", "embedding", "vision", "other")

_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision|image_encoder|multi_modal_projector|mm_projector)(\.|$)")


def module_kind(model: nn.Module, param_name: str) -> str:
    """The kind of module a parameter belongs to (one of :data:`KINDS`), from the classes on its module path:
    vision towers first, then the innermost recognisable module (a sequence mixer the guard knows, an attention,
    a convolution, an MLP or experts, a norm, an embedding or the output head)."""
    from blockdiag_dist.guard import KNOWN_MIXERS

    if _VISION.search(param_name):
        return "vision"
    path = param_name.split(".")[:-1]
    modules, m = [], model
    for part in path:
        m = getattr(m, part, None)
        if m is None:
            break
        modules.append(m)
    leaf = param_name.split(".")[-1]
    for mod in reversed(modules):
        names = [c.__name__ for c in type(mod).__mro__]
        if any(n in KNOWN_MIXERS for n in names) or leaf in ("A_log", "dt_bias"):
            return "linear attention / state space"
        if isinstance(mod, (nn.Conv1d,)):
            return "convolution"
        if isinstance(mod, nn.Embedding) or names[0].endswith("Embedding"):
            return "embedding"
        low = names[0].lower()
        if "norm" in low:
            return "norm"
        if "attention" in low or low.endswith("attn"):
            return "attention"
        if any(k in low for k in ("mlp", "expert", "moe", "feedforward", "ffn")):
            return "mlp"
    if path and path[-1] in ("lm_head", "embed_tokens", "wte", "embed_out"):
        return "embedding"
    return "other"


@dataclass
class Comparison:
    """``got`` against ``ref``: the loss's relative error, every parameter's, each group's worst, and the first
    parameter (in module order) above its limit (``limits[name]`` when given, else ``limit``)."""

    loss_rel: float
    per_param: dict[str, float]
    per_kind: dict[str, tuple[float, str]]  # kind -> (worst relative error, its parameter)
    first_wrong: str | None
    limit: float
    limits: dict[str, float] = field(default_factory=dict)  # per-parameter limits, where not ``limit``
    loss_limit: float | None = None
    kinds: dict[str, str] = field(default_factory=dict)  # parameter -> module kind

    @property
    def worst(self) -> float:
        return max([self.loss_rel, *self.per_param.values()])

    def limit_of(self, name: str) -> float:
        return self.limits.get(name, self.limit)

    @property
    def failing(self) -> list[str]:
        """Parameters above their limit, in module order."""
        return [n for n in self.per_param if self.per_param[n] > self.limit_of(n)]

    @property
    def loss_ok(self) -> bool:
        return self.loss_rel <= (self.limit if self.loss_limit is None else self.loss_limit)

    @property
    def ok(self) -> bool:
        return self.loss_ok and not self.failing

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {e:.1e}" for k, (e, _) in self.per_kind.items())
        head = f"loss {self.loss_rel:.1e}; {kinds}"
        return head if self.first_wrong is None else f"{head}; first wrong: {self.first_wrong} ({self.per_param[self.first_wrong]:.1e})"


ZERO_GRADIENT = 1e-12  # a gradient norm at most this fraction of the step's largest: zero in exact arithmetic


def _rel(got: np.ndarray, ref: np.ndarray, scale: float | None = None) -> float:
    scale = float(np.linalg.norm(ref)) if scale is None else scale
    diff = float(np.linalg.norm(got - ref))
    if not np.isfinite(diff):
        return float("inf")
    return diff / scale if scale > 0 else diff


def compare(
    ref: StepResult, got: StepResult, model: nn.Module, limit: float, *, limits: Mapping[str, float] | None = None,
    loss_limit: float | None = None,
) -> Comparison:
    """Relative (Frobenius) errors of ``got`` against ``ref``, grouped by :func:`module_kind` of ``model``;
    ``limits`` (parameter -> limit) and ``loss_limit`` replace ``limit`` where given. A parameter whose reference
    gradient's norm is at most :data:`ZERO_GRADIENT` of the largest (zero in exact arithmetic) has its error
    relative to the largest gradient's norm."""
    missing = sorted(set(ref.grads) ^ set(got.grads))
    if missing:
        raise ValueError(f"compare: expected the same parameters in both steps, got {missing[:5]} in only one")
    loss_rel = abs(got.loss - ref.loss) / max(abs(ref.loss), np.finfo(np.float64).tiny)
    if not np.isfinite(loss_rel):
        loss_rel = float("inf")
    order = [n for n, _ in model.named_parameters() if n in ref.grads]
    order += [n for n in ref.grads if n not in set(order)]
    # a gradient zero in exact arithmetic (a key bias: a softmax ignores a shift shared by a query's logits) is
    # rounding: its error is measured against the largest gradient's norm, not against its own rounding
    norms = {n: float(np.linalg.norm(ref.grads[n])) for n in order}
    top = max(norms.values(), default=0.0)
    per_param = {n: _rel(got.grads[n], ref.grads[n], top if norms[n] <= ZERO_GRADIENT * top else None) for n in order}
    limits = dict(limits or {})
    kinds = {n: module_kind(model, n) for n in per_param}
    per_kind: dict[str, tuple[float, str]] = {}
    for name, err in per_param.items():
        kind = kinds[name]
        if kind not in per_kind or err > per_kind[kind][0]:
            per_kind[kind] = (err, name)
    first = next((n for n in order if per_param[n] > limits.get(n, limit)), None)
    per_kind = {k: per_kind[k] for k in KINDS if k in per_kind}
    return Comparison(loss_rel=loss_rel, per_param=per_param, per_kind=per_kind, first_wrong=first, limit=limit,
                      limits=limits, loss_limit=loss_limit, kinds=kinds)
