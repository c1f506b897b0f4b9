"""Mamba1 models (Jamba, Falcon-Mamba, Mamba, Zamba: the selective scan) train under CP with the same few lines as
Llama: the loss and every parameter's gradient equal each document run alone on one device, at CP 1, 2 and 4, on
every layout, in float64 (the truth with the Mamba1 layers in float64, see verify.model.hybrid), with activation
checkpointing too. The stock layer outside a step and the refusal of a cache or a mask are
tests/test_hf_hybrid.py's.

What the models compute in float32 whatever their dtype, and what it costs here: Mamba and Falcon-Mamba cast their
logits to float32 (``lm_head(...).float()``), so their loss is a float32 sum (measured up to 5.3e-8 against the
per-document sum; every gradient stays below 1e-15); their blocks' ``residual_in_fp32`` (default True) casts every
residual to float32, a rounding of every hidden state that the tiny models turn off (``verify.model.hybrid``). The
stock Mamba1 layers compute their decays, state updates and the norms of ``dt, B, C`` in float32 (float64 in the
truth, see ``float64_kernel``, and under CP). Jamba and Zamba: nothing (loss and gradients at 1e-16)."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from verify.model.hybrid import build_tiny_hybrid, cp_parity_step  # noqa: E402

from mixer_checks import assert_summaries_cross, parity_problems  # noqa: E402
from test_hf_hybrid import cp_problems, the_truth  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_LIMIT = 1e-10
FLOAT32_LIMIT = 1e-6  # a loss the model sums in float32 (see the module docstring; measured <= 5.3e-8)
TIMEOUT = 300.0
FLOAT32_LOSS = ("mamba", "falcon_mamba")  # logits cast to float32 by the model


@functools.lru_cache(maxsize=None)
def truth_and_model(family: str):
    """The per-document truth and the model it ran (built once per family: several CP runs compare with them)."""
    return the_truth(family), build_tiny_hybrid(family)


def float64_problems(label: str, family: str, got) -> list[str]:
    ref, model = truth_and_model(family)
    return parity_problems(label, got, ref, model, computed="selective_scan", layers="Mamba1", limit=FLOAT64_LIMIT,
                           loss_limit=FLOAT32_LIMIT if family in FLOAT32_LOSS else FLOAT64_LIMIT)


@pytest.mark.parametrize("family", ["jamba", "falcon_mamba", "mamba", "zamba"])
def test_cp1_matches_each_document_alone(family):
    """(Refused by the guard before: tests/test_never_silent.py.)"""
    assert not float64_problems(f"{family} cp1", family, cp_parity_step(family))


CP_RUNS = {  # CP size -> (family, layout, checkpointing)
    2: [("jamba", "contiguous", None), ("jamba", "balanced", None), ("jamba", "auto", "non_reentrant"),
        ("falcon_mamba", "contiguous", None), ("falcon_mamba", "balanced", "reentrant"), ("falcon_mamba", "auto", None),
        ("zamba", "balanced", None)],
    4: [("jamba", "contiguous", None), ("jamba", "balanced", None), ("jamba", "auto", None),
        ("falcon_mamba", "contiguous", None), ("falcon_mamba", "balanced", None), ("falcon_mamba", "auto", None)],
}


@pytest.mark.parametrize("cp", sorted(CP_RUNS))
def test_cp_matches_each_document_alone(pools, cp):
    problems = cp_problems(pools, cp, CP_RUNS[cp], float64_problems, TIMEOUT)
    assert_summaries_cross(cp, transitions=True)  # documents cross ranks: summaries (transitions at CP 4) move
    assert not problems, "\n".join(problems)


def test_install_refuses_other_classes():
    from blockdiag_dist.integrations.hf_mixers import install_mamba1

    with pytest.raises(ValueError, match=r"install_mamba1: expected one of .*JambaMambaMixer.*, got Linear"):
        install_mamba1(torch.nn.Linear)


def test_the_docs_example_trains_a_tiny_jamba():
    """docs/hybrid.md's Jamba step runs as written (its assert: the Mamba layers were computed per document)."""
    import mixer_checks

    ns = mixer_checks.docs_example("jamba_step")  # runs the block: its step, with its assert
    assert torch.isfinite(ns["loss"]) and ns["loss"].grad_fn is not None
