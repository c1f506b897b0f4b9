"""Bench section "trainer": a ``BlockdiagTrainer`` step against the hand-written loop of docs/trainer.md, at the
same CP size, on the same work (the same tiny model, the same documents in the same order, flattened into one
row per step by transformers' ``DataCollatorWithFlattening``), side by side in one pool: the Trainer's own cost
around the step (its dataloader, loss scaling, DDP, callbacks) as a ratio. Goal: <= 1.05x.

Fair by construction: the same processes and intra-op threads (each run records ``torch.get_num_threads()``; a
mismatch raises), the runs alternate (Trainer, loop, Trainer, loop, ...) so that a change of the machine's load
falls on both, the first two steps of every run are left out (warm-up), and the median is taken. Neither side logs
during the timed steps (the Trainer's ``logging_steps`` is past the last step; the loop prints nothing): a logged
loss is one more collective and host sync per logging step, on either side."""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from verify.pool import WorkerPool

GOAL = 1.05


def trainer_steps(model_type: str, cp: int, steps: int, rows: int) -> tuple[list[float], int]:
    """Seconds from one step's start to the next's of ``BlockdiagTrainer`` (one pool rank): its dataloader,
    collation, step and callbacks, as the hand loop's iteration counts its own; and the intra-op threads."""
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, TrainerCallback, TrainingArguments

    from blockdiag_dist.integrations.trainer import BlockdiagTrainer, environment_from_group
    from examples.trl_sft import documents, tiny_model

    environment_from_group()
    stamps: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=rows,
                             learning_rate=1e-3, logging_steps=steps + 1, report_to=[], use_cpu=True, bf16=False,
                             disable_tqdm=True, save_strategy="no", remove_unused_columns=False,
                             train_sampling_strategy="sequential", max_grad_norm=0.0)
    trainer = BlockdiagTrainer(model=tiny_model(model_type), args=args, cp_size=cp, callbacks=[Stamps()],
                               train_dataset=Dataset.from_dict({"input_ids": documents(steps * rows)}),
                               data_collator=DataCollatorWithFlattening(return_tensors="pt"))
    trainer.train()
    return [b - a for a, b in zip(stamps, stamps[1:])], torch.get_num_threads()


def loop_steps(model_type: str, cp: int, steps: int, rows: int) -> tuple[list[float], int]:
    """Seconds of each step of the hand-written loop on the same batches (one pool rank), and the intra-op threads."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import DataCollatorWithFlattening

    from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
    from blockdiag_dist.integrations import all_reduce_grads, causal_lm_loss, global_token_count, shift_labels
    from examples.trl_sft import documents, tiny_model

    dist = torch.distributed
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
    model = tiny_model(model_type)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collate = DataCollatorWithFlattening(return_tensors="pt")
    docs = documents(steps * rows)
    out = []
    for s in range(steps):
        t = time.perf_counter()
        batch = collate([{"input_ids": d} for d in docs[s * rows:(s + 1) * rows]])
        batch["labels"] = shift_labels(batch["labels"])
        ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, dict(batch))
        n = global_token_count(batch["labels"], mesh["cp"])
        with ctx():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            causal_lm_loss(logits, batch["labels"], n).backward()
        all_reduce_grads(model.parameters(), mesh)
        opt.step()
        opt.zero_grad()
        out.append(time.perf_counter() - t)
    return out, torch.get_num_threads()


def bench_trainer(model_type: str = "qwen3_5", cp: int = 2, steps: int = 10, rows: int = 8, rounds: int = 3,
                  timeout: float = 900.0) -> dict:
    """Median step seconds (first two steps of each run left out: warm-up) of both, alternating in one pool,
    ``rounds`` runs of each."""
    trainer, loop, threads = [], [], set()
    with WorkerPool(cp, collective_timeout=timeout) as pool:
        for _ in range(rounds):
            for fn, into in ((trainer_steps, trainer), (loop_steps, loop)):
                per_rank = pool.run(fn, args=(model_type, cp, steps, rows), timeout=timeout, name=fn.__name__)
                threads |= {n for _, n in per_rank}
                into += per_rank[0][0][2:]  # rank 0's steps (the ranks of a step wait for each other)
    if len(threads) != 1:
        raise RuntimeError(f"bench trainer: expected one intra-op thread count on every rank and run, got {sorted(threads)}")
    t, h = statistics.median(trainer), statistics.median(loop)
    return {"model": model_type, "cp": cp, "rows": rows, "steps": steps, "rounds": rounds, "threads": threads.pop(),
            "trainer_seconds": t, "loop_seconds": h, "ratio": t / h, "goal": GOAL}
