"""Batch padding, sharding and the block-diagonal CP context: the seed's API.

``make_cp_blockdiag_batch_and_ctx`` validates the whole batch first, then (and only then) pads every
sequence-aligned tensor to a multiple of the CP size, slices it to this rank's rows, and returns
``(train_ctx, batch)``. Entering ``train_ctx()`` activates the step state that ``cp_blockdiag_sdpa`` reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import Tensor

from blockdiag_ref import DocLayout, doc_ids_from_batch, layout_from_batch, normalize_window
from blockdiag_ref.batch import boundaries_name_documents, check_integer_positions, positions_name_documents

from .options import CPOptions, kernel_substitution
from .plan import plan_step
from .sharding import check_visual_rows, shard_tensor, shard_visual_tokens
from .state import StepState, activate

__all__ = ["_cp_blockdiag_doc_ids", "make_cp_blockdiag_batch_and_ctx"]

# Pad value of each known sequence-aligned key ("padding_token_id" is filled in per call). Any other tensor
# whose first two dims are [B, S] is sequence-aligned too and padded with 0.
KNOWN_PADS: dict[str, object] = {
    "inputs_embeds": 0.0,
    "input_ids": "padding_token_id",
    "labels": -100,
    "shift_labels": -100,  # pre-shifted targets (transformers' loss and TRL's fused head score them unshifted)
    "position_ids": 0,
    "_packed_seq_ids": 0,
    "loss_mask": 0,
    "padding_mask": True,
    "visual_pos_masks": False,
}
EXACT_BS_KEYS = ("input_ids", "labels", "shift_labels", "_packed_seq_ids", "loss_mask", "padding_mask", "visual_pos_masks")
# Tensors of a multimodal batch that are not sequence-aligned, whatever their shape: never sharded.
UNSHARDED_KEYS = frozenset({
    "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts",
})
# The flash-attn keywords of a flattening collator: boundaries and longest length of the unsharded row. Read for the
# documents where they name them, then dropped: the rank's batch holds other rows.
ROW_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# What the loss reads beside the logits: sharded even with shard_primary=False (the logits come out sharded).
TARGET_KEYS = ("labels", "shift_labels", "loss_mask", "padding_mask", "_packed_seq_ids")
DEEPSTACK_KEY = "_deepstack_visual_embeds"  # a list of [n_vis, H], one per level, indexed by visual token


def _cp_blockdiag_doc_ids(batch: dict, seq_len: int, device, batch_size: int) -> torch.Tensor:
    """Resolve per-position document ids ``[B, S]`` (int64, 0 == padding) for the mask.

    Prefers ``_packed_seq_ids``; else a 4-D block-causal ``attention_mask`` (every document in it is
    recovered); else a 2-D indexed ``attention_mask``, or a validity one split where ``position_ids`` restart
    at 0; else the segments of ``cu_seq_lens_q`` (one packed row); else documents from ``position_ids`` restarting
    at 0 (transformers' ``DataCollatorWithFlattening``; ``[n, B, S]`` mRoPE positions restarting at 0 on every
    axis); else one document per row.
    Delegates to :func:`blockdiag_ref.doc_ids_from_batch`.
    """
    return doc_ids_from_batch(batch, seq_len, batch_size, device)


def _mesh_info(cp_mesh: Any) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, world, rank) of a 1-D DeviceMesh, a ProcessGroup, or None (one-rank CP, no group)."""
    if cp_mesh is None:
        return None, 1, 0
    if isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh, dist.get_world_size(cp_mesh), dist.get_rank(cp_mesh)
    if not (hasattr(cp_mesh, "size") and hasattr(cp_mesh, "get_group")):
        raise ValueError(f"cp_mesh: expected a 1-D DeviceMesh, a ProcessGroup or None, got {type(cp_mesh).__name__}")
    ndim = getattr(cp_mesh, "ndim", 1)
    if ndim != 1:
        raise ValueError(f"cp_mesh: expected a 1-D (sub)mesh for context parallelism, got {ndim} dims")
    size = int(cp_mesh.size())
    group = cp_mesh.get_group()
    group_size = dist.get_world_size(group)
    if group_size != size:
        raise ValueError(f"cp_mesh: expected its process group to hold cp_mesh.size() = {size} ranks, got {group_size}")
    return group, size, dist.get_rank(group)


def _validate_batch(batch: Any, loss_mask: Tensor | None) -> tuple[str, int, int, torch.device]:
    """Check everything the batch function will rely on; return (primary key, B, S, device)."""
    if not isinstance(batch, MutableMapping):
        raise ValueError(f"batch: expected a dict of tensors, got {type(batch).__name__}")
    present = [k for k in ("inputs_embeds", "input_ids") if batch.get(k) is not None]
    if len(present) != 1:
        raise ValueError(
            f"batch: expected exactly one primary stream, 'inputs_embeds' [B, S, H] or 'input_ids' [B, S]; "
            f"got {present or 'neither'}"
        )
    key = present[0]
    x = batch[key]
    if not isinstance(x, Tensor):
        raise ValueError(f"{key}: expected a torch.Tensor, got {type(x).__name__}")
    if key == "inputs_embeds" and (x.dim() != 3 or not x.is_floating_point()):
        raise ValueError(f"inputs_embeds: expected a float tensor [B, S, H], got {x.dtype} of shape {tuple(x.shape)}")
    if key == "input_ids" and (x.dim() != 2 or x.is_floating_point() or x.is_complex()):
        raise ValueError(f"input_ids: expected an integer tensor [B, S], got {x.dtype} of shape {tuple(x.shape)}")
    B, S = x.shape[0], x.shape[1]
    if B < 1 or S < 1:
        raise ValueError(f"{key}: expected B >= 1 and S >= 1, got B={B}, S={S}")
    for k in EXACT_BS_KEYS:
        t = batch.get(k)
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != (B, S)):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{k}: expected shape [B, S] = {[B, S]} like {key}, got {got}")
    pos = batch.get("position_ids")
    if pos is not None:
        if not isinstance(pos, Tensor) or not (
            (pos.dim() == 2 and tuple(pos.shape) == (B, S)) or (pos.dim() == 3 and tuple(pos.shape[1:]) == (B, S))
        ):
            got = tuple(pos.shape) if isinstance(pos, Tensor) else type(pos).__name__
            raise ValueError(f"position_ids: expected [B, S] = {[B, S]} or [n, B, S] (e.g. 3 for mRoPE), got {got}")
        # else they are checked where they are read for documents (every one, or at the boundaries' edges)
        if not (positions_name_documents(batch, S, B) or boundaries_name_documents(batch)):
            _check_positions(pos)
    labels = batch.get("labels")
    if labels is not None and (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool):
        raise ValueError(f"labels: expected integer token ids [B, S] (next-token targets, -100 = ignored), got dtype "
                         f"{labels.dtype}")
    if batch.get("_packed_seq_ids") is not None and batch.get("attention_mask") is not None:
        # the doc ids take precedence, so the mask is not read for documents; it is checked as when it stands alone
        doc_ids_from_batch({"attention_mask": batch["attention_mask"]}, S, B)
    vpm = batch.get("visual_pos_masks")
    if vpm is not None and vpm.dtype != torch.bool:
        raise ValueError(f"visual_pos_masks: expected a bool tensor [B, S] (True = visual token), got dtype {vpm.dtype}")
    if loss_mask is not None and (not isinstance(loss_mask, Tensor) or tuple(loss_mask.shape) != (B, S)):
        got = tuple(loss_mask.shape) if isinstance(loss_mask, Tensor) else type(loss_mask).__name__
        raise ValueError(f"loss_mask: expected shape [B, S] = {[B, S]}, got {got}")
    devices = {t.device for t in batch.values() if isinstance(t, Tensor)} | ({loss_mask.device} if loss_mask is not None else set())
    deepstack = batch.get(DEEPSTACK_KEY)
    if deepstack is not None:
        if not isinstance(deepstack, (list, tuple)) or not all(isinstance(t, Tensor) for t in deepstack):
            raise ValueError(f"{DEEPSTACK_KEY}: expected a list of tensors [n_vis, H], one per level, got {type(deepstack).__name__}")
        devices |= {t.device for t in deepstack}
    if len(devices) > 1:
        raise ValueError(f"batch: expected every tensor on one device, got {sorted(str(d) for d in devices)}")
    return key, B, S, x.device


def _check_positions(pos: Tensor) -> None:
    """Integer positions >= 0, whether or not they are read for documents (doc ids or a mask take precedence)."""
    check_integer_positions(pos)
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError(f"position_ids: expected positions >= 0, got {int(pos.min())}")


def _validate_deepstack(batch: MutableMapping, layout: DocLayout) -> None:
    """``_deepstack_visual_embeds`` holds one row per visual token of ``visual_pos_masks`` at every level."""
    deepstack = batch.get(DEEPSTACK_KEY)
    if deepstack is None:
        return
    vpm = batch.get("visual_pos_masks")
    if vpm is None:
        raise ValueError(
            f"{DEEPSTACK_KEY}: expected visual_pos_masks [B, S] beside it (the positions its rows belong to), got none"
        )
    check_visual_rows(deepstack, vpm, DEEPSTACK_KEY, lambda: f", one row per visual token of visual_pos_masks "
                      f"({_visual_tokens_per_document(vpm, layout.doc_ids)})")


def _visual_tokens_per_document(vpm: Tensor, doc_ids: Tensor) -> str:
    """'row 0 document 1: 4, row 0 document 2: 10' (documents holding visual tokens, in order)."""
    parts = []
    for b in range(vpm.shape[0]):
        ids, counts = torch.unique_consecutive(doc_ids[b].cpu(), return_counts=True)
        start = 0
        for d, n in zip(ids.tolist(), counts.tolist()):
            k = int(vpm[b, start:start + n].sum())
            if k:
                parts.append(f"row {b} {'padding' if d == 0 else f'document {d}'}: {k}")
            start += n
    return ", ".join(parts) or "none"


def _options(options: CPOptions | None, keywords: dict[str, Any]) -> CPOptions:
    """The step's options: ``options`` when given (no keyword option may then differ from its default), else the
    keywords, validated by :class:`CPOptions`."""
    if options is None:
        return CPOptions(**keywords)
    if not isinstance(options, CPOptions):
        raise ValueError(f"options: expected a blockdiag_dist.CPOptions or None, got {type(options).__name__}")
    defaults = CPOptions()
    both = sorted(k for k, v in keywords.items() if v != getattr(defaults, k))
    if both:
        raise ValueError(f"options: expected the keyword options left at their defaults when options= is given, got {both} too")
    return options


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    *,
    kv_exchange: str | None = None,
    kernel: str | None = None,
    layout: str = "contiguous",
    window_sizes: Sequence[Sequence[int] | None] | None = None,
    check_consensus: bool | None = None,
    expect_attention: bool = True,
    shard_primary: bool = True,
    shard_vision: bool = False,
    conv_widths: Sequence[int] | None = None,
    options: CPOptions | None = None,
    bidirectional_blocks: Tensor | None = None,
) -> tuple[Callable[[], ContextManager], dict[str, Any]]:
    """Shard a packed batch for block-diagonal CP and build the step state.

    Args:
        cp_mesh: the 1-D context-parallel (sub)mesh (a ``DeviceMesh``); a ``ProcessGroup`` or ``None``
            (one-rank CP, no communication) are accepted too.
        tp_mesh: accepted for ``_cp_make_batch_fn`` signature compatibility; unused.
        batch: exactly one of ``inputs_embeds [B, S, H]`` / ``input_ids [B, S]``, plus any of ``labels``,
            ``position_ids [B, S]`` or ``[n, B, S]`` (mRoPE), ``_packed_seq_ids``, ``attention_mask``,
            ``cu_seq_lens_q/k`` (one packed row's document boundaries: the documents are then read from them
            alone, in ``O(documents)``), ``loss_mask``, and for a vision-language model its inputs
            (``pixel_values``, ``image_grid_thw``, ..., never sharded), ``visual_pos_masks [B, S]`` and
            ``_deepstack_visual_embeds``. The documents come by the precedence of :mod:`blockdiag_ref.batch`.
            Mutated in place, after all validation, and returned (the same dict; pass ``dict(batch)`` to keep
            yours: values are replaced, never written into): ``attention_mask``, ``cu_seq_lens_q/k`` and
            ``max_length_q/k`` (they describe the unsharded row) are dropped, ``padding_mask [B, S]``
            (True = pad) is added, every sequence-aligned tensor is padded to ``W * L`` and sliced to this
            rank's ``L`` rows. ``inputs_embeds`` is sliced differentiably, so grads reach the full tensor.
            Labels must already be aligned with positions (next-token targets), as for any sharded loss.
        loss_mask: optional ``[B, S]``; padded with 0, sharded, stored into ``batch["loss_mask"]``.
        padding_token_id: pad value of ``input_ids``.
        kv_exchange: ``auto`` (default) | ``allgather`` | ``halo`` | ``a2a`` (and synonyms).
        kernel: ``auto`` (default, = ``varlen``) | ``varlen`` | ``dense`` (and synonyms).
        layout: how rows are assigned to ranks: ``contiguous`` (the seed's sequential sharding),
            ``balanced`` (equal rows, equalised attention work; see :mod:`blockdiag_dist.balance`) or ``auto``
            (the cheapest of those two and balanced with chunk boundaries snapped to documents, by a modelled
            step cost; see :func:`blockdiag_dist.plan.choose_layout`).
        window_sizes: the windows the model's attention calls use; their plans are built here (default:
            the unwindowed one, and none with ``expect_attention=False``; ``[]``: none). A window not listed
            (or a chunked or bidirectional call) is planned on its first use in the step.
        check_consensus: compare a fingerprint of the plans across the ranks (one small all-reduce) and raise
            ``PlanMismatchError`` on every rank, naming the disagreeing ranks (ranks given different batches would
            otherwise compute wrong attention or hang): here, once for all the windows planned here, and for any
            other window on its first use in the step. Default on (``BLOCKDIAG_CHECK_CONSENSUS=0`` turns the
            default off); ``False`` saves one small all-reduce per step (and per window planned later).
        expect_attention: a normal exit of ``train_ctx()`` raises ``AttentionNotRoutedError`` when no attention
            call reached ``cp_blockdiag_sdpa`` in the step (attention that bypasses it attends only within the
            rank's shard). ``False`` only for a model that does not mix along the sequence at all; recurrent
            and convolution layers are judged by the guard either way (:mod:`blockdiag_dist.guard`).
        shard_primary: ``False`` for a model that embeds its inputs itself on the full row (a vision-language
            model's own forward splices vision features into the embedded ``input_ids``): only what the loss
            reads beside the logits (``labels``, ``loss_mask``, ``padding_mask``, ``_packed_seq_ids``) is
            sharded here; the primary stream, ``position_ids`` and every other model input stay full, and the
            integration shards the model's decoder entry (``inputs_embeds``, ``position_ids``,
            ``visual_pos_masks``, deepstack embeddings) with this step's plan
            (:mod:`blockdiag_dist.integrations.vlm`); a step whose decoder entry was not sharded raises at its
            context's exit. ``pixel_values``, ``image_grid_thw`` and the other vision inputs are never sharded.
            With ``True`` (default), ``_deepstack_visual_embeds`` (a list of ``[n_vis, H]``, one row per visual
            token of ``visual_pos_masks``) keeps the rows of the visual tokens this rank holds, in its order.
        shard_vision: with ``shard_primary=False``, a vision-language model's vision tower runs on this rank's
            share of the images (balanced by a modelled cost) instead of all of them, and a differentiable gather
            gives every rank the whole output (:mod:`blockdiag_dist.integrations.vision_shard`).
        conv_widths: the widths of the model's causal convolutions (:func:`blockdiag_dist.mixers.causal_conv`):
            their history exchanges are planned here, and a convolution wider than the widest is refused
            (default: any width, planned on its first use in the step).
        options: all of the above (and ``padding_token_id``) as one validated :class:`~blockdiag_dist.CPOptions`,
            as a trainer integration or a config file holds them; given together with any of the keyword options
            above set to a non-default value it is refused (one source for each option).
        bidirectional_blocks: int ``[B, S]`` block ids of the full rows (0 = none): attention calls with
            ``cp_blockdiag_sdpa(..., bidirectional_blocks=True)`` let a query in a block see every later key of its
            block in its document (Gemma 3's images, PaliGemma's prefix; :mod:`blockdiag_dist.bidirectional`). The
            transformers integration sets them itself from ``token_type_ids`` at the model's entry.

    Returns:
        ``(train_ctx, batch)``: ``train_ctx()`` is a context manager activating the step state (run forward
        and backward inside it); the state is also ``train_ctx.state``.

    Raises:
        ValueError: naming expected vs got, before the batch is touched.
    """
    opts = _options(options, dict(
        kv_exchange=kv_exchange, kernel=kernel, layout=layout, window_sizes=window_sizes, check_consensus=check_consensus,
        expect_attention=expect_attention, shard_primary=shard_primary, shard_vision=shard_vision,
        conv_widths=conv_widths, padding_token_id=padding_token_id,
    ))
    if not opts.shard_primary:
        from .integrations import vlm  # noqa: F401  (registers the scan visitor that hooks decoder entries)
    group, world, rank = _mesh_info(cp_mesh)
    return _step(batch, loss_mask, opts, group, world, rank, bidirectional_blocks)


def _step(batch: Any, loss_mask: Tensor | None, opts: CPOptions, group: dist.ProcessGroup | None, world: int,
          rank: int, bidirectional_blocks: Tensor | None = None) -> tuple[Callable[[], ContextManager], dict[str, Any]]:
    """The batch function once the CP group is known: check the batch, plan the step from its documents (read
    once, without a doc-id tensor where 2-D positions name them), build the state, shard. ``group=None`` with
    ``world > 1`` is one rank's planning without a group (the bench's; no consensus check is possible)."""
    kv_exchange, layout, padding_token_id = opts.resolved_exchange(), opts.layout, opts.padding_token_id
    kernel_name, kernel_requested = opts.resolved_kernel()
    expect_attention, shard_primary, shard_vision = opts.expect_attention, opts.shard_primary, opts.shard_vision
    if opts.window_sizes is None:  # a model without attention plans none ahead
        lefts = [-1] if expect_attention else []
    else:
        lefts = sorted({normalize_window(w) for w in opts.window_sizes})
    check_consensus, conv_widths = opts.check_consensus, opts.conv_widths
    key, B, S, device = _validate_batch(batch, loss_mask)
    if check_consensus is None:
        check_consensus = os.environ.get("BLOCKDIAG_CHECK_CONSENSUS", "1") not in ("", "0")

    doc_layout = layout_from_batch(batch, S, B)
    _validate_deepstack(batch, doc_layout)
    plan = plan_step(doc_layout, world, layout)
    state = StepState(
        plan, rank=rank, group=group, device=device, kv_exchange=kv_exchange, kernel=kernel_name,
        check_consensus=check_consensus, expect_attention=expect_attention, shard_primary=shard_primary,
        padding_token_id=padding_token_id, shard_vision=shard_vision,
    )
    substitution = kernel_substitution(kernel_requested)
    if substitution:
        state.note(f"kernel {kernel_requested!r}: {substitution}")
    if bidirectional_blocks is not None:
        state.set_bidirectional_blocks(bidirectional_blocks)
    state.agree_windows([(left, -1, False, False) for left in lefts])  # one all-gather for all of them
    state.docs  # noqa: B018 - the documents' plan, built here once per step (pure, no communication)
    if conv_widths is not None:
        from .mixers.conv import plan_conv

        state.mixer_widths = frozenset(conv_widths)
        for w in state.mixer_widths:
            state.mixer_plan(("conv", w), lambda w=w: plan_conv(plan, rank, w, device))

    # ---- mutation starts here: everything above may raise, nothing below does ---------------------------
    shards = plan.shards
    batch.pop("attention_mask", None)
    for k in ROW_BOUNDARY_KEYS:
        batch.pop(k, None)
    batch.pop("padding_mask", None)  # set below, from the plan, for this rank's rows only
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    if shard_primary and batch.get(DEEPSTACK_KEY) is not None:  # before visual_pos_masks is sharded
        vpm = batch["visual_pos_masks"]
        batch[DEEPSTACK_KEY] = [shard_visual_tokens(t, vpm, shards, rank) for t in batch[DEEPSTACK_KEY]]
    for k in list(batch):
        t = batch[k]
        if not isinstance(t, Tensor) or k in UNSHARDED_KEYS or (not shard_primary and k not in TARGET_KEYS):
            continue
        pad = KNOWN_PADS.get(k, 0)
        pad = padding_token_id if pad == "padding_token_id" else pad
        if k == "position_ids" and t.dim() == 3:
            batch[k] = shard_tensor(t, 2, pad, shards, rank)
        elif t.dim() >= 2 and tuple(t.shape[:2]) == (B, S):
            batch[k] = shard_tensor(t, 1, pad, shards, rank)
    batch["padding_mask"] = state.docs.padding_mask  # True on the batch's padding and CP's

    def train_ctx() -> ContextManager:
        return activate(state)

    train_ctx.state = state  # type: ignore[attr-defined]
    return train_ctx, batch
