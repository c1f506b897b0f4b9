"""Judging code we did not write: adapters, the classifier (each planted mutant lands in its class), the
convention reference, pools that survive refusals, and the conformance report."""

from __future__ import annotations

import dataclasses
import importlib.util
import time

import pytest
import torch

from verify.adapters import ADAPTERS, OURS, Conventions, module_path
from verify.cases import Case, parse_rows
from verify.classify import classify, convention_expected, convention_groups
from verify.conformance import conformance_cases, run_conformance, write_markdown
from verify.pool import PoolError, WorkerPool
from verify.runner import expected_results, impl_info
from verify.session import Session

PEERS = all(importlib.util.find_spec(m) for m in ("nemo_automodel", "ring_attention_pytorch"))
needs_peers = pytest.mark.skipif(not PEERS, reason="third-party packages missing: run `make peers` (make test does)")
needs_ringmaster = pytest.mark.skipif(not importlib.util.find_spec("ringmaster"),
                                      reason="axolotl-ringmaster missing: run `make peers` (make test does)")

# reused ids (1 comes back after 2), middle and tail padding, documents across the rank boundary
REUSED = Case(rows=parse_rows("1x2,2x3,1x2,0x1,2x2,0x2"), cp=2, hq=4, hkv=2, dim=3, name="reused")
TWO_ROWS = Case(rows=parse_rows("1x3,2x3/0x1,1x5"), cp=2, name="two-rows")


@pytest.fixture(scope="module")
def keep_session():
    with Session(case_timeout=60.0, keep_after_uniform_error=True) as s:
        yield s


def _classify(session, impl: str, case: Case, conv: Conventions = OURS):
    result = session.run_one(case, impl=impl)
    return result, classify(result, conv, lambda c, ref: session.run_one(c, impl=impl, reference=ref))


# ---- classifier on the planted mutants ------------------------------------------------------------------
@pytest.mark.parametrize(
    "mutant, case, cls",
    [
        pytest.param("toy", REUSED, "pass", id="toy-pass"),
        pytest.param("off_by_one", REUSED, "bug", id="off-by-one-bug"),
        pytest.param("no_grad_reduce", REUSED, "bug", id="no-grad-reduce-bug"),
        pytest.param("short_straddle", REUSED, "bug", id="short-straddle-bug"),
        pytest.param("leak_across_docs", REUSED, "bug", id="leak-bug"),
        pytest.param("nonzero_padding", REUSED, "bug", id="nonzero-padding-bug"),
        pytest.param("refuse_rows", TWO_ROWS, "unsupported", id="refusal-unsupported"),
        pytest.param("raise_forward", REUSED, "crash", id="raise-crash"),
        pytest.param("kill_rank", REUSED, "crash", id="killed-crash"),
        pytest.param("docs_by_id", REUSED, "contract", id="declared-convention-contract"),
    ],
)
def test_each_mutant_lands_in_its_class(keep_session, mutant, case, cls):
    impl = f"verify.mutants.{mutant}"
    result, verdict = _classify(keep_session, impl, case, impl_info(impl).conventions)
    assert verdict.cls == cls, (verdict, result.details)
    if cls == "unsupported":
        assert verdict.message == "ValueError: toy: expected one packed row (B = 1), got B=2"
    if cls == "contract":
        assert verdict.conventions == ["document=id"] and verdict.recheck is not None and verdict.recheck.ok
    if cls == "bug":
        assert "err" in verdict.why and "limit" in verdict.why


def test_a_convention_is_not_an_excuse_for_a_real_bug(keep_session):
    """Declared conventions only move a case to contract when the re-check passes: a leak across documents
    stays a bug under 'document = every token sharing an id', and wrong padding stays a bug unless padding
    is declared free."""
    _, verdict = _classify(keep_session, "verify.mutants.leak_across_docs", REUSED, Conventions(document="id"))
    assert verdict.cls == "bug" and verdict.recheck is not None and "document=id" in verdict.why
    result, verdict = _classify(keep_session, "verify.mutants.nonzero_padding", REUSED, Conventions(padding="free"))
    assert verdict.cls == "contract" and verdict.conventions == ["padding=free"], result.failed_metrics
    _, verdict = _classify(keep_session, "verify.mutants.docs_by_id", REUSED, OURS)  # undeclared: a bug
    assert verdict.cls == "bug"


def test_a_hang_is_classed_hang_within_the_deadline():
    with Session(case_timeout=5.0, keep_after_uniform_error=True) as s:
        t0 = time.monotonic()
        result, verdict = _classify(s, "verify.mutants.skip_collective", REUSED)
    assert verdict.cls == "hang" and result.ranks == [0]
    assert time.monotonic() - t0 < 5.0 + 60


def _error(ranks, lines):
    from verify.session import CaseResult

    details = "case: raised\n" + "\n".join(
        f"--- rank {r} ---\nTraceback (most recent call last):\n  File \"x.py\", line 1\n{line}" for r, line in zip(ranks, lines))
    return CaseResult(case=REUSED, status="error", ranks=list(ranks), details=details)


@pytest.mark.parametrize(
    "ranks, lines, cls, message",
    [
        pytest.param([0, 1], ["ValueError: B > 1", "ValueError: B > 1"], "unsupported", "ValueError: B > 1", id="every-rank"),
        pytest.param([1, 0], ["torch.x.NotImplementedError: no rule", "NotImplementedError: no rule"], "unsupported",
                     "NotImplementedError: no rule", id="module-qualified"),
        pytest.param([1], ["ValueError: B > 1"], "crash", "ValueError: B > 1", id="one-rank-strands-the-other"),
        pytest.param([0, 1], ["ValueError", "ValueError"], "crash", "ValueError: ", id="no-message"),
        pytest.param([0, 1], ["RuntimeError: overflow", "RuntimeError: overflow"], "crash", "RuntimeError: overflow", id="unclear"),
        pytest.param([0, 1], ["NotImplementedError: Could not run 'aten::f' with arguments from the 'CPU' backend.\n"
                              "Meta: registered at x.cpp:1 [backend fallback]"] * 2, "unsupported",
                     "NotImplementedError: Could not run 'aten::f' with arguments from the 'CPU' backend.",
                     id="multi-line-message"),
    ],
)
def test_refusals_need_a_clear_error_on_every_rank(ranks, lines, cls, message):
    verdict = classify(_error(ranks, lines))
    assert (verdict.cls, verdict.message) == (cls, message)


# ---- the reference under declared conventions ----------------------------------------------------------
def test_convention_groups():
    case = Case(rows=parse_rows("1x2,2x1,1x1,0x1,3x1"), cp=1, source="mask4d")
    assert convention_groups(case, OURS).tolist() == [[1, 1, 2, 3, 0, 4]]
    assert convention_groups(case, Conventions(document="id")).tolist() == [[1, 1, 2, 1, 0, 3]]
    assert convention_groups(case, Conventions(mask4d="validity")).tolist() == [[1, 1, 1, 1, 0, 2]]
    assert convention_groups(case, Conventions(document="row")).tolist() == [[1, 1, 1, 1, 1, 1]]


def test_convention_reference_is_ours_where_the_conventions_agree():
    case = dataclasses.replace(REUSED, rows=parse_rows("1x3,2x4,0x3"))  # no reused id: 'id' documents = runs
    ours, theirs = expected_results(case), convention_expected(case, Conventions(document="id"))
    for name, t in ours["ref"].items():
        assert torch.equal(t, theirs["ref"][name]), name


# ---- pools that survive refusals -------------------------------------------------------------------------
def _raise_everywhere():
    raise ValueError("refused on every rank")


def _raise_on_rank1_then_wait():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("only rank 1")
    dist.barrier()


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def test_pool_keeps_its_group_after_an_error_raised_on_every_rank_only():
    with WorkerPool(2, keep_after_uniform_error=True) as pool:
        with pytest.raises(PoolError, match="refused on every rank"):
            pool.run(_raise_everywhere, timeout=60)
        assert pool.run(_rank, timeout=60) == [0, 1] and pool.spawns == 1
        with pytest.raises(PoolError, match="only rank 1"):
            pool.run(_raise_on_rank1_then_wait, timeout=60)
        assert pool.run(_rank, timeout=60) == [0, 1] and pool.spawns == 2  # rank 0 was stuck: a fresh group


# ---- adapters -------------------------------------------------------------------------------------------
def test_adapter_names_resolve_and_unavailable_ones_say_why():
    assert module_path("nemo") == "verify.adapters.nemo" and module_path("a.b") == "a.b"
    assert set(ADAPTERS) >= {"blockdiag_dist", "nemo", "ring_attention", "torch_cp", "ring_flash_attn"}
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ring_flash_attn: unavailable here: CUDA only"):
            impl_info("ring_flash_attn")


def _step(impl: str, dtype=torch.float64, hkv: int = 2, one_doc: bool = False):
    """Worker: one attention step through an adapter on CP-sharded q, k, v; errors against the reference."""
    from blockdiag_ref import reference_attention
    from verify.adapters import attention_step
    from verify.pool import worker_info
    from verify.runner import impl_info as info

    env = worker_info()
    g = torch.Generator().manual_seed(0)
    ids = torch.ones(1, 12, dtype=torch.int64) if one_doc else torch.tensor([[1] * 5 + [2] * 4 + [3] * 3])
    q = torch.randn(1, 4, 12, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, 12, 4, generator=g, dtype=torch.float64) for _ in range(2))
    res = attention_step(info(impl).module, env["cp_mesh"], q.to(dtype), k.to(dtype), v.to(dtype), ids)
    rows = res["positions"][~res["padding"]]
    ref = reference_attention(q, k, v, ids, enable_gqa=True)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    reference_attention(qf, kf, vf, ids, enable_gqa=True).backward(torch.ones_like(q))
    out = res["out"].double().transpose(1, 2)[~res["padding"]]
    return {"out": (out - ref.transpose(1, 2)[0, rows]).abs().max().item(),
            "grads": [g.double().numpy() for g in (res["dq"], res["dk"], res["dv"])],
            "ref_grads": [t.grad.numpy() for t in (qf, kf, vf)]}


@needs_peers
@pytest.mark.parametrize("impl", ["blockdiag_dist", "nemo"])
def test_attention_step_runs_one_call_outside_the_verifier(impl):
    """The entry point benchmarks use: forward + backward of one call on a sharded batch, CP 2, float64."""
    with WorkerPool(2) as pool:
        per_rank = pool.run(_step, args=(impl,), timeout=120)
    assert max(r["out"] for r in per_rank) < 1e-12
    for i in range(3):
        total = sum(r["grads"][i] for r in per_rank)
        assert abs(total - per_rank[0]["ref_grads"][i]).max() < 1e-12


@needs_peers
def test_ring_attention_adapter_pairs_gqa_heads_like_sdpa():
    """ring-attention-pytorch pairs query head j with key/value head j % Hkv; the adapter reorders heads so
    that SDPA's pairing (j // (Hq / Hkv)) holds: one causal document, CP 1 (a one-member ring), float32."""
    with WorkerPool(1) as pool:
        (r,) = pool.run(_step, args=("ring_attention", torch.float32, 2, True), timeout=120)
    assert r["out"] < 1e-5
    for got, ref in zip(r["grads"], r["ref_grads"]):
        assert abs(got - ref).max() < 1e-5


# ---- the report -----------------------------------------------------------------------------------------
@needs_peers
def test_conformance_report_classes_every_cell(tmp_path):
    cases = conformance_cases(cps=(2,), dtypes=("float64",), sources=("packed", "mask4d"), layouts=["reused-ids", "two-rows"])
    data = run_conformance(["blockdiag_dist", "nemo", "ring_flash_attn"], cases, case_timeout=60)
    ours, nemo = data["impls"]["blockdiag_dist"], data["impls"]["nemo"]
    assert ours["counts"]["pass"] == len(cases) == 4
    assert nemo["counts"]["unsupported"] == 2 and nemo["counts"]["contract"] == 2, nemo["counts"]
    by = {(c["layout"], c["source"]): c for c in nemo["cells"]}
    assert by[("reused-ids", "packed")]["conventions"] == ["document=id"]
    assert by[("reused-ids", "mask4d")]["conventions"] == ["mask4d=validity"]
    assert "local_batch_size=1" in by[("two-rows", "packed")]["message"]
    path = tmp_path / "C.md"
    write_markdown(str(path), data)
    text = path.read_text()
    assert "| `nemo` | 0 | 2 | 2 | 0 | 0 | 0 |" in text
    if not torch.cuda.is_available():
        assert "`ring_flash_attn`: CUDA only" in text


def test_a_pool_that_cannot_start_reports_every_case_as_crash():
    """Each case retries the start and reports its failure (later chunks once turned into KeyErrors)."""
    cases = [dataclasses.replace(REUSED, seed=s) for s in range(3)]
    with Session(case_timeout=30.0, chunk=2, backend="no-such-backend") as s:
        results = s.run(cases, impl="verify.mutants.toy")
    assert [r.status for r in results] == ["crash"] * 3
    assert all("PoolError" in r.details and "KeyError" not in r.details for r in results), [r.details for r in results]


# ---- axolotl-ringmaster ---------------------------------------------------------------------------------------
def test_ringmaster_adapters_declare_its_conventions():
    """Taken from ringmaster 0.2.7's code: documents are the runs between restarts of position_ids (ours), padding
    tokens form segments of their own (free), every attention source is offered (a 4-D mask is refused by it)."""
    from types import SimpleNamespace

    from verify.adapters import Unsupported
    from verify.adapters.ringmaster import CONVENTIONS, ULYSSES_CONVENTIONS, UNAVAILABLE, restarting_positions

    for conv in (CONVENTIONS, ULYSSES_CONVENTIONS):
        assert conv.differences() == ["padding=free"] and conv.sources == ("packed", "mask4d", "mask2d")
    assert module_path("ringmaster") == "verify.adapters.ringmaster"
    assert module_path("ringmaster_ulysses") == "verify.adapters.ringmaster_ulysses"
    assert restarting_positions(torch.tensor([[1, 1, 2, 0, 0, 1]])).tolist() == [[0, 1, 0, 0, 1, 0]]
    if UNAVAILABLE is None:  # CP 1: no ringmaster code runs (RingmasterConfig(size=1).enabled is False): refused
        from verify.adapters.ringmaster import make_cp_blockdiag_batch_and_ctx

        one = SimpleNamespace(size=lambda: 1, get_local_rank=lambda: 0)
        with pytest.raises(Unsupported, match="does not run at CP 1"):
            make_cp_blockdiag_batch_and_ctx(one, None, {"inputs_embeds": torch.zeros(1, 4, 2)})


@needs_ringmaster
def test_ringmaster_cases_land_in_their_classes(keep_session):
    """Through the conformance classifier: packed rows with middle and tail padding differ only by padding=free
    (real rows and every gradient right, ring and Ulysses); a 4-D mask is ringmaster's quoted refusal; its
    cp_linear_scan crosses documents (a contract: document=row, exact against one scan of the whole row)."""
    from verify.ringmaster_state import _scan_on_rank, linear_scan_errors

    for impl in ("ringmaster", "ringmaster_ulysses"):
        conv = impl_info(impl).conventions
        _, verdict = _classify(keep_session, impl, REUSED, conv)
        assert verdict.cls == "contract" and verdict.conventions == ["padding=free"], verdict
    _, verdict = _classify(keep_session, "ringmaster", dataclasses.replace(REUSED, source="mask4d"))
    assert verdict.cls == "unsupported"
    assert verdict.message == "ValueError: Context parallelism requires a right-padded causal 2D mask"
    pool = keep_session.pool(2)  # the CP 2 pool the cases above ran in
    errors = linear_scan_errors(pool.run(_scan_on_rank, timeout=120, name="ringmaster cp_linear_scan"))
    assert errors["row"] < 1e-12 and errors["documents"] > 1e-2, errors


# ---- the Trainers section ---------------------------------------------------------------------------------------
def test_trainer_rows_are_parsed_and_trls_guard_is_read_from_its_source():
    from verify.trainers import DEFAULT_ROWS, trainer_rows, trl_guard

    assert trainer_rows(None) == list(DEFAULT_ROWS)
    assert trainer_rows("accelerate-cp:llama, blockdiag-sft:qwen3_5") == [("accelerate-cp", "llama"),
                                                                         ("blockdiag-sft", "qwen3_5")]
    with pytest.raises(ValueError, match="expected PATH:MODEL with PATH one of .* got 'stock:llama'"):
        trainer_rows("stock:llama")
    if importlib.util.find_spec("trl"):
        guard = trl_guard()
        assert guard["text"].startswith("ValueError: Packing is not compatible with context parallelism")
        assert guard["where"].startswith("trl/trainer/sft_trainer.py:")
