"""LFM2's short convolutions (``Lfm2ShortConv``, ``Lfm2MoeShortConv``) per document under CP: tiny models from their
configs (``verify.model.hybrid``: convolution of width 3, attention, convolution; the MoE variant's last layer
sparse), the two packed rows of the hybrid tests (documents over three ranks at CP 4), float64, loss and every
parameter's gradient against each document run alone on one device, at CP 1, 2 and 4 and every layout. The stock
layer computes in the model's dtype (no float32 step of its own); the model's float32 steps (rotary angles, RMSNorms)
round the same in both, and every parameter is held to 1e-10. The stock model on the packed rows, whose
convolution runs across document ends, is wrong by far more than that (the test's truth would see such a bug).
(Refused by the guard before: tests/test_never_silent.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from blockdiag_dist import plan_step  # noqa: E402
from verify.model.harness import compare, packed_reference  # noqa: E402
from verify.model.hybrid import build_tiny_hybrid, cp_parity_step, hybrid_batch, hybrid_docs, truth  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LIMIT = 1e-10
TIMEOUT = 300.0
CP_RUNS = {  # CP size -> (family, layout)
    1: [("lfm2", "contiguous"), ("lfm2_moe", "contiguous")],
    2: [("lfm2", "contiguous"), ("lfm2", "balanced"), ("lfm2", "auto"), ("lfm2_moe", "balanced")],
    4: [("lfm2", "contiguous"), ("lfm2", "balanced"), ("lfm2_moe", "auto")],
}


def _problems(label: str, family: str, got) -> list[str]:
    c = compare(truth(family, hybrid_docs()), got, build_tiny_hybrid(family), LIMIT, loss_limit=LIMIT)
    bad = [] if c.ok else [f"{label}: {c.summary()}"]
    if not any("ShortConv: computed per document" in n for n in got.notes):
        bad.append(f"{label}: the short convolutions were not computed per document (notes {got.notes})")
    return bad


@pytest.mark.parametrize("cp", sorted(CP_RUNS))
def test_cp_matches_each_document_alone(pools, cp):
    runs = CP_RUNS[cp]
    if cp == 1:
        outcomes = [[cp_parity_step(family, layout=layout)] for family, layout in runs]
    else:
        calls = [((family,), {"layout": layout}) for family, layout in runs]
        outcomes = list(pools(cp).run_many(cp_parity_step, calls, timeout=TIMEOUT,
                                           names=[f"{f} cp{cp} {lay}" for f, lay in runs]))
        ids = hybrid_batch(hybrid_docs())["_packed_seq_ids"]
        for layout in ("contiguous", "balanced"):  # documents continue across ranks: history moves
            docs = plan_step(ids, cp, layout).documents
            assert any(p.prev_ranks for r in range(cp) for p in docs.pieces_of(r))
    problems = []
    for (family, layout), per_rank in zip(runs, outcomes):
        assert isinstance(per_rank, list), per_rank
        problems += _problems(f"{family} cp{cp} {layout}", family, per_rank[0])
    assert not problems, "\n".join(problems)


def test_the_stock_model_packed_runs_its_convolution_across_documents():
    model = build_tiny_hybrid("lfm2")
    c = compare(truth("lfm2", hybrid_docs()), packed_reference(model, hybrid_batch(hybrid_docs())), model, LIMIT)
    assert c.worst > 1e-3, c.summary()
