"""Train a causal LM with block-diagonal CP over a data-parallel x context-parallel mesh.

One step: pack documents (:func:`synthetic_batch`), give each DP replica its rows, shard them over CP with
``make_cp_blockdiag_batch_and_ctx``, run forward and backward inside ``train_ctx()``, sum the partial
gradients over DP x CP (the loss of every rank is normalised by the global target count), AdamW.

In one process (CP 1, ``mesh=None``), in a spawned pool (:func:`run_distributed`), or under torchrun
(``python -m examples``, see ``examples/__main__.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.integrations import (
    IGNORE_INDEX,
    all_reduce_grads,
    all_reduce_sum_,
    causal_lm_loss,
    global_token_count,
    pack_documents,
)

from .model import TinyConfig, TinyDecoder

__all__ = [
    "DTYPES",
    "PARITY_RTOL",
    "Parity",
    "TrainConfig",
    "TrainResult",
    "build_tiny_model",
    "make_mesh",
    "parity",
    "run_distributed",
    "synthetic_batch",
    "tiny_forward",
    "train",
    "train_step",
]

DTYPES = {"float64": torch.float64, "float32": torch.float32}
PARITY_RTOL = {"float64": 1e-10, "float32": 1e-5}  # relative, CP n vs CP 1: losses, first-step grads, final weights

Forward = Callable[[nn.Module, dict[str, Tensor]], Tensor]  # (model, sharded batch) -> logits [B, L, V]


@dataclass(frozen=True)
class TrainConfig:
    """A run: ``steps`` steps of ``rows`` packed rows of ``seq_len`` tokens (the global batch, split over DP)."""

    steps: int = 4
    rows: int = 4
    seq_len: int = 37  # odd: CP pads it to a multiple of the CP size
    max_doc_len: int = 24
    tail_padding: int = 0  # padding positions after every row's documents (a CP rank may then hold only padding)
    layout: str = "contiguous"  # CP sharding: "contiguous" | "balanced" | "auto"
    lr: float = 1e-2
    weight_decay: float = 0.1
    dtype: str = "float64"
    checkpointing: str | None = None  # None | "reentrant" | "non_reentrant"
    seed: int = 0
    model: TinyConfig = field(default_factory=TinyConfig)


@dataclass
class TrainResult:
    losses: list[float]  # the global loss of every step (equal on every rank)
    grads: dict[str, np.ndarray]  # gradients of the first step, summed over the mesh, by parameter name
    weights: dict[str, np.ndarray]  # final parameters, by name
    modes: list[str]  # the K/V exchange of every step ("local" at CP 1)


def synthetic_batch(cfg: TrainConfig, step: int) -> dict[str, Tensor]:
    """The global batch of ``step``: random documents (1 to ``max_doc_len`` tokens of ids ``1..V-1``) packed
    into ``rows`` rows of ``seq_len - tail_padding`` tokens, then ``tail_padding`` padding positions; the same
    on every rank (seeded generator), so nothing is broadcast."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    packed_len = cfg.seq_len - cfg.tail_padding
    docs, total = [], 0
    while total < cfg.rows * packed_len:  # enough documents to fill at least `rows` rows
        n = int(torch.randint(1, cfg.max_doc_len + 1, (1,), generator=g))
        docs.append(torch.randint(1, cfg.model.vocab_size, (n,), generator=g))
        total += n
    batch = pack_documents(docs, packed_len)
    return {
        k: F.pad(v[: cfg.rows], (0, cfg.tail_padding), value=IGNORE_INDEX if k == "labels" else 0)
        for k, v in batch.items()
    }


def build_tiny_model(cfg: TrainConfig) -> nn.Module:
    """The tiny decoder in ``cfg.dtype``, initialised from ``cfg.seed`` (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    return TinyDecoder(cfg.model, checkpointing=cfg.checkpointing).to(DTYPES[cfg.dtype])


def tiny_forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(batch["input_ids"], batch["position_ids"])


def make_mesh(dp: int, cp: int, device_type: str = "cpu"):
    """The 2-D ``("dp", "cp")`` DeviceMesh over the default process group (its world must be ``dp * cp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp < 1 or cp < 1 or dp * cp != world:
        raise ValueError(f"mesh: expected dp * cp = world size {world} (dp, cp >= 1), got dp={dp}, cp={cp}")
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def train_step(
    model: nn.Module, batch: dict[str, Tensor], mesh, forward: Forward = tiny_forward, layout: str = "contiguous"
) -> tuple[float, str]:
    """Forward and backward of one replica's rows ``batch`` (``[B, S]`` tensors, not yet CP-sharded); leaves
    the gradient summed over the mesh in every ``.grad``. Returns (global loss, K/V exchange used)."""
    cp_mesh = None if mesh is None else mesh["cp"]
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch, layout=layout)
    num_tokens = global_token_count(batch["labels"], mesh)
    with train_ctx():  # backward inside too: checkpoint recompute and the exchange's backward need the state
        loss = causal_lm_loss(forward(model, batch), batch["labels"], num_tokens)
        loss.backward()
    all_reduce_grads(model.parameters(), mesh)
    return float(all_reduce_sum_(loss.detach().clone(), mesh)), train_ctx.state.window_plan(-1).mode


def train(model: nn.Module, cfg: TrainConfig, mesh=None, forward: Forward = tiny_forward) -> TrainResult:
    """``cfg.steps`` AdamW steps. ``mesh``: a ``("dp", "cp")`` DeviceMesh (see :func:`make_mesh`) or ``None``
    for one process. DP replica ``d`` trains on rows ``[d * R / dp, (d + 1) * R / dp)`` of each global batch."""
    dp_rank, dp = (0, 1) if mesh is None else (mesh.get_local_rank("dp"), mesh["dp"].size())
    if cfg.rows % dp:
        raise ValueError(f"rows: expected a multiple of the DP size {dp}, got {cfg.rows}")
    per_replica = cfg.rows // dp
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses, modes, grads = [], [], {}
    for step in range(cfg.steps):
        rows = slice(dp_rank * per_replica, (dp_rank + 1) * per_replica)
        batch = {k: v[rows] for k, v in synthetic_batch(cfg, step).items()}
        loss, mode = train_step(model, batch, mesh, forward, cfg.layout)
        if step == 0:  # kept for parity checks
            grads = {name: p.grad.detach().cpu().numpy().copy() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        modes.append(mode)
    weights = {name: p.detach().cpu().numpy().copy() for name, p in model.named_parameters()}
    return TrainResult(losses=losses, grads=grads, weights=weights, modes=modes)


@functools.lru_cache(maxsize=None)
def _cached_mesh(dp: int, cp: int, device_type: str):
    return make_mesh(dp, cp, device_type)


def run_distributed(
    cfg: TrainConfig,
    dp: int,
    cp: int,
    build: Callable[[TrainConfig], nn.Module] = build_tiny_model,
    forward: Forward = tiny_forward,
) -> TrainResult:
    """Run :func:`train` on every rank of the initialised default group (a pool task or a torchrun rank);
    meshes are built once per process and shape."""
    return train(build(cfg), cfg, _cached_mesh(dp, cp, "cpu"), forward)


@dataclass(frozen=True)
class Parity:
    """Distance of a run from its reference. Tensors are compared as ``||x - x_ref|| / ||x_ref||`` (Frobenius),
    the worst parameter counting. Element-wise, AdamW's ``m / sqrt(v)`` turns rounding noise in a near-zero
    gradient into a step-sized difference on a few elements (in float32 as large as the single-process
    float32-vs-float64 gap), so the element-wise figure is reported, not judged."""

    loss_abs: float  # max over steps of |loss - loss_ref|
    loss_rel: float  # max over steps of |loss - loss_ref| / |loss_ref|
    grad_rel: float  # first step's gradients
    weight_rel: float  # final weights
    weight_max_rel: float  # max over parameters of max|w - w_ref| / max|w_ref| (element-wise; reported only)
    steps: int

    def ok(self, dtype: str) -> bool:
        return max(self.loss_rel, self.grad_rel, self.weight_rel) <= PARITY_RTOL[dtype]


def _rel(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], norm: Callable[[np.ndarray], float]) -> float:
    """max over tensors of ``norm(got - ref) / norm(ref)`` (a zero reference counts as the smallest normal)."""
    return max(float(norm(got[k] - x) / max(norm(x), np.finfo(x.dtype).tiny)) for k, x in ref.items())


def _max_abs(x: np.ndarray) -> float:
    return float(np.abs(x).max())


def parity(ref: TrainResult, got: TrainResult) -> Parity:
    """How far ``got`` is from ``ref`` (same config, other mesh)."""
    if len(ref.losses) != len(got.losses) or ref.weights.keys() != got.weights.keys():
        raise ValueError(
            f"parity: expected runs of the same model and length, got {len(ref.losses)} vs {len(got.losses)} steps "
            f"and {sorted(ref.weights)} vs {sorted(got.weights)}"
        )
    diffs = [abs(a - b) for a, b in zip(ref.losses, got.losses)]
    return Parity(
        loss_abs=max(diffs),
        loss_rel=max(d / abs(a) for d, a in zip(diffs, ref.losses)),
        grad_rel=_rel(ref.grads, got.grads, np.linalg.norm),
        weight_rel=_rel(ref.weights, got.weights, np.linalg.norm),
        weight_max_rel=_rel(ref.weights, got.weights, _max_abs),
        steps=len(diffs),
    )
