"""Hugging Face transformers models train with block-diagonal CP through ``AttentionInterface``.

- the collator's pre-shifted labels give transformers' own shifted loss;
- a registered ``blockdiag_cp`` model gets no mask from transformers and calls our attention in every layer;
- at CP 1 it matches transformers' own SDPA on the packed batch (which finds the documents from
  ``position_ids``): an oracle independent of blockdiag;
- at CP 2 its losses, first-step gradients and final weights match CP 1 (Llama; Qwen2 with a sliding-window
  layer; with and without gradient checkpointing);
- batches from transformers' own ``DataCollatorWithFlattening`` (one row, documents marked only by
  ``position_ids`` restarts) train a Llama at CP 2 as transformers' SDPA trains it in one process.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the 'hf' extra: pip install -e '.[hf]')"
)

import blockdiag_dist.integrations.hf as hf_integration  # noqa: E402
from blockdiag_dist import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_dist.integrations import causal_lm_loss, pack_documents, register_transformers_attention  # noqa: E402
from examples.hf import build_tiny_hf, hf_forward  # noqa: E402
from examples.training import (  # noqa: E402
    PARITY_RTOL,
    TrainConfig,
    TrainResult,
    parity,
    run_distributed,
    synthetic_batch,
    train,
)
from verify.pool import WorkerPool  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2
TASK_TIMEOUT_S = 180.0  # per run on every rank: a deadline for hangs, not a speed limit
CASES = [  # (family, dtype, checkpointing)
    ("llama", "float64", None),
    ("llama", "float32", None),
    ("llama", "float64", "reentrant"),
    ("llama", "float64", "non_reentrant"),
    ("qwen2-sliding", "float64", None),
]


@pytest.fixture(scope="module")
def pool2():
    with WorkerPool(2, collective_timeout=TASK_TIMEOUT_S) as pool:
        yield pool


def config(dtype: str, checkpointing: str | None = None) -> TrainConfig:
    return TrainConfig(steps=STEPS, dtype=dtype, checkpointing=checkpointing)


@functools.lru_cache(maxsize=None)
def cp1(family: str, dtype: str, checkpointing: str | None, attn: str | None = None) -> TrainResult:
    cfg = dataclasses.replace(config(dtype, checkpointing), expect_attention=attn is None)  # attn: not routed
    return train(build_tiny_hf(cfg, family, attn), cfg, forward=hf_forward)


def test_collator_labels_equal_transformers_shifted_labels():
    """transformers shifts ``labels`` inside the model; ``pack_documents``' labels are already shifted, with
    -100 where the next token is another document's. Same loss when transformers is given -100 at every
    document start and on padding."""
    model = build_tiny_hf(config("float32"), "llama", "sdpa")  # transformers computes its loss in float32
    batch = pack_documents([[5, 6, 7, 8], [9, 10, 11], [3, 4], [12]], seq_len=6)  # 3 rows, padding, a 1-token doc
    starts = (batch["position_ids"] == 0) | (batch["_packed_seq_ids"] == 0)
    hf_labels = batch["input_ids"].masked_fill(starts, -100)
    theirs = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=hf_labels, use_cache=False)
    ours = causal_lm_loss(theirs.logits, batch["labels"], int((batch["labels"] != -100).sum()))
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-6, atol=0)
    # the naive labels=input_ids predicts across document ends and padding: a different loss
    naive = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["input_ids"], use_cache=False
    )
    assert abs(naive.loss.item() - ours.item()) > 1e-3


@pytest.fixture
def attention_calls(monkeypatch) -> list:
    """The ``attn_mask`` of every call the registered attention makes to ``cp_blockdiag_sdpa``."""
    calls, real = [], hf_integration.cp_blockdiag_sdpa

    def spy(*args, **kwargs):
        calls.append(kwargs["attn_mask"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_integration, "cp_blockdiag_sdpa", spy)
    return calls


def one_step_at_cp1(model) -> None:
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, pack_documents([[1, 2, 3], [4, 5]], seq_len=5))
    with train_ctx():
        hf_forward(model, batch).sum().backward()


def test_registered_attention_gets_no_mask_and_runs_every_layer(attention_calls):
    name = register_transformers_attention()
    assert name == "blockdiag_cp" and name in transformers.AttentionInterface()
    cfg = config("float64")
    one_step_at_cp1(build_tiny_hf(cfg, "llama"))
    assert len(attention_calls) == cfg.model.layers
    if int(transformers.__version__.split(".")[0]) >= 5:  # 4.x builds a local 4-D mask, which is ignored
        assert all(mask is None for mask in attention_calls), "transformers 5 builds no mask for an unregistered type"


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_checkpointing_recomputes_through_our_attention(attention_calls, checkpointing):
    cfg = config("float64", checkpointing)
    one_step_at_cp1(build_tiny_hf(cfg, "llama"))
    assert len(attention_calls) == 2 * cfg.model.layers, "expected each layer's forward and its recompute"


@pytest.mark.parametrize("family", ["llama", "qwen2-sliding"])
def test_cp1_matches_transformers_sdpa_on_the_packed_batch(family):
    ours, theirs = cp1(family, "float64", None), cp1(family, "float64", None, "sdpa")
    p = parity(theirs, ours)
    assert p.ok("float64"), p


def test_cp2_matches_cp1(pool2):
    names = [f"{family} {dtype} checkpointing={ck}" for family, dtype, ck in CASES]
    calls = [
        ((config(dtype, ck), 1, 2, functools.partial(build_tiny_hf, family=family), hf_forward), {})
        for family, dtype, ck in CASES
    ]
    outcomes = list(pool2.run_many(run_distributed, calls, timeout=TASK_TIMEOUT_S, names=names))
    assert len(outcomes) == len(CASES) and all(isinstance(o, list) for o in outcomes), outcomes[-1]
    failures = []
    for name, (family, dtype, ck), per_rank in zip(names, CASES, outcomes):
        got = per_rank[0]
        if all(mode == "local" for mode in got.modes):
            failures.append(f"{name}: no step exchanged keys across CP ranks (modes {got.modes})")
        p = parity(cp1(family, dtype, ck), got)
        if not p.ok(dtype):
            failures.append(f"{name}: {p} exceeds relative {PARITY_RTOL[dtype]:g}")
    assert not failures, "\n".join(failures)


def test_flattening_collator_batches_at_cp2_match_transformers_sdpa(pool2):
    """``DataCollatorWithFlattening`` output (labels in transformers' convention, pre-shifted by ``shift_labels``;
    no doc ids, no mask: the documents are the ``position_ids`` restarts) at CP 2 with blockdiag's attention
    against transformers' own SDPA in one process on the same batches."""
    cfg = dataclasses.replace(config("float64"), collator="hf_flattening")
    batch = synthetic_batch(cfg, 0)
    assert sorted(batch) == ["input_ids", "labels", "position_ids"] and batch["input_ids"].shape[0] == 1
    assert int((batch["position_ids"] == 0).sum()) > 4, "expected several documents in the flattened row"
    oracle = dataclasses.replace(cfg, expect_attention=False)  # transformers' SDPA: not routed, on purpose
    theirs = train(build_tiny_hf(oracle, "llama", "sdpa"), oracle, forward=hf_forward)
    args = (cfg, 1, 2, functools.partial(build_tiny_hf, family="llama"), hf_forward)
    got = pool2.run(run_distributed, args=args, timeout=TASK_TIMEOUT_S, name="llama flattening collator at CP 2")[0]
    assert any(mode != "local" for mode in got.modes), got.modes
    p = parity(theirs, got)
    assert p.ok("float64"), f"{p} exceeds relative {PARITY_RTOL['float64']:g}"
