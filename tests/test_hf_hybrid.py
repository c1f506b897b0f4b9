"""Hybrid transformers models (Gated DeltaNet + attention) train under CP with the same few lines as Llama:
the loss and every parameter's gradient equal each document run alone on one device, at CP 1, 2, 4 and
DP 2 x CP 2, on every layout, in float64 (the truth with the Gated DeltaNet layers in float64, see
verify.model.hybrid), under
bf16 autocast (within the rule: twice the single-device bf16 error plus a floor) and with activation
checkpointing, reentrant and not. Outside a step the layer is transformers' own."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx, plan_step  # noqa: E402
from blockdiag_dist.mixers import plan_conv, plan_recurrence  # noqa: E402
from verify.model.harness import compare, text_forward  # noqa: E402
from verify.model.hybrid import (  # noqa: E402
    build_tiny_hybrid, cp_parity_step, float32_reduced, hybrid_batch, hybrid_docs, truth,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_LIMIT = 1e-10
FLOAT32_REDUCED_LIMIT = 1e-6  # its RMSNorm weights' gradients, which the model sums over tokens in float32 (~1e-7)
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-3
BF16_GROSS = 0.1  # per parameter: bf16 rounding stays far below (measured <= 7e-2 on A_log / dt_bias)
TIMEOUT = 240.0


@functools.lru_cache(maxsize=None)
def the_truth(family: str, **kw):
    return truth(family, hybrid_docs(), **kw)


def float64_problems(label: str, family: str, got) -> list[str]:
    ref = the_truth(family)
    c = compare(ref, got, build_tiny_hybrid(family), FLOAT64_LIMIT)
    bad = [f"{label}: loss {c.loss_rel:.1e}"] if c.loss_rel > FLOAT64_LIMIT else []
    for name, err in c.per_param.items():
        limit = FLOAT32_REDUCED_LIMIT if float32_reduced(name) else FLOAT64_LIMIT
        if err > limit:
            bad.append(f"{label}: {name} {err:.1e} > {limit:g} ({c.summary()})")
    if not any("computed per document" in n for n in got.notes):
        bad.append(f"{label}: the Gated DeltaNet layers were not computed per document (notes {got.notes})")
    return bad


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_cp1_matches_each_document_alone(family):
    got = cp_parity_step(family)
    assert not float64_problems(f"{family} cp1", family, got)


CP_RUNS = {  # CP size -> (family, layout, checkpointing)
    2: [("qwen3_next", "contiguous", None), ("qwen3_next", "balanced", None), ("qwen3_next", "auto", None),
        ("qwen3_5", "balanced", None), ("qwen3_next", "contiguous", "reentrant"), ("qwen3_next", "balanced", "non_reentrant")],
    4: [("qwen3_next", "contiguous", None), ("qwen3_next", "balanced", None), ("qwen3_next", "auto", None),
        ("qwen3_5_moe", "contiguous", None)],
}


def cp_problems(pools, cp: int, runs, problems_of, timeout: float = TIMEOUT) -> list[str]:
    """One step of each ``(family, layout, checkpointing)`` of ``runs`` on the CP pool of ``cp`` ranks; what
    ``problems_of(label, family, step)`` finds in each (rank 0's step: loss and gradients summed over the group)."""
    calls = [((family,), {"layout": layout, "checkpointing": ck}) for family, layout, ck in runs]
    names = [f"{family} cp{cp} {layout} ckpt={ck}" for family, layout, ck in runs]
    problems = []
    for name, (family, _, _), per_rank in zip(names, runs, pools(cp).run_many(cp_parity_step, calls, timeout=timeout,
                                                                               names=names)):
        assert isinstance(per_rank, list), per_rank
        problems += problems_of(name, family, per_rank[0])
    return problems


@pytest.mark.parametrize("cp", sorted(CP_RUNS))
def test_cp_matches_each_document_alone(pools, cp):
    problems = cp_problems(pools, cp, CP_RUNS[cp], float64_problems)
    ids = hybrid_batch(hybrid_docs())["_packed_seq_ids"]
    for layout in ("contiguous", "balanced"):  # the inputs make documents cross ranks: summaries and histories move
        plan = plan_step(ids, cp, layout)
        assert plan_recurrence(plan.documents, 0).any_traffic and plan_conv(plan, 1, 4).mode != "local"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_dp2_cp2_matches_each_document_alone(pools, layout):
    per_rank = pools(4).run(cp_parity_step, args=("qwen3_next",), kwargs={"layout": layout, "dp": 2}, timeout=TIMEOUT,
                            name=f"dp2 x cp2 {layout}")
    assert not float64_problems(f"dp2 x cp2 {layout}", "qwen3_next", per_rank[0])


def kind_errors(ref, got, model) -> dict[str, float]:
    """Relative (Frobenius) error of every module kind's gradients taken together: the kind's scale absorbs the
    rounding of tiny, cancelling gradients (a Gated DeltaNet's ``A_log`` / ``dt_bias``: 4 numbers each, sums
    over every token of terms of both signs, whose own relative bf16 error swings tenfold between seeds)."""
    from verify.model.harness import module_kind

    diff, norm = {}, {}
    for name, r in ref.grads.items():
        kind = module_kind(model, name)
        diff[kind] = diff.get(kind, 0.0) + float(((got.grads[name] - r) ** 2).sum())
        norm[kind] = norm.get(kind, 0.0) + float((r ** 2).sum())
    return {k: (diff[k] / norm[k]) ** 0.5 for k in diff}


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_bf16_autocast_within_twice_the_single_device_error(pools, family):
    """Under bf16 autocast (float32 weights) the error against the float64 truth is, per module kind, at most
    twice the error of the stock model run per document under the same autocast on one device, plus a floor;
    and no parameter's gradient is grossly wrong."""
    base = the_truth(family, stock_kernel=True, dtype=torch.float32, autocast=True)
    ref = the_truth(family)
    got = pools(2).run(cp_parity_step, args=(family,), kwargs={"dtype": "float32", "autocast": True,
                       "layout": "balanced"}, timeout=TIMEOUT, name=f"{family} bf16 autocast cp2")[0]
    model = build_tiny_hybrid(family)
    e_base, e_got = kind_errors(ref, base, model), kind_errors(ref, got, model)
    bad = [f"{k}: {e_got[k]:.2e} > 2 x {e:.2e} + {BF16_FLOOR}" for k, e in e_base.items()
           if e_got[k] > BF16_FACTOR * e + BF16_FLOOR]
    c_base, c_got = compare(ref, base, model, 1.0), compare(ref, got, model, 1.0)
    assert c_got.loss_rel <= BF16_FACTOR * c_base.loss_rel + BF16_FLOOR
    bad += [f"{n}: {e:.2e} (a wrong gradient, not rounding)" for n, e in c_got.per_param.items() if e > BF16_GROSS]
    assert not bad, "\n".join(bad)


# family -> (the layer's path in the tiny model, its installer in blockdiag_dist.integrations.hf_mixers)
INSTALLED = {
    "qwen3_next": ("model.layers.0.linear_attn", "install_gated_delta_net"),
    "nemotron_h": ("model.layers.0.mixer", "install_mamba2"),
    "lfm2": ("model.layers.0.conv", "install_short_conv"),
    "kimi_linear": ("model.layers.0.self_attn", "install_kda"),
    "jamba": ("model.layers.0.mamba", "install_mamba1"),
    "zamba": ("model.layers.0.mamba", "install_mamba1"),
}


@pytest.mark.parametrize("family", sorted(INSTALLED))
def test_outside_a_step_the_layer_is_transformers_own(family):
    model = build_tiny_hybrid(family)
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, hybrid_batch(hybrid_docs()))
    with ctx():  # the guard installs the per-document forward on the class
        text_forward(model, local)
    layer = model.get_submodule(INSTALLED[family][0])
    stock = type(layer).forward._blockdiag_stock
    h = torch.randn(2, 16, 32, dtype=torch.float64)
    assert torch.equal(layer(h), stock(layer, h)), "outside a step the installed forward must call the stock one"


@pytest.mark.parametrize("family", sorted(INSTALLED))
def test_refuses_a_cache_or_a_mask_under_a_step(family):
    from blockdiag_dist.integrations import hf_mixers

    path, installer = INSTALLED[family]
    layer = build_tiny_hybrid(family).get_submodule(path)
    getattr(hf_mixers, installer)(type(layer))
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, hybrid_batch(hybrid_docs()), expect_attention=False)
    h = torch.randn(*local["input_ids"].shape, 32, dtype=torch.float64)
    with ctx():
        with pytest.raises(ValueError, match=r"expected no cache under a CP step \(use_cache=False in training\), got object"):
            layer(h, cache=object())
        with pytest.raises(ValueError, match=r"expected no attention_mask under a CP step .*got a tensor of shape \(2, 64\)"):
            layer(h, attention_mask=torch.ones(2, 64))
        for alias in ("cache_params", "past_key_values"):  # the deprecated names transformers renames to the cache
            with pytest.raises(ValueError, match=r"expected no cache under a CP step .*got object"):
                layer(h, **{alias: object()})
        with pytest.raises(ValueError, match=r"expected no cache under a CP step .*got object"):
            layer(h, object())  # by position, as the stock signature orders them (cache, attention_mask)
        for twice in ({"cache": None}, {"cache_params": None}, {"attention_mask": None}):  # given twice
            with pytest.raises(TypeError, match=rf"{type(layer).__name__}.forward: .*multiple values for argument "
                                                r"'(cache|attention_mask)'"):
                layer(h, None, None, **twice)


def test_a_subclass_is_read_by_its_own_signature():
    """The installers accept subclasses, whose forward may order its parameters otherwise: under a step a
    positional argument is read by the installed class's own signature."""
    from blockdiag_dist.integrations.hf_mixers import install_mamba2

    layer = build_tiny_hybrid("nemotron_h").get_submodule("model.layers.0.mixer")
    base = type(layer)

    class MaskFirst(base):
        def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
            return base.forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)

    layer.__class__ = MaskFirst
    install_mamba2(MaskFirst)
    h = torch.randn(2, 16, 32, dtype=torch.float64)
    assert torch.equal(layer(h), base.forward(layer, h)), "outside a step the subclass's own forward runs"
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, hybrid_batch(hybrid_docs()), expect_attention=False)
    h = torch.randn(*local["input_ids"].shape, 32, dtype=torch.float64)
    with ctx():
        with pytest.raises(ValueError, match=r"MaskFirst \(layer 0\): expected no cache under a CP step .*got object"):
            layer(h, None, object())
        with pytest.raises(ValueError, match=r"expected no attention_mask under a CP step .*got a tensor of shape \(2, 64\)"):
            layer(h, torch.ones(2, 64), None)
        with pytest.raises(TypeError, match=r"MaskFirst.forward: too many positional arguments \(expected the parameters "
                                            r"of MaskFirst.forward: \(self, hidden_states, attention_mask, cache, \*\*kwargs\)"):
            layer(h, None, None, None)
