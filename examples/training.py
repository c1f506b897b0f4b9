"""Train a causal LM with block-diagonal CP over a data-parallel x context-parallel mesh.

One step: pack documents (:func:`synthetic_batch`), give each DP replica its rows, shard them over CP with
``make_cp_blockdiag_batch_and_ctx``, run forward and backward inside ``train_ctx()``, sum the partial
gradients over DP x CP (the loss of every rank is normalised by the global target count), AdamW.

In one process (CP 1, ``mesh=None``), in a spawned pool (:func:`run_distributed`), or under torchrun
(``python -m examples``, see ``examples/__main__.py``).

Trainer variants, each a :class:`TrainConfig` field: the forward under bf16 autocast; the gradient reduction by
DDP or FSDP2 over the flattened dp x cp mesh (:func:`wrap_model`) instead of :func:`all_reduce_grads`; the
blocks compiled with ``torch.compile``; gradient accumulation over micro-batches, with the backwards interleaved
or deferred until every forward ran (pipeline-style); batches from transformers' ``DataCollatorWithFlattening``.
"""

from __future__ import annotations

import contextlib
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
    allreduce_sum_hook,
    causal_lm_loss,
    flat_mesh,
    fsdp_sum_gradients,
    global_token_count,
    pack_documents,
    shift_labels,
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
    "wrap_model",
]

DTYPES = {"float64": torch.float64, "float32": torch.float32}
PARITY_RTOL = {"float64": 1e-10, "float32": 1e-5}  # relative, CP n vs CP 1: losses, first-step grads, final weights
AUTOCAST = {None: None, "bfloat16": torch.bfloat16}
PARALLEL = ("manual", "ddp", "fsdp")
SCHEDULES = ("interleaved", "deferred")
COLLATORS = ("blockdiag", "hf_flattening")

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
    expect_attention: bool = True  # False: attention not routed on purpose (an oracle on stock attention at CP 1)
    seed: int = 0
    model: TinyConfig = field(default_factory=TinyConfig)
    autocast: str | None = None  # the forward under torch.autocast to this dtype ("bfloat16"); weights in `dtype`
    parallel: str = "manual"  # gradient sum over the mesh: "manual" (all_reduce_grads) | "ddp" | "fsdp"
    compile: str | None = None  # torch.compile backend of every block ("eager", "aot_eager", "inductor")
    micro_batches: int = 1  # gradient accumulation: each replica's rows in this many micro-batches per step
    # "interleaved": each micro-batch's backward right after its forward, inside its context; "deferred"
    # (pipeline-style): every micro-batch's forward in its context, then the backwards, outside any context
    schedule: str = "interleaved"
    collator: str = "blockdiag"  # "blockdiag" (pack_documents, `rows` rows) | "hf_flattening" (one row)

    def __post_init__(self) -> None:
        for name, value, allowed in [
            ("autocast", self.autocast, tuple(AUTOCAST)),
            ("parallel", self.parallel, PARALLEL),
            ("schedule", self.schedule, SCHEDULES),
            ("collator", self.collator, COLLATORS),
        ]:
            if value not in allowed:
                raise ValueError(f"TrainConfig.{name}: expected one of {allowed}, got {value!r}")
        if self.micro_batches < 1 or self.rows % self.micro_batches:
            raise ValueError(
                f"TrainConfig.micro_batches: expected a divisor of rows={self.rows}, got {self.micro_batches}"
            )


@dataclass
class TrainResult:
    losses: list[float]  # the global loss of every step (equal on every rank)
    grads: dict[str, np.ndarray]  # gradients of the first step, summed over the mesh, by parameter name
    weights: dict[str, np.ndarray]  # final parameters, by name
    modes: list[str]  # the K/V exchange of every step ("local" at CP 1)


def synthetic_batch(cfg: TrainConfig, step: int) -> dict[str, Tensor]:
    """The global batch of ``step``: random documents (1 to ``max_doc_len`` tokens of ids ``1..V-1``) packed
    into ``rows`` rows of ``seq_len - tail_padding`` tokens, then ``tail_padding`` padding positions; the same
    on every rank (seeded generator), so nothing is broadcast.

    ``collator="hf_flattening"``: the same documents concatenated into one row by transformers'
    ``DataCollatorWithFlattening`` (documents found from the ``position_ids`` resets only), labels pre-shifted
    with :func:`shift_labels`."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    packed_len = cfg.seq_len - cfg.tail_padding
    docs, total = [], 0
    while total < cfg.rows * packed_len:  # enough documents to fill at least `rows` rows
        n = int(torch.randint(1, cfg.max_doc_len + 1, (1,), generator=g))
        docs.append(torch.randint(1, cfg.model.vocab_size, (n,), generator=g))
        total += n
    if cfg.collator == "hf_flattening":
        from transformers import DataCollatorWithFlattening

        flat = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
        return {
            "input_ids": flat["input_ids"],
            "labels": shift_labels(flat["labels"]),
            "position_ids": flat["position_ids"],
        }
    batch = pack_documents(docs, packed_len)
    return {
        k: F.pad(v[: cfg.rows], (0, cfg.tail_padding), value=IGNORE_INDEX if k == "labels" else 0)
        for k, v in batch.items()
    }


def build_tiny_model(cfg: TrainConfig) -> nn.Module:
    """The tiny decoder in ``cfg.dtype``, initialised from ``cfg.seed`` (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    model = TinyDecoder(cfg.model, checkpointing=cfg.checkpointing).to(DTYPES[cfg.dtype])
    if cfg.compile is not None:
        for block in model.blocks:
            block.compile(backend=cfg.compile)
    return model


def tiny_forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(batch["input_ids"], batch["position_ids"])


def make_mesh(dp: int, cp: int, device_type: str = "cpu"):
    """The 2-D ``("dp", "cp")`` DeviceMesh over the default process group (its world must be ``dp * cp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp < 1 or cp < 1 or dp * cp != world:
        raise ValueError(f"mesh: expected dp * cp = world size {world} (dp, cp >= 1), got dp={dp}, cp={cp}")
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def wrap_model(model: nn.Module, cfg: TrainConfig, mesh) -> nn.Module:
    """``model`` ready for ``cfg.parallel`` on ``mesh``: as it is for ``"manual"`` (:func:`train_step` sums the
    gradients), wrapped in DDP with a summing hook over the flattened dp x cp group for ``"ddp"``, every block
    and the root sharded by FSDP2 over that group, with sum reduction, for ``"fsdp"``. DDP and FSDP2 average
    over their group by default: wrong here, where each CP rank holds a partial gradient."""
    if cfg.parallel == "manual":
        return model
    if mesh is None:
        raise ValueError(f"parallel={cfg.parallel!r}: expected a DeviceMesh, got None (one process)")
    group_mesh = flat_mesh(mesh)
    if cfg.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        group = group_mesh.get_group()
        ddp = DistributedDataParallel(model, process_group=group)
        ddp.register_comm_hook(group, allreduce_sum_hook)
        return ddp
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=group_mesh)
    fully_shard(model, mesh=group_mesh)
    fsdp_sum_gradients(model)
    return model


def _reduces_its_gradients(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, (DistributedDataParallel, FSDPModule))


def train_step(
    model: nn.Module,
    batch: dict[str, Tensor],
    mesh,
    forward: Forward = tiny_forward,
    layout: str = "contiguous",
    *,
    micro_batches: int = 1,
    schedule: str = "interleaved",
    autocast: str | None = None,
    expect_attention: bool = True,
) -> tuple[float, str]:
    """Forward and backward of one replica's rows ``batch`` (``[B, S]`` tensors, not yet CP-sharded) in
    ``micro_batches`` micro-batches, each with its own ``train_ctx``; the loss of every micro-batch is divided by
    the step's global target count, so the accumulated gradient is the whole step's. Leaves the gradient summed
    over the mesh in every ``.grad`` (by DDP / FSDP2 when ``model`` is wrapped). Returns (global loss, K/V
    exchange used by the last micro-batch). ``expect_attention=False`` for a model whose attention does not go
    through ``cp_blockdiag_sdpa`` (transformers' own SDPA as a single-process oracle)."""
    cp_mesh = None if mesh is None else mesh["cp"]
    rows = batch["labels"].shape[0]
    if rows % micro_batches:
        raise ValueError(f"micro_batches: expected a divisor of the replica's {rows} rows, got {micro_batches}")
    size = rows // micro_batches
    steps = [
        make_cp_blockdiag_batch_and_ctx(
            cp_mesh, None, {k: v[i * size : (i + 1) * size] for k, v in batch.items()}, layout=layout,
            expect_attention=expect_attention,
        )
        for i in range(micro_batches)
    ]
    num_tokens = global_token_count(torch.cat([b["labels"] for _, b in steps]), mesh)
    dtype = AUTOCAST[autocast]
    losses = []
    for train_ctx, micro in steps:
        device_type = micro["labels"].device.type
        with train_ctx():  # backward inside too, unless deferred: checkpoint recompute needs the step's state
            with torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
                logits = forward(model, micro)
            loss = causal_lm_loss(logits, micro["labels"], num_tokens)
            if schedule == "interleaved":
                loss.backward()
        losses.append(loss.detach() if schedule == "interleaved" else loss)
    if schedule == "deferred":  # pipeline-style: every forward first, then the backwards, outside the contexts
        for loss in losses:
            loss.backward()
    if not _reduces_its_gradients(model):
        all_reduce_grads(model.parameters(), mesh)
    total = torch.stack([loss.detach() for loss in losses]).sum()
    return float(all_reduce_sum_(total, mesh)), steps[-1][0].state.window_plan(-1).mode


def train(model: nn.Module, cfg: TrainConfig, mesh=None, forward: Forward = tiny_forward) -> TrainResult:
    """``cfg.steps`` AdamW steps. ``mesh``: a ``("dp", "cp")`` DeviceMesh (see :func:`make_mesh`) or ``None``
    for one process. DP replica ``d`` trains on rows ``[d * R / dp, (d + 1) * R / dp)`` of each global batch."""
    dp_rank, dp = (0, 1) if mesh is None else (mesh.get_local_rank("dp"), mesh["dp"].size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    named = list(getattr(model, "module", model).named_parameters())  # DDP's names without "module."
    losses, modes, grads = [], [], {}
    for step in range(cfg.steps):
        batch = synthetic_batch(cfg, step)
        total_rows = batch["labels"].shape[0]
        if total_rows % dp:
            raise ValueError(f"rows: expected a multiple of the DP size {dp}, got {total_rows}")
        per_replica = total_rows // dp
        batch = {k: v[dp_rank * per_replica : (dp_rank + 1) * per_replica] for k, v in batch.items()}
        loss, mode = train_step(
            model, batch, mesh, forward, cfg.layout,
            micro_batches=cfg.micro_batches, schedule=cfg.schedule, autocast=cfg.autocast,
            expect_attention=cfg.expect_attention,
        )
        if step == 0:  # kept for parity checks
            grads = {name: _host(p.grad) for name, p in named}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        modes.append(mode)
    weights = {name: _host(p) for name, p in named}
    return TrainResult(losses=losses, grads=grads, weights=weights, modes=modes)


def _host(t: Tensor) -> np.ndarray:
    """A numpy copy of the whole tensor (an FSDP2 shard is gathered first)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.cpu().numpy().copy()


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
    """Run :func:`train` on every rank of the initialised default group (a pool task or a torchrun rank), the
    model wrapped for ``cfg.parallel``; meshes are built once per process and shape."""
    mesh = _cached_mesh(dp, cp, "cpu")
    return train(wrap_model(build(cfg), cfg, mesh), cfg, mesh, forward)


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
