"""The CUDA flash-linear-attention path of the Gated DeltaNet mixer on the CPU, through the strict emulation of
fla-core 0.6.0's ``chunk_gated_delta_rule`` (``verify.gpu.emulate``): what it refuses, what it computes, and the
verifier's gated-delta cases at CP 1, 2 and 4 run through it. Only fla's Triton kernel itself is not run."""

from __future__ import annotations

import re

import pytest
import torch

from blockdiag_dist.kernels import gated_delta
from blockdiag_ref import reference_gated_delta_rule
from conftest import assert_pass
from verify.cases import Case, mixer_matrix
from verify.gpu import emulate
from verify.gpu.emulate import chunk_gated_delta_rule, emulated


def _inputs(T: int = 11, H: int = 2, HV: int = 4, K: int = 4, V: int = 3, B: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=g, dtype=dtype)
    gate = -torch.nn.functional.softplus(torch.randn(B, T, HV, generator=g)).to(dtype)
    beta = torch.rand(B, T, HV, generator=g).to(dtype)
    return q, k, v, gate, beta


@pytest.mark.parametrize("change, message", [
    pytest.param(dict(B=2), "The batch size is expected to be 1 rather than 2", id="batch-2-with-cu"),
    pytest.param(dict(initial=torch.zeros(2, 4, 4, 3)), "i.e., 3 rather than 2", id="initial-states-ne-sequences"),
    pytest.param(dict(K=260), "head dimension larger than 256", id="head-dim"),
    pytest.param(dict(dtype=torch.float64), "q must be float32, float16 or bfloat16", id="float64"),
    pytest.param(dict(HV=3), "must be evenly divisible", id="gva"),
    pytest.param(dict(cu=torch.tensor([0, 4, 9])), "must run from 0 to 11 tokens", id="cu-short"),
    pytest.param(dict(cu=torch.tensor([0, 4, 4, 11])), "at least one token", id="empty-sequence"),
    pytest.param(dict(kw=dict(chunk_size=128)), "`chunk_size` must be 16, 32, or 64", id="chunk-size"),
    pytest.param(dict(kw=dict(use_gate_in_kernel=True)), "not emulated", id="unused-option"),
])
def test_the_fla_emulation_refuses_what_fla_refuses(change, message):
    q, k, v, g, beta = _inputs(B=change.get("B", 1), K=change.get("K", 4), HV=change.get("HV", 4), dtype=change.get("dtype", torch.float32))
    cu = change.get("cu", torch.tensor([0, 4, 5, 11]))
    with pytest.raises((ValueError, NotImplementedError), match=re.escape(message)):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=change.get("initial"), cu_seqlens=cu, **change.get("kw", {}))


def test_the_fla_emulation_computes_the_gated_delta_rule_per_sequence():
    """Against blockdiag_ref's token-by-token recurrence (doc ids from cu_seqlens, GVA, l2-normalised q and k):
    the output in the inputs' dtype, the final state in float32, the initial state's gradient carried."""
    q, k, v, g, beta = _inputs()
    cu = torch.tensor([0, 4, 5, 11])
    ids = torch.repeat_interleave(torch.arange(1, 4), cu.diff())[None]
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, output_final_state=True)
    ref = reference_gated_delta_rule(q, k, v, g, beta, ids)
    assert out.dtype == torch.float32 and final.dtype == torch.float32 and final.shape == (3, 4, 4, 3)
    assert (out.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    # a sequence's final state continues it: the last sequence split in two gives the same output
    _, head = chunk_gated_delta_rule(*(t[:, 5:8] for t in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 3]),
                                     use_qk_l2norm_in_kernel=True, output_final_state=True)
    h0 = head.clone().requires_grad_()
    tail, _ = chunk_gated_delta_rule(*(t[:, 8:] for t in (q, k, v, g, beta)), initial_state=h0, cu_seqlens=torch.tensor([0, 3]),
                                     use_qk_l2norm_in_kernel=True)
    assert (tail - out[:, 8:]).abs().max() <= 1e-6
    tail.sum().backward()
    assert h0.grad is not None and h0.grad.abs().sum() > 0


def test_the_torch_branch_and_the_fla_branch_agree():
    """blockdiag's own chunked kernel and the fla branch (through the emulation) on the same packed pieces with
    initial states: same outputs, final states and gradients, and the fla branch really ran."""
    T, H, K, V = 13, 2, 4, 3
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(T, H, V, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(T, H, generator=gen))
    beta = torch.rand(T, H, generator=gen)
    initial = torch.randn(3, H, K, V, generator=gen)
    meta = gated_delta.plan_chunks([0, 6, 7, 13], chunk=4)
    results = []
    for use_fla in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, initial)]
        with emulated() as calls:
            before = calls["chunk_gated_delta_rule"]
            if not use_fla:
                gated_delta.FLA_DEVICE_TYPES = ()
            out, final = gated_delta.chunk_gated_delta(*leaves[:5], meta, leaves[5])
            assert calls["chunk_gated_delta_rule"] - before == int(use_fla)
        (out.sum() + final.square().sum()).backward()
        results.append([out, final, *(t.grad for t in leaves)])
    for a, b in zip(*results):
        assert (a - b).abs().max() <= 1e-4 * (1 + b.abs().max())


def gated_delta_cases(cp: int) -> list[Case]:
    return [c for c in mixer_matrix(cps=(cp,), dtypes=("float32",), layouts=("contiguous", "balanced"), layers=("gated_delta",))]


def test_verifier_gated_delta_cases_at_cp1_run_through_the_fla_emulation(one_thread):
    from verify.gpu.backends import BackendRecorder
    from verify.gpu.matrix import run_one

    cases = gated_delta_cases(1)
    with emulated() as calls:
        before = calls["chunk_gated_delta_rule"]
        results = [run_one(c, torch.device("cpu"), BackendRecorder()) for c in cases]
        assert calls["chunk_gated_delta_rule"] > before
    assert_pass(results)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [2, 4])
def test_verifier_gated_delta_cases_at_cp2_and_4_run_through_the_fla_emulation(emulated_session, cp):
    cases = gated_delta_cases(cp)
    assert any(c.name == "padding-rank" for c in cases)
    assert_pass(emulated_session.run(cases))
    per_rank = emulated_session.pool(cp).run(emulate.calls, timeout=60, name="emulated calls")
    assert all(r.get("chunk_gated_delta_rule", 0) > 0 for r in per_rank), per_rank
