"""One case on one rank: a small attention block run three ways, then compared.

The block: ``inputs_embeds [B, S, E]`` -> projections ``q, k, v`` -> attention -> output projection to a
small vocabulary -> summed cross-entropy against labels with ``-100`` on padding and at random positions.

1. reference: float64, single device, ``blockdiag_ref.reference_attention``;
2. baseline (dtypes below float64): the case's dtype, single device, stock SDPA with the dense
   per-document mask, once on every SDPA backend of the device; the worst error against the reference sets
   the tolerance (see ``tolerances.py``). Stock SDPA has no sinks and no soft-cap: for those variants the
   ``math`` baseline is explicit-score math in the case's dtype (transformers' eager attention: scores and
   the weighted sum in the dtype, soft-cap and softmax in float32), and on CPU ``flash_attention`` is the
   fused kernel with the sinks joined through an explicit logsumexp (soft-cap: refused, the fused kernel has
   none);
3. implementation: the case's dtype, CP-sharded through ``make_cp_blockdiag_batch_and_ctx`` and
   ``cp_blockdiag_sdpa`` of the module under test (on the SDPA backend the case forces, if any).

Each compared quantity reports its error, the baseline error per backend, and the error the implementation
inherits from its kernel: the baseline error of the backend it ran on (the forced one, else torch's default
choice for the baseline's inputs).

Every rank builds the same inputs from one seeded generator (nothing is broadcast) and checks its own rows:
outputs of real rows; padding rows exactly 0; grads of q, k, v (padding rows exactly 0); and, summed over
ranks, grads of ``inputs_embeds`` through the differentiable slice, grads of the projection weights and the
loss. When the module reports its exchange (a step state with ``traffic`` and ``comm_report``), the bytes it
moved are checked against its plan, and the tokens that arrived from each rank against the minimum computed
from the reference mask (``exchange_check.py``, in the parent).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from blockdiag_ref import DocLayout, reference_attention, temperature_scale

from .case_io import Metrics, impl_batch, summed_over_ranks
from .cases import SOURCES, TEMPERATURE_ATTN_SCALE, Case, Support, case_blocks
from .tolerances import BASELINE_BACKENDS, STAND_INS, sdpa_backend

__all__ = ["ImplInfo", "applicable", "case_exchange_plan", "check_case", "compared_on_ranks", "expected_results", "impl_info", "pack_expected", "run_case", "summed_metrics"]

VOCAB = 11
VARIANT_KWARGS = {"sinks": "sinks", "softcap": "softcap", "chunk": "chunk_size",  # Case variant -> sdpa keyword
                  "temperature": "temperature", "bidirectional": "bidirectional_blocks"}


class ImplInfo:
    """What a module under test offers: the two seed functions, plus optional keyword options."""

    def __init__(self, module_name: str):
        from .adapters import OURS, module_path

        self.name = module_name
        self.module = importlib.import_module(module_path(module_name))
        unavailable = getattr(self.module, "UNAVAILABLE", None)
        if unavailable:
            raise ValueError(f"--impl {module_name}: unavailable here: {unavailable}")
        self.conventions = getattr(self.module, "CONVENTIONS", OURS)
        for fn in ("make_cp_blockdiag_batch_and_ctx", "cp_blockdiag_sdpa"):
            if not callable(getattr(self.module, fn, None)):
                raise ValueError(f"--impl {module_name}: expected a module exposing {fn}(), it has none")
        self.make = self.module.make_cp_blockdiag_batch_and_ctx
        self.sdpa = self.module.cp_blockdiag_sdpa
        self.make_params = set(inspect.signature(self.make).parameters)
        self.options = {o for o in ("kernel", "kv_exchange", "layout") if o in self.make_params}
        sdpa_params = set(inspect.signature(self.sdpa).parameters)
        self.windows = "window_size" in sdpa_params
        # bidirectional blocks are the step's: the batch function takes them too
        self.variants = {v for v, kw in VARIANT_KWARGS.items()
                         if kw in sdpa_params and (v != "bidirectional" or kw in self.make_params)}
        self.whole_blocks = "bidirectional" in self.variants and "whole_blocks" in sdpa_params  # a modifier of them
        self.sources = tuple(self.conventions.sources)  # the doc-id sources it declares (all, unless it says)
        from .families import SPECS

        self.mixers = {layer for layer, s in SPECS.items() if callable(getattr(self.module, s.function_name, None))}

    def supports(self, case: Case) -> bool:
        if case.layer != "attention":
            return case.layer in self.mixers and (case.layout is None or "layout" in self.options)
        wanted = {"kernel": case.kernel, "kv_exchange": case.exchange, "layout": case.layout}
        if any(v is not None and k not in self.options for k, v in wanted.items()):
            return False
        if not set(case.variants) <= self.variants or case.source not in self.sources:
            return False
        if case.whole_blocks and not self.whole_blocks:
            return False
        return case.window < 0 or self.windows

    def support(self) -> Support:
        """What the matrix must cover for this implementation (:func:`verify.cases.default_matrix`)."""
        sources = tuple(s for s in SOURCES if s in self.sources)
        if not sources:
            raise ValueError(f"--impl {self.name}: expected a doc-id source among {SOURCES} declared in its CONVENTIONS, "
                             f"got {self.sources!r}")
        return Support(sources=sources, windows=self.windows, variants=tuple(self.variants))


def applicable(info, case: Case) -> bool:
    """Whether the implementation offers what the case asks for (halo only where every rank's needed set
    lies on its left neighbour)."""
    if not info.supports(case):
        return False
    if case.exchange == "halo":  # many cases of a matrix share these (648 checks, 188 distinct in make verify's)
        return _halo_ok(case.rows, case.cp, case.layout or "contiguous", case.window, case.chunk, case.bidirectional,
                        case.whole_blocks)
    return True


@functools.lru_cache(maxsize=1024)
def _halo_ok(rows, cp: int, layout: str, window: int, chunk: int, bidirectional: bool, whole_blocks: bool) -> bool:
    case = Case(rows=rows, cp=cp, window=window, chunk=chunk, bidirectional=bidirectional, whole_blocks=whole_blocks)
    return case_exchange_plan(case, layout).halo_ok


def case_exchange_plan(case: Case, layout: str | None = None):
    """The attention exchange's plan of a case's step, as the implementation builds it: its chunks, its window, its
    bidirectional blocks (a block crossing a rank edge needs keys from the right), under ``layout`` (default: the
    case's)."""
    from blockdiag_dist.plan import plan_step

    plan = plan_step(torch.tensor(case.doc_ids()), case.cp, layout or case.layout or "contiguous").chunked(case.chunk)
    if not case.bidirectional:
        return plan.exchange(case.window)
    from blockdiag_dist.bidirectional import exchange_plan, plan_blocks

    blocks = plan_blocks(plan.layout, plan.shards, plan.documents, torch.tensor(case.blocks()))
    return exchange_plan(plan, case.window, blocks, case.whole_blocks)


_impls: dict[str, ImplInfo] = {}


def impl_info(module_name: str) -> ImplInfo:
    if module_name not in _impls:
        _impls[module_name] = ImplInfo(module_name)
    return _impls[module_name]


# ---- inputs ---------------------------------------------------------------------------------------------
def make_inputs(case: Case) -> dict[str, Tensor]:
    """float64 master inputs, identical on every rank (one seeded generator)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    B, S, E = case.batch_size, case.seq_len, case.hidden
    ids = torch.tensor(case.doc_ids(), dtype=torch.int64)
    f64 = torch.float64

    def w(*shape: int, gain: float = 1.0) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=f64) * (gain / math.sqrt(shape[0]))

    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    labels[(torch.rand(B, S, generator=g) < 0.2) | (ids == 0)] = -100
    inputs = {
        "doc_ids": ids,
        "x": torch.randn(B, S, E, generator=g, dtype=f64),
        "wq": w(E, case.hq * case.dim, gain=case.gain),
        "wk": w(E, case.hkv * case.dim, gain=case.gain),
        "wv": w(E, case.hkv * case.dim),
        "wo": w(case.hq * case.dim, VOCAB),
        "labels": labels,
    }
    if case.sinks:  # drawn last: a case without sinks keeps the inputs it always had
        inputs["sinks"] = torch.randn(case.hq, generator=g, dtype=f64) * 2.0
    return inputs


def _variant_kwargs(case: Case, ws: dict[str, Tensor]) -> dict[str, Any]:
    """The case's attention variants as keywords of ``reference_attention`` / ``cp_blockdiag_sdpa``."""
    out: dict[str, Any] = {}
    if case.sinks:
        out["sinks"] = ws["sinks"]
    if case.softcap > 0:
        out["softcap"] = case.softcap
    if case.chunk > 0:
        out["chunk_size"] = case.chunk
    if case.temperature > 0:
        out["temperature"] = (case.temperature, TEMPERATURE_ATTN_SCALE)
    if case.bidirectional:  # the reference takes the block ids; under a step a call asks for the step's (True)
        out["bidirectional_blocks"] = torch.tensor(case.blocks(), dtype=torch.int64)
    if case.whole_blocks:
        out["whole_blocks"] = True
    return out


def _block(case: Case, x: Tensor, ws: dict[str, Tensor], labels: Tensor, attend) -> dict[str, Tensor]:
    """Run the block; returns q, k, v (grads retained), out and loss."""
    B, L, _ = x.shape
    q = (x @ ws["wq"]).view(B, L, case.hq, case.dim).transpose(1, 2)
    k = (x @ ws["wk"]).view(B, L, case.hkv, case.dim).transpose(1, 2)
    v = (x @ ws["wv"]).view(B, L, case.hkv, case.dim).transpose(1, 2)
    for t in (q, k, v):
        t.retain_grad()
    out = attend(q, k, v)
    logits = out.transpose(1, 2).reshape(B, L, case.hq * case.dim) @ ws["wo"]
    loss_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    loss = F.cross_entropy(logits.reshape(-1, VOCAB).to(loss_dtype), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return {"q": q, "k": k, "v": v, "out": out, "loss": loss}


def _leaves(inputs: dict[str, Tensor], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, dict[str, Tensor]]:
    """Fresh leaves for one run (never the master tensors: runs must not share gradients)."""

    def leaf(t: Tensor) -> Tensor:
        return t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_()

    return leaf(inputs["x"]), {k: leaf(inputs[k]) for k in ("wq", "wk", "wv", "wo", "sinks") if k in inputs}


def _forced(backend: str | None):
    """Context forcing one SDPA backend (None: torch's own choice)."""
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([sdpa_backend(backend)])


def _single_device(
    case: Case, inputs: dict[str, Tensor], dtype: torch.dtype, device: torch.device, reference: bool,
    backend: str | None = None, per_rank: int = 1,
) -> dict:
    """The case's block on one device: the float64 reference (``reference``), or stock SDPA with the dense
    per-document mask on ``backend`` in ``dtype``; with ``per_rank`` > 1, one SDPA call per CP rank's rows, its
    ``L`` queries against the whole row's keys padded to ``per_rank * L`` (the shape of a CP rank's call). The
    reference of a case with sinks also gives ``dsinks_terms``: the sum of the magnitudes of the sinks' gradient's
    terms, per head, the largest (the scale of its limit, :func:`summed_metrics`)."""
    window = (case.window, 0) if case.window >= 0 else None
    x, ws = _leaves(inputs, dtype, device)
    variants = _variant_kwargs(case, ws)
    if reference:
        layout = DocLayout.from_doc_ids(inputs["doc_ids"])

        def attend(q, k, v):
            return reference_attention(q, k, v, layout, enable_gqa=True, window_size=window, **variants)
    else:
        mask, pad = _dense_mask(inputs["doc_ids"], case.window, case.chunk, case.bidirectional, case.whole_blocks)
        mask, pad = mask.to(device), pad.to(device)
        sinks, softcap = variants.get("sinks"), variants.get("softcap")
        if sinks is not None or softcap is not None:
            attend = _variant_baseline(backend, device, mask, pad, sinks, softcap)
        else:
            # padding rows see their row's first key: no row fully masked (CUDA backends may give NaN there);
            # their output is replaced by 0, so they take and give exactly 0 gradient
            sdpa_mask = mask | (pad & (torch.arange(mask.shape[-1], device=device) == 0))

            def attend(q, k, v):
                if per_rank > 1:
                    return torch.where(pad, 0.0, _per_rank_sdpa(q, k, v, sdpa_mask, per_rank, backend))
                with _forced(backend):
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=True)
                return torch.where(pad, 0.0, o)
        if "temperature" in variants:  # the query scaled as the model scales it, by its position in its document
            scale = temperature_scale(DocLayout.from_doc_ids(inputs["doc_ids"]).doc_positions, *variants["temperature"])
            scale, unscaled = scale.to(device)[:, None, :, None], attend

            def attend(q, k, v):
                return unscaled((q * scale).to(q.dtype), k, v)

    res = _block(case, x, ws, inputs["labels"].to(device), attend)
    terms = reference and "sinks" in ws
    if terms:
        res["out"].retain_grad()
    with _forced(backend):
        res["loss"].backward(retain_graph=terms)
    extra = {}
    if terms:
        # the sinks' gradient sums one term per query and head, -p_sink * (dO . O), which may cancel: linear in dO,
        # so the sum of their magnitudes is the gradient again with each query's dO signed by its dO . O
        d_out = res["out"].grad
        signed = d_out * torch.sign((d_out * res["out"].detach()).sum(-1, keepdim=True))
        (magnitude,) = torch.autograd.grad(res["out"], ws["sinks"], grad_outputs=signed)
        extra["dsinks_terms"] = magnitude.abs().max()
    return {
        "out": res["out"].detach(), "loss": res["loss"].detach(), "x": x.grad,
        **{f"d{n}": res[n].grad for n in ("q", "k", "v")}, **{f"d{n}": ws[n].grad for n in ws}, **extra,
    }


def _per_rank_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, world: int, backend: str | None) -> Tensor:
    """Stock SDPA as a CP rank calls it: each rank's ``L = ceil(S / world)`` queries against the row's keys padded to
    ``world * L`` (the padding masked), one call per rank, the outputs concatenated: ``q [B, H, S, D]``, ``mask
    [B, 1, S, S]`` -> ``[B, H, S, Dv]``."""
    S = q.shape[2]
    L = -(-S // world)
    extra = world * L - S
    k, v, mask = F.pad(k, (0, 0, 0, extra)), F.pad(v, (0, 0, 0, extra)), F.pad(mask, (0, extra))
    outs = []
    with _forced(backend):
        for a in range(0, S, L):
            outs.append(F.scaled_dot_product_attention(q[:, :, a : a + L], k, v, attn_mask=mask[:, :, a : a + L], enable_gqa=True))
    return torch.cat(outs, dim=2)


def _dense_mask(doc_ids: Tensor, window: int, chunk: int, bidirectional: bool = False,
                whole_blocks: bool = False) -> tuple[Tensor, Tensor]:
    """The baseline's dense per-document mask ``[B, 1, S, S]`` and padding rows ``[B, 1, S, 1]`` (bool, host),
    computed once per distinct (doc ids, window, chunk): every baseline backend and the many cases of a matrix
    that share a layout reuse them (read only)."""
    ids = doc_ids.detach().cpu()
    return _dense_mask_of(str(ids.dtype), tuple(ids.shape), tuple(ids.flatten().tolist()), window, chunk, bidirectional,
                          whole_blocks)


@functools.lru_cache(maxsize=128)
def _dense_mask_of(dtype: str, shape: tuple, flat: tuple, window: int, chunk: int,
                   bidirectional: bool = False, whole_blocks: bool = False) -> tuple[Tensor, Tensor]:
    ids = torch.tensor(flat, dtype=getattr(torch, dtype.removeprefix("torch."))).view(shape)
    layout = DocLayout.from_doc_ids(ids)
    blocks = torch.tensor(case_blocks(ids.tolist()), dtype=torch.int64) if bidirectional else None
    mask = layout.materialize_mask(window_size=(window, 0) if window >= 0 else None, chunk_size=chunk if chunk > 0 else None,
                                   bidirectional_blocks=blocks, whole_blocks=whole_blocks)
    return mask, layout.padding_mask[:, None, :, None]


def _variant_baseline(backend: str | None, device: torch.device, mask: Tensor, pad: Tensor, sinks: Tensor | None,
                      softcap: float | None):
    """Single-device attention with sinks / a soft-cap in the case's dtype, as a stock computation would run it:
    ``math``: explicit scores (transformers' eager attention); ``flash_attention`` on CPU (sinks only): the
    fused kernel, the sinks joined by ``out * sigmoid(lse - sink)`` with ``lse`` from explicit scores. Other backends raise (the baseline names them refused)."""
    if backend == "math":
        def attend(q, k, v):
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            scores = scores.float()
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mask, -math.inf).masked_fill(pad, 0.0)  # padding rows: finite, zeroed
            if sinks is not None:
                sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
                probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
            else:
                probs = torch.softmax(scores, -1)
            return torch.where(pad, 0.0, probs.to(q.dtype) @ v)
        return attend
    if backend == "flash_attention" and device.type == "cpu" and softcap is None:
        visible = mask | (pad & torch.eye(mask.shape[-1], dtype=torch.bool, device=device))  # no empty row

        def attend(q, k, v):
            with _forced(backend):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
            g = q.shape[1] // k.shape[1]
            scores = (q @ k.repeat_interleave(g, 1).transpose(-2, -1)) / math.sqrt(q.shape[-1])
            lse = torch.logsumexp(scores.masked_fill(~visible, -math.inf), -1, keepdim=True)
            o = o * torch.sigmoid(lse - sinks.view(1, -1, 1, 1).to(lse.dtype))  # = exp(lse - logaddexp(lse, sink))
            return torch.where(pad, 0.0, o)
        return attend
    what = "soft-capping" if softcap is not None else "sinks"
    raise RuntimeError(f"SDPA backend {backend} on {device.type}: no {what} (stock SDPA has none)")


# ---- the implementation under CP ----------------------------------------------------------------------
def _run_impl(case: Case, impl: ImplInfo, inputs: dict[str, Tensor], dtype, device, cp_mesh) -> dict:
    x, ws = _leaves(inputs, dtype, device)
    batch = impl_batch(case, inputs, x, device)
    opts = {k: v for k, v in (("kernel", case.kernel), ("kv_exchange", case.exchange), ("layout", case.layout)) if v}
    if "window_sizes" in impl.make_params:  # the window the call uses, planned by the batch function; chunked and
        # bidirectional calls plan theirs on first use (the batch function's windows are plain ones)
        plain = case.chunk <= 0 and not case.bidirectional
        opts["window_sizes"] = [(case.window, 0) if case.window >= 0 else None] if plain else []
    if case.bidirectional:
        opts["bidirectional_blocks"] = torch.tensor(case.blocks(), dtype=torch.int64, device=device)
    train_ctx, batch = impl.make(cp_mesh, None, batch, **opts)
    sdpa_kwargs: dict[str, Any] = {"is_causal": True, "enable_gqa": case.hq != case.hkv}
    if case.window >= 0:
        sdpa_kwargs["window_size"] = (case.window, 0)
    variants = _variant_kwargs(case, ws)
    sinks = variants.pop("sinks", None)
    if case.bidirectional:
        variants["bidirectional_blocks"] = True
    sdpa_kwargs.update(variants)

    def attend(q: Tensor, k: Tensor, v: Tensor, *s: Tensor) -> Tensor:
        return impl.sdpa(q, k, v, **sdpa_kwargs, **({"sinks": s[0]} if s else {}))

    extra = () if sinks is None else (sinks,)
    if case.checkpoint != "none":  # recomputed during backward, on autograd's threads
        plain = attend

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return torch.utils.checkpoint.checkpoint(plain, q, k, v, *extra, use_reentrant=case.checkpoint == "reentrant")
    elif extra:
        plain = attend

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return plain(q, k, v, *extra)

    with train_ctx(), _forced(case.backend):
        res = _block(case, batch["inputs_embeds"], ws, batch["labels"], attend)
        res["loss"].backward()
    state = getattr(train_ctx, "state", None)
    return {
        "res": res, "x": x, "ws": ws, "positions": batch["position_ids"], "padding": batch["padding_mask"],
        "state": state,
    }


# ---- comparison -----------------------------------------------------------------------------------------
def _heads_view(t: Tensor) -> Tensor:
    """[B, H, L, D] -> [B, L, H, D] so that row selection by (b, l) keeps heads and dims together."""
    return t.transpose(1, 2)


def expected_results(
    case: Case, device: torch.device | str = "cpu", inputs: dict[str, Tensor] | None = None,
    restore: Callable[[dict], dict] | None = None,
) -> dict[str, Any]:
    """The reference (float64) and, below float64, the single-device baseline of a case on every SDPA backend
    of the device: ``{"ref": results, "base": {backend: results} | None, "default_backend": name | None,
    "refused": {backend: message}, "stood_in": {backend: device}}`` (a refused backend of ``STAND_INS`` run on
    another device). ``inputs`` replaces the case's own (e.g. reordered tokens) and
    ``restore`` maps each result back (both for re-checks under another convention, ``verify.classify``).
    A mixer case's are :func:`verify.mixers.mixer_expected`'s."""
    if case.layer != "attention":
        from .mixers import mixer_expected

        return mixer_expected(case, device, inputs, restore)
    device = torch.device(device)
    inputs = make_inputs(case) if inputs is None else inputs
    restore = restore or (lambda res: res)
    ref = restore(_single_device(case, inputs, torch.float64, device, reference=True))
    if case.dtype == "float64":
        return {"ref": ref, "base": None, "default_backend": None, "refused": {}}
    dtype = getattr(torch, case.dtype)
    base, refused, stood_in = {}, {}, {}
    # a fused kernel's rounding depends on the call's shape (torch's CPU kernel loses float32 precision in dV on a
    # call with more keys than queries): under CP a rank's queries meet the row's keys, so the fused backends are
    # also run as a rank calls them (the math backend's rounding does not depend on it; the variants with sinks or
    # a soft-cap run explicit scores)
    per_rank = case.cp > 1 and not case.sinks and not case.softcap > 0
    for backend in BASELINE_BACKENDS.get(device.type, ("math",)):
        try:
            base[backend] = restore(_single_device(case, inputs, dtype, device, reference=False, backend=backend))
        except RuntimeError as exc:  # this backend refuses these inputs: a user gets it only for maskless calls
            refused[backend] = str(exc).splitlines()[0]
            where, dtypes = STAND_INS.get(device.type, {}).get(backend, (None, ()))
            if where is not None and case.dtype in dtypes:  # ... whose rounding the same algorithm elsewhere shows
                try:
                    res = restore(_single_device(case, inputs, dtype, torch.device(where), reference=False, backend=backend))
                except RuntimeError as again:
                    refused[backend] += f"; on {where} too: " + str(again).splitlines()[0]
                    continue
                base[backend] = _tensors(res, lambda t: None if t is None else t.to(device))
                stood_in[backend] = where
            continue
        if per_rank and backend != "math":
            try:
                base[f"{backend} per rank"] = restore(_single_device(case, inputs, dtype, device, reference=False,
                                                                     backend=backend, per_rank=case.cp))
            except RuntimeError as exc:  # refused on a rank's shape: not a kernel a rank can be given there
                refused[f"{backend} per rank"] = str(exc).splitlines()[0]
    # soft-capped cases: no SDPA backend computes them; the baseline and the implementation run explicit scores
    default = "math" if case.softcap > 0 else _default_backend(case, dtype, device)
    return {"ref": ref, "base": base, "default_backend": default, "refused": refused, "stood_in": stood_in}


def _default_backend(case: Case, dtype: torch.dtype, device: torch.device) -> str | None:
    """The backend torch picks by itself for the baseline's SDPA call (same shapes, dtype and mask kind);
    None if this torch cannot say."""
    from torch.nn.attention import SDPBackend

    q = torch.zeros(case.batch_size, case.hq, case.seq_len, case.dim, dtype=dtype, device=device)
    k = torch.zeros(case.batch_size, case.hkv, case.seq_len, case.dim, dtype=dtype, device=device)
    mask = torch.ones(case.seq_len, case.seq_len, dtype=torch.bool, device=device)
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, k, mask, 0.0, False, enable_gqa=True)).name.lower()
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _tensors(v: dict | None, fn) -> dict | None:
    return None if v is None else {n: fn(t) for n, t in v.items()}


def compared_on_ranks(case: Case) -> tuple[str, ...]:
    """The quantities of :func:`expected_results` a rank compares itself (:func:`check_case`); the others are
    summed over ranks and compared by whoever merges them (:func:`summed_metrics`)."""
    if case.layer != "attention":
        from .families import spec

        return ("out", *(f"d{n}" for n in spec(case.layer).inputs))
    return ("out", "dq", "dk", "dv")


def pack_expected(expected: dict, names: tuple[str, ...] | None = None) -> dict:
    """Plain numpy arrays, to travel to the workers by value (no shared-memory tensors); ``names``: only these
    quantities (default: all). numpy has no bfloat16: such tensors travel as float32, which holds every
    bfloat16 value exactly."""

    def array(t: Tensor):
        t = t.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()

    def pick(res: dict) -> dict:
        return res if names is None else {n: res[n] for n in names}

    base = expected["base"]
    return {**expected, "ref": _tensors(pick(expected["ref"]), array),
            "base": None if base is None else {b: _tensors(pick(r), array) for b, r in base.items()}}


def unpack_expected(packed: dict) -> dict:
    base = packed["base"]
    return {**packed, "ref": _tensors(packed["ref"], torch.from_numpy),
            "base": None if base is None else {b: _tensors(r, torch.from_numpy) for b, r in base.items()}}


def check_case(
    case: Case, impl: ImplInfo, cp_mesh, rank: int, world: int, device: torch.device, expected: dict | None = None
) -> dict:
    """Run the implementation on this rank and compare with ``expected`` (computed here when not given)."""
    expected = unpack_expected(pack_expected(expected_results(case, device)) if expected is None else expected)
    if case.layer != "attention":
        from .mixers import check_mixer_case

        return check_mixer_case(case, impl, cp_mesh, rank, world, device, expected)
    dtype = getattr(torch, case.dtype)
    inputs = make_inputs(case)
    ref, base = expected["ref"], expected["base"]  # host tensors: every comparison runs on the host
    used = case.backend or expected["default_backend"]
    run = _run_impl(case, impl, inputs, dtype, device, cp_mesh)
    res = run["res"]
    m = Metrics(case.dtype)

    def host(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().cpu()

    pos = run["positions"].to(torch.int64).cpu()
    pos = pos[0] if pos.dim() == 3 else pos  # [B, L]
    padding = run["padding"].to(torch.bool).cpu()
    B = case.batch_size
    b_idx = torch.arange(B)[:, None].expand_as(pos)
    real = ~padding
    rb, rp = b_idx[real], pos[real]  # global (row, position) of this rank's real rows

    def rows_of(full: Tensor | None) -> Tensor | None:
        return None if full is None else _heads_view(full)[rb, rp]

    def base_rows(name: str) -> dict[str, Tensor] | None:
        return None if base is None else {b: rows_of(r[name]) for b, r in base.items()}

    out_local = _heads_view(host(res["out"]))
    # the scale of the whole case's output, not of this rank's rows: a verdict must not depend on how the rows are split
    m.close("out", out_local[real], rows_of(ref["out"]), base_rows("out"), ref["out"].abs().max().item(), used)
    m.exact_zero("out_padding_rows", out_local[padding])
    qkv_scale = max(ref[f"d{n}"].abs().max().item() for n in ("q", "k", "v"))
    for n in ("q", "k", "v"):
        g = host(res[n].grad)
        m.close(f"d{n}", None if g is None else _heads_view(g)[real], rows_of(ref[f"d{n}"]), base_rows(f"d{n}"), qkv_scale, used)
        m.exact_zero(f"d{n}_padding_rows", None if g is None else _heads_view(g)[padding])

    # this rank's contributions to quantities summed over ranks; whoever merges the ranks adds them up
    partials = {"dinputs_embeds": run["x"].grad, "loss": res["loss"].detach()}
    partials.update({f"dW{n[1]}": run["ws"][n].grad for n in ("wq", "wk", "wv", "wo")})
    if case.sinks:
        partials["dsinks"] = run["ws"]["sinks"].grad

    state = run["state"]
    info: dict[str, Any] = {"rank": rank}
    if state is not None and hasattr(state, "traffic") and hasattr(state, "comm_report"):
        bytes_per_token = case.hkv * 2 * case.dim * torch.empty((), dtype=dtype).element_size()
        chunk = {"chunk": case.chunk} if case.chunk > 0 else {}
        if case.bidirectional:
            chunk["bidirectional"] = True
        if case.whole_blocks:
            chunk["whole_blocks"] = True
        report = state.comm_report(case.window, bytes_per_token=bytes_per_token, **chunk)
        fwd = state.traffic.totals("forward")  # one call per forward (two under checkpointing: the recompute)
        bwd = state.traffic.totals("backward")
        calls = max(fwd["calls"], 1)
        m.equal("recv_bytes_fwd", fwd["recv_bytes"], calls * report["recv"][rank])
        m.equal("sent_bytes_fwd", fwd["sent_bytes"], calls * report["sent"][rank])
        m.equal("recv_bytes_bwd", bwd["recv_bytes"], bwd["calls"] * report["sent"][rank])
        info.update(mode=report["mode"], reason=report["reason"], notes=list(getattr(state, "notes", [])))
        # what arrived, checked by the parent against the reference mask (verify.exchange_check)
        info["arrived"] = [list(e.recv_by_source) for e in state.traffic.entries if e.phase == "forward"]
        info["real_positions"] = torch.stack([rb, rp], 1).tolist()
        info["local_tokens"] = int(pos.numel())
    info["metrics"] = m.rows
    info["partials"] = {k: None if t is None else t.detach().double().cpu().numpy() for k, t in partials.items()}
    return info


SUMMED = (("dinputs_embeds", "x"), ("dWq", "dwq"), ("dWk", "dwk"), ("dWv", "dwv"), ("dWo", "dwo"), ("loss", "loss"))


def summed_metrics(case: Case, per_rank: list[dict], expected: dict) -> dict[str, dict[str, Any]]:
    """Check the quantities summed over ranks (grads of inputs_embeds and of the weights, the loss): the sum
    of every rank's contribution, in float64 and rank order, against the reference. A rank whose part never
    received a gradient contributes nothing; no gradient on any rank fails."""
    if case.layer != "attention":
        from .mixers import mixer_summed_metrics

        return mixer_summed_metrics(case, per_rank, expected)
    ref, base = expected["ref"], expected["base"]
    used = case.backend or expected.get("default_backend")
    m = Metrics(case.dtype)
    # the magnitudes rounding is scaled by, where not the quantity's own: the weights' gradients, the largest of
    # them; the sinks' gradient, a sum over the queries whose terms may cancel, the sum of the terms' magnitudes
    # (computed with the reference; python -m verify fuzz --max-len 80 --seed 20261222: 0.0144 from terms of 1.04)
    w_scale = max(ref[k].abs().max().item() for k in ("dwq", "dwk", "dwv", "dwo"))
    group = {**dict.fromkeys(("dwq", "dwk", "dwv", "dwo"), w_scale),
             "dsinks": float(ref["dsinks_terms"]) if "dsinks_terms" in ref else 0.0}
    for label, key in SUMMED + ((("dsinks", "dsinks"),) if case.sinks else ()):
        got = summed_over_ranks(per_rank, label, ref[key])
        bases = None if base is None else {b: r[key] for b, r in base.items()}
        m.close(label, got, ref[key], bases, group.get(key, 0.0), used)
        if label.startswith("dW") or label == "dsinks":
            m.on_every_rank(label, per_rank)
    return m.rows


# ---- entry points for pool workers and torchrun ----------------------------------------------------------
def warm_up() -> None:
    """Pay one-time costs at pool start instead of in the first case: the first non-reentrant checkpoint
    imports torch._dynamo (about a second); the project's implementation and the mixer cases' modules are
    imported here too (a few tenths of a second per rank)."""
    import blockdiag_dist  # noqa: F401

    from . import mixers  # noqa: F401

    x = torch.ones(1, requires_grad=True)
    torch.utils.checkpoint.checkpoint(torch.mul, x, x, use_reentrant=False).backward()

def _env():
    from .pool import worker_info

    env = worker_info()
    if env:
        return env["cp_mesh"], env["rank"], env["world"], torch.device(env["device_type"])
    from .launch import torchrun_env

    return torchrun_env()


def run_case(case_dict: dict, impl_name: str, expected: dict | None = None) -> dict:
    """Run one case on this rank (inside a pool worker or a torchrun process); ``expected`` is
    :func:`pack_expected` output computed by the parent, or None to compute it here. The result's ``cpu_s`` is the
    CPU time the rank's process took for the case, its collectives' threads included."""
    cpu = time.process_time()
    cp_mesh, rank, world, device = _env()
    case = case_from_dict(case_dict)
    if case.cp != world:
        raise ValueError(f"case needs CP {case.cp}, this group has {world} ranks")
    info = check_case(case, impl_info(impl_name), cp_mesh, rank, world, device, expected)
    info["cpu_s"] = time.process_time() - cpu
    return info


def case_from_dict(d: dict) -> Case:
    from .cases import parse_rows

    d = dict(d)
    d["rows"] = parse_rows(d["rows"]) if isinstance(d["rows"], str) else d["rows"]
    return Case(**d)
