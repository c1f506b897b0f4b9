"""A deliberately small CP attention with the seed's API, and the bugs that CP systems get wrong.

``make_toy(bug)`` returns ``(make_cp_blockdiag_batch_and_ctx, cp_blockdiag_sdpa)``. With ``bug=None`` it is
correct (contiguous shards, all-gather of K and V, a dense per-document mask) and passes the verifier; each
bug is one realistic mistake. The verifier must report every one of them.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from blockdiag_ref import DocLayout, doc_ids_from_batch, temperature_scale

BUGS = (
    "off_by_one",  # the causal mask lets each query see one future key
    "no_grad_reduce",  # backward of the all-gather keeps the local slice instead of summing over ranks
    "leak_across_docs",  # the mask is causal over the whole row: packed documents see each other
    "nonzero_padding",  # padding rows are not zeroed (they attend to their own row's keys)
    "short_straddle",  # keys of the previous rank are cut one token short for a straddling document
    "skip_collective",  # rank 1 never enters the all-gather: the others wait for it
    "raise_forward",  # rank 1 raises inside the forward
    "raise_backward",  # rank 1 raises inside the backward
    "kill_rank",  # rank 1 dies (SIGKILL) inside the forward
    "kv_scale",  # K and V arrive scaled by 1 + 1e-4 (1 + 1e-9 in float64): the smallest error limits must catch
    "refuse_rows",  # refuses B > 1 with a ValueError on every rank (a declared limit, not a bug)
    "docs_by_id",  # a document is every token sharing an id (a convention, declared by its module)
    "late_layer",  # from a step's second attention call on, each query sees one future key (a model's later layers)
    "sinks_ignored",  # the sinks never join the softmax denominator (an attention function dropping s_aux)
    "chunk_from_row",  # chunk boundaries counted from the row's first position instead of each document's start
    "softcap_after_softmax",  # softcap * tanh(p / softcap) on the probabilities instead of on the scores
    "temperature_from_row",  # the NoPE temperature from each query's position in the row, not in its document
    "block_cut_at_rank_edge",  # a bidirectional block sees only its later keys held on the query's own rank
)

KV_SCALE = {torch.float64: 1e-9}  # relative perturbation of kv_scale per dtype; 1e-4 for every other dtype

_state: dict[str, Any] = {}


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world, bug):
        ctx.group, ctx.world, ctx.bug = group, world, bug
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.cat(out, dim=2)  # [B, H, W * L, D]

    @staticmethod
    def backward(ctx, grad):
        if ctx.bug == "raise_backward" and dist.get_rank(ctx.group) == 1:
            raise RuntimeError("planted bug: rank 1 raises in backward")
        chunks = list(grad.contiguous().chunk(ctx.world, dim=2))
        rank = dist.get_rank(ctx.group)
        if ctx.bug == "no_grad_reduce":
            return chunks[rank].contiguous(), None, None, None
        out = torch.empty_like(chunks[rank])
        dist.reduce_scatter(out, [c.contiguous() for c in chunks], group=ctx.group)
        return out, None, None, None


def make_toy(bug: str | None) -> tuple[Callable, Callable]:
    assert bug is None or bug in BUGS, bug

    def make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch, loss_mask=None, padding_token_id=0, *,
                                        bidirectional_blocks=None):
        group = None if cp_mesh is None else cp_mesh.get_group()
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        x = batch["inputs_embeds"]
        B, S = x.shape[:2]
        if bug == "refuse_rows" and B > 1:
            raise ValueError(f"toy: expected one packed row (B = 1), got B={B}")
        ids = doc_ids_from_batch(batch, S, B, x.device)
        L = math.ceil(S / world)
        pad = L * world - S
        batch.pop("attention_mask", None)
        batch["padding_mask"] = ids == 0
        for key in list(batch):
            t = batch[key]
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == (B, S):
                value = {"labels": -100, "padding_mask": True}.get(key, 0)
                t = torch.cat([t, torch.full((B, pad, *t.shape[2:]), value, dtype=t.dtype, device=t.device)], 1)
                batch[key] = t[:, rank * L : (rank + 1) * L]
        full_ids = F.pad(ids, (0, pad))
        layout = DocLayout.from_doc_ids(full_ids.cpu())
        seg = full_ids if bug == "docs_by_id" else layout.segment_ids.to(x.device)
        state = {"group": group, "world": world, "rank": rank, "L": L, "seg": seg, "calls": 0,
                 "start": layout.doc_starts.to(x.device)}
        if bidirectional_blocks is not None:
            state["blocks"] = layout.block_labels(F.pad(bidirectional_blocks.cpu(), (0, pad))).to(x.device)

        @contextlib.contextmanager
        def ctx():
            _state["active"] = state
            try:
                yield
            finally:
                _state.pop("active", None)

        return ctx, batch

    def cp_blockdiag_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                          window_size=None, *, sinks=None, softcap=None, chunk_size=None, temperature=None,
                          bidirectional_blocks=None):
        st = _state.get("active")
        if st is None:
            if sinks is not None or softcap is not None or chunk_size is not None or temperature is not None or (
                    bidirectional_blocks is not None):
                raise ValueError("toy: attention variants are computed under a step only")
            return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        rank, world, L = st["rank"], st["world"], st["L"]
        if bug == "raise_forward" and rank == 1:
            raise RuntimeError("planted bug: rank 1 raises in forward")
        if bug == "kill_rank" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if world > 1 and not (bug == "skip_collective" and rank == 1):
            k = _AllGather.apply(key, st["group"], world, bug)
            v = _AllGather.apply(value, st["group"], world, bug)
        else:
            k, v = key, value
            if world > 1:  # the skipping rank attends locally and moves on
                k = torch.cat([torch.zeros_like(key)] * rank + [key] + [torch.zeros_like(key)] * (world - rank - 1), 2)
                v = torch.cat([torch.zeros_like(value)] * rank + [value] + [torch.zeros_like(value)] * (world - rank - 1), 2)
        if bug == "kv_scale":  # what arrives differs from what was sent (the local slice too: CP 1 is CP)
            eps = KV_SCALE.get(key.dtype, 1e-4)
            k, v = k * (1 + eps), v * (1 + eps)
        seg = st["seg"]  # [B, W * L]
        qpos = torch.arange(rank * L, (rank + 1) * L, device=query.device)
        kpos = torch.arange(world * L, device=query.device)
        seg_q = seg[:, qpos][:, :, None]
        seg_k = seg[:, None, :]
        if bug == "leak_across_docs":
            same = (seg_q != 0) & (seg_k != 0)
        else:
            same = (seg_q == seg_k) & (seg_q != 0)
        st["calls"] += 1
        late = bug == "late_layer" and st["calls"] > 1
        causal = kpos[None, :] <= qpos[:, None] + (1 if bug == "off_by_one" or late else 0)
        mask = same & causal[None]
        if bug == "short_straddle" and rank > 0:
            mask &= (kpos != rank * L - 1)[None, None, :]  # the previous rank's last token never arrives
        if window_size is not None and window_size[0] >= 0:
            mask &= kpos[None, None, :] >= qpos[None, :, None] - window_size[0]
        if chunk_size is not None:
            if bug == "chunk_from_row":
                cq, ck = (qpos // chunk_size)[None, :], (kpos // chunk_size)[None, :]
            else:
                start = st["start"]
                cq, ck = (qpos - start[:, qpos]) // chunk_size, (kpos - start) // chunk_size
            mask &= cq[:, :, None] == ck[:, None, :]
        if bidirectional_blocks:  # the later keys of the query's block
            lab = st["blocks"]
            later = (lab[:, qpos][:, :, None] == lab[:, None, :]) & (lab[:, qpos][:, :, None] != 0)
            later &= (kpos[None, :] > qpos[:, None])[None]
            if bug == "block_cut_at_rank_edge":
                later &= (kpos < (rank + 1) * L)[None, None, :]
            mask = mask | later
        pad_rows = seg_q[:, :, 0] == 0
        if temperature is not None:
            in_doc = torch.where(pad_rows, -1, qpos[None, :] - st["start"][:, qpos])
            where = qpos[None, :].expand_as(in_doc) if bug == "temperature_from_row" else in_doc
            query = (query * temperature_scale(where, *temperature).to(query.device)[:, None, :, None]).to(query.dtype)
        if bug == "nonzero_padding":
            mask = mask | (pad_rows[:, :, None] & (kpos[None, None, :] <= qpos[None, :, None]))
        if sinks is not None or softcap is not None:
            out = _explicit(query, k, v, mask[:, None], scale, sinks, softcap, bug)
        else:
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=enable_gqa)
        if bug != "nonzero_padding":
            out = torch.where(pad_rows[:, None, :, None], 0.0, out)
        return out

    return make_cp_blockdiag_batch_and_ctx, cp_blockdiag_sdpa


def _explicit(q, k, v, mask, scale, sinks, softcap, bug):
    """Attention with sinks / a soft-cap from explicit scores (rows with no key give 0)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None and bug != "softcap_after_softmax":
        scores = softcap * torch.tanh(scores / softcap)
    has_key = mask.any(-1, keepdim=True)
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0.0)
    if sinks is not None and bug != "sinks_ignored":
        sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    if softcap is not None and bug == "softcap_after_softmax":
        probs = softcap * torch.tanh(probs / softcap)
    return torch.where(has_key, probs, 0.0) @ v
