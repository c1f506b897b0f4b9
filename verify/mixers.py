"""One mixer case on one rank: a small block around a sequence mixer of hybrid models, run three ways, compared.

The blocks (``case.layer``):

- ``conv``: ``inputs_embeds [B, S, E]`` -> ``u = x Wu [B, S, C]`` (``C = Hq * D``) -> causal depthwise convolution of
  width ``case.width`` with bias and SiLU -> ``Wo`` to a small vocabulary -> summed cross-entropy;
- ``gated_delta``: ``x`` -> ``q, k = x Wq, x Wk [B, S, Hk, K]``, ``v = x Wv [B, S, Hv, V]`` (``Hv = case.hq``,
  ``Hk = case.hkv``, ``K = case.dim``, ``V = case.dim + 1``), ``g = -softplus(x Wa)``, ``beta = sigmoid(x Wb)``
  -> the gated delta rule -> ``Wo`` -> summed cross-entropy;
- ``mamba2``: ``x`` -> ``xs = x Wx [B, S, H, Dh]`` (``H = case.hq``, ``Dh = case.dim``), ``dt = softplus(x Wdt +
  dt_bias) [B, S, H]``, ``B, C = x Wb, x Wc [B, S, G, N]`` (``G = case.hkv``, ``N = case.dim + 1``), ``A = -exp(A_log)``,
  ``D`` -> Mamba2's SSD -> ``Wo`` -> summed cross-entropy;
- ``sparse``: DeepSeek Sparse Attention: ``q = x Wq [B, S, H, D]`` (``H = case.hq``, ``D = case.dim``), a latent
  ``c = x Wl [B, S, D + 2]`` expanded to keys ``c Wk`` and values ``c Wv [., H, D + 1]``; an indexer of ``case.hkv``
  heads of ``D`` whose queries, keys and weights are small integers drawn per position (the indexer has no
  gradient, and its scores are then exact in every dtype: the same top-k, ties included, in the reference and the
  implementation) keeping the top ``case.width`` keys of each query's document prefix -> attention over them ->
  ``Wo`` -> summed cross-entropy.

1. reference: float64, single device, ``blockdiag_ref.reference_causal_conv`` / ``reference_gated_delta_rule`` /
   ``reference_ssd``
   (token by token per document);
2. baseline (below float64): the same reference computation in the case's dtype, single device (the
   tolerance rule of ``tolerances.py``: at most twice its error, plus a floor);
3. implementation: the case's dtype, CP-sharded through ``make_cp_blockdiag_batch_and_ctx`` and the module's
   ``causal_conv`` / ``gated_delta_rule`` / ``ssd``, with the case's layout and activation checkpointing.

Per rank: outputs of real rows, padding rows exactly 0, the gradient of the mixer's inputs (u; q, k, v, g, beta;
xs, dt, B, C),
padding rows exactly 0; summed over ranks: grads of ``inputs_embeds``, of every weight (the convolution's
included) and the loss. A module reporting its mixers' traffic (``state.mixer_traffic``) is checked against its
plan: the elements each forward received.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from blockdiag_ref import reference_causal_conv, reference_dsa_attention, reference_gated_delta_rule, reference_ssd

from .case_io import Metrics, impl_batch, summed_over_ranks
from .cases import Case

__all__ = ["MIXER_LAYERS", "check_mixer_case", "mixer_expected", "mixer_inputs", "mixer_summed_metrics"]

VOCAB = 11
MIXER_LAYERS = {"conv": "causal_conv", "gated_delta": "gated_delta_rule", "mamba2": "ssd", "sparse": "dsa_attention"}  # layer -> the module's function
BASELINE = "reference-in-dtype"


def _sizes(case: Case) -> dict[str, int]:
    return {"E": case.hidden, "C": case.hq * case.dim, "Hv": case.hq, "Hk": case.hkv, "K": case.dim, "V": case.dim + 1,
            "H": case.hq, "G": case.hkv, "Dh": case.dim, "N": case.dim + 1, "F": case.dim + 2, "Hi": case.hkv,
            "D": case.dim, "Dv": case.dim + 1}


INDEX_SCALE = 0.5  # the indexer's scale: a power of two keeps its integer scores exact


def index_inputs(case: Case) -> dict[str, Tensor]:
    """The indexer's inputs of a ``sparse`` case, ``[B, S, ...]`` float64 small integers (exact in every dtype):
    ``iq [B, S, Hi, D]``, ``ik [B, S, D]``, ``iw [B, S, Hi]``. Identical on every rank (one seeded generator)."""
    g = torch.Generator().manual_seed(3000 + case.seed)
    B, S, n = case.batch_size, case.seq_len, _sizes(case)
    draw = lambda *shape: torch.randint(-2, 3, shape, generator=g).to(torch.float64)  # noqa: E731
    return {"iq": draw(B, S, n["Hi"], n["D"]), "ik": draw(B, S, n["D"]), "iw": draw(B, S, n["Hi"])}


def mixer_inputs(case: Case) -> dict[str, Tensor]:
    """float64 master inputs, identical on every rank (one seeded generator)."""
    g = torch.Generator().manual_seed(2000 + case.seed)
    B, S = case.batch_size, case.seq_len
    n = _sizes(case)
    ids = torch.tensor(case.doc_ids(), dtype=torch.int64)
    f64 = torch.float64

    def w(*shape: int, fan: int | None = None) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=f64) / math.sqrt(fan or shape[0])

    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    labels[(torch.rand(B, S, generator=g) < 0.2) | (ids == 0)] = -100
    out = {"doc_ids": ids, "x": torch.randn(B, S, n["E"], generator=g, dtype=f64), "labels": labels}
    if case.layer == "conv":
        out.update(wu=w(n["E"], n["C"]), weight=w(n["C"], case.width, fan=case.width), bias=0.1 * w(n["C"], fan=1),
                   wo=w(n["C"], VOCAB))
    elif case.layer == "mamba2":
        # decays as strong as the models': A = -exp(A_log) ~ -(1..H) (their init), dt ~ softplus(1): a float32
        # kernel that subtracts long cumulative sums of dt A loses digits here (caught in float32)
        A_log = torch.log(torch.arange(1, n["H"] + 1, dtype=f64)) + 0.2 * w(n["H"], fan=1)
        out.update(wx=w(n["E"], n["H"] * n["Dh"]), wdt=w(n["E"], n["H"]), dt_bias=0.3 * w(n["H"], fan=1) + 1.0,
                   A_log=A_log, wb=w(n["E"], n["G"] * n["N"]), wc=w(n["E"], n["G"] * n["N"]),
                   D=w(n["H"], fan=1), wo=w(n["H"] * n["Dh"], VOCAB))
    elif case.layer == "sparse":
        out.update(wq=w(n["E"], n["H"] * n["D"]), wl=w(n["E"], n["F"]), wk=w(n["F"], n["H"] * n["D"]),
                   wv=w(n["F"], n["H"] * n["Dv"]), wo=w(n["H"] * n["Dv"], VOCAB))
    else:
        out.update(wq=w(n["E"], n["Hk"] * n["K"]), wk=w(n["E"], n["Hk"] * n["K"]), wv=w(n["E"], n["Hv"] * n["V"]),
                   wa=w(n["E"], n["Hv"]), wb=w(n["E"], n["Hv"]), wo=w(n["Hv"] * n["V"], VOCAB))
    return out


WEIGHTS = {"conv": ("wu", "weight", "bias", "wo"), "gated_delta": ("wq", "wk", "wv", "wa", "wb", "wo"),
           "mamba2": ("wx", "wdt", "dt_bias", "A_log", "wb", "wc", "D", "wo"), "sparse": ("wq", "wl", "wk", "wv", "wo")}
MIXER_INPUTS = {"conv": ("u",), "gated_delta": ("q", "k", "v", "g", "beta"), "mamba2": ("xs", "dt", "Bm", "Cm"),
                "sparse": ("q", "latent")}


def _block(case: Case, x: Tensor, ws: dict[str, Tensor], labels: Tensor, mix) -> dict[str, Tensor]:
    """The block; returns the mixer's inputs (grads retained), its output and the loss. ``mix(*inputs, weight,
    bias)`` for conv, ``mix(q, k, v, g, beta)`` for the gated delta rule, ``mix(xs, dt, A, Bm, Cm, D)`` for Mamba2."""
    B, L, _ = x.shape
    n = _sizes(case)
    if case.layer == "conv":
        u = x @ ws["wu"]
        u.retain_grad()
        out = mix(u, ws["weight"], ws["bias"])
        feats, res = out, {"u": u}
    elif case.layer == "mamba2":
        res = {"xs": (x @ ws["wx"]).view(B, L, n["H"], n["Dh"]), "dt": F.softplus(x @ ws["wdt"] + ws["dt_bias"]),
               "Bm": (x @ ws["wb"]).view(B, L, n["G"], n["N"]), "Cm": (x @ ws["wc"]).view(B, L, n["G"], n["N"])}
        for t in res.values():
            t.retain_grad()
        out = mix(res["xs"], res["dt"], -torch.exp(ws["A_log"]), res["Bm"], res["Cm"], ws["D"])
        feats = out.reshape(B, L, -1).to(x.dtype)
    elif case.layer == "sparse":
        res = {"q": (x @ ws["wq"]).view(B, L, n["H"], n["D"]), "latent": x @ ws["wl"]}
        for t in res.values():
            t.retain_grad()

        def expand(rows: Tensor) -> tuple[Tensor, Tensor]:  # [T, F] -> keys [T, H, D], values [T, H, Dv]
            return (rows @ ws["wk"]).view(-1, n["H"], n["D"]), (rows @ ws["wv"]).view(-1, n["H"], n["Dv"])

        out = mix(res["q"].transpose(1, 2), res["latent"], expand).transpose(1, 2)  # [B, L, H, Dv]
        feats = out.reshape(B, L, -1)
    else:
        q = (x @ ws["wq"]).view(B, L, n["Hk"], n["K"])
        k = (x @ ws["wk"]).view(B, L, n["Hk"], n["K"])
        v = (x @ ws["wv"]).view(B, L, n["Hv"], n["V"])
        g = -F.softplus(x @ ws["wa"])
        beta = torch.sigmoid(x @ ws["wb"])
        res = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
        for t in res.values():
            t.retain_grad()
        out = mix(q, k, v, g, beta)
        feats = out.reshape(B, L, -1)
    logits = feats @ ws["wo"]
    loss_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    loss = F.cross_entropy(logits.reshape(-1, VOCAB).to(loss_dtype), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return {**res, "out": out, "loss": loss}


def _leaves(case: Case, inputs: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
    def leaf(t: Tensor) -> Tensor:
        return t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_()

    return leaf(inputs["x"]), {k: leaf(inputs[k]) for k in WEIGHTS[case.layer]}


def _results(case: Case, res: dict, x: Tensor, ws: dict[str, Tensor]) -> dict[str, Tensor]:
    return {"out": res["out"].detach(), "loss": res["loss"].detach(), "x": x.grad,
            **{f"d{n}": res[n].grad for n in MIXER_INPUTS[case.layer]}, **{f"d{n}": ws[n].grad for n in ws}}


def _single_device(case: Case, inputs: dict[str, Tensor], dtype: torch.dtype, device: torch.device) -> dict:
    ids = inputs["doc_ids"]
    x, ws = _leaves(case, inputs, dtype, device)
    if case.layer == "conv":
        def mix(u, weight, bias):
            return reference_causal_conv(u, ids, weight, bias, "silu", dtype=dtype)
    elif case.layer == "mamba2":
        def mix(xs, dt, A, Bm, Cm, D):
            return reference_ssd(xs, dt, A, Bm, Cm, ids, D=D, dtype=dtype)
    elif case.layer == "sparse":
        idx = index_inputs(case)

        def mix(q, latent, expand):
            B, S = latent.shape[:2]
            k, v = expand(latent.reshape(B * S, -1))
            k, v = (t.view(B, S, *t.shape[1:]).transpose(1, 2) for t in (k, v))
            # scores in float32 as the model computes them (exact here: small integers), topk on the same rows
            return reference_dsa_attention(q, k, v, idx["iq"], idx["iw"], idx["ik"], ids, case.width,
                                           index_scale=INDEX_SCALE, score_dtype=torch.float32)[0]
    else:
        def mix(q, k, v, g, beta):
            return reference_gated_delta_rule(q, k, v, g, beta, ids, dtype=dtype)
    res = _block(case, x, ws, inputs["labels"].to(device), mix)
    res["loss"].backward()
    out = _results(case, res, x, ws)
    # a row of padding only leaves the reference's outputs unconnected to its inputs: their gradient is zero
    leaves = {"x": x, **{f"d{n}": res[n] for n in MIXER_INPUTS[case.layer]}, **{f"d{n}": ws[n] for n in ws}}
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
    fn = getattr(impl.module, MIXER_LAYERS[case.layer])
    if case.layer == "conv":
        def mix(u, weight, bias):
            return fn(u, weight, bias, "silu")
    elif case.layer == "mamba2":
        def mix(xs, dt, A, Bm, Cm, D):
            return fn(xs, dt, A, Bm, Cm, D)
    elif case.layer == "sparse":
        from blockdiag_dist.sparse import DsaIndex

        idx = index_inputs(case)
        pos = batch["position_ids"].to(torch.int64).clamp(max=case.seq_len - 1).cpu()  # CP padding: any row
        rows = torch.arange(case.batch_size)[:, None].expand_as(pos)
        index = DsaIndex(query=idx["iq"][rows, pos].to(device, dtype), key=idx["ik"][rows, pos].to(device, dtype),
                         weights=idx["iw"][rows, pos].to(device, torch.float32), scale=INDEX_SCALE)

        def mix(q, latent, expand):
            return fn(q, latent, expand, topk=case.width, index=index)[0]
    else:
        def mix(q, k, v, g, beta):
            return fn(q, k, v, g, beta)
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
    n = _sizes(case)
    if case.layer == "sparse":  # its keys travel in the attention exchange (state.traffic), not the mixers'
        return None
    if case.layer == "conv":
        from blockdiag_dist.mixers import plan_conv

        plan = plan_conv(state.plan, rank, case.width)
        return None if plan.mode == "local" else plan.recv_tokens[rank] * n["C"]
    from blockdiag_dist.mixers import plan_recurrence

    plan = plan_recurrence(state.plan.documents, rank)
    if not plan.any_traffic or state.world == 1:
        return None
    if case.layer == "mamba2":  # state [H, Dh, N], transition [H]
        return sum(plan.recv_splits(n["H"] * n["Dh"] * n["N"], n["H"]))
    return sum(plan.recv_splits(n["Hv"] * n["K"] * n["V"], n["Hv"] * n["K"] * n["K"]))


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
    m.close("out", out[real], rows(ref["out"]), base_rows("out"))
    m.exact_zero("out_padding_rows", out[padding])
    names = MIXER_INPUTS[case.layer]
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
        info["mode"] = "local" if want is None else ("history" if case.layer == "conv" else "summary")
        if case.layer == "sparse":  # the keys' exchange: the attention's, for an unbounded window, needed-only
            info["mode"] = state.window_plan(-1).mode
            n = _sizes(case)
            needed = state.comm_report(-1)["min_recv"][rank] if info["mode"] != "allgather" else None
            got = state.traffic.totals("forward")["recv_elements"]
            if needed is not None:  # latents and indexer keys of each needed token, once per forward
                m.equal("dsa_recv_elements_fwd", got, calls * needed * (n["F"] + n["D"]))
        info["notes"] = list(getattr(state, "notes", []))
        if case.layer == "conv":  # the history tokens that arrived, checked by the parent against the reference mask
            info["arrived"] = [list(e.recv_by_source) for e in fwd]
            info["real_positions"] = torch.stack([rb, rp], 1).tolist()
            info["local_tokens"] = int(pos.numel())
            info["window"] = case.width - 1
    partials = {"dinputs_embeds": run["x"].grad, "loss": res["loss"].detach()}
    partials.update({f"dW_{n}": run["ws"][n].grad for n in WEIGHTS[case.layer]})
    info["metrics"] = m.rows
    info["partials"] = {k: None if t is None else t.detach().double().cpu().numpy() for k, t in partials.items()}
    return info


def mixer_summed_metrics(case: Case, per_rank: list[dict], expected: dict) -> dict[str, dict[str, Any]]:
    """Quantities summed over ranks (grads of inputs_embeds and of every weight, the loss) against the reference."""
    ref, base = expected["ref"], expected["base"]
    m = Metrics(case.dtype)
    w_scale = max(ref[f"d{n}"].abs().max().item() for n in WEIGHTS[case.layer])
    summed = [("dinputs_embeds", "x"), ("loss", "loss")] + [(f"dW_{n}", f"d{n}") for n in WEIGHTS[case.layer]]
    for label, key in summed:
        got = summed_over_ranks(per_rank, label, ref[key])
        bases = None if base is None else {b: r[key] for b, r in base.items()}
        m.close(label, got, ref[key], bases, w_scale if label.startswith("dW") else 0.0)
    return m.rows
