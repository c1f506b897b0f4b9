"""Functions that the mixer tests run on every rank of a verify.pool.WorkerPool (importable by the spawned
workers): each builds its inputs from a seed on every rank, runs one step and returns plain numbers or arrays. Last,
the checks the hybrid model tests (tests/test_hf_*.py) share, run in the parent: :func:`parity_problems`,
:func:`assert_summaries_cross`."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
from verify.pool import worker_info

HYBRID_DOC = Path(__file__).resolve().parents[1] / "docs" / "hybrid.md"


def docs_example(name: str):
    """The ```python block of docs/hybrid.md that defines ``name``, executed; returns the namespace."""
    blocks = re.findall(r"```python\n(.*?)```", HYBRID_DOC.read_text(), re.S)
    code = next(b for b in blocks if f"def {name}(" in b or f"class {name}(" in b)
    ns: dict = {"__name__": "__docs__"}
    exec(compile(code, f"{HYBRID_DOC.name} ({name})", "exec"), ns)
    return ns


def doc_cumsum_step(ids: list[list[int]], layout: str, channels: int = 3) -> dict:
    """docs/hybrid.md's doc_cumsum at this pool's CP size: local output rows (with their global positions) and
    this rank's part of the gradient of ``(y * w).sum()`` w.r.t. the full input."""
    env = worker_info()
    doc_cumsum = docs_example("doc_cumsum")["doc_cumsum"]
    ids_t = torch.tensor(ids)
    B, S = ids_t.shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, channels, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, S, channels, generator=g, dtype=torch.float64)
    ctx, batch = make_cp_blockdiag_batch_and_ctx(env["cp_mesh"], None, {"inputs_embeds": x, "_packed_seq_ids": ids_t,
                                                 "w": w}, layout=layout, expect_attention=False)
    with ctx():
        y = doc_cumsum(batch["inputs_embeds"], ctx.state)
        (y * batch["w"]).sum().backward()
    return {"y": y.detach().numpy(), "positions": ctx.state.positions.tolist(), "dx": x.grad.numpy()}


def mixer_inputs(kind: str, B: int, S: int, seed: int, *, C: int = 5, W: int = 4, heads=(2, 4), K: int = 3, V: int = 2):
    """float64 inputs of one mixer case, the same on every rank (and in the parent)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "conv":
        return {"x": torch.randn(B, S, C, generator=g, dtype=torch.float64),
                "weight": torch.randn(C, W, generator=g, dtype=torch.float64),
                "bias": torch.randn(C, generator=g, dtype=torch.float64)}
    if kind == "ssd":  # H = 4 heads of 3, G = 2 groups, state N = 2
        return {"x": torch.randn(B, S, 4, 3, generator=g, dtype=torch.float64),
                "dt": torch.rand(B, S, 4, generator=g, dtype=torch.float64) + 0.05,
                "A": -torch.rand(4, generator=g, dtype=torch.float64) - 0.2,
                "B": torch.randn(B, S, 2, 2, generator=g, dtype=torch.float64),
                "C": torch.randn(B, S, 2, 2, generator=g, dtype=torch.float64),
                "D": torch.randn(4, generator=g, dtype=torch.float64)}
    if kind == "scan":  # Mamba1: I = 6 channels in G = 2 groups, state N = 2
        return {"x": torch.randn(B, S, 6, generator=g, dtype=torch.float64),
                "dt": torch.rand(B, S, 6, generator=g, dtype=torch.float64) + 0.05,
                "A": -torch.rand(6, 2, generator=g, dtype=torch.float64) - 0.2,
                "B": torch.randn(B, S, 2, 2, generator=g, dtype=torch.float64),
                "C": torch.randn(B, S, 2, 2, generator=g, dtype=torch.float64),
                "D": torch.randn(6, generator=g, dtype=torch.float64)}
    if kind == "light":  # lightning attention: H = 4 heads, K = 3, V = 2, a fixed decay rate per head
        return {"q": torch.randn(B, S, 4, K, generator=g, dtype=torch.float64),
                "k": torch.randn(B, S, 4, K, generator=g, dtype=torch.float64),
                "v": torch.randn(B, S, 4, V, generator=g, dtype=torch.float64),
                "slope": torch.rand(4, generator=g, dtype=torch.float64) * 0.8 + 0.1}
    Hk, Hv = heads
    decay_shape = (B, S, Hv, K) if kind == "kda" else (B, S, Hv)  # KDA: a decay per key channel
    return {"q": torch.randn(B, S, Hk, K, generator=g, dtype=torch.float64),
            "k": torch.randn(B, S, Hk, K, generator=g, dtype=torch.float64),
            "v": torch.randn(B, S, Hv, V, generator=g, dtype=torch.float64),
            "g": -torch.rand(*decay_shape, generator=g, dtype=torch.float64) * 1.5,
            "beta": torch.rand(B, S, Hv, generator=g, dtype=torch.float64)}


def mixer_reference(kind: str, ids: torch.Tensor, inputs: dict) -> torch.Tensor:
    from blockdiag_ref import (reference_causal_conv, reference_gated_delta_rule, reference_kda,
                               reference_lightning_attention, reference_selective_scan, reference_ssd)

    if kind == "conv":
        return reference_causal_conv(inputs["x"], ids, inputs["weight"], inputs["bias"], "silu")
    if kind == "ssd":
        return reference_ssd(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], ids, D=inputs["D"])
    if kind == "light":
        return reference_lightning_attention(inputs["q"], inputs["k"], inputs["v"], inputs["slope"], ids)
    if kind == "scan":
        return reference_selective_scan(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], ids,
                                        D=inputs["D"])
    fn = reference_kda if kind == "kda" else reference_gated_delta_rule
    return fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], ids)


def run_mixer_cases(cases: list[dict]) -> list[dict]:
    """Each case: ``kind`` (conv | gdr | kda | ssd | scan | light), ``ids``, ``layout``, ``seed`` (+ ``chunk``, ``state_dtype``): this
    rank's output rows and positions, its part of every input's gradient of ``(out * w).sum()``, and the mixer
    traffic it recorded, with the plan's expected element counts."""
    from blockdiag_dist.mixers import (causal_conv, gated_delta_rule, kimi_delta_attention, lightning_attention,
                                       selective_scan, ssd)

    env = worker_info()
    results = []
    for case in cases:
        ids = torch.tensor(case["ids"])
        B, S = ids.shape
        inputs = {n: t.requires_grad_() for n, t in mixer_inputs(case["kind"], B, S, case["seed"]).items()}
        seq = {n: t for n, t in inputs.items() if t.dim() >= 2 and tuple(t.shape[:2]) == (B, S)}
        batch = {"inputs_embeds": torch.zeros(B, S, 1, dtype=torch.float64), "_packed_seq_ids": ids, **seq}
        ctx, batch = make_cp_blockdiag_batch_and_ctx(env.get("cp_mesh"), None, batch, layout=case["layout"],
                                                     expect_attention=False)
        with ctx():
            if case["kind"] == "conv":
                out = causal_conv(batch["x"], inputs["weight"], inputs["bias"], "silu")
            elif case["kind"] == "ssd":  # chunks of 4: pieces of several chunks, scans of several steps
                out = ssd(batch["x"], batch["dt"], inputs["A"], batch["B"], batch["C"], inputs["D"],
                          chunk=case.get("chunk", 4), state_dtype=case.get("state_dtype"))
            elif case["kind"] == "light":  # the slope's gradient too (through the transitions exp(-slope n))
                out = lightning_attention(batch["q"], batch["k"], batch["v"], inputs["slope"], chunk=case.get("chunk", 4),
                                          state_dtype=case.get("state_dtype"))
            elif case["kind"] == "scan":
                out = selective_scan(batch["x"], batch["dt"], inputs["A"], batch["B"], batch["C"], inputs["D"],
                                     chunk=case.get("chunk", 4), state_dtype=case.get("state_dtype"))
            else:
                fn = kimi_delta_attention if case["kind"] == "kda" else gated_delta_rule
                out = fn(*(batch[n] for n in ("q", "k", "v", "g", "beta")), chunk=case.get("chunk", 4),
                         state_dtype=case.get("state_dtype"))
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
            (out * weights).sum().backward()
        state = ctx.state
        results.append({
            "out": out.detach().numpy(), "weights": weights.numpy(), "positions": state.positions.tolist(),
            "grads": {n: (None if t.grad is None else t.grad.numpy()) for n, t in inputs.items()},
            "traffic": [(e.mode, e.phase, e.sent_elements, e.recv_elements) for e in state.mixer_traffic.entries],
        })
    return results


def disagreeing_mixer() -> str:
    """Rank 1 calls the gated delta rule with 2 value heads, the others with 4: every rank raises
    PlanMismatchError at the mixer's first call, before its exchange, naming what each rank called."""
    from blockdiag_dist import PlanMismatchError
    from blockdiag_dist.mixers import gated_delta_rule

    env = worker_info()
    ids = torch.tensor([[1] * 12])
    ctx, batch = make_cp_blockdiag_batch_and_ctx(env["cp_mesh"], None, {"inputs_embeds": torch.zeros(1, 12, 1),
                                                 "_packed_seq_ids": ids}, expect_attention=False)
    heads = (2, 2) if env["rank"] == 1 else (2, 4)
    inputs = mixer_inputs("gdr", 1, ctx.state.local_len, 0, heads=heads)
    try:
        with ctx():
            gated_delta_rule(*(inputs[n] for n in ("q", "k", "v", "g", "beta")))
    except PlanMismatchError as exc:
        assert not ctx.state.mixer_traffic.entries, "an exchange ran before the consensus error"
        return str(exc)
    raise AssertionError("no error for ranks calling the mixer with different sizes")


def extension_example_step(ids: list[list[int]], layout: str) -> dict:
    """docs/hybrid.md's DecayedOuterProduct recurrence through run_recurrence at this pool's CP size (float64):
    this rank's outputs with their positions, and its part of every input's gradient of ``(out * w).sum()``."""
    from blockdiag_dist.mixers import run_recurrence

    rec = docs_example("DecayedOuterProduct")["DecayedOuterProduct"]()
    env = worker_info()
    ids_t = torch.tensor(ids)
    B, S = ids_t.shape
    inputs = extension_inputs(B, S)
    batch = {"inputs_embeds": torch.zeros(B, S, 1, dtype=torch.float64), "_packed_seq_ids": ids_t, **inputs}
    ctx, batch = make_cp_blockdiag_batch_and_ctx(env["cp_mesh"], None, batch, layout=layout, expect_attention=False)
    L = ctx.state.local_len
    local = tuple(batch[n].reshape(B * L, *batch[n].shape[2:]) for n in ("q", "k", "v", "a"))
    with ctx():
        out = run_recurrence(rec, local, ctx.state, state_dtype=torch.float64)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
        (out * w).sum().backward()
    return {"out": out.detach().view(B, L, *out.shape[1:]).numpy(), "w": w.view(B, L, *out.shape[1:]).numpy(),
            "positions": ctx.state.positions.tolist(), "grads": {n: t.grad.numpy() for n, t in inputs.items()}}


def extension_inputs(B: int, S: int, H: int = 2, K: int = 3, V: int = 2) -> dict:
    g = torch.Generator().manual_seed(11)
    return {"q": torch.randn(B, S, H, K, generator=g, dtype=torch.float64).requires_grad_(),
            "k": torch.randn(B, S, H, K, generator=g, dtype=torch.float64).requires_grad_(),
            "v": torch.randn(B, S, H, V, generator=g, dtype=torch.float64).requires_grad_(),
            "a": torch.rand(B, S, H, generator=g, dtype=torch.float64).requires_grad_()}


def parity_problems(label: str, got, ref, model, *, computed: str, layers: str, limit: float = 1e-10,
                    loss_limit: float | None = None, limit_of=None) -> list[str]:
    """What the hybrid model tests find wrong in a step ``got`` (verify.model.hybrid.cp_parity_step) against the
    per-document truth ``ref`` of ``model``: a loss beyond ``loss_limit`` (default ``limit``), a parameter's
    gradient beyond ``limit_of(name)`` (default ``limit``), and notes that do not say the ``layers`` were computed
    per document by ``computed`` (a name in blockdiag_dist.mixers)."""
    from verify.model.harness import compare

    loss_limit = limit if loss_limit is None else loss_limit
    c = compare(ref, got, model, limit)
    bad = [f"{label}: loss {c.loss_rel:.1e} > {loss_limit:g}"] if c.loss_rel > loss_limit else []
    for name, err in c.per_param.items():
        name_limit = limit if limit_of is None else limit_of(name)
        if err > name_limit:
            bad.append(f"{label}: {name} {err:.1e} > {name_limit:g} ({c.summary()})")
    if not any("computed per document" in n and computed in n for n in got.notes):
        bad.append(f"{label}: the {layers} layers were not computed per document (notes {got.notes})")
    return bad


def assert_summaries_cross(cp: int, *, transitions: bool = False) -> None:
    """The hybrid tests' documents (verify.model.hybrid.hybrid_docs) cross ranks at CP ``cp`` on the contiguous and
    balanced layouts: some rank receives summaries, and with ``transitions`` at CP 4 one receives a transition."""
    from blockdiag_dist import plan_step
    from blockdiag_dist.mixers import plan_recurrence
    from verify.model.hybrid import hybrid_batch, hybrid_docs

    ids = hybrid_batch(hybrid_docs())["_packed_seq_ids"]
    for layout in ("contiguous", "balanced"):
        docs = plan_step(ids, cp, layout).documents
        assert any(plan_recurrence(docs, r).any_traffic for r in range(cp)), (cp, layout)
        if transitions and cp == 4:
            assert any(plan_recurrence(docs, r).with_transition for r in range(cp)), (cp, layout)
