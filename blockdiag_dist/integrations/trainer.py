"""Packed training under block-diagonal CP in Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

    from blockdiag_dist.integrations import register_transformers_attention
    from blockdiag_dist.integrations.trainer import BlockdiagSFTTrainer      # or BlockdiagTrainer
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_transformers_attention())
    trainer = BlockdiagSFTTrainer(model=model, args=SFTConfig(packing=True, ...), train_dataset=ds,
                                  processing_class=tokenizer, cp_size=2)
    trainer.train()          # launched by `accelerate launch --num_processes N` or `torchrun`; CP 1 in one process

What the mixin changes, and why each is right:

- **Data**: ranks ``[d * cp, (d + 1) * cp)`` form CP group ``d``; every rank of a CP group gets the same batches,
  the DP groups different ones (the Trainer's dataloader is sharded over DP only, by handing accelerate a
  ``("dp_replicate", "cp")`` mesh when it prepares a dataloader).
- **The step** (``_prepare_context_parallel_inputs``, the hook ``Trainer.training_step`` and ``prediction_step``
  already call): labels are shifted on the full rows (``shift_labels``: the model and TRL's fused head then score
  them without shifting a shard; blockdiag's own collators, whose labels are already shifted, hand them on as
  ``shift_labels``), per-document ``position_ids`` are added where the batch has none, the batch
  function shards every sequence-aligned tensor and returns the step context, inside which the Trainer runs the
  forward and the backward. The collator's ``cu_seq_lens_q/k`` (``DataCollatorWithFlattening(
  return_flash_attn_kwargs=True)``) name the documents, read in ``O(documents)``; they, ``max_length_q/k`` and
  ``seq_idx`` describe the unsharded row and are dropped from the rank's batch.
- **Loss and gradients**: a model that takes no ``num_items_in_batch`` (``accepts_loss_kwargs = False``, e.g.
  Qwen2.5-VL) gets its loss from its logits and the pre-shifted labels (the Trainer's ``compute_loss_func``, set
  here). ``get_cp_size()`` returns the CP size, so the Trainer's ``num_items_in_batch`` counts
  every target of the DP x CP step once; each rank's loss is its shard's sum divided by it, multiplied by the
  world size (``average_tokens_across_devices``), and DDP / FSDP average over the world: the gradient is the sum
  of the ranks' partial gradients over the step's targets, and the logged loss (a mean over ranks) the step's.

Precision, sharding, compilation: ``bf16=True`` autocasts the forward (attention receives the autocast dtype and
accumulates in float32; weights and gradients stay float32). FSDP2 through accelerate (``fsdp="full_shard"``,
``fsdp_config={"fsdp_version": 2}``) shards over every rank and averages like DDP: the same sum. accelerate applies
FSDP on accelerator devices only; on CPU it drops the plugin without a message and the Trainer uses DDP: noted in
``cp_notes`` and the log. ``torch_compile=True`` compiles the model around blockdiag's attention (a graph break at
each call).

Refused at construction, on every rank (each would train silently wrong under CP): accelerate's own CP
(``ParallelismConfig(cp_size > 1)``: it replaces every mask by ``is_causal``), ``average_tokens_across_devices=False``,
label smoothing and ``compute_loss_func`` (both shift the
sharded labels again), ``compute_metrics`` at CP > 1 (the logits stay sharded). At a step: a batch that names no
documents while ``require_documents`` (TRL packing or ``padding_free``: on by default) is refused before the model runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..batch import make_cp_blockdiag_batch_and_ctx
from ..options import CPOptions
from .packing import IGNORE_INDEX, shift_labels

__all__ = ["BlockdiagSFTTrainer", "BlockdiagTrainer", "BlockdiagTrainerMixin", "document_positions", "environment_from_group",
           "fsdp_not_applied"]

# Keys the batch function adds or keeps for the loss that are not model inputs.
NOT_MODEL_INPUTS = ("padding_mask", "_packed_seq_ids", "loss_mask")
# Keys from which the batch function reads documents (besides a 4-D attention_mask).
DOCUMENT_SOURCES = ("_packed_seq_ids", "cu_seq_lens_q", "position_ids")


def document_positions(doc_ids: Tensor) -> Tensor:
    """Position of every token inside its document (0 at each document's first token; padding 0).
    ``doc_ids [B, S]`` int64 (0 = padding, a document = a maximal run of one id) -> int64 ``[B, S]``.

    >>> document_positions(torch.tensor([[1, 1, 1, 2, 2, 0, 1]])).tolist()
    [[0, 1, 2, 0, 1, 0, 0]]
    """
    B, S = doc_ids.shape
    idx = torch.arange(S, device=doc_ids.device).expand(B, S)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return torch.where(doc_ids == 0, torch.zeros_like(idx), idx - first)


def environment_from_group() -> None:
    """Set the launch variables accelerate reads (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``OMP_NUM_THREADS``) from the already initialised default process group, one node: for a process that joined its
    group without a launcher (a ``FileStore``, a worker pool) before it builds ``TrainingArguments``. A no-op
    without a group."""
    import os

    if not (dist.is_available() and dist.is_initialized()):
        return
    world, rank = str(dist.get_world_size()), str(dist.get_rank())
    os.environ.update(WORLD_SIZE=world, RANK=rank, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def fsdp_not_applied(accelerator: Any) -> str:
    """Why FSDP asked for in the arguments is not in force: accelerate builds its FSDP plugin, then applies it only
    on accelerator devices (CUDA, XPU, NPU, ...); on CPU its distributed type stays ``MULTI_CPU`` (or ``NO`` in one
    process) and the Trainer wraps the model in DDP instead, without a message."""
    from importlib.metadata import version

    kind = getattr(accelerator, "distributed_type", None)
    kind = getattr(kind, "value", kind)
    return (f"fsdp: asked for, not applied: accelerate {version('accelerate')} leaves FSDP off on this machine "
            f"(distributed type {kind}; it applies the FSDP plugin on accelerator devices only), so the Trainer "
            "uses DDP over every rank (one process: no wrapper). Gradients are still summed over DP x CP; the "
            "parameters are not sharded")


class _CPGroups:
    """The ``("dp_replicate", "cp")`` mesh over the default process group (ranks of a CP group contiguous), or
    none in one process."""

    def __init__(self, cp_size: int, device: torch.device) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world % cp_size:
            raise ValueError(f"cp_size: expected a divisor of the world size {world}, got {cp_size}")
        self.cp_size, self.world = cp_size, world
        self.mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type, (world // cp_size, cp_size), mesh_dim_names=("dp_replicate", "cp"))

    @property
    def cp_mesh(self) -> Any:
        return None if self.mesh is None or self.cp_size == 1 else self.mesh["cp"]


class _PreShiftedLabels:
    """A blockdiag collator (``PackingCollator``, ``MultimodalPackingCollator``) whose ``labels`` are already
    next-token targets: they are handed on as ``shift_labels`` too, which the Trainer counts and the loss scores
    unshifted."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, features: Any) -> dict[str, Any]:
        batch = self.collate(features)
        batch["shift_labels"] = batch["labels"]
        return batch


def _shifted_causal_lm_loss(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """The Trainer's ``compute_loss_func`` for a model that takes no ``num_items_in_batch`` (``accepts_loss_kwargs =
    False``, e.g. Qwen2.5-VL): this rank's share of the step's loss from its logits and its pre-shifted labels,
    over the targets of the whole DP x CP step."""
    from .training import causal_lm_loss

    if num_items_in_batch is None:
        raise ValueError("num_items_in_batch: expected the step's target count from the Trainer, got None")
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    return causal_lm_loss(logits, labels, num_items_in_batch)


class BlockdiagTrainerMixin:
    """Block-diagonal CP for a ``transformers.Trainer`` subclass (``class T(BlockdiagTrainerMixin, Trainer)``).

    Args (keyword-only, besides the Trainer's own):
        cp_size: ranks per CP group (a divisor of the world size; 1 = every rank its own batches, documents still
            kept apart: CP with one rank).
        cp_options: the batch function's options (:class:`~blockdiag_dist.CPOptions`: kernel, exchange, layout,
            windows, ...).
        require_documents: refuse a batch that names no documents (no ``_packed_seq_ids``, no ``position_ids``, no
            4-D mask), where one document per row would merge packed documents. Default: on when the args ask for
            packing or ``padding_free`` (TRL), off otherwise.
    """

    def __init__(self, *args: Any, cp_size: int = 1, cp_options: CPOptions | None = None,
                 require_documents: bool | None = None, **kwargs: Any) -> None:
        if cp_options is not None and not isinstance(cp_options, CPOptions):
            raise ValueError(f"cp_options: expected a blockdiag_dist.CPOptions or None, got {type(cp_options).__name__}")
        super().__init__(*args, **kwargs)
        self.cp_options = cp_options or CPOptions()
        self._cp = _CPGroups(cp_size, self.args.device)
        if require_documents is None:
            require_documents = bool(getattr(self.args, "packing", False) or getattr(self.args, "padding_free", False))
        self.require_documents = require_documents
        self.cp_notes: list[str] = []  # what the trainer runs otherwise than its arguments ask, with the reason
        from .multimodal import MultimodalPackingCollator
        from .packing import PackingCollator

        if isinstance(self.data_collator, (PackingCollator, MultimodalPackingCollator)):
            self.data_collator = _PreShiftedLabels(self.data_collator)
        self._check_config()
        # A model whose own loss would be a mean over this rank's shard: the loss from its logits, here
        self._own_loss = not getattr(self, "model_accepts_loss_kwargs", False)
        if self._own_loss:
            self.compute_loss_func = _shifted_causal_lm_loss

    # ---- refusals at construction ------------------------------------------------------------------------------
    def _check_config(self) -> None:
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and getattr(pc, "cp_enabled", False):
            raise ValueError(
                f"parallelism_config: expected cp_size=1 (blockdiag provides CP: pass cp_size= to the trainer), got "
                f"accelerate's cp_size={pc.cp_size}, whose hooks replace every attention mask by is_causal=True"
            )
        if not self.args.average_tokens_across_devices and self._cp.world > 1:
            raise ValueError(
                "average_tokens_across_devices: expected True (the loss of each rank divided by the targets of the "
                "whole DP x CP step), got False: each rank's loss would be a mean over its shard"
            )
        if getattr(self, "label_smoother", None) is not None:
            raise ValueError(
                f"label_smoothing_factor: expected 0 under blockdiag CP, got {self.args.label_smoothing_factor}: the "
                "label smoother shifts the sharded labels again"
            )
        if getattr(self.args, "fsdp_plugin_args", None) is not None and not getattr(self, "is_fsdp_enabled", False):
            self._note(fsdp_not_applied(self.accelerator))
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError(
                "compute_loss_func: expected None under blockdiag CP, got a function: it would receive this rank's "
                "sharded labels unshifted (the model's loss reads the pre-shifted shift_labels)"
            )
        if self._cp.cp_size > 1 and getattr(self, "compute_metrics", None) is not None:
            raise ValueError(
                f"compute_metrics: expected None at cp_size={self._cp.cp_size}, got a function: each rank holds the "
                "logits of its shard only (evaluation computes the loss)"
            )

    def _note(self, text: str) -> None:
        import logging

        self.cp_notes.append(text)
        logging.getLogger(__name__).warning(text)

    # ---- the Trainer's hooks -----------------------------------------------------------------------------------
    def get_cp_size(self) -> int:
        """Ranks that share one batch: the Trainer divides its global target count by it."""
        return self._cp.cp_size

    def _get_dataloader(self, *args: Any, **kwargs: Any):
        """The Trainer's dataloader, sharded over DP only: the ranks of one CP group read the same batches."""
        if self._cp.mesh is None or self._cp.cp_size == 1:
            return super()._get_dataloader(*args, **kwargs)
        accelerator, mesh = self.accelerator, self._cp.mesh
        accelerator._prepare_device_mesh = lambda: mesh  # accelerate shards by the mesh's dp dims
        try:
            return super()._get_dataloader(*args, **kwargs)
        finally:
            del accelerator._prepare_device_mesh

    def _prepare_context_parallel_inputs(
        self, model: torch.nn.Module, inputs: Mapping[str, Any]
    ) -> tuple[Callable[[], AbstractContextManager], dict[str, Any]]:
        """Shard this rank's batch and return the step context (see the module docstring)."""
        batch = dict(inputs)
        # the unsharded row's documents token by token, for other kernels: the batch function reads them from the full
        # rows (and drops the collator's boundaries, cu_seq_lens_q/k, once read)
        batch.pop("seq_idx", None)
        mask = batch.get("attention_mask")
        if self.require_documents and not any(batch.get(k) is not None for k in DOCUMENT_SOURCES) and not (
            isinstance(mask, Tensor) and mask.dim() == 4
        ):
            raise ValueError(
                "batch: expected documents named by _packed_seq_ids, cu_seq_lens_q, restarting position_ids or a 4-D mask "
                f"(packing is on), got only {sorted(batch)}: every row would be one document, merging the packed documents"
            )
        labels = batch.get("labels")
        if isinstance(labels, Tensor) and batch.get("shift_labels") is None:
            if labels.dim() != 2 or labels.is_floating_point():
                raise ValueError(f"labels: expected an integer tensor [B, S], got {labels.dtype} of shape {tuple(labels.shape)}")
            batch["shift_labels"] = shift_labels(labels, IGNORE_INDEX)
        primary = batch.get("input_ids", batch.get("inputs_embeds"))
        if batch.get("position_ids") is None and isinstance(primary, Tensor):
            from .. import _cp_blockdiag_doc_ids

            B, S = primary.shape[:2]
            doc_ids = _cp_blockdiag_doc_ids(batch, S, primary.device, B)
            batch["position_ids"] = document_positions(doc_ids)
            batch["_packed_seq_ids"] = doc_ids  # the batch function reads the documents found here, not again
            batch.pop("attention_mask", None)  # read for them just now (the batch function drops it anyway)
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(self._cp.cp_mesh, None, batch, options=self.cp_options)
        for key in NOT_MODEL_INPUTS:
            batch.pop(key, None)
        if self._own_loss and batch.get("shift_labels") is not None:  # the Trainer hands labels to compute_loss_func
            batch["labels"] = batch.pop("shift_labels")
        return train_ctx, batch


def _trainer_class() -> type:
    from transformers import Trainer

    class BlockdiagTrainer(BlockdiagTrainerMixin, Trainer):
        """``transformers.Trainer`` with block-diagonal CP (:class:`BlockdiagTrainerMixin`)."""

    BlockdiagTrainer.__module__ = __name__
    return BlockdiagTrainer


def _sft_trainer_class() -> type:
    from trl import SFTTrainer

    class BlockdiagSFTTrainer(BlockdiagTrainerMixin, SFTTrainer):
        """TRL's ``SFTTrainer`` with block-diagonal CP (:class:`BlockdiagTrainerMixin`): packing (``bfd``,
        ``wrapped``) and ``padding_free`` at any CP size."""

    BlockdiagSFTTrainer.__module__ = __name__
    return BlockdiagSFTTrainer


_LAZY = {"BlockdiagTrainer": _trainer_class, "BlockdiagSFTTrainer": _sft_trainer_class}


def __getattr__(name: str) -> type:  # transformers and trl are imported on first use only
    if name in _LAZY:
        cls = _LAZY[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
