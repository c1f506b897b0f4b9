"""TRL's SFTTrainer (packing on) and transformers' Trainer with block-diagonal CP (``BlockdiagSFTTrainer``).

- after one step, every parameter's gradient equals the one of each document run alone on one device (float64),
  at CP 1 in this process and at CP 2 and DP 2 x CP 2 in process groups: text (Llama), hybrid (Qwen3.5's Gated
  DeltaNet, Nemotron-H's Mamba2, LFM2's short convolutions) and sinks (gpt-oss);
- the losses the Trainer logs over several steps at CP 2 equal CP 1's;
- what would train silently wrong is refused at construction or at the first step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (the 'trainer' extra: pip install -e '.[trainer]')")

from examples.trl_sft import run_sft, tiny_model, tiny_tokenizer  # noqa: E402
from trainer_checks import (  # noqa: E402
    bf16_on_rank, compiled_on_rank, fsdp2_on_rank, fsdp_note_on_rank, per_document_truth, perturbation_probe, run_on_rank, sft_on_rank,
    vlm_on_rank, worst_gradient_error,
)
from verify.tolerances import TOLERANCES, judge  # noqa: E402
from verify.trainers import FLOAT64_LIMIT, TRL_FLOAT32_HEAD_LIMIT  # noqa: E402  (the limits the report uses)

pytestmark = pytest.mark.usefixtures("one_thread")

TIMEOUT_S = 240.0  # per run on every rank: a deadline for hangs, not a speed limit
FAMILIES = ["llama", "qwen3_5", "nemotron_h", "lfm2", "gpt_oss"]
# transformers' models compute parts of a float64 model in float32 (RMSNorms, rotary angles, the loss's logits, MoE
# routing; the stock Gated DeltaNet / Mamba2 gates): runs and truths here compute the whole forward in float64
# (examples.trl_sft.promoted; measured <= 3.2e-14 at CP 2 for every family). As written, a float64 hidden state that
# differs from the truth's in its last bits can round to another float32: measured 1.5e-7 (Llama, DP 2 x CP 2).
# TRL 1.16's SFTTrainer scores tokens with its fused LM head in float32: TRL_FLOAT32_HEAD_LIMIT (verify/trainers.py).
# The Trainer logs the loss through a float32 accumulator (its tr_loss): logged losses agree to float32.
LOGGED_LOSS_LIMIT = 1e-6


def _check_first_step(model_type: str, run: dict, limit: float = FLOAT64_LIMIT) -> None:
    truth = per_document_truth(model_type, run["batch"])
    assert sorted(run["grads"]) == sorted(truth)
    err, name = worst_gradient_error(run["grads"], truth)
    assert err <= limit, f"{model_type}: gradient of {name} off by {err:.3g} relative (limit {limit:g})"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_trainer_at_cp2_first_step_gradients_equal_each_document_alone(pools, model_type):
    """transformers' Trainer with DataCollatorWithFlattening (documents = position_ids restarts), float64."""
    runs = pools(2).run(sft_on_rank, args=(model_type, 2, 1, "float64", True, "hf"), timeout=TIMEOUT_S,
                        name=f"Trainer {model_type} at CP 2")
    _check_first_step(model_type, runs[0])


def test_trainer_at_cp2_with_the_collators_boundaries_equals_each_document_alone(pools):
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: the documents come from ``cu_seq_lens_q`` (a
    hybrid model: its Gated DeltaNet reads them from the step too), float64."""
    runs = pools(2).run(sft_on_rank, args=("qwen3_5", 2, 1, "float64", True, "hf", True), timeout=TIMEOUT_S,
                        name="Trainer qwen3_5 at CP 2, boundaries")
    assert "cu_seq_lens_q" in runs[0]["batch"]  # the recorded batch is the collator's, before sharding
    _check_first_step("qwen3_5", runs[0])


@pytest.mark.parametrize("model_type", ["qwen3_5", "llama"])
def test_sft_trainer_at_cp2_first_step_gradients_equal_each_document_alone(pools, model_type):
    """TRL's SFTTrainer, packing bfd (padding-free rows), float64 model (TRL's head in float32), TRL's default
    gradient checkpointing."""
    runs = pools(2).run(sft_on_rank, args=(model_type, 2, 1, "float64", True, "sft"), timeout=TIMEOUT_S,
                        name=f"SFTTrainer {model_type} at CP 2")
    _check_first_step(model_type, runs[0], TRL_FLOAT32_HEAD_LIMIT)


def test_trainer_at_cp1_in_one_process_first_step_gradients_equal_each_document_alone():
    run = run_sft("qwen3_5", 1, 1, "float64", record_first_step=True, trainer="hf", rows=8, float64=True)
    _check_first_step("qwen3_5", run)


def test_dp2_x_cp2_first_step_gradients_equal_each_document_alone(pools):
    """Two DP groups of two CP ranks: each DP group trains on its own batches; the gradient of the step is that of
    both groups' documents, each alone, over all their targets."""
    runs = pools(4).run(_dp_cp_on_rank, args=("llama",), timeout=TIMEOUT_S, name="Trainer llama at DP 2 x CP 2")
    batches = [runs[0]["batch"], runs[2]["batch"]]  # rank 0 leads DP group 0, rank 2 DP group 1
    assert not torch.equal(batches[0]["input_ids"], batches[1]["input_ids"]), "DP groups must read different batches"
    assert torch.equal(runs[1]["batch"]["input_ids"], batches[0]["input_ids"]), "a CP group must read one batch"
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    truth: dict[str, torch.Tensor] = {}
    for b, n in zip(batches, counts):  # per_document_truth divides by its own batch's targets: rescale to the step's
        for name, g in per_document_truth("llama", b).items():
            truth[name] = truth.get(name, 0) + g * n / sum(counts)
    err, name = worst_gradient_error(runs[0]["grads"], truth)
    assert err <= FLOAT64_LIMIT, f"gradient of {name} off by {err:.3g} relative"


def _dp_cp_on_rank(model_type: str) -> dict:
    return run_sft(model_type, 2, 1, "float64", record_first_step=True, trainer="hf", float64=True)


def _step_truth(model_type: str, batches: list[dict]) -> dict[str, torch.Tensor]:
    """The per-document truth of a step over the batches of all DP groups, divided by all their targets."""
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    truth: dict[str, torch.Tensor] = {}
    for b, n in zip(batches, counts):  # per_document_truth divides by its own batch's targets: rescale to the step's
        for name, g in per_document_truth(model_type, b).items():
            truth[name] = truth.get(name, 0) + g * n / sum(counts)
    return truth


def test_bf16_mixed_precision_at_cp2_is_within_the_bfloat16_bound_of_cp1(pools):
    """``bf16=True`` (CPU: float32 weights, bf16 autocast around the forward), tiny Qwen3.5 (attention and Gated
    DeltaNet layers). Every parameter's first-step gradient, against each document alone in float64, within
    verify/tolerances.py's bfloat16 rule: at most 2x the error of the same Trainer at CP 1 in one process under the
    same autocast, plus the bfloat16 floor. Weights and gradients stay float32 (the optimizer's master copy); the
    K/V exchanges moved bfloat16 (2 bytes: attention ran in the autocast dtype)."""
    cp1 = run_sft("qwen3_5", 1, 1, "bf16-mixed", record_first_step=True, trainer="hf")
    run = pools(2).run(bf16_on_rank, args=("qwen3_5", 2), timeout=TIMEOUT_S, name="Trainer qwen3_5 bf16 at CP 2")[0]
    assert torch.equal(run["batch"]["input_ids"], cp1["batch"]["input_ids"])
    assert run["param_dtypes"] == cp1["param_dtypes"] == ["torch.float32"]
    assert {g.dtype for g in run["grads"].values()} == {torch.float32}
    assert run["exchanged_element_sizes"] == [2], run["exchanged_element_sizes"]
    truth = per_document_truth("qwen3_5", run["batch"])
    assert sorted(run["grads"]) == sorted(cp1["grads"]) == sorted(truth)
    for name, t in truth.items():
        base, _ = worst_gradient_error({name: cp1["grads"][name]}, {name: t})
        err, _ = worst_gradient_error({name: run["grads"][name]}, {name: t})
        limit, ok = judge("bfloat16", err, 1.0, base)
        assert ok, f"{name}: bf16 gradient off by {err:.3g} relative at CP 2, CP 1's {base:.3g} (limit {limit:.3g})"


def test_fsdp2_at_dp2_x_cp2_first_step_gradients_equal_each_document_alone(pools):
    """The Trainer's FSDP2 path (``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}``): accelerate shards the
    model with ``fully_shard`` over every rank (DP x CP) and averages the gradients over them; the Trainer's loss is
    each rank's share times the world size, so the average is the sum of the CP ranks' partial gradients. accelerate
    1.15 applies FSDP on accelerator devices only: here its GPU branch's decision is taken on CPU
    (trainer_checks.accelerate_fsdp_on_cpu), the rest is accelerate's own fsdp2_prepare_model on gloo."""
    runs = pools(4).run(fsdp2_on_rank, args=("llama", 2), timeout=TIMEOUT_S, name="Trainer llama FSDP2 at DP 2 x CP 2")
    assert runs[0]["wrapper"].startswith("FSDP"), runs[0]["wrapper"]  # FSDPLlamaForCausalLM: fully_shard applied
    assert not torch.equal(runs[0]["batch"]["input_ids"], runs[2]["batch"]["input_ids"])
    err, name = worst_gradient_error(runs[0]["grads"], _step_truth("llama", [runs[0]["batch"], runs[2]["batch"]]))
    assert err <= FLOAT64_LIMIT, f"gradient of {name} off by {err:.3g} relative"


@pytest.mark.slow(reason="torch.compile of a whole tiny model through the Trainer: about 150 s on 2 busy cores, most of it compiling")
def test_torch_compile_at_cp2_equals_eager(pools):
    """``torch_compile=True`` (backend ``aot_eager``: inductor needs a C++ build per graph) at CP 2: the model is
    compiled, blockdiag's attention runs eagerly behind its ``torch.compiler.disable`` boundary (a graph break per
    call); the first step's gradients and two steps' losses equal eager ones within float32's floor."""
    eager = pools(2).run(compiled_on_rank, args=("llama", 2, False), timeout=TIMEOUT_S, name="Trainer llama eager")[0]
    compiled = pools(2).run(compiled_on_rank, args=("llama", 2, True), timeout=600.0, name="Trainer llama compiled")[0]
    assert compiled["wrapper"] == "OptimizedModule" and eager["wrapper"] != "OptimizedModule"
    assert compiled["graph_breaks"] > 0 and compiled["frames"] > 0, compiled  # compiled around our attention
    err, name = worst_gradient_error(compiled["grads"], eager["grads"])
    assert err <= TOLERANCES["float32"].floor, f"gradient of {name} off by {err:.3g} relative"
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=TOLERANCES["float32"].floor, abs=0)


@pytest.mark.parametrize("trainer", ["hf", "sft"])
def test_cp2_losses_over_steps_equal_cp1(pools, trainer):
    """The logged losses (float32: the Trainer's accumulator) of 5 steps at CP 2 and CP 1."""
    steps, limit = 5, LOGGED_LOSS_LIMIT
    cp1 = run_sft("qwen3_5", 1, steps, "float64", trainer=trainer, float64=trainer == "hf")["losses"]
    runs = pools(2).run(sft_on_rank, args=("qwen3_5", 2, steps, "float64", False, trainer), timeout=TIMEOUT_S,
                        name=f"{trainer} qwen3_5 at CP 2, {steps} steps")
    assert len(cp1) == steps
    for r in runs:
        assert r["losses"] == pytest.approx(cp1, rel=limit, abs=0), (r["losses"], cp1)


def test_gradient_accumulation_and_evaluation_at_cp2_equal_cp1(pools):
    """Two micro-batches per step (one step context each, the loss over both micro-batches' targets) and the
    evaluation loss after training: CP 2 as CP 1. A large learning rate makes a wrong gradient move the next loss."""
    kw = dict(trainer="hf", float64=True, accumulate=2, evaluate=True, lr=0.05)
    cp1 = run_sft("llama", 1, 3, "float64", **kw)
    runs = pools(2).run(run_on_rank, args=("llama", 2, 3, kw), timeout=TIMEOUT_S, name="Trainer llama at CP 2, accumulation 2")
    for r in runs:
        assert r["losses"] == pytest.approx(cp1["losses"], rel=LOGGED_LOSS_LIMIT, abs=0)
        assert r["eval_loss"] == pytest.approx(cp1["eval_loss"], rel=1e-12, abs=0)


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(pools, tmp_path):
    """At CP 2: 4 steps saving at step 2; then a run resumed from checkpoint-2 (its log history carries steps 1, 2
    from the checkpoint) logs the same losses for steps 3, 4."""
    whole = dict(trainer="hf", float64=True, lr=0.05, output_dir=str(tmp_path / "a"), save_steps=2)
    first = pools(2).run(run_on_rank, args=("llama", 2, 4, whole), timeout=TIMEOUT_S, name="Trainer at CP 2, saving")[0]
    resumed = dict(whole, output_dir=str(tmp_path / "b"), resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    second = pools(2).run(run_on_rank, args=("llama", 2, 4, resumed), timeout=TIMEOUT_S, name="Trainer at CP 2, resumed")[0]
    assert len(first["losses"]) == len(second["losses"]) == 4
    assert second["losses"] == pytest.approx(first["losses"], rel=LOGGED_LOSS_LIMIT, abs=0)
    assert len(set(first["losses"])) == 4, "the steps must train (distinct losses)"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_language_model_at_cp2_first_step_gradients_equal_each_document_alone(pools, family):
    """BlockdiagTrainer with MultimodalPackingCollator (documents with images in packed rows), the model's own forward
    on the full rows (CPOptions(shard_primary=False)), vision tower included; the model takes no num_items_in_batch,
    so its loss comes from its logits (the trainer's compute_loss_func). The truth: tests/test_vlm.py's."""
    from test_vlm import truth

    runs = pools(2).run(vlm_on_rank, args=(family, 2), timeout=TIMEOUT_S, name=f"Trainer {family} at CP 2")
    _, ref = truth(family)
    assert runs[0]["targets"] == ref.targets
    err, name = worst_gradient_error(runs[0]["grads"], {n: torch.from_numpy(g) / ref.targets for n, g in ref.grads.items()})
    assert err <= FLOAT64_LIMIT, f"{family}: gradient of {name} off by {err:.3g} relative"


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_perturbing_one_document_moves_only_its_logits_at_cp2(pools, model_type):
    """trl #6843's reproducer through the trainer's step at CP 2: replace the tokens of the third of six packed
    documents; every other document's logits stay bitwise the same, on every rank."""
    runs = pools(2).run(perturbation_probe, args=(model_type, 2, 2), timeout=TIMEOUT_S, name=f"probe {model_type}")
    assert max(r["inside"] for r in runs) > 1e-3, runs  # the perturbed document's logits moved
    assert all(r["outside"] == 0.0 for r in runs), runs


# ---- refusals --------------------------------------------------------------------------------------------------
def _sft(**kw):
    from datasets import Dataset
    from trl import SFTConfig

    from blockdiag_dist.integrations.trainer import BlockdiagSFTTrainer
    from examples.trl_sft import documents

    args = SFTConfig(output_dir=kw.pop("output_dir"), max_steps=1, report_to=[], use_cpu=True, packing=True,
                     max_length=32, disable_tqdm=True, **kw.pop("config", {}))
    return BlockdiagSFTTrainer(model=tiny_model("llama"), args=args, train_dataset=Dataset.from_dict({"input_ids": documents(20)}),
                               processing_class=tiny_tokenizer(), **kw)


@pytest.mark.parametrize("config, kw, match", [
    pytest.param({"label_smoothing_factor": 0.1}, {}, r"label_smoothing_factor: expected 0 under blockdiag CP, got 0.1", id="label-smoothing"),
    pytest.param({}, {"compute_loss_func": lambda *a, **k: None}, "compute_loss_func: expected None", id="compute-loss-func"),
    pytest.param({}, {"cp_size": 3}, "cp_size: expected a divisor of the world size 1, got 3", id="cp-not-divisor"),
    pytest.param({}, {"cp_size": 0}, r"cp_size: expected an int >= 1, got 0", id="cp-zero"),
    pytest.param({}, {"cp_options": {"layout": "auto"}}, "cp_options: expected a blockdiag_dist.CPOptions", id="options-type"),
])
def test_trainer_refuses_what_would_train_wrong(tmp_path, config, kw, match):
    with pytest.raises(ValueError, match=match):
        _sft(output_dir=str(tmp_path), config=config, **kw)


def test_a_packed_batch_without_documents_is_refused_before_the_model_runs(tmp_path):
    trainer = _sft(output_dir=str(tmp_path))
    batch = {"input_ids": torch.randint(2, 90, (1, 16)), "labels": torch.randint(2, 90, (1, 16))}
    with pytest.raises(ValueError, match=r"expected documents named by _packed_seq_ids, cu_seq_lens_q, restarting position_ids or a 4-D mask"):
        trainer._prepare_context_parallel_inputs(trainer.model, batch)


def test_fsdp_that_accelerate_leaves_off_on_cpu_is_noted(pools):
    """accelerate 1.15 drops an FSDP plugin on CPU without a message (the Trainer then wraps the model in DDP; in one
    process transformers refuses FSDP outright): at CP 2 the trainer says so in ``cp_notes`` and its log, and the
    step trains by DDP; without FSDP in the arguments there is no note."""
    from importlib.metadata import version

    runs = pools(2).run(fsdp_note_on_rank, timeout=TIMEOUT_S, name="Trainer fsdp asked on CPU")
    for r in runs:
        assert not r["fsdp"] and r["wrapper"] == "DistributedDataParallel", r
        assert len(r["notes"]) == 1 and f"fsdp: asked for, not applied: accelerate {version('accelerate')}" in r["notes"][0], r
        assert r["plain_notes"] == []


def test_documents_are_found_once_when_position_ids_are_absent(tmp_path, monkeypatch):
    """A batch with a 4-D mask and no position_ids: the trainer finds the documents (to build per-document positions)
    and hands them to the batch function, which does not scan the mask again."""
    import blockdiag_ref.batch as ref_batch

    trainer = _sft(output_dir=str(tmp_path))
    scans = []
    scan = ref_batch.doc_ids_from_4d_mask
    monkeypatch.setattr(ref_batch, "doc_ids_from_4d_mask", lambda m: scans.append(1) or scan(m))
    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
    mask = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0) & torch.ones(8, 8, dtype=torch.bool).tril()
    ctx, batch = trainer._prepare_context_parallel_inputs(trainer.model, {"input_ids": torch.arange(2, 10)[None], "attention_mask": mask[:, None]})
    assert len(scans) == 1
    assert ctx.state.plan.layout.seqlens == [[3, 4]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert "_packed_seq_ids" not in batch


def test_accelerates_own_cp_is_refused(tmp_path):
    """accelerate's CP replaces every mask by is_causal=True: refused where the trainer checks its config."""
    from types import SimpleNamespace

    trainer = _sft(output_dir=str(tmp_path))
    trainer.accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(cp_enabled=True, cp_size=2))
    with pytest.raises(ValueError, match="parallelism_config: expected cp_size=1 .* got accelerate's cp_size=2"):
        trainer._check_config()


def test_a_collators_boundaries_alone_name_the_documents_and_give_the_positions(tmp_path):
    """``DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True)``: the documents come
    from ``cu_seq_lens_q``, the per-document positions are added from them, and the boundaries are dropped."""
    trainer = _sft(output_dir=str(tmp_path))
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), "labels": torch.tensor([[-100, 6, 7, -100, 9, 10, 11]]),
              "cu_seq_lens_q": torch.tensor([0, 3, 7], dtype=torch.int32),
              "cu_seq_lens_k": torch.tensor([0, 3, 7], dtype=torch.int32), "max_length_q": 4, "max_length_k": 4}
    ctx, batch = trainer._prepare_context_parallel_inputs(trainer.model, inputs)
    assert ctx.state.plan.layout.seqlens == [[3, 4]]
    assert sorted(batch) == ["input_ids", "labels", "position_ids", "shift_labels"]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]


def test_step_inputs_are_sharded_with_shifted_labels_and_no_row_descriptions(tmp_path):
    """The batch handed to the model: labels pre-shifted on the full row (a document's last token has no target),
    the collator's cu_seq_lens / seq_idx gone, per-document positions kept."""
    trainer = _sft(output_dir=str(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    labels = torch.tensor([[-100, 6, 7, -100, 9, 10, 11]])
    inputs = {"input_ids": ids, "labels": labels, "position_ids": pos, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1]]),
              "cu_seq_lens_q": torch.tensor([0, 3, 7], dtype=torch.int32), "max_length_q": 4}
    ctx, batch = trainer._prepare_context_parallel_inputs(trainer.model, inputs)
    assert sorted(batch) == ["input_ids", "labels", "position_ids", "shift_labels"]
    assert batch["shift_labels"].tolist() == [[6, 7, -100, 9, 10, 11, -100]]
    assert ctx.state.plan.layout.seqlens == [[3, 4]]
