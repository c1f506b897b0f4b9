"""TRL's SFTTrainer with packing under block-diagonal CP, on CPU (gloo) or GPUs (NCCL):

    accelerate launch --num_processes 2 --cpu examples/trl_sft.py --cp 2            # CP 2
    torchrun --standalone --nproc-per-node 2 examples/trl_sft.py --cp 2             # the same, by torchrun
    python examples/trl_sft.py                                                      # CP 1, one process
    torchrun --standalone --nproc-per-node 2 examples/trl_sft.py --cp 2 --trainer hf --dtype bf16-mixed   # bf16 autocast
    torchrun --standalone --nproc-per-node 2 examples/trl_sft.py --cp 2 --trainer hf --torch-compile aot_eager
    torchrun --standalone --nproc-per-node 4 examples/trl_sft.py --cp 2 --trainer hf --fsdp2  # FSDP2 on GPUs

A tiny model from its config (``--model llama | qwen3 | qwen3_5 | nemotron_h | lfm2 | gpt_oss``), a tokenizer built
in memory and a synthetic pre-tokenized dataset of documents of assorted lengths: nothing is downloaded. TRL packs
the documents (``--packing-strategy bfd``: padding-free rows whose ``position_ids`` restart at every document), and
``BlockdiagSFTTrainer`` shards each packed row over the CP group. Prints one line per logged step (the step's loss,
the same on every rank) and, with ``--out FILE``, writes the losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's packages

VOCAB = 96


def tiny_tokenizer():
    """A word-level tokenizer over ``t0 .. t{VOCAB-3}`` plus ``<pad>`` and ``</s>``, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1} | {f"t{i}": i + 2 for i in range(VOCAB - 2)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def documents(n: int, seed: int = 0, longest: int = 40) -> list[list[int]]:
    """``n`` token documents of lengths 3 .. ``longest`` (ids 2 .. VOCAB-1), each ending with ``</s>``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, longest + 1, (n,), generator=g).tolist()
    return [torch.randint(2, VOCAB, (k - 1,), generator=g).tolist() + [1] for k in lengths]


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32):
    """A tiny causal LM of ``model_type`` (the verifier's tiny config of it: verify.model.zoo), with blockdiag's
    attention registered; the same weights on every rank and every call."""
    from blockdiag_dist.integrations import register_transformers_attention
    from verify.model.zoo import build, resolve

    name = {"qwen3_5": "qwen3_5_text"}.get(model_type, model_type)
    return build(resolve(name, tiny=True), dtype, register_transformers_attention())


def promoted(model: torch.nn.Module, on: bool = True):
    """While active (and ``on``), ``model``'s whole forward computes in float64, its loss included: transformers'
    RMSNorms, rotary angles and loss cast to float32 whatever the model's dtype (verify.model.precision.Promote)."""
    import contextlib

    from verify.model.precision import float64_modules

    return float64_modules(model, lambda m: m is model) if on else contextlib.nullcontext()


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: an FSDP2 (``fully_shard``) parameter's or gradient's shards gathered (a collective: every rank
    calls it), any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_sft(model_type: str, cp: int, steps: int, dtype: str = "float32", *, packing_strategy: str = "bfd",
            max_length: int = 64, rows: int = 4, record_first_step: bool = False, output_dir: str | None = None,
            resume_from_checkpoint: str | None = None, save_steps: int | None = None, lr: float = 1e-3,
            trainer: str = "sft", float64: bool = False, accumulate: int = 1, evaluate: bool = False,
            training_args: dict | None = None, boundaries: bool = False) -> dict:
    """Train ``model_type`` at CP ``cp`` (every process of the default group, or one process) with TRL's
    ``BlockdiagSFTTrainer`` (``trainer="sft"``: TRL packs ``rows`` rows of ``max_length``) or transformers'
    ``BlockdiagTrainer`` (``trainer="hf"``: ``rows`` documents per step flattened into one row by transformers'
    ``DataCollatorWithFlattening``). Returns the logged losses and, with ``record_first_step``, the first step's full
    batch (this rank's, before sharding) and every parameter's gradient before the optimizer step. ``float64``: the
    whole forward in float64 (:func:`promoted`), for float64 parity tests. ``accumulate``: gradient accumulation
    steps; ``evaluate``: also return the evaluation loss on held-out documents after training; ``training_args``: more
    ``TrainingArguments`` fields (e.g. ``{"torch_compile": True}``, FSDP's ``fsdp`` / ``fsdp_config``); ``boundaries``
    (``trainer="hf"``): the collator also gives flash-attn's keywords (``return_flash_attn_kwargs=True``), and the
    documents are read from its ``cu_seq_lens_q``."""
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, TrainerCallback, TrainingArguments
    from trl import SFTConfig

    from blockdiag_dist.integrations.trainer import BlockdiagSFTTrainer, BlockdiagTrainer, environment_from_group

    environment_from_group()  # accelerate reads the launch from the environment; the group may already exist
    common = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="blockdiag-sft-"), max_steps=steps,
        per_device_train_batch_size=rows, learning_rate=lr, logging_steps=1, report_to=[],
        use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, dataloader_drop_last=True, disable_tqdm=True,
        max_grad_norm=0.0, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        bf16=dtype == "bf16-mixed", fp16=False,  # transformers turns bf16 autocast on by default where the CPU has it
        gradient_accumulation_steps=accumulate, per_device_eval_batch_size=rows,
    ) | (training_args or {})
    if trainer == "sft":
        args = SFTConfig(packing=True, packing_strategy=packing_strategy, max_length=max_length, **common)
        cls, extra = BlockdiagSFTTrainer, {"processing_class": tiny_tokenizer()}
    else:
        args = TrainingArguments(remove_unused_columns=False, **common)
        collator = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=boundaries)
        cls, extra = BlockdiagTrainer, {"data_collator": collator}
    recorded: dict = {}
    steps_state: list = []  # the first step's CP states (one per micro-batch)

    class FirstStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if record_first_step and "grads" not in recorded:
                recorded["grads"] = {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                recorded["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
                # bytes per element of what the K/V exchanges moved: the dtype attention computed in
                recorded["exchanged_element_sizes"] = sorted({e.element_size for st in steps_state for e in st.traffic.entries})

    weights = torch.float32 if dtype == "bf16-mixed" else getattr(torch, dtype)
    trainer = cls(model=tiny_model(model_type, weights), args=args,
                  train_dataset=Dataset.from_dict({"input_ids": documents(200)}),
                  eval_dataset=Dataset.from_dict({"input_ids": documents(24, seed=1)}) if evaluate else None,
                  cp_size=cp, callbacks=[FirstStep()], **extra)
    if record_first_step:
        prepare = trainer._prepare_context_parallel_inputs

        def keep_batch(model, inputs):
            recorded.setdefault("batch", {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            ctx, batch = prepare(model, inputs)
            if "grads" not in recorded and model.training:
                steps_state.append(ctx.state)
            return ctx, batch

        trainer._prepare_context_parallel_inputs = keep_batch
    with promoted(trainer.model, float64):
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    if evaluate:
        with promoted(trainer.model, float64):
            recorded["eval_loss"] = float(trainer.evaluate()["eval_loss"])
    return {"losses": losses, "wrapper": type(trainer.model_wrapped).__name__, **recorded}


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=1, help="ranks per CP group (a divisor of the number of processes)")
    p.add_argument("--model", default="qwen3_5", help="llama | qwen3 | qwen3_5 | nemotron_h | lfm2 | gpt_oss")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--packing-strategy", default="bfd", help="TRL's: bfd (padding-free rows) or wrapped")
    p.add_argument("--max-length", type=int, default=64, help="tokens per packed row")
    p.add_argument("--dtype", default="float32", help="float32 | float64 | bf16-mixed (float32 weights, bf16 autocast)")
    p.add_argument("--trainer", default="sft", choices=("sft", "hf"),
                   help="sft: BlockdiagSFTTrainer (TRL packing); hf: BlockdiagTrainer with DataCollatorWithFlattening")
    p.add_argument("--torch-compile", default=None, metavar="BACKEND",
                   help="TrainingArguments(torch_compile=True, torch_compile_backend=BACKEND), e.g. aot_eager, inductor")
    p.add_argument("--fsdp2", action="store_true",
                   help='TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2}): accelerate shards the model '
                        "over every rank on GPUs; on CPU accelerate 1.15 leaves FSDP off (the trainer notes it; DDP trains)")
    p.add_argument("--boundaries", action="store_true",
                   help="with --trainer hf: the collator also gives cu_seq_lens_q/k, from which the documents are read")
    p.add_argument("--out", default=None, help="write the logged losses here as JSON (rank 0)")
    a = p.parse_args(argv)
    extra: dict = {}
    if a.torch_compile:
        extra.update(torch_compile=True, torch_compile_backend=a.torch_compile)
    if a.fsdp2:
        extra.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
    own_group = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized()
    if own_group:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    losses = run_sft(a.model, a.cp, a.steps, a.dtype, packing_strategy=a.packing_strategy, max_length=a.max_length,
                     trainer=a.trainer, training_args=extra, boundaries=a.boundaries)["losses"]
    if int(os.environ.get("RANK", "0")) == 0:
        for i, loss in enumerate(losses, 1):
            print(f"step {i:3d} loss {loss:.6f}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"cp": a.cp, "model": a.model, "losses": losses}, f)
    if own_group:  # every rank done with its collectives before any tears its connections down
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
