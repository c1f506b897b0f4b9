"""The verifier's matrix as a covering design: for any declared support, every named layout meets every doc-id
source, head shape, window and attention variant declared, at every CP size and dtype; the matrix stays within
``make verify``'s budget; and every planted bug is reported through an adapter declaring minimal support."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from verify.cases import NAMED_LAYOUTS, SOURCES, VARIANT_NAMES, Case, Support, case_values, coverage, default_matrix
from verify.cli import CASE_BUDGET, _parser, build_matrix, matrix_axes
from verify.families import SPECS
from verify.mutants.minimal import NAMES as MINIMAL
from verify.runner import applicable, expected_results, impl_info

# the parent's plans and references are tiny tensors: on a loaded machine a second OpenMP thread only spins (building
# blockdiag_dist's matrix took 29 s with two threads, 1.2 s with one)
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("varlen", "dense")
EXCHANGES = ("auto", "allgather", "halo", "a2a")


class Declared:
    """An implementation's declaration, as :func:`verify.runner.applicable` reads it (ImplInfo's ``supports``)."""

    def __init__(self, support: Support, options: set[str]):
        self.support_ = support
        self.options = options

    def supports(self, case: Case) -> bool:
        wanted = {"kernel": case.kernel, "kv_exchange": case.exchange, "layout": case.layout}
        if any(v is not None and k not in self.options for k, v in wanted.items()):
            return False
        return (case.source in self.support_.sources and set(case.variants) <= set(self.support_.variants)
                and (case.window < 0 or self.support_.windows))


def _draw_declaration(rng: random.Random):
    support = Support(sources=tuple(rng.sample(SOURCES, rng.randint(1, len(SOURCES)))), windows=rng.random() < 0.5,
                      variants=tuple(rng.sample(VARIANT_NAMES, rng.randint(0, len(VARIANT_NAMES)))))
    options: set[str] = set()
    kernels: tuple = (None,)
    exchanges: tuple = (None,)
    layouts: tuple = (None,)
    if rng.random() < 0.5:
        options.add("kernel")
        kernels = tuple(rng.sample(KERNELS, rng.randint(1, 2)))
    if rng.random() < 0.5:
        options.add("kv_exchange")
        # halo alone takes only layouts whose needed sets lie on the left neighbour: not every layout exists for it
        exchanges = tuple(rng.sample(EXCHANGES, rng.randint(1, 4)))
        if exchanges == ("halo",):
            exchanges = ("halo", "a2a")
    if rng.random() < 0.3:
        options.add("layout")
        layouts = tuple(rng.sample(("contiguous", "balanced"), rng.randint(1, 2)))
    cps = tuple(sorted(rng.sample((1, 2, 3, 4, 8), rng.randint(1, 3))))
    dtypes = tuple(rng.sample(("float64", "float32"), rng.randint(1, 2)))
    return support, options, kernels, exchanges, layouts, cps, dtypes


@pytest.mark.parametrize("seed", range(24))
def test_every_layout_meets_every_declared_value_at_every_cp_size(seed):
    """A random declaration (sources, windows, variants, kernels, exchanges, sharding layouts; CP sizes and
    dtypes of the run): every (layout, value) pair is met at every CP size and dtype, only declared values are
    drawn, every case is applicable, each kernel runs the plain attention, and a (CP size, layout, dtype) group
    holds no more cases than its options give or its largest dimension needs (plus a plain case per kernel)."""
    support, options, kernels, exchanges, layouts, cps, dtypes = _draw_declaration(random.Random(seed))
    info = Declared(support, options)
    cases = list(default_matrix(cps=cps, dtypes=dtypes, kernels=kernels, exchanges=exchanges, layouts=layouts,
                                applicable=lambda c: applicable(info, c), support=support))
    cov = coverage(cases, cps, dtypes, support)
    assert all(v["met"] == v["total"] and not v["missing"] for v in cov.values()), (support, cov)
    allowed = support.values()
    groups: dict[tuple, int] = {}
    for c in cases:
        assert applicable(info, c), c.label()
        for dim, value in case_values(c).items():
            assert value in allowed[dim], (dim, value, support)
        groups[(c.cp, c.name, c.dtype)] = groups.get((c.cp, c.name, c.dtype), 0) + 1
    widest = max(len(v) for v in allowed.values())
    slots = len(kernels) * len(exchanges) * len(layouts)
    # each kernel's first case is the plain attention: the kernels after the first may take one value slot each
    assert max(groups.values()) <= max(slots, widest + len(kernels) - 1), (groups, slots, widest)
    plain = {(c.cp, c.name, c.dtype, c.kernel) for c in cases if c.window < 0 and not c.variants}
    assert plain == {(c.cp, c.name, c.dtype, c.kernel) for c in cases}
    expected_groups = {(cp, n, d) for cp in cps for n in NAMED_LAYOUTS for d in dtypes if not (n == "s-lt-cp" and cp == 1)}
    assert set(groups) == expected_groups


def test_coverage_names_the_pairs_never_met():
    """The coverage count is not a restatement of the construction: cases of one source leave the others unmet."""
    support = Support()
    cases = [c for c in default_matrix(cps=(2,), dtypes=("float64",), kernels=(None,), exchanges=(None,), support=support)
             if c.source == "packed" and c.name != "reused-ids"]
    cov = coverage(cases, (2,), ("float64",), support)
    assert cov["layout x source"]["met"] == 10 and cov["layout x source"]["total"] == 33
    missing = cov["layout x source"]["missing"]
    assert len(missing) == 23 and "reused-ids x packed (CP 2 float64)" in missing and "one-long x mask4d (CP 2 float64)" in missing


def _args(impl: str, *extra: str):
    return _parser().parse_args(["run", "--impl", impl, *extra])


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_matrix_size_stays_within_the_make_verify_budget(quick):
    """``make verify`` (blockdiag_dist, every option it offers) must finish in 3 minutes: its case count stays
    within CASE_BUDGET (measured cases/s x 180 s, docs/verifier.md), and the covering did not grow it."""
    extra = ("--quick",) if quick else ()
    info = impl_info("blockdiag_dist")
    cases = build_matrix(info, _args("blockdiag_dist", *extra))
    assert len(cases) <= CASE_BUDGET["quick" if quick else "full"], len(cases)
    cps, dtypes = matrix_axes(info, _args("blockdiag_dist", *extra))
    cov = coverage(cases, cps, dtypes, info.support())
    assert {k: (v["met"], v["total"]) for k, v in cov.items()} == {
        "layout x source": (33, 33), "layout x heads": (33, 33), "layout x window": (33, 33), "layout x variant": (55, 55),
        "layout x temperature": (22, 22), "layout x bidirectional": (22, 22)}


def test_minimal_declaration_meets_reused_ids_with_packed_ids_at_cp_1_2_4():
    """The issue's example: one kernel, one exchange, ``_packed_seq_ids`` only; ``--quick -k reused`` used to find
    no case."""
    info = impl_info("verify.mutants.minimal.toy")
    assert info.sources == ("packed",) and not info.options
    cases = [c for c in build_matrix(info, _args("verify.mutants.minimal.toy", "--quick", "-k", "reused"))]
    assert {(c.cp, c.dtype) for c in cases} == {(cp, d) for cp in (1, 2, 4) for d in ("float64", "float32")}
    assert {c.source for c in cases} == {"packed"}
    assert {case_values(c)["heads"] for c in cases} == {"MHA", "GQA", "MQA"}


# ---- every planted bug, through the minimal adapter, with --quick -------------------------------------------
_truths: dict[Case, dict] = {}


def _cached_truth(case: Case) -> dict:
    """The reference and baselines of a case, computed once for all the mutants judged on the same matrix."""
    if case not in _truths:
        _truths[case] = expected_results(case)
    return _truths[case]


def _layout_by_layout(cases: list[Case]) -> list[Case]:
    """The same cases, reordered: the first case of every (layer, layout, CP size) first (the mixers' before
    attention's), then the second ..."""
    streams: dict[tuple, list[Case]] = {}
    for c in cases:  # the matrix's order within a stream
        streams.setdefault((c.layer, c.name, c.cp), []).append(c)
    names = list(NAMED_LAYOUTS)
    keys = sorted(streams, key=lambda k: (k[0] == "attention", names.index(k[1]) if k[1] in names else len(names), k[2]))
    out = []
    for i in range(max(len(s) for s in streams.values())):
        out += [streams[k][i] for k in keys if i < len(streams[k])]
    return out


def _planted_layers(bug: str) -> set[str]:
    """The layers bug ``bug`` is planted in: a mixer bug's families (``verify.families``' specs that plant it), the
    attention for the attention bugs (``verify.mutants._toy``)."""
    if bug.startswith("mixer_"):
        layers = {s.layer for s in SPECS.values() if bug[len("mixer_"):] in s.mutants}
        assert layers, f"{bug}: no family plants it"
        return layers
    return {"attention"}


def _search_order(cases: list[Case], layers: set[str]) -> list[Case]:
    """``_layout_by_layout(cases)`` with the cases of ``layers`` first: a bug's search starts where it is planted and
    meets every other case after (nothing is dropped: a bug seen only through another layer is still found)."""
    ordered = _layout_by_layout(cases)
    return [c for c in ordered if c.layer in layers] + [c for c in ordered if c.layer not in layers]


def test_the_minimal_toy_passes_a_batch_of_every_layout(session):
    """Without a bug the adapter passes (the cases the search above starts with)."""
    impl = "verify.mutants.minimal.toy"
    cases = _layout_by_layout(build_matrix(impl_info(impl), _args(impl, "--quick")))[:36]
    bad = [r for r in session.run(cases, impl=impl, reference=_cached_truth) if not r.ok]
    assert not bad, [(r.case.label(), r.details) for r in bad]


BATCH = 4  # cases run before looking for a report (1 for a fault: it kills the pool of every CP size it meets)
# what the first report of each planted bug must be (a wrong answer is "fail"; verify.mutants' table)
REPORTED = {"skip_collective": "timeout", "raise_forward": "error", "raise_backward": "error", "kill_rank": "crash",
            "refuse_rows": "error"}
NOT_THE_ATTENTION_VERIFIERS = {"late_layer": "wrong only in a model's later layers: verify model's (test_verify_model)",
                               # the minimal adapter declares no layout (contiguous shards only), where a continuing
                               # piece starts its rank's row: blockdiag_dist's --quick meets the bug on balanced
                               # cases (test_quick_matrix_meets_the_scan_decay_bug)
                               "mixer_scan_decay_per_rank": "wrong only where a rank holds two intervals of a row",
                               "mixer_decay_per_rank": "wrong only where a rank holds two intervals of a row"}
# bugs first, faults and the refusal last: each of those kills the pools it meets, and the next test pays the respawn
ORDER = sorted((n for n in MINIMAL if n != "toy" and n not in NOT_THE_ATTENTION_VERIFIERS), key=lambda n: n in REPORTED)


@pytest.mark.parametrize("bug", ORDER)
def test_every_planted_bug_is_reported_through_the_minimal_adapter_with_quick(session, bug):
    """``python -m verify --impl verify.mutants.minimal.<bug> --quick``'s own cases, explored from the layers the
    bug is planted in, layout by layout and CP size by CP size in batches (shared pools, references computed once
    for every mutant) until one is reported: some case must not pass, the first report is the bug's (a wrong answer
    fails, it does not raise) and comes from a layer it is planted in."""
    impl = f"verify.mutants.minimal.{bug}"
    layers = _planted_layers(bug)
    cases = _search_order(build_matrix(impl_info(impl), _args(impl, "--quick")), layers)
    timeout = session.case_timeout
    session.case_timeout = 10.0 if bug in REPORTED else timeout  # a hang is reported at the deadline: keep it short
    try:
        batch = 1 if bug in REPORTED else BATCH
        for lo in range(0, len(cases), batch):
            bad = [r for r in session.run(cases[lo : lo + batch], impl=impl, reference=_cached_truth) if not r.ok]
            if bad:
                first = bad[0]
                assert first.status == REPORTED.get(bug, "fail"), (first.case.label(), first.status, first.details[-1500:])
                assert first.case.layer in layers, (first.case.label(), layers)
                assert first.case.command(impl).endswith(f"--impl {impl}")
                return
    finally:
        session.case_timeout = timeout
    pytest.fail(f"{impl}: all {len(cases)} cases of --quick passed")


@pytest.mark.parametrize("bug, layer", [("scan_decay_per_rank", "mamba1"), ("decay_per_rank", "kda"),
                                        ("decay_per_rank", "lightning")])
def test_quick_matrix_meets_the_scan_decay_bug(session, bug, layer):
    """``mixer_scan_decay_per_rank`` and KDA's and lightning's ``mixer_decay_per_rank`` (a continuing piece decayed by the tokens
    its rank holds before it in its row) are reported by blockdiag_dist's own ``--quick`` cases of their layer: some
    balanced case fails (the balanced and auto ones are run)."""
    impl = f"verify.mutants.mixer_{bug}"
    cases = [c for c in build_matrix(impl_info("blockdiag_dist"), _args("blockdiag_dist", "--quick"))
             if c.layer == layer and c.layout in ("balanced", "auto")]
    results = session.run(cases, impl=impl, reference=_cached_truth)
    assert any(r.status == "fail" for r in results), [(r.case.label(), r.status) for r in results]


def test_cli_quick_reports_the_id_equality_leak_and_writes_coverage(tmp_path):
    """The issue's command: ``--impl <minimal> --quick -k reused`` runs the reused-ids layout at CP 1, 2, 4 and fails;
    the coverage line and the JSON name the pairs met."""
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "verify", "--impl", "verify.mutants.minimal.docs_by_id", "--quick", "-k",
                        "reused", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL reused-ids cp2" in p.stdout and "pairs met at every CP size and dtype: layout x source 1/11" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["coverage"]["layout x source"] == {"met": 1, "total": 11, "missing": doc["coverage"]["layout x source"]["missing"]}
    assert len(doc["coverage"]["layout x source"]["missing"]) == 10
    assert {r["case"]["cp"] for r in doc["results"] if r["status"] == "fail"} == {1, 2, 4}


# ---- verify model: its layouts meet reused ids and every doc-id source ---------------------------------------
def test_model_covering_meets_every_source_and_dtype_per_layout():
    from verify.model.layouts import DEFAULT_LAYOUTS, MODEL_SOURCES, covering, model_coverage
    from verify.model.check import ModelCase

    assert "reused-ids" in DEFAULT_LAYOUTS
    rng = random.Random(0)
    for _ in range(30):
        layouts = rng.sample(list(DEFAULT_LAYOUTS), rng.randint(1, len(DEFAULT_LAYOUTS)))
        sources = rng.sample(list(MODEL_SOURCES), rng.randint(1, 3))
        dtypes = rng.sample(["float64", "float32"], rng.randint(1, 2))
        cps = (1, 2)
        triples = covering(layouts, sources, dtypes)
        assert len(triples) == len(layouts) * max(len(sources), len(dtypes))
        cases = [ModelCase(model="m", args=(), cp=cp, layout=lay, dtype=d, source=src) for cp in cps for lay, src, d in triples]
        cov = model_coverage(cases, cps, layouts, sources, dtypes)
        assert all(v["met"] == v["total"] for v in cov.values()), cov
    cov = model_coverage([ModelCase(model="m", args=(), cp=1, layout="reused-ids", source="packed")], (1, 2),
                         ["reused-ids"], ["packed", "mask4d"], ["float64"])
    assert cov["layout x source"] == {"met": 0, "total": 2, "missing": ["reused-ids x packed (CP 2)",
                                                                         "reused-ids x mask4d (CP 1, CP 2)"]}


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_model_source_gives_the_layouts_documents(cp):
    """What a case sends (reused ids as they are, restarting positions alone, a 4-D mask) resolves to the layout's
    documents (maximal runs), and ``_packed_seq_ids`` comes with the ids reused."""
    import torch

    from blockdiag_ref import DocLayout, doc_ids_from_batch
    from verify.model.layouts import MODEL_SOURCES, batch_for_source, make_packed, model_rows

    packed = make_packed(model_rows("reused-ids", cp), vocab=64)
    want = DocLayout.from_doc_ids(packed.batch["_packed_seq_ids"]).segment_ids
    B, S = packed.batch["input_ids"].shape
    sent = {}
    for source in MODEL_SOURCES:
        batch = sent[source] = batch_for_source(packed, source)
        got = DocLayout.from_doc_ids(doc_ids_from_batch(batch, S, B)).segment_ids
        assert torch.equal(got, want), source
    assert set(sent["packed"]["_packed_seq_ids"][0].tolist()) == {1, 2}  # five documents, two ids
    assert "_packed_seq_ids" not in sent["positions"] and "attention_mask" not in sent["positions"]
    assert sent["mask4d"]["attention_mask"].shape == (B, 1, S, S) and "_packed_seq_ids" not in sent["mask4d"]
    assert "_packed_seq_ids" in packed.batch  # the parent's own numbering is left as it was
