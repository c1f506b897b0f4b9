"""Train the tiny decoder: ``python -m examples`` (one process, CP 1) or under torchrun over a DP x CP mesh::

    timeout 600 torchrun --standalone --nproc-per-node 4 -m examples --dp 2 --cp 2 --steps 4

CPU and gloo. The process group has a timeout (``--timeout``), so a stuck collective raises instead of
hanging; rank 0 prints the loss of every step.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from .model import CHECKPOINTING
from .training import DTYPES, TrainConfig, build_tiny_model, run_distributed, train


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples", description="Train the tiny decoder with block-diagonal CP")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--cp", type=int, default=None, help="CP size (default: world size / dp)")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=TrainConfig.dtype)
    p.add_argument("--checkpointing", choices=[c for c in CHECKPOINTING if c], default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective raises")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp = args.cp if args.cp is not None else max(world // args.dp, 1)
    cfg = TrainConfig(steps=args.steps, dtype=args.dtype, checkpointing=args.checkpointing)
    if "WORLD_SIZE" not in os.environ:
        if args.dp * cp != 1:
            raise SystemExit(f"expected torchrun for dp * cp = {args.dp * cp} > 1, got one process without WORLD_SIZE")
        result = train(build_tiny_model(cfg), cfg)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        try:
            result = run_distributed(cfg, args.dp, cp)
            dist.barrier()  # every rank done before any tears its connections down (gloo aborts otherwise)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    for step, (loss, mode) in enumerate(zip(result.losses, result.modes)):
        print(f"step {step}: loss {loss:.12f}  (kv exchange: {mode})")


if __name__ == "__main__":
    main()
