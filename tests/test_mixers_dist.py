"""The mixers of blockdiag_dist.mixers on real process groups against the float64 references: outputs of real
rows, padding rows exactly 0, and every input's gradient (summed over ranks), for contiguous, balanced and auto
layouts, B > 1, padding anywhere (a rank holding only padding too), documents over 3+ ranks or coming back to
a rank, many documents per rank, pieces shorter than the convolution's history; the exchanged elements equal
the plan's."""

from __future__ import annotations

import pytest
import torch

import mixer_checks
from blockdiag_dist.mixers import plan_conv, plan_recurrence
from blockdiag_dist.plan import plan_step
from blockdiag_ref import DocLayout

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = {
    "over-all-ranks": [[1] * 3 + [2] * 30 + [3] * 3],
    "many-short": [[1, 2, 2, 3, 4, 4, 4, 5, 6, 6, 7, 7, 7, 7, 8, 9, 9, 10, 11, 11, 12, 12, 12, 13]],
    "two-rows-padding": [[1] * 9 + [0] * 2 + [2] * 7 + [0] * 2 + [3] * 4, [0] * 3 + [4] * 13 + [5] * 8],
    "padding-rank": [[1] * 11 + [2] * 7 + [0] * 8],
    "single-tokens": [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]],
}


# KDA shares the delta rule's code, lightning attention the SSD's: fewer rows
KDA_ROWS = ("over-all-ranks", "two-rows-padding", "padding-rank")


def cases_for(cp: int) -> list[dict]:
    out, seed = [], 0
    for name, ids in ROWS.items():
        for layout in ("contiguous", "balanced", "auto"):
            for kind in ("conv", "gdr", "ssd", "scan") + (("kda", "light") if name in KDA_ROWS else ()):
                out.append({"name": f"{name} {layout} {kind}", "kind": kind, "ids": ids, "layout": layout, "seed": seed})
                seed += 1
    return out


def check(case: dict, per_rank: list[dict], cp: int) -> list[str]:
    ids = torch.tensor(case["ids"])
    B, S = ids.shape
    inputs = {n: t.requires_grad_() for n, t in mixer_checks.mixer_inputs(case["kind"], B, S, case["seed"]).items()}
    ref = mixer_checks.mixer_reference(case["kind"], ids, inputs)
    full_w = torch.zeros_like(ref)
    problems = []
    for r, res in enumerate(per_rank):
        pos = torch.tensor(res["positions"])
        keep = pos < S
        out = torch.from_numpy(res["out"])
        full_w[:, pos[keep]] = torch.from_numpy(res["weights"])[:, keep]
        err = (out[:, keep] - ref.detach()[:, pos[keep]]).abs().max().item()
        if err > 1e-12:
            problems.append(f"{case['name']}: rank {r} output error {err:.2e}")
        pad = (ids[:, pos[keep]] == 0)
        if out[:, keep][pad].abs().sum() != 0 or out[:, ~keep].abs().sum() != 0:
            problems.append(f"{case['name']}: rank {r} padding rows are not 0")
    (ref * full_w).sum().backward()
    for n, t in inputs.items():
        got = sum(torch.from_numpy(res["grads"][n]) for res in per_rank if res["grads"][n] is not None)
        err = (got - t.grad).abs().max().item()
        if err > 1e-11 * max(1.0, t.grad.abs().max().item()):
            problems.append(f"{case['name']}: grad of {n} error {err:.2e}")
    return problems


def expected_elements(case: dict, cp: int) -> list[tuple[str, int, int]]:
    """Per rank: (mode, sent, received) elements of the forward exchange the plan prescribes (None: none)."""
    plan = plan_step(torch.tensor(case["ids"]), cp, case["layout"])
    out = []
    for r in range(cp):
        if case["kind"] == "conv":
            cp_ = plan_conv(plan, r, 4)
            C = 5
            out.append(None if cp_.mode == "local" else (cp_.mode, cp_.sent_tokens[r] * C, cp_.recv_tokens[r] * C))
        else:
            rp = plan_recurrence(plan.documents, r)
            Hv, K, V = 4, 3, 2
            cn, mn = {"gdr": (Hv * K * V, Hv * K * K), "kda": (Hv * K * V, Hv * K * K),
                      "ssd": (4 * 3 * 2, 4),  # ssd: [H, Dh, N], [H]
                      "scan": (6 * 2, 6 * 2),  # selective scan: [I, N] both
                      "light": (4 * 2 * 3, 4)}[case["kind"]]  # lightning: [H, V, K], [H]
            out.append(None if not rp.any_traffic else ("summary", sum(rp.send_splits(cn, mn)), sum(rp.recv_splits(cn, mn))))
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_mixers_match_the_reference_on_every_layout(session, cp):
    cases = cases_for(cp)
    per_case = session.pool(cp).run(mixer_checks.run_mixer_cases, args=(cases,), timeout=240, name=f"mixers cp{cp}")
    problems = []
    for i, case in enumerate(cases):
        per_rank = [per_case[r][i] for r in range(cp)]
        problems += check(case, per_rank, cp)
        for r, expected in enumerate(expected_elements(case, cp)):
            fwd = [t for t in per_rank[r]["traffic"] if t[1] == "forward"]
            got = None if not fwd else (fwd[0][0], fwd[0][2], fwd[0][3])
            if len(fwd) > 1 or got != expected:
                problems.append(f"{case['name']}: rank {r} moved {fwd}, the plan says {expected}")
    assert not problems, "\n".join(problems)


def test_cp1_runs_the_same_code_with_no_exchange():
    cases = cases_for(1)
    per_case = mixer_checks.run_mixer_cases(cases)
    problems = []
    for case, res in zip(cases, per_case):
        problems += check(case, [res], 1)
        if res["traffic"]:
            problems.append(f"{case['name']}: CP 1 moved {res['traffic']}")
    assert not problems, "\n".join(problems)


def test_ranks_calling_a_mixer_with_different_sizes_fail_alike(session):
    messages = session.pool(3).run(mixer_checks.disagreeing_mixer, timeout=60, name="mixer consensus")
    assert len(set(messages)) == 1, messages
    assert "CP plan consensus failed (mixer)" in messages[0]
    assert "rank 0: gated_delta_rule q(2, 3) v(4, 2)" in messages[0] and "rank 1: gated_delta_rule q(2, 3) v(2, 2)" in messages[0]


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_the_extension_example_recurrence_at_cp3(session, layout):
    """docs/hybrid.md's DecayedOuterProduct (a scalar transition, written only against the Recurrence interface)
    across 3 ranks: outputs and every input's gradient equal each document run alone."""
    ids = torch.tensor([[1] * 14 + [2] * 3 + [0] * 2 + [3] * 5])
    per_rank = session.pool(3).run(mixer_checks.extension_example_step, args=(ids.tolist(), layout), timeout=120,
                                   name="extension example")
    rec = mixer_checks.docs_example("DecayedOuterProduct")["DecayedOuterProduct"]()
    inputs = mixer_checks.extension_inputs(*ids.shape)
    seg = DocLayout.from_doc_ids(ids)
    S = ids.shape[1]
    truth = torch.zeros(1, S, 2, 2, dtype=torch.float64)
    for row, start, end in seg.segments.tolist():
        piece = tuple(inputs[n][row, start:end] for n in ("q", "k", "v", "a"))
        truth = truth.index_put((torch.tensor([row]), torch.arange(start, end)), rec.scan(piece, (0, end - start), None, False)[0])
    w = torch.zeros_like(truth)
    for r in per_rank:
        pos = torch.tensor(r["positions"])
        keep = pos < S
        torch.testing.assert_close(torch.from_numpy(r["out"])[:, keep], truth.detach()[:, pos[keep]], rtol=1e-12, atol=1e-12)
        w[:, pos[keep]] = torch.from_numpy(r["w"])[:, keep]
    (truth * w).sum().backward()
    for n, t in inputs.items():
        got = sum(torch.from_numpy(r["grads"][n]) for r in per_rank)
        torch.testing.assert_close(got, t.grad, rtol=1e-11, atol=1e-12)


def test_selective_scan_without_an_initial_state_kernel_gets_one_by_correction():
    """mamba_ssm's CUDA scan starts every sequence from zero: a scan from zero plus
    blockdiag_dist.kernels.selective_scan.initial_state_correction equals the scan entering with the state, in its
    outputs, its leaving states and every gradient (the initial states' included), on pieces of several chunks, in
    float64 and float32."""
    from blockdiag_dist.kernels.chunks import plan_chunks
    from blockdiag_dist.kernels.selective_scan import chunk_selective_scan, scan_from_zero_then_correct

    g = torch.Generator().manual_seed(0)
    cu, I, N, G = [0, 5, 6, 30, 47], 6, 3, 2
    T, P = cu[-1], len(cu) - 1
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 2e-6)):
        la = (-torch.rand(T, I, N, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
        b, C, init = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
                      for s in ((T, I, N), (T, G, N), (P, I, N)))
        meta = plan_chunks(cu, 4)
        results = []
        for fn in (chunk_selective_scan, scan_from_zero_then_correct):
            y, final = fn(la, b, C, meta, init)
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
            grads = torch.autograd.grad((y * w).sum() + final.sum(), (la, b, C, init))
            results.append((y, final, *grads))
        for name, direct, corrected in zip(("y", "final", "dla", "db", "dC", "dinit"), *results):
            err = ((direct - corrected).abs().max() / direct.abs().max()).item()
            assert err < tol, f"{dtype} {name}: relative error {err:.1e}"


def test_conv_plan_of_a_row_shorter_than_the_width_holds_no_tap_before_the_row():
    """One token at CP 2 (S < CP: rank 1 holds padding only), width 4: the taps before the row's start are not
    looked up (their flat ids are negative) and every tap of the token is its own row or the zero row."""
    plan = plan_step(torch.tensor([[1]]), 2)
    for rank in range(2):
        cp_ = plan_conv(plan, rank, 4)
        assert cp_.mode == "local" and not bool((cp_.fix_taps < 0).any())
    taps = plan_conv(plan, 0, 4).fix_taps  # [W, fixed rows]: three zero-row taps, then the token itself
    assert taps.shape == (4, 1) and taps[-1].tolist() == [0] and len(set(taps[:-1].flatten().tolist())) == 1
