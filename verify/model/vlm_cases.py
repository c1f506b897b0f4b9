"""Vision-language models stepped three ways: the truth (:func:`multimodal_document_reference`: each (text,
images) document alone through the stock model's own forward) and one step under CP by either recipe on this rank
(:func:`run_case`): the cases of the multimodal parity tests (tests/test_vlm.py) and of docs/multimodal.md's
figures. Compared with :func:`verify.model.harness.compare`.

The documents (:func:`documents`): two rows of ``S = 41``; row 0 holds a document opening with text and an image
of 4 x 8 patches (29 tokens) and one opening with an image of 4 x 4 patches (12 tokens), so at CP 2 the first
image spans the rank boundary; row 1 a text-only document (9 tokens) and one with an image of 4 x 4 patches in its
middle (17 tokens), then padding.

Recipes:

- ``"own"``: the model's own forward, ``model(**model_inputs(batch))``, on the batch of
  :func:`~blockdiag_dist.integrations.pack_multimodal_documents` with ``shard_primary=False``: the model embeds
  and splices on the full rows, the integration shards its decoder entry;
- ``"preshard"`` (NeMo Automodel's recipe): the user runs the vision tower and splices its features into the
  embedded rows on the full rows, then hands ``inputs_embeds``, ``position_ids [3, B, S]``, ``labels``,
  ``_packed_seq_ids`` (and for deepstack ``visual_pos_masks``, ``_deepstack_visual_embeds``) to the batch
  function, and calls the language model and the head on the shard.

Shape legend: B rows, S row length, L rows of this rank, H hidden size, V vocabulary, n_vis visual tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from blockdiag_dist.integrations import IGNORE_INDEX, causal_lm_loss, pack_multimodal_documents

from .harness import StepResult, cp_step, param_grads

__all__ = [
    "FLOAT32_STEPS",
    "RECIPES",
    "SEQ_LEN",
    "documents",
    "error_of",
    "float64_throughout",
    "multimodal_document_reference",
    "packed_batch",
    "preshard_batch",
    "preshard_forward",
    "run_case",
]

SEQ_LEN = 41
# What the stock models compute in float32 even in a float64 model, forward and backward (the gradient through
# each step is rounded to float32): where an ulp-level difference upstream (a different summation order under CP)
# can flip a float32 rounding.
FLOAT32_STEPS = {
    "RMSNorm": "the RMS norms (Qwen2.5-VL: decoder, vision blocks and patch merger; Qwen3-VL: decoder) normalise in "
               "float32 and cast back",
    "vision rotary": "the vision tower rotates q and k in float32 (apply_rotary_pos_emb_vision) and casts back",
}
RECIPES = ("own", "preshard")
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def multimodal_document_reference(
    model: nn.Module, docs: list[dict], *, image_token_id: int | None = None
) -> StepResult:
    """The truth for a vision-language model: each (text, images) document alone, through the model's own forward
    with its stock attention: ``model(input_ids [1, n], pixel_values, image_grid_thw, mm_token_type_ids)``, the
    model computing its own mRoPE positions (``get_rope_index``) and splicing its own vision features. The loss is
    the next-token cross-entropy summed over every document's targets, none where the target is an image token
    (``image_token_id``, default ``model.config.image_token_id``); the gradients are those of that sum, vision
    tower included. A document is a mapping with ``input_ids [n]`` and, when it holds images, ``pixel_values``
    and ``image_grid_thw``."""
    image_token_id = model.config.image_token_id if image_token_id is None else image_token_id
    model.zero_grad(set_to_none=True)
    total, targets = 0.0, 0
    for doc in docs:
        ids = torch.as_tensor(doc["input_ids"]).to(torch.int64)[None]
        inputs = {"input_ids": ids, "mm_token_type_ids": (ids == image_token_id).to(torch.int64)}
        if doc.get("image_grid_thw") is not None:
            inputs.update(pixel_values=doc["pixel_values"], image_grid_thw=torch.as_tensor(doc["image_grid_thw"]))
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:].masked_fill(ids[:, 1:] == image_token_id, IGNORE_INDEX)
        loss = causal_lm_loss(model(**inputs, use_cache=False).logits, labels, 1)  # a sum: divided by 1
        loss.backward()
        total += float(loss.detach())
        targets += int((labels != IGNORE_INDEX).sum())
    return StepResult(loss=total, grads=param_grads(model), targets=targets)


def documents(seed: int = 0, dtype: torch.dtype = torch.float64) -> list[dict]:
    """The four documents above (random patches from ``seed``), identical on every rank."""
    from examples.vlm import image_document

    g = torch.Generator().manual_seed(seed)
    return [
        image_document([5, 6, 7], (1, 4, 8), list(range(10, 26)), g, dtype),  # 3 + 1 + 8 + 1 + 16 = 29 tokens
        image_document([], (1, 4, 4), [30, 31, 32, 33, 34, 35, 36], g, dtype),  # image first: 4 + 1 + 7 = 12
        image_document([40, 41, 42, 43, 44, 45, 46, 47, 48], None, [], g, dtype),  # text only: 9
        image_document([50, 51, 52, 53], (1, 4, 4), [54, 55, 56, 57, 58, 59, 60], g, dtype),  # 4 + 1 + 4 + 1 + 7
    ]


def packed_batch(docs: list[dict]) -> dict[str, Tensor]:
    """The documents packed into rows of :data:`SEQ_LEN` with per-document mRoPE positions."""
    from examples.vlm import IMAGE_TOKEN, MERGE

    return pack_multimodal_documents(docs, SEQ_LEN, image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE)


def preshard_batch(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Any]:
    """The user's part of the pre-shard recipe, on the full rows: embed, run the vision tower, splice its features
    at the image tokens; for deepstack, ``visual_pos_masks [B, S]`` and ``_deepstack_visual_embeds`` (a list of
    ``[n_vis, H]``, one per level, in the order of ``inputs_embeds[visual_pos_masks]``)."""
    inner = model.model
    ids = batch["input_ids"]
    embeds = inner.get_input_embeddings()(ids)
    vision = inner.get_image_features(batch["pixel_values"], batch["image_grid_thw"], return_dict=True)
    mask = ids == model.config.image_token_id
    embeds = embeds.masked_scatter(mask[..., None], torch.cat(vision.pooler_output).to(embeds.dtype))
    out: dict[str, Any] = {"inputs_embeds": embeds, "position_ids": batch["position_ids"], "labels": batch["labels"]}
    if "_packed_seq_ids" in batch:
        out["_packed_seq_ids"] = batch["_packed_seq_ids"]
    deepstack = getattr(vision, "deepstack_features", None)
    if deepstack:
        out["visual_pos_masks"] = mask
        out["_deepstack_visual_embeds"] = [torch.cat(level).to(embeds.dtype) for level in deepstack]
    return out


def preshard_forward(model: nn.Module, local: dict[str, Any]) -> Tensor:
    """The shard through the language model (and its deepstack inputs) and the head: logits ``[B, L, V]``."""
    extra = {}
    if "_deepstack_visual_embeds" in local:
        extra = {"visual_pos_masks": local["visual_pos_masks"], "deepstack_visual_embeds": local["_deepstack_visual_embeds"]}
    hidden = model.model.language_model(
        inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"], use_cache=False, **extra
    ).last_hidden_state
    return model.lm_head(hidden)


def _rms_norm_in_input_dtype(self, hidden_states: Tensor) -> Tensor:
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    h = hidden_states.to(dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


def _rotary_vision_in_input_dtype(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import rotate_half

    dtype = torch.promote_types(q.dtype, torch.float32)
    cos, sin = cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)
    qd, kd = q.to(dtype), k.to(dtype)
    return (qd * cos + rotate_half(qd) * sin).to(q.dtype), (kd * cos + rotate_half(kd) * sin).to(k.dtype)


@contextlib.contextmanager
def float64_throughout():
    """Within the block, the steps of :data:`FLOAT32_STEPS` compute in their input's dtype (float32 at least)
    instead: a float64 model then stays in float64, so CP's own error is seen at float64's resolution."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as q25
    from transformers.models.qwen3_vl import modeling_qwen3_vl as q3

    patches = [(q25.Qwen2_5_VLRMSNorm, "forward", _rms_norm_in_input_dtype),
               (q3.Qwen3VLTextRMSNorm, "forward", _rms_norm_in_input_dtype),
               (q25, "apply_rotary_pos_emb_vision", _rotary_vision_in_input_dtype),
               (q3, "apply_rotary_pos_emb_vision", _rotary_vision_in_input_dtype)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run_case(
    family: str,
    recipe: str,
    layout: str = "contiguous",
    *,
    dtype: str = "float64",
    checkpointing: str | None = None,
    autocast: str | None = None,
    doc_ids: bool = True,
    in_float64: bool = False,
    shard_primary: bool | None = None,
    shard_vision: bool = False,
    seed: int = 0,
) -> StepResult:
    """One step of ``family`` by ``recipe`` on this rank (CP over the default group when one is initialised, else
    CP 1), loss and gradients summed over the CP group. ``autocast="bfloat16"``: the step under CPU autocast;
    ``doc_ids=False``: the batch without ``_packed_seq_ids`` (the documents come from the mRoPE positions);
    ``in_float64``: under :func:`float64_throughout`; ``shard_primary``: the batch function's option (default:
    ``False`` for ``"own"``, ``True`` for ``"preshard"``)."""
    from examples.vlm import build_tiny_vlm, vlm_forward

    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    model = build_tiny_vlm(family, dtype=_DTYPES[dtype], seed=seed, checkpointing=checkpointing)
    batch = packed_batch(documents(seed + 1, _DTYPES[dtype]))
    if not doc_ids:
        batch.pop("_packed_seq_ids")
    mesh = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        from verify.pool import worker_info

        mesh = worker_info()["cp_mesh"]
    amp = torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext()
    with amp, (float64_throughout() if in_float64 else contextlib.nullcontext()):
        model.zero_grad(set_to_none=True)
        if recipe == "own":
            own = False if shard_primary is None else shard_primary
            return cp_step(model, batch, mesh, vlm_forward, shard_primary=own, layout=layout, shard_vision=shard_vision)
        pre = True if shard_primary is None else shard_primary
        return cp_step(model, preshard_batch(model, batch), mesh, preshard_forward, layout=layout, shard_primary=pre)


def error_of(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    """``"ErrorType: message"`` of what ``fn(*args, **kwargs)`` raises on this rank, or None (a pool task that
    expects a refusal on every rank without the pool restarting its group)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the caller judges the error
        return f"{type(e).__name__}: {e}"
    return None
