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

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from verify.model.hybrid import build_tiny_hybrid, cp_parity_step  # noqa: E402

from mixer_checks import assert_summaries_cross, parity_problems  # noqa: E402
from test_hf_hybrid import cp_problems, the_truth  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_LIMIT = 1e-10
TIMEOUT = 300.0


def float64_problems(label: str, family: str, got) -> list[str]:
    return parity_problems(label, got, the_truth(family), build_tiny_hybrid(family), computed="kimi_delta_attention",
                           layers="KDA", limit=FLOAT64_LIMIT)


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
        assert_summaries_cross(cp)  # documents cross ranks: summaries move
    assert not problems, "\n".join(problems)


def test_install_refuses_other_classes():
    from blockdiag_dist.integrations.hf_mixers import install_kda

    with pytest.raises(ValueError, match=r"install_kda: expected one of .*KimiLinearDeltaAttention.*, got Linear"):
        install_kda(torch.nn.Linear)
