"""No SDPA call of ours gets a query row with no key to attend to: CUDA's fused backends (cuDNN, memory-
efficient) may return NaN for such a row, in its output or in the gradients (pytorch #196678), however the
caller zeroes it afterwards. Checked on every call the kernels that run on CUDA make (the dense kernel, the
varlen kernel's masked plan) and the verifier's single-device baseline makes, over the verifier's CP 1 matrix
(every named layout, padding inside rows and whole padding rows, every doc-id source)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import blockdiag_dist.kernels.varlen as varlen
from conftest import assert_pass
from verify.cases import SOURCES, default_matrix
from verify.gpu.backends import BackendRecorder, fully_masked_rows
from verify.gpu.matrix import run_one


def test_fully_masked_rows_are_counted():
    q = torch.randn(1, 2, 3, 4)
    mask = torch.tensor([[True, False, False], [False, False, False], [True, True, False]])
    assert fully_masked_rows((q, q, q, mask), {}) == 1
    additive = torch.zeros(3, 3).masked_fill(~mask, -torch.inf)
    assert fully_masked_rows((q, q, q), {"attn_mask": additive}) == 1
    assert fully_masked_rows((q, q, q, None, 0.0, True), {}) == 0
    rec = BackendRecorder()
    with rec.role("planted"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert rec.counts()["planted"]["fully masked rows"] == 1


@pytest.mark.parametrize("kernel", ["dense", "varlen-masked"])
def test_no_sdpa_call_gets_a_fully_masked_row(monkeypatch, one_thread, kernel):
    """The varlen kernel runs its masked plan on CUDA (the fused CPU blocks are CPU-only): forced here."""
    if kernel == "varlen-masked":
        monkeypatch.setattr(varlen, "fused_unusable_reason", lambda *a: "forced: the plan CUDA runs")
    base = default_matrix(cps=(1,), dtypes=("float32",), kernels=(kernel.split("-")[0],), exchanges=(None,))
    cases = [dataclasses.replace(c, source=s) for i, c in enumerate(base) for s in SOURCES if not c.sinks and not c.softcap
             and (i + SOURCES.index(s)) % 2 == 0]
    assert any(c.name == "middle-padding" for c in cases) and any(c.name == "padding-rank" for c in cases)
    rec = BackendRecorder()
    results = [run_one(c, torch.device("cpu"), rec) for c in cases]
    assert_pass(results)
    counts = rec.counts()
    assert sum(counts["baseline"].values()) > 0 and sum(counts[f"implementation {kernel.split('-')[0]}"].values()) > 0
    assert {role: c.get("fully masked rows", 0) for role, c in counts.items()} == dict.fromkeys(counts, 0)
