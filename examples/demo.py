"""``make train-demo``: train the tiny decoder a few steps at CP 1 (this process) and at DP d x CP n (a spawned
gloo group of d * n ranks on CPU), print both loss curves, and end with the line

    loss parity: max |Δ| = <value> over <N> steps

exiting 1 when the losses, first-step gradients or final weights differ by more than the dtype's relative
tolerance. Every task of the group has a deadline: a stuck rank ends the run with an error, never a hang.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from verify.pool import WorkerPool

from .model import CHECKPOINTING
from .training import DTYPES, PARITY_RTOL, TrainConfig, build_tiny_model, parity, run_distributed, train


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="CP 1 vs DP x CP loss parity of the tiny decoder (CPU, gloo)")
    p.add_argument("--cp", type=int, default=2, help="CP size of the distributed run")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the distributed run")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    p.add_argument("--checkpointing", choices=[c for c in CHECKPOINTING if c], default=None)
    p.add_argument("--tail-padding", type=int, default=0, help="padding positions after every row's documents")
    p.add_argument("--layout", choices=["contiguous", "balanced", "auto"], default="contiguous", help="CP sharding")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the distributed run, in seconds")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: extra threads only spin against the ranks

    cfg = TrainConfig(
        steps=args.steps, dtype=args.dtype, checkpointing=args.checkpointing, tail_padding=args.tail_padding,
        layout=args.layout,
    )
    ref = train(build_tiny_model(cfg), cfg)
    label = f"CP {args.cp}" if args.dp == 1 else f"DP {args.dp} x CP {args.cp}"
    with WorkerPool(args.dp * args.cp, collective_timeout=args.timeout) as pool:
        got = pool.run(run_distributed, args=(cfg, args.dp, args.cp), timeout=args.timeout, name=f"train at {label}")[0]
    print(f"{'step':>4}  {'CP 1 loss':>20}  {label + ' loss':>20}  kv exchange")
    for step, (a, b, mode) in enumerate(zip(ref.losses, got.losses, got.modes)):
        print(f"{step:>4}  {a:>20.15f}  {b:>20.15f}  {mode}")
    result = parity(ref, got)
    rtol = PARITY_RTOL[args.dtype]
    print(
        f"{args.dtype}, relative to CP 1: loss {result.loss_rel:.2e}, first-step grads {result.grad_rel:.2e}, "
        f"final weights {result.weight_rel:.2e} (tolerance {rtol:g})"
    )
    print(f"loss parity: max |Δ| = {result.loss_abs:.3e} over {result.steps} steps")
    return 0 if result.ok(args.dtype) else 1


if __name__ == "__main__":
    sys.exit(main())
