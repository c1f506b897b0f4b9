"""Kimi Delta Attention models (Kimi Linear; Ling, ``bailing_hybrid``, with its safe gate) train under CP with the
same few lines as Llama: the loss and every parameter's gradient equal each document run alone on one device, at
CP 1, 2 and 4, on every layout, in float64 (the truth with the KDA layers in float64: verify.model.hybrid's
"mixers64"). Outside a step the layer is transformers' own; a cache or a mask under a step is refused
(tests/test_hf_hybrid.py, for every installed family).

What the models compute in float32 whatever their dtype: the KDA layer's forget gate (``.float()``), its kernel
(``chunk_kimi_delta_attention`` casts q, k, v, g, beta to float32) and its gated RMSNorm — the truth and the
installed layer compute them in float64 (the installed layer: in the model's dtype, float32 at least); the
RMSNorms' normalisation (``x.to(float32)``, elementwise, its weight applied in the model's dtype: the same rounding
in the truth and under CP, measured 6e-16); the MoE router (``F.linear`` in float32; the tiny models here have
dense MLPs). Measured: every gradient and the loss within 3e-15 of the truth at CP 1, 2 and 4."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from blockdiag_dist import plan_step  # noqa: E402
from blockdiag_dist.mixers import plan_recurrence  # noqa: E402
from verify.model.harness import compare  # noqa: E402
from verify.model.hybrid import build_tiny_hybrid, cp_parity_step, hybrid_batch, hybrid_docs, truth  # noqa: E402

from test_hf_hybrid import cp_problems  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_LIMIT = 1e-10
TIMEOUT = 300.0


@functools.lru_cache(maxsize=None)
def the_truth(family: str):
    return truth(family, hybrid_docs())


def float64_problems(label: str, family: str, got) -> list[str]:
    c = compare(the_truth(family), got, build_tiny_hybrid(family), FLOAT64_LIMIT)
    bad = [f"{label}: loss {c.loss_rel:.1e}"] if c.loss_rel > FLOAT64_LIMIT else []
    bad += [f"{label}: {n} {e:.1e} > {FLOAT64_LIMIT:g} ({c.summary()})" for n, e in c.per_param.items() if e > FLOAT64_LIMIT]
    if not any("computed per document" in n and "kimi_delta_attention" in n for n in got.notes):
        bad.append(f"{label}: the KDA layers were not computed per document (notes {got.notes})")
    return bad


CP_RUNS = {  # CP size -> (family, layout, checkpointing)
    2: [("kimi_linear", "contiguous", None), ("kimi_linear", "balanced", None), ("kimi_linear", "auto", None),
        ("bailing_hybrid", "balanced", "non_reentrant")],
    4: [("kimi_linear", "contiguous", None), ("kimi_linear", "balanced", None), ("kimi_linear", "auto", "reentrant"),
        ("bailing_hybrid", "contiguous", None)],
}


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_kda_models_match_each_document_alone(pools, cp):
    """(Both were refused by the guard before: tests/test_never_silent.py.)"""
    if cp == 1:
        problems = [p for fam in ("kimi_linear", "bailing_hybrid") for p in float64_problems(f"{fam} cp1", fam, cp_parity_step(fam))]
    else:
        problems = cp_problems(pools, cp, CP_RUNS[cp], float64_problems, TIMEOUT)
        ids = hybrid_batch(hybrid_docs())["_packed_seq_ids"]
        for layout in ("contiguous", "balanced"):  # documents cross ranks: summaries (with transitions at CP 4) move
            docs = plan_step(ids, cp, layout).documents
            assert any(plan_recurrence(docs, r).any_traffic for r in range(cp))
    assert not problems, "\n".join(problems)


def test_install_refuses_other_classes():
    from blockdiag_dist.integrations.hf_mixers import install_kda

    with pytest.raises(ValueError, match=r"install_kda: expected one of .*KimiLinearDeltaAttention.*, got Linear"):
        install_kda(torch.nn.Linear)
