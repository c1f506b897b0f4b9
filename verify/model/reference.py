"""The truth and the baselines of a model-level case, computed once per model and layout in the parent.

:class:`Reference` holds the stock models (one per dtype, the same weights), what the float64 model computes
below float64 (:func:`~verify.model.precision.float32_ops`), and per document layout: the truth (each document
alone in float64, as written or with its sequence mixers in float64), the baselines that set the limits, and the
stock model on the packed rows on one device. See :mod:`verify.model.check` for how they judge a case.

Shape legend: B rows, S packed length, N real positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..tolerances import TOLERANCES
from .harness import _VISION, ZERO_GRADIENT, StepResult, compare, document_reference, packed_reference, padded_batch_step, text_forward
from .judge import Baseline, Truth, compare_all, module_errors
from .layouts import Packed, make_packed, model_rows
from .multimodal import image_inputs, make_multimodal, multimodal_batched, multimodal_forward, multimodal_reference
from .precision import LowPrecisionUse, Promote, float32_ops, float64_eager_attention, float64_islands, float64_modules
from .record import Key, ModuleRecorder, Records, packed as packed_records
from .zoo import Prepared, build

__all__ = ["FLOAT32_BACKENDS", "Baseline", "Reference", "Truth", "checksum", "layer_masks", "recorder_of"]

FLOAT32_BACKENDS = ("math", "flash_attention")  # CPU SDPA backends the float32 baseline runs on
ROUNDING = ZERO_GRADIENT  # a gradient norm at most this fraction of the largest is rounding (zero in exact arithmetic)
# the float32 baseline's second sample (text models): each document as 8 identical rows (loss / 8, exact). A
# gradient summed over every token is a float32 sum whose rounding follows its terms and their order: DeepSeek-V4's
# hc_head.hc_scale (reused-ids) moves 5.1e-6 alone, 8.0e-6 / 5.4e-6 / 1.7e-5 with 2 / 4 / 8 copies; CP 1 2.2e-5
COPIES = 8
# ... and each document as 2 to 7 identical rows too: a CPU GEMM takes another kernel, with another summation order,
# for another row count. Measured on an AVX-512 machine: Ling's float32 router, through its experts' float64
# gradients, moves 5.0e-9 with 1, 2, 4 or 8 rows or any padding, 6.8e-8 with 3 and 6.3e-8 with 5 (CP 2: 1.7e-8);
# DeepSeek-V4's float32 hc_head.hc_scale (spans-every-rank) moves 1.6e-6 to 1.1e-4 with 1 to 16 rows (CP 2: 1.6e-4)
MORE_COPIES = (2, 3, 4, 5, 6, 7)
# ... and as 9 to 16 identical rows where a gradient of at most FEW numbers has its limit set by the baseline: such a
# gradient's error is one draw of the rounding of a sum over every token, not an average over many numbers, and the
# widest of 8 draws understates where a ninth lands. DeepSeek-V4's hc_head.hc_base (4 numbers, one-long, seed 37) moves
# 9.2e-6 to 2.9e-5 with 1 to 8 rows, up to 1.1e-4 with 9 to 16 and 1.0e-4 with 17 to 32 (3 of those 16 stock runs are
# over the limits 8 draws give, none over those of 16), and CP 3 measured 9.0e-5 against a limit of 6.2e-5. Were the
# draws Gaussian, a further scalar would land beyond twice the widest of 8 about 1 time in 120, of 16 1 in 800
WIDER_COPIES = tuple(range(9, 17))
FEW = 16
ODD_COPIES = 3  # the float64 baseline's row-count sample (each float64 sample is also run all in float64)
# a float64 baseline sample computed all in float64 that differs from the exact truth by more than this changes what
# the model computes, not only its rounding: reordered float64 sums move a recurrence's gate gradient by ~1e-9, a
# padding that is not neutral moves gradients by 0.07-1.7 (HY-V4, HY-V4-VL, Mistral Large 4, DeepSeek-V4)
NOT_ROUNDING = 1e-6
# the modeling modules' chunked recurrences that take ``chunk_size`` (Gated DeltaNet's, Kimi Delta Attention's)
CHUNK_KERNELS = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention")
RECHUNK = 4  # the chunk length of the truth's second chunking (see Reference.chunking_cost)


def checksum(model: nn.Module) -> float:
    """Sum of every parameter in float64: equal iff (for practical purposes) the weights are. numpy's pairwise sum:
    the same bits whatever the process's torch thread count (torch's parallel reduction orders it by threads)."""
    return float(sum(np.sum(p.detach().to(torch.float64).cpu().numpy()) for p in model.parameters()))


def recorder_of(model: nn.Module) -> ModuleRecorder:
    """A recorder of every module but a vision tower's (its outputs are patches, not rows)."""
    return ModuleRecorder(model, skip=lambda name: bool(_VISION.search(name)))


def _vocab(prepared: Prepared) -> int:
    text = getattr(prepared.config, "text_config", None) or prepared.config
    return int(text.vocab_size)


def _worst(a: dict, b: dict) -> dict:
    return {k: max(a.get(k, 0.0), b.get(k, 0.0)) for k in set(a) | set(b)}


class Reference:
    """Everything about one model the parent computes: stock models per dtype, the float32 ops of the float64
    model (and their cost), and per document layout the truth, the baselines and the packed stock run."""

    def __init__(self, prepared: Prepared, seed: int = 0) -> None:
        self.prepared = prepared
        self.seed = seed
        self._models: dict[str, tuple[nn.Module, ModuleRecorder]] = {}
        self._truth: dict[Any, Truth] = {}
        self._base: dict[Any, Baseline | None] = {}
        self._packed: dict[Any, dict[str, Any]] = {}
        self._batches: dict[Any, Packed] = {}
        self._ops: list[LowPrecisionUse] | None = None
        self.cost: float | None = None  # what the ops below float64 cost (stock vs all in float64), worst gradient
        self._exact: dict[Any, dict[str, float]] = {}  # per layout: each parameter's error of stock vs all in float64
        self._rechunk: dict[Any, dict[str, float]] = {}  # per layout and truth: see chunking_cost
        self._exact_loss: dict[Any, float] = {}  # per layout: the loss's error of stock vs all in float64
        self.weights: float | None = None

    # -- models --
    def model(self, dtype: str) -> tuple[nn.Module, ModuleRecorder]:
        if dtype not in self._models:
            m = build(self.prepared, getattr(torch, dtype), self.prepared.reference_attention, self.seed)
            self._models[dtype] = (m, recorder_of(m))
            if self.weights is None:
                self.weights = checksum(m)
        return self._models[dtype]

    def _stock(self, model: nn.Module, variant: str = "stock"):
        """The reference's attention: stock SDPA, or eager attention computed in float64 (as CP computes it); with
        ``variant="mixers64"`` the sequence mixers the guard knows (Gated DeltaNet, Mamba2, ...) run in float64 too;
        with ``variant="exact"`` every op runs in float64 (:class:`~verify.model.precision.Promote`). A preset's
        ``float64_islands`` run in float64 in every variant (a float64 model only), as in the step under CP."""
        stack = contextlib.ExitStack()
        if variant == "exact":  # every op in float64, attention included
            stack.enter_context(Promote())
            return stack
        stack.enter_context(float64_islands(model, self.islands()))
        if self.prepared.reference_attention == "eager":
            stack.enter_context(float64_eager_attention(model))
        if variant == "mixers64":
            stack.enter_context(float64_modules(model, _is_mixer))
        return stack

    def islands(self) -> tuple[str, ...]:
        """The module classes run in float64 on both sides (the preset's ``float64_islands``)."""
        return self.prepared.preset.float64_islands if self.prepared.preset else ()

    def variants(self) -> list[str]:
        """The float64 truths a case may match: the model as written ("stock"), and, when a sequence mixer of the
        model computes below float64 on its stock path, the model with its mixers in float64 ("mixers64"): an
        implementation that replaces the mixer may compute it in the model's dtype or round as the stock path
        does; either is judged with sharp limits against the truth it follows."""
        return ["stock", "mixers64"] if self.mixer_classes() else ["stock"]

    def mixer_classes(self) -> list[str]:
        """The sequence mixers that compute below float64 on the stock path: in their own code, or in a module
        inside them (MiniMax's lightning layer: its RMSNorm over the heads)."""
        model, _ = self.model("float64")
        mixers = {n: type(m).__name__ for n, m in model.named_modules() if _is_mixer(m)}
        found = set()
        for u in self.float32_ops():
            if _is_mixer_class(u.cls):
                found.add(u.cls)
            found.update(c for n, c in mixers.items() if u.module.startswith(n + "."))
        return sorted(found)

    def packed(self, rows) -> Packed:
        if rows not in self._batches:
            if self.prepared.multimodal:
                self._batches[rows] = make_multimodal(self.model("float64")[0], rows, _vocab(self.prepared), self.seed)
            else:
                self._batches[rows] = make_packed(rows, _vocab(self.prepared), self.seed)
        return self._batches[rows]

    def reference_step(self, model: nn.Module, p: Packed, recorder: ModuleRecorder | None = None) -> StepResult:
        """Each document alone through ``model`` (see :func:`~verify.model.harness.document_reference`)."""
        if self.prepared.multimodal:
            return multimodal_reference(model, p, recorder=recorder)
        return document_reference(model, p.docs, recorder=recorder)

    # -- what the model computes below float64 --
    def float32_ops(self) -> list[LowPrecisionUse]:
        if self._ops is None:
            model, _ = self.model("float64")
            p = self.packed(model_rows("spans-every-rank", 2))
            if self.prepared.multimodal:
                i = next((j for j, px in enumerate(p.pixels) if px is not None), 0)
                batch = p.doc_batch(i)
            else:
                doc = p.docs[0]
                batch = {"input_ids": doc[None], "position_ids": torch.arange(doc.numel())[None]}
            with self._stock(model):
                self._ops = float32_ops(model, lambda: self.forward(model, batch))
        return self._ops

    def forward(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return (multimodal_forward if self.prepared.multimodal else text_forward)(model, batch)

    def _masked_forward(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
                     use_cache=False, **image_inputs(model, batch)).logits

    # -- the truth --
    def truth(self, rows, variant: str = "stock") -> Truth:
        key = (rows, variant)
        if key not in self._truth:
            model, rec = self.model("float64")
            p = self.packed(rows)
            with self._stock(model, variant):
                step = self.reference_step(model, p, rec)
            real = p.real
            order: list[Key] = []
            for r in step.records:
                order += [k for k in r.order if k not in set(order)]
            cls = {}
            for r in step.records:
                cls.update(r.cls)
            self._truth[key] = Truth(step, packed_records(step.records, p.places, p.lengths, real, "out"),
                                     packed_records(step.records, p.places, p.lengths, real, "inp"), order, cls)
            if variant != "exact" and self.float32_ops() and (self.cost is None or self.cast_params()):
                exact = self.truth(rows, "exact").step  # the exact truth: also what the baselines' samples are checked against
                c = compare(exact, step, model, 0.0)
                self.cost = max(self.cost or 0.0, c.worst)
                self._exact[key] = c.per_param
                self._exact_loss[key] = c.loss_rel
        return self._truth[key]

    def rounding_params(self, rows, variant: str = "stock") -> set[str]:
        """Parameters whose true gradient is zero in exact arithmetic and only rounding in float64 (a key bias: a
        softmax is unchanged when every logit of a query moves alike), found as a gradient norm at most
        :data:`ROUNDING` of the largest: :func:`~verify.model.harness.compare` measures their error against the
        largest gradient's norm (against their own it would be rounding over rounding), and the float64 limit is
        the baseline's like every rounding's (a real error there is many orders of magnitude above it)."""
        grads = self.truth(rows, variant).step.grads
        norms = {n: float(np.linalg.norm(g)) for n, g in grads.items()}
        top = max(norms.values(), default=0.0)
        return {n for n, v in norms.items() if top > 0 and v <= ROUNDING * top}

    def cast_params(self) -> set[str]:
        """Parameters the model casts below float64 in its forward: their gradients are summed below float64 by
        the model itself (a norm's ``weight.float()``, a router's ``weight.type(torch.float32)``)."""
        return {n for use in self.float32_ops() for n in use.params}

    def cast_cost(self, rows, variant: str = "stock") -> dict[str, float]:
        """Per cast parameter: its gradient's error, stock against the model all in float64."""
        if variant == "exact":
            return {}
        self.truth(rows, variant)
        per = self._exact.get((rows, variant), {})
        return {n: per[n] for n in self.cast_params() if n in per}

    def chunking_cost(self, rows, variant: str = "stock") -> dict[str, float]:
        """Per parameter: its gradient's error, the truth against the same documents with the model's chunked
        recurrences (Gated DeltaNet's chunked delta rule, Mamba2's chunked scan) cut every :data:`RECHUNK` tokens
        instead of the model's chunk: the same sums in another order, which a CP step cannot avoid either (a rank
        boundary cuts a chunk). A gate's gradient (``A_log``, ``dt_bias``) is a small sum of large terms of both
        signs: in float64 it moves by up to ~1e-9 with the chunking. Empty for a model without such a mixer."""
        key = (rows, variant)
        if key not in self._rechunk:
            truth = self.truth(rows, variant)
            model, _ = self.model("float64")
            step = None
            with self._stock(model, variant), rechunked(model, RECHUNK) as changed:
                if changed:
                    step = self.reference_step(model, self.packed(rows))
            self._rechunk[key] = {} if step is None else compare(truth.step, step, model, 0.0).per_param
        return self._rechunk[key]

    def loss_cast_cost(self, rows, variant: str = "stock") -> float:
        """The loss's error, stock against the model all in float64: what the model's own float32 ops cost the
        loss (e.g. logits cast to float32: the loss is a float32 sum, whose order a CP step changes)."""
        if variant == "exact":
            return 0.0
        self.truth(rows, variant)
        return self._exact_loss.get((rows, variant), 0.0)

    # -- baselines --
    def baseline(self, rows, dtype: str, variant: str = "stock") -> Baseline | None:
        """The baseline of ``dtype`` (None for float64 when the model computes nothing below float64). Below
        float64 it is the model as shipped, in ``dtype``, against the truth of ``variant`` (with ``"mixers64"``
        its error includes what the stock mixer's float32 path itself costs)."""
        key = (rows, dtype, variant)
        if key in self._base:
            return self._base[key]
        truth = self.truth(rows, variant)
        p = self.packed(rows)
        if dtype == "float64":
            if (variant == "exact" or not self.float32_ops()) and not self.rounding_params(rows, variant):
                self._base[key] = None
                return None
            model, rec = self.model("float64")
            S = p.batch["labels"].shape[1]
            kept, dropped = [], []
            samples = self._float64_samples(p, S)
            while samples:
                sample = samples.pop(0)
                with self._stock(model, variant):
                    step, per_doc = sample(model, rec)
                b = self._errors(sample.what, truth, step, per_doc, p, model)
                if variant == "exact" or sample.promoted or self._is_rounding(rows, sample, model, rec):
                    kept.append(b)
                    continue
                dropped.append(b)
                if len(dropped) == 1:  # samples without padding take its place
                    samples += self._unpadded_samples(rows, p)
            if dropped:  # kept holds the all-float64 sample at least
                kept[-1] = dataclasses.replace(kept[-1], what=kept[-1].what + "; left out, all in float64 it differs "
                                               "by more than rounding: " + "; ".join(b.what for b in dropped))
            self._base[key] = functools.reduce(_merged, kept)
            return self._base[key]
        model, rec = self.model(dtype)
        backends = FLOAT32_BACKENDS if self.prepared.reference_attention == "sdpa" else (None,)
        worst: Baseline | None = None
        refused = []
        for backend in backends:
            try:
                with _sdpa_backend(backend):
                    step = self.reference_step(model, p, rec)
            except RuntimeError as exc:  # this backend refuses these inputs: it cannot be the one a user gets
                refused.append(f"SDPA {backend} refuses: {_first_line(exc)}")
                continue
            b = self._errors(f"{dtype}, each document alone" + (f" (SDPA {backend})" if backend else ""), truth, step,
                             step.records, p, model)
            worst = b if worst is None else _merged(worst, b)
        if worst is None:
            raise RuntimeError("; ".join(refused))
        if refused:
            worst.what += " (" + "; ".join(refused) + ")"
        if not self.prepared.multimodal:  # the same step, every sum over the tokens over COPIES x the terms
            ok = next(b for b in backends if not any(f"SDPA {b} refuses" in r for r in refused))

            def sampled(worst: Baseline, counts: tuple[int, ...]) -> Baseline:
                for copies in counts:
                    with _sdpa_backend(ok):
                        step, records = _copies(model, rec, docs=p.docs, copies=copies)
                    b = self._errors(f"{dtype}, each document as {copies} identical rows" + (f" (SDPA {ok})" if ok else ""),
                                     truth, step, records, p, model)
                    worst = _merged(worst, b)
                return worst

            worst = sampled(worst, (COPIES, *MORE_COPIES))
            few = _few_set_by_baseline(worst, truth.step, dtype)
            if few:  # more draws of the rounding for them (WIDER_COPIES)
                worst = sampled(worst, WIDER_COPIES)
                worst.what += (f" ({WIDER_COPIES[0]} to {WIDER_COPIES[-1]} rows for the gradients of at most {FEW} "
                               f"numbers whose limit the baseline sets: " + ", ".join(few) + ")")
        self._base[key] = worst
        return worst

    def _float64_samples(self, p: Packed, S: int) -> list[_Sample]:
        """The float64 baseline's samples: the documents right-padded together to a little more than the packed
        length, in two orders (one sample of rounding is not enough), and, text models, each document as
        :data:`ODD_COPIES` identical rows. Where a padded sample is not rounding alone
        (:meth:`_is_rounding`), a text model's documents each as :data:`COPIES` identical rows (no padding) take
        its place."""
        out = []
        for order, pad in ((1, 3), (-1, 8)):
            idx = list(range(len(p.docs)))[::order]
            what = (f"float64, documents right-padded together to S + {pad} tokens"
                    + (" in reverse order" if order < 0 else "") + " vs one by one")
            out.append(_Sample(what, functools.partial(_padded, p=p, length=S + pad, idx=idx,
                                                       multimodal=self.prepared.multimodal)))
        if not self.prepared.multimodal:  # an odd batch: another GEMM kernel's summation order (ODD_COPIES)
            out.append(_Sample(f"float64, each document as {ODD_COPIES} identical rows",
                               functools.partial(_copies, docs=p.docs, copies=ODD_COPIES)))
        return out

    def _unpadded_samples(self, rows, p: Packed) -> list[_Sample]:
        """The float64 baseline's samples where padding is not neutral: a text model's documents each as
        :data:`COPIES` identical rows (every sum over the tokens over 8 x the terms), and the documents one by one
        with every op in float64 against the model as written (the whole rounding its float32 ops add: a CP step
        perturbs their inputs by float64 rounding, which flips some float32 roundings; the copies alone do not)."""
        out = [] if self.prepared.multimodal else [
            _Sample(f"float64, each document as {COPIES} identical rows", functools.partial(_copies, docs=p.docs))]
        exact = self.truth(rows, "exact").step  # every op in float64: the exact truth itself
        out.append(_Sample("every op in float64, each document alone", lambda model, rec: (exact, exact.records),
                           promoted=True))
        return out

    def _is_rounding(self, rows, sample: _Sample, model: nn.Module, recorder: ModuleRecorder) -> bool:
        """Whether ``sample`` differs from the documents one by one by rounding only: computed with every op in
        float64 (:class:`~verify.model.precision.Promote`), it must equal the exact truth within
        :data:`NOT_ROUNDING`. Right-padding is not neutral for every model: all in float64, HY-V4's
        hyper-connections, Mistral Large 4 and DeepSeek-V4's compressor move their gradients by 0.2-0.9 when the
        documents are padded together. Such a sample would set limits no rounding explains."""
        exact = self.truth(rows, "exact")
        with Promote():
            step, _ = sample(model, recorder)
        c = compare(exact.step, step, model, 0.0)
        return max(c.worst, c.loss_rel) <= NOT_ROUNDING

    def _errors(self, what: str, truth: Truth, step: StepResult, per_doc: list[Records], p: Packed, model) -> Baseline:
        c = compare(truth.step, step, model, 0.0)
        real = p.real
        out = packed_records(per_doc, p.places, p.lengths, real, "out")
        inp = packed_records(per_doc, p.places, p.lengths, real, "inp")
        return Baseline(what, c.per_param, c.loss_rel, module_errors(out, truth.out), module_errors(inp, truth.inp))

    # -- the packed rows on one device, stock model --
    def packed_stock(self, rows) -> dict[str, Any]:
        """Whether the stock model, given the packed rows on one device (text: transformers finds the documents from
        the restarting ``position_ids``; vision-language: per-document masks per layer type), computes the truth: ``{"status": "ok" | "wrong" | "refused", "worst", "first_wrong", "message"}`` (judged
        with the float64 limits). "wrong" means the model is not packing-safe by itself (a layer that mixes the
        sequence without the mask, positions from the rows): wrong under CP whatever CP does."""
        if rows in self._packed:
            return self._packed[rows]
        truth = self.truth(rows)
        model, rec = self.model("float64")
        p = self.packed(rows)
        try:
            with self._stock(model):
                whole = {k: v for k, v in p.batch.items() if k != "_packed_seq_ids"}
                forward = self.forward
                if self.prepared.multimodal:  # transformers finds documents from 2-D positions only: give masks
                    text = getattr(model.config, "text_config", model.config)
                    doc_pos = torch.zeros_like(p.batch["input_ids"])
                    for d, (b, s0) in zip(p.docs, p.places):
                        doc_pos[b, s0 : s0 + d.numel()] = torch.arange(d.numel())
                    whole["attention_mask"] = layer_masks(text, p.batch["_packed_seq_ids"], doc_pos,
                                                          next(model.parameters()).dtype, _blocks(model, p.batch))
                    forward = self._masked_forward
                step = packed_reference(model, whole, forward, recorder=rec)
        except Exception as exc:  # noqa: BLE001 - the model refuses packed rows: reported, not judged
            self._packed[rows] = {"status": "refused", "message": f"{type(exc).__name__}: {_first_line(exc)}"}
            return self._packed[rows]
        real = p.real
        got_out = {k: v[real[0], real[1]].numpy() for k, v in step.records[0].out.items()}
        got_inp = {k: v[real[0], real[1]].numpy() for k, v in step.records[0].inp.items()}
        verdict = compare_all(self, rows, "float64", truth, step, got_out, got_inp, model)
        self._packed[rows] = {"status": "ok" if verdict["ok"] else "wrong", "worst": verdict["worst_grad"],
                              "first_wrong": verdict.get("first_wrong_module"), "loss": verdict["loss_rel"]}
        return self._packed[rows]


def layer_masks(text_config: Any, seq_ids: Tensor, doc_pos: Tensor, dtype: torch.dtype,
                blocks: Tensor | None = None) -> Tensor | dict[str, Tensor]:
    """Additive ``[B, 1, S, S]`` per-document masks (0 where query i may see key j: same document, j <= i, within
    the layer's window or chunk, or in the same bidirectional block of ``blocks [B, S]`` (0 = none) within the
    document; a padding row sees itself; the dtype's lowest value elsewhere), one per layer type of ``text_config``
    (transformers takes such a dict instead of building masks), else one mask."""
    B, S = seq_ids.shape
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    same = (seq_ids[:, :, None] == seq_ids[:, None, :]) & (seq_ids[:, :, None] != 0)
    base = same & (j <= i)
    block = torch.zeros_like(base)
    if blocks is not None:
        block = same & (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] != 0)

    def additive(allowed: Tensor) -> Tensor:
        allowed = allowed | block | torch.eye(S, dtype=torch.bool)
        return torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~allowed[:, None], torch.finfo(dtype).min)

    window = getattr(text_config, "sliding_window", None)
    chunk = getattr(text_config, "attention_chunk_size", None)
    kinds = {
        "sliding_attention": base & (i - j < window) if window else base,
        "chunked_attention": base & (doc_pos[:, :, None] // chunk == doc_pos[:, None, :] // chunk) if chunk else base,
    }
    types = getattr(text_config, "layer_types", None)
    if not types:
        return additive(kinds["sliding_attention"] if window else base)
    return {t: additive(kinds.get(t, base)) for t in set(types)}


def _blocks(model: nn.Module, batch: dict[str, Tensor]) -> Tensor | None:
    """The bidirectional blocks ``[B, S]`` the model reads from the batch's token types (``token_type_ids``: Gemma
    3's images, PaliGemma's prefix; ``mm_token_type_ids``: Gemma 4's images; the model's own rule, as the
    integration tables it), or None."""
    from blockdiag_dist.integrations.vlm import bidirectional_blocks_of

    types = next((batch[k] for k in ("token_type_ids", "mm_token_type_ids") if batch.get(k) is not None), None)
    return None if types is None else bidirectional_blocks_of(getattr(model, "model", model), types)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


@contextlib.contextmanager
def _sdpa_backend(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    from torch.nn.attention import sdpa_kernel

    from ..tolerances import sdpa_backend

    with sdpa_kernel([sdpa_backend(name)]):
        yield


def _is_mixer_class(name: str) -> bool:
    from blockdiag_dist.guard import KNOWN_MIXERS

    return name in KNOWN_MIXERS


def _is_mixer(module: nn.Module) -> bool:
    return any(_is_mixer_class(c.__name__) for c in type(module).__mro__)


@contextlib.contextmanager
def rechunked(model: nn.Module, every: int) -> Iterator[bool]:
    """Inside: the stock chunked recurrences of ``model``'s sequence mixers cut every ``every`` tokens (the
    modeling module's chunked kernels, :data:`CHUNK_KERNELS`, given ``chunk_size=every``; a mixer's own
    ``chunk_size`` set to ``every``). Yields whether any was found; everything is restored on exit."""
    undo: list[tuple[Any, str, Any]] = []
    for m in model.modules():
        if not _is_mixer(m):
            continue
        module = sys.modules.get(type(m).__module__)
        for name in CHUNK_KERNELS:
            kernel = getattr(module, name, None)
            if kernel is not None and not any(obj is module and attr == name for obj, attr, _ in undo):
                undo.append((module, name, kernel))
                setattr(module, name, functools.partial(kernel, chunk_size=every))
        if isinstance(m.__dict__.get("chunk_size"), int):
            undo.append((m, "chunk_size", m.chunk_size))
            m.chunk_size = every
    try:
        yield bool(undo)
    finally:
        for obj, name, old in reversed(undo):
            setattr(obj, name, old)


@dataclasses.dataclass(frozen=True)
class _Sample:
    """One float64 baseline sample: what it is, and ``run(model, recorder) -> (step, per-document records)``."""

    what: str
    run: Any
    promoted: bool = False  # every op in float64 by construction: what the model's own float32 ops round, no more

    def __call__(self, model: nn.Module, recorder: ModuleRecorder):
        return self.run(model, recorder)


def _padded(model: nn.Module, recorder: ModuleRecorder, *, p: Packed, length: int, idx: list[int], multimodal: bool):
    """The documents in the order ``idx``, right-padded together to ``length``: the step and each document's
    records, in document order."""
    if multimodal:
        step, per_doc = multimodal_batched(model, recorder, p, length, idx)
    else:
        step, per_doc = padded_batch_step(model, recorder, [p.docs[i] for i in idx], length)
    return step, [per_doc[idx.index(i)] for i in range(len(p.docs))]


def _copies(model: nn.Module, recorder: ModuleRecorder, *, docs, copies: int = COPIES):
    step = document_reference(model, docs, recorder=recorder, copies=copies)
    return step, step.records


def _few_set_by_baseline(base: Baseline, truth: StepResult, dtype: str) -> list[str]:
    """The gradients of at most ``FEW`` numbers whose limit the baseline sets (``factor x baseline`` above the
    ``floor x spread`` of :func:`verify.model.judge.limit`; float32: 2 and 4e-6), in parameter order."""
    tol = TOLERANCES[dtype]
    return [n for n, g in truth.grads.items() if g.size <= FEW
            and tol.factor * base.params.get(n, 0.0) > tol.floor * max(1.0, truth.spread.get(n, 1.0))]


def _merged(a: Baseline, b: Baseline) -> Baseline:
    return Baseline(f"{a.what}; {b.what}", _worst(a.params, b.params), max(a.loss, b.loss), _worst(a.out, b.out),
                    _worst(a.inp, b.inp))
