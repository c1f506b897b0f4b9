"""One mixer case on one rank: a small block around a sequence mixer of hybrid models, run three ways, compared.

The blocks (``case.layer``), one per mixer family: :data:`verify.families.SPECS` (``conv``, ``gated_delta``,
``mamba2``, ...), each the family's mixer between small projections and a read-out to a small vocabulary, summed
cross-entropy.

1. reference: float64, single device, the family's reference (``blockdiag_ref.reference_causal_conv``,
   ``reference_gated_delta_rule``, ...: token by token per document);
2. baseline (below float64): the same reference computation in the case's dtype, single device (the
   tolerance rule of ``tolerances.py``: at most twice its error, plus a floor);
3. implementation: the case's dtype, CP-sharded through ``make_cp_blockdiag_batch_and_ctx`` and the module's
   function of the family (``causal_conv``, ``gated_delta_rule``, ...), with the case's layout and activation
   checkpointing.

Per rank: outputs of real rows, padding rows exactly 0, the gradient of the mixer's inputs (the spec's
``inputs``), padding rows exactly 0; summed over ranks: grads of ``inputs_embeds``, of every weight (the convolution's
included) and the loss. A module reporting its mixers' traffic (``state.mixer_traffic``) is checked against its
plan: the elements each forward received (and, for a family whose inputs travel in the attention's exchange,
``sparse``, the spec's own check of that exchange: the needed bytes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from .case_io import Metrics, impl_batch, summed_over_ranks
from .cases import Case
from .families import VOCAB, sizes, spec, weight_maker

__all__ = ["BASELINE", "check_mixer_case", "mixer_expected", "mixer_inputs", "mixer_summed_metrics"]

BASELINE = "reference-in-dtype"


def mixer_inputs(case: Case) -> dict[str, Tensor]:
    """float64 master inputs, identical on every rank (one seeded generator)."""
    g = torch.Generator().manual_seed(2000 + case.seed)
    B, S = case.batch_size, case.seq_len
    ids = torch.tensor(case.doc_ids(), dtype=torch.int64)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    labels[(torch.rand(B, S, generator=g) < 0.2) | (ids == 0)] = -100
    out = {"doc_ids": ids, "x": torch.randn(B, S, case.hidden, generator=g, dtype=torch.float64), "labels": labels}
    sp = spec(case.layer)
    ws = sp.weights(case, weight_maker(g), sizes(case))
    assert tuple(ws) == sp.weight_names, (tuple(ws), sp.weight_names)
    out.update(ws)
    return out


def _block(case: Case, x: Tensor, ws: dict[str, Tensor], labels: Tensor, mix) -> dict[str, Tensor]:
    """The family's block, then the read-out and the loss; returns the mixer's inputs (grads retained), its output
    and the loss."""
    res, out, feats = spec(case.layer).block(case, x, ws, mix, sizes(case))
    logits = feats @ ws["wo"]
    loss_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    loss = F.cross_entropy(logits.reshape(-1, VOCAB).to(loss_dtype), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return {**res, "out": out, "loss": loss}


def _leaves(case: Case, inputs: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
    def leaf(t: Tensor) -> Tensor:
        return t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_()

    return leaf(inputs["x"]), {k: leaf(inputs[k]) for k in spec(case.layer).weight_names}


def _results(case: Case, res: dict, x: Tensor, ws: dict[str, Tensor]) -> dict[str, Tensor]:
    return {"out": res["out"].detach(), "loss": res["loss"].detach(), "x": x.grad,
            **{f"d{n}": res[n].grad for n in spec(case.layer).inputs}, **{f"d{n}": ws[n].grad for n in ws}}


def _single_device(case: Case, inputs: dict[str, Tensor], dtype: torch.dtype, device: torch.device) -> dict:
    ids = inputs["doc_ids"]
    x, ws = _leaves(case, inputs, dtype, device)
    family = spec(case.layer)
    mix = family.reference_mix(family.family.load("reference"), ids, dtype, case=case)
    res = _block(case, x, ws, inputs["labels"].to(device), mix)
    res["loss"].backward()
    out = _results(case, res, x, ws)
    # a row of padding only leaves the reference's outputs unconnected to its inputs: their gradient is zero
    leaves = {"x": x, **{f"d{n}": res[n] for n in spec(case.layer).inputs}, **{f"d{n}": ws[n] for n in ws}}
    return {k: (torch.zeros_like(leaves[k]) if v is None else v) for k, v in out.items()}


def mixer_expected(case: Case, device: torch.device | str = "cpu", inputs: dict[str, Tensor] | None = None,
                   restore=None) -> dict[str, Any]:
    """The float64 reference and, below float64, the reference computation in the case's dtype (the baseline),
    in :func:`verify.runner.expected_results`' format (one baseline "backend")."""
    device = torch.device(device)
    inputs = mixer_inputs(case) if inputs is None else inputs
    restore = restore or (lambda r: r)
    ref = restore(_single_device(case, inputs, torch.float64, device))
    if case.dtype == "float64":
        return {"ref": ref, "base": None, "default_backend": None, "refused": {}}
    base = restore(_single_device(case, inputs, getattr(torch, case.dtype), device))
    return {"ref": ref, "base": {BASELINE: base}, "default_backend": None, "refused": {}}


def _run_impl(case: Case, impl, inputs: dict[str, Tensor], dtype, device, cp_mesh) -> dict:
    x, ws = _leaves(case, inputs, dtype, device)
    batch = impl_batch(case, inputs, x, device)
    opts = {"layout": case.layout} if case.layout else {}
    if "expect_attention" in impl.make_params:
        opts["expect_attention"] = False
    train_ctx, batch = impl.make(cp_mesh, None, batch, **opts)
    family = spec(case.layer)
    mix = family.impl_mix(getattr(impl.module, family.function_name), case=case, batch=batch, device=device, dtype=dtype)
    if case.checkpoint != "none":
        plain = mix

        def mix(*tensors):
            return torch.utils.checkpoint.checkpoint(plain, *tensors, use_reentrant=case.checkpoint == "reentrant")

    with train_ctx():
        res = _block(case, batch["inputs_embeds"], ws, batch["labels"], mix)
        res["loss"].backward()
    return {"res": res, "x": x, "ws": ws, "positions": batch["position_ids"], "padding": batch["padding_mask"],
            "state": getattr(train_ctx, "state", None)}


def _expected_elements(case: Case, state, rank: int) -> int | None:
    """Elements this rank's mixer receives per forward by its plan (None when the plan moves nothing)."""
    return spec(case.layer).received(case, state, rank, sizes(case))


def check_mixer_case(case: Case, impl, cp_mesh, rank: int, world: int, device: torch.device, expected: dict) -> dict:
    """Run the mixer case on this rank and compare with ``expected`` (unpacked)."""
    dtype = getattr(torch, case.dtype)
    inputs = mixer_inputs(case)
    ref, base = expected["ref"], expected["base"]
    run = _run_impl(case, impl, inputs, dtype, device, cp_mesh)
    res = run["res"]
    m = Metrics(case.dtype)
    pos = run["positions"].to(torch.int64).cpu()
    padding = run["padding"].to(torch.bool).cpu()
    real = ~padding
    b_idx = torch.arange(case.batch_size)[:, None].expand_as(pos)
    rb, rp = b_idx[real], pos[real]

    def rows(full: Tensor | None) -> Tensor | None:
        return None if full is None else full[rb, rp]

    def base_rows(name: str) -> dict[str, Tensor] | None:
        return None if base is None else {b: rows(r[name]) for b, r in base.items()}

    out = res["out"].detach().cpu()
    # the scale of the whole case's output, not of this rank's rows: a verdict must not depend on how the rows are split
    m.close("out", out[real], rows(ref["out"]), base_rows("out"), ref["out"].abs().max().item())
    m.exact_zero("out_padding_rows", out[padding])
    names = spec(case.layer).inputs
    group = max(ref[f"d{n}"].abs().max().item() for n in names)
    for n in names:
        g = res[n].grad
        g = None if g is None else g.detach().cpu()
        m.close(f"d{n}", None if g is None else g[real], rows(ref[f"d{n}"]), base_rows(f"d{n}"), group)
        m.exact_zero(f"d{n}_padding_rows", None if g is None else g[padding])
    state = run["state"]
    info: dict[str, Any] = {"rank": rank}
    if state is not None and hasattr(state, "mixer_traffic"):
        fwd = [e for e in state.mixer_traffic.entries if e.phase == "forward"]
        want = _expected_elements(case, state, rank)
        calls = 2 if case.checkpoint != "none" else 1  # a checkpoint's recompute exchanges again
        m.equal("mixer_recv_elements_fwd", sum(e.recv_elements for e in fwd), 0 if want is None else calls * want)
        family = spec(case.layer)
        exchanges = family.exchange
        info["mode"] = "local" if want is None else exchanges
        if family.check_exchange is not None:  # an exchange outside the mixers' traffic (the attention's), by the spec
            info["mode"] = family.check_exchange(case, state, rank, m, calls, sizes(case))
        info["notes"] = list(getattr(state, "notes", []))
        if exchanges == "history":  # the history tokens that arrived, checked by the parent against the reference mask
            info["arrived"] = [list(e.recv_by_source) for e in fwd]
            info["real_positions"] = torch.stack([rb, rp], 1).tolist()
            info["local_tokens"] = int(pos.numel())
            info["window"] = case.width - 1
    partials = {"dinputs_embeds": run["x"].grad, "loss": res["loss"].detach()}
    partials.update({f"dW_{n}": run["ws"][n].grad for n in spec(case.layer).weight_names})
    info["metrics"] = m.rows
    info["partials"] = {k: None if t is None else t.detach().double().cpu().numpy() for k, t in partials.items()}
    return info


def mixer_summed_metrics(case: Case, per_rank: list[dict], expected: dict) -> dict[str, dict[str, Any]]:
    """Quantities summed over ranks (grads of inputs_embeds and of every weight, the loss) against the reference."""
    ref, base = expected["ref"], expected["base"]
    m = Metrics(case.dtype)
    w_scale = max(ref[f"d{n}"].abs().max().item() for n in spec(case.layer).weight_names)
    summed = [("dinputs_embeds", "x"), ("loss", "loss")] + [(f"dW_{n}", f"d{n}") for n in spec(case.layer).weight_names]
    for label, key in summed:
        got = summed_over_ranks(per_rank, label, ref[key])
        bases = None if base is None else {b: r[key] for b, r in base.items()}
        m.close(label, got, ref[key], bases, w_scale if label.startswith("dW") else 0.0)
        if label.startswith("dW"):
            m.on_every_rank(label, per_rank)
    return m.rows
