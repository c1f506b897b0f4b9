"""Pool-worker and truth helpers of tests/test_trainer_integration.py: TRL's SFTTrainer with blockdiag CP
(``examples.trl_sft.run_sft``); the per-document truth it is judged against is :mod:`verify.trainers`' (the
conformance report's Trainers section uses the same)."""

from __future__ import annotations

import contextlib

import torch

from examples.trl_sft import run_sft, tiny_model
from verify.trainers import per_document_truth, worst_gradient_error  # noqa: F401  (the truth the report uses too)


def sft_on_rank(model_type: str, cp: int, steps: int, dtype: str, record: bool, trainer: str = "sft",
                boundaries: bool = False) -> dict:
    """One rank's run; rank 0 returns the record, the others only their losses (every rank logs the step's loss).
    transformers' Trainer: the whole forward in float64 (``float64``), as in the truth. TRL's SFTTrainer as it runs
    (its float32 LM head; its default gradient checkpointing, whose recompute would run outside the promotion)."""
    out = run_sft(model_type, cp, steps, dtype, record_first_step=record, trainer=trainer, float64=trainer == "hf",
                  boundaries=boundaries)
    out.pop("eval_loss", None)
    if torch.distributed.get_rank() != 0:
        out = {"losses": out["losses"]}
    return out


def run_on_rank(model_type: str, cp: int, steps: int, kwargs: dict) -> dict:
    """``run_sft`` on one rank with keyword arguments (losses and what they ask for)."""
    out = run_sft(model_type, cp, steps, "float64", **kwargs)
    return {k: v for k, v in out.items() if k in ("losses", "eval_loss")}


def perturbation_probe(model_type: str, cp: int, changed: int) -> dict:
    """trl #6843's reproducer through the trainer's step: the logits of a packed row, then of the same row with
    document ``changed``'s tokens replaced; per rank, the largest logit change inside and outside that document."""
    import tempfile

    from transformers import TrainingArguments

    from blockdiag_dist.integrations.trainer import BlockdiagTrainer, environment_from_group
    from examples.trl_sft import documents

    environment_from_group()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)
    trainer = BlockdiagTrainer(model=tiny_model(model_type, torch.float64), args=args, cp_size=cp)
    docs = documents(6, seed=3)
    g = torch.Generator().manual_seed(4)
    other = [d if i != changed else torch.randint(2, 90, (len(d),), generator=g).tolist() for i, d in enumerate(docs)]
    out = []
    for ds in (docs, other):
        ids = torch.tensor([sum(ds, [])])
        pos = torch.cat([torch.arange(len(d)) for d in ds])[None]
        which = torch.cat([torch.full((len(d),), i + 1) for i, d in enumerate(ds)])[None]  # 1-based: 0 pads
        ctx, batch = trainer._prepare_context_parallel_inputs(trainer.model, {"input_ids": ids, "position_ids": pos, "probe_doc": which})
        which_local = batch.pop("probe_doc")
        with ctx(), torch.no_grad():
            logits = trainer.model(**batch, use_cache=False).logits
        out.append((logits, which_local))
    (a, w), (b, _) = out
    diff = (a - b).abs().amax(dim=-1)[0]
    inside, outside = w[0] == changed + 1, (w[0] != changed + 1) & (w[0] != 0)
    return {"inside": float(diff[inside].max()) if inside.any() else 0.0,
            "outside": float(diff[outside].max()) if outside.any() else 0.0}


def vlm_on_rank(family: str, cp: int) -> dict:
    """One step of a tiny vision-language model by ``BlockdiagTrainer`` at CP ``cp``: its own forward on the full
    rows (``shard_primary=False``), documents with images packed by ``MultimodalPackingCollator``, float64
    throughout; every parameter's gradient before the optimizer step, and the step's targets."""
    import tempfile

    from transformers import TrainerCallback, TrainingArguments

    from blockdiag_dist import CPOptions
    from blockdiag_dist.integrations import MultimodalPackingCollator
    from blockdiag_dist.integrations.trainer import BlockdiagTrainer, environment_from_group
    from examples.vlm import IMAGE_TOKEN, MERGE, build_tiny_vlm
    from verify.model.vlm_cases import SEQ_LEN, documents, float64_throughout

    environment_from_group()
    docs = documents(1)
    recorded: dict = {}

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            recorded["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    model = build_tiny_vlm(family)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=1, per_device_train_batch_size=len(docs),
                             report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no",
                             remove_unused_columns=False, train_sampling_strategy="sequential", max_grad_norm=0.0)
    collate = MultimodalPackingCollator(seq_len=SEQ_LEN, image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE)
    trainer = BlockdiagTrainer(model=model, args=args, train_dataset=docs, data_collator=collate, cp_size=cp,
                               cp_options=CPOptions(shard_primary=False), callbacks=[Grads()])
    with float64_throughout():  # as the truth (test_vlm.truth) computes
        trainer.train()
    batch = collate(docs)
    return {"grads": recorded["grads"], "targets": int((batch["labels"] != -100).sum())}


def bf16_on_rank(model_type: str, cp: int) -> dict:
    """One step of ``BlockdiagTrainer`` with ``bf16=True`` (float32 weights, bf16 autocast on CPU), as
    :func:`run_sft` records it; rank 0 returns the record."""
    out = run_sft(model_type, cp, 1, "bf16-mixed", record_first_step=True, trainer="hf")
    return out if torch.distributed.get_rank() == 0 else {}


@contextlib.contextmanager
def accelerate_fsdp_on_cpu():
    """While active, accelerate applies an FSDP plugin on CPU as it does on accelerator devices.

    accelerate 1.15 decides FSDP in ``AcceleratorState.__init__``: for accelerator devices (``MULTI_GPU``, ...) it
    sets ``distributed_type = FSDP`` and keeps the plugin; on CPU (``MULTI_CPU``) it drops the plugin and the Trainer
    wraps the model in DDP. Here the same three assignments of its GPU branch run on CPU, so everything after them is
    accelerate's and the Trainer's own FSDP2 path (``fsdp2_prepare_model``: ``fully_shard`` over the default group,
    gloo), which is what a GPU user's run goes through."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


def fsdp2_on_rank(model_type: str, cp: int) -> dict:
    """One step of ``BlockdiagTrainer`` under accelerate's FSDP2 (``fsdp="full_shard"``, ``fsdp_version 2``), the
    whole forward in float64; the first rank of each CP group returns its batch, the gathered gradients and the
    class of the model the Trainer trained."""
    with accelerate_fsdp_on_cpu():
        out = run_sft(model_type, cp, 1, "float64", record_first_step=True, trainer="hf", float64=True,
                      training_args={"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}})
    return out if torch.distributed.get_rank() % cp == 0 else {}


def compiled_on_rank(model_type: str, cp: int, compiled: bool) -> dict:
    """Two steps of ``BlockdiagTrainer`` with ``torch_compile=True`` (backend ``aot_eager``) or eagerly, float32;
    rank 0 returns the losses, the first step's gradients, the model's class and the frames dynamo compiled."""
    args = {"torch_compile": True, "torch_compile_backend": "aot_eager"} if compiled else {}
    torch._dynamo.reset()
    out = run_sft(model_type, cp, 2, "float32", record_first_step=True, trainer="hf", training_args=args)
    from torch._dynamo.utils import counters

    out["frames"] = int(counters["stats"]["unique_graphs"])
    out["graph_breaks"] = sum(counters["graph_break"].values())
    return {k: out[k] for k in ("losses", "grads", "wrapper", "frames", "graph_breaks")} if torch.distributed.get_rank() == 0 else {}


def fsdp_note_on_rank() -> dict:
    """``BlockdiagTrainer`` at CP 2 with ``fsdp="full_shard"`` (version 2) as accelerate runs it on CPU (no
    emulation), one step; and one without FSDP. Their notes, whether FSDP is on and the wrapper it trained."""
    import tempfile

    from transformers import TrainingArguments

    from blockdiag_dist.integrations.trainer import BlockdiagTrainer, environment_from_group
    from examples.trl_sft import documents

    environment_from_group()
    out = {}
    for fsdp in (True, False):
        extra = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if fsdp else {}
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=1, per_device_train_batch_size=2, report_to=[],
                                 use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no", **extra)
        trainer = BlockdiagTrainer(model=tiny_model("llama"), args=args, cp_size=2,
                                   train_dataset=[{"input_ids": torch.tensor(d)} for d in documents(4)],
                                   data_collator=_flattening())
        if fsdp:
            trainer.train()
            out.update(notes=trainer.cp_notes, fsdp=trainer.is_fsdp_enabled, wrapper=type(trainer.model_wrapped).__name__)
        else:
            out["plain_notes"] = trainer.cp_notes
    return out


def _flattening():
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_tensors="pt")
