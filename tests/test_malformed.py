"""Malformed input: every kind is answered by a ValueError naming what was expected and what was got, raised
before the batch is mutated. This table is the "Malformed input" table of docs/faults.md (a test keeps them in sync)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from blockdiag_dist import (causal_conv, configure_cp_varlen, cp_blockdiag_sdpa, gated_delta_rule, kimi_delta_attention,
                            lightning_attention, make_cp_blockdiag_batch_and_ctx, selective_scan, ssd)
from blockdiag_ref import DocLayout, reference_attention

FAULTS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "faults.md"
MULTIMODAL_PAGE = Path(__file__).resolve().parents[1] / "docs" / "multimodal.md"


def good_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "inputs_embeds": torch.randn(2, 7, 3, generator=g),
        "labels": torch.randint(0, 5, (2, 7), generator=g),
        "position_ids": torch.arange(7).expand(2, 7).clone(),
        "_packed_seq_ids": torch.tensor([[1, 1, 1, 2, 2, 0, 0], [3, 3, 0, 3, 4, 4, 4]]),
        "attention_mask": torch.ones(2, 7, dtype=torch.long),
    }




def not_block_causal(b):
    b.pop("_packed_seq_ids")
    mask = DocLayout.from_doc_ids(torch.tensor([[1, 1, 2, 2, 2, 2, 2]] * 2)).materialize_mask().clone()
    mask[:, :, 3, 1] = True  # document 2 sees into document 1
    b["attention_mask"] = mask


# id, what is malformed, how to break a good batch, extra keyword arguments, expected message
BATCH_ROWS = [
    ("both-streams", "both `inputs_embeds` and `input_ids`", lambda b: b.update(input_ids=torch.zeros(2, 7, dtype=torch.long)), {}, r"exactly one primary stream.*got \['inputs_embeds', 'input_ids'\]"),
    ("no-stream", "neither `inputs_embeds` nor `input_ids`", lambda b: b.pop("inputs_embeds"), {}, "exactly one primary stream.*got neither"),
    ("embeds-rank", "`inputs_embeds` not `[B, S, H]`", lambda b: b.update(inputs_embeds=torch.zeros(2, 7)), {}, r"inputs_embeds: expected a float tensor \[B, S, H\], got torch.float32 of shape \(2, 7\)"),
    ("ids-float", "`input_ids` of a float dtype", lambda b: (b.pop("inputs_embeds"), b.update(input_ids=torch.zeros(2, 7))), {}, r"input_ids: expected an integer tensor \[B, S\], got torch.float32"),
    ("empty-sequence", "S = 0", lambda b: b.update(inputs_embeds=torch.zeros(2, 0, 3)), {}, "expected B >= 1 and S >= 1, got B=2, S=0"),
    ("labels-seq-len", "`labels` with another sequence length", lambda b: b.update(labels=torch.zeros(2, 6, dtype=torch.long)), {}, r"labels: expected shape \[B, S\] = \[2, 7\] like inputs_embeds, got \(2, 6\)"),
    ("labels-batch", "`labels` with another batch size", lambda b: b.update(labels=torch.zeros(3, 7, dtype=torch.long)), {}, r"labels: expected shape \[B, S\] = \[2, 7\] like inputs_embeds, got \(3, 7\)"),
    ("position-ids-rank", "`position_ids` of a wrong rank", lambda b: b.update(position_ids=torch.zeros(7, dtype=torch.long)), {}, r"position_ids: expected \[B, S\] = \[2, 7\] or \[n, B, S\]"),
    ("position-ids-mrope", "`position_ids [3, B, S']` with another length", lambda b: b.update(position_ids=torch.zeros(3, 2, 6, dtype=torch.long)), {}, r"position_ids: expected \[B, S\] = \[2, 7\] or \[n, B, S\].*got \(3, 2, 6\)"),
    ("position-ids-float", "float `position_ids` read for documents (no doc ids, no mask)", lambda b: (b.pop("_packed_seq_ids"), b.pop("attention_mask"), b.update(position_ids=b["position_ids"].float())), {}, "position_ids: expected integer positions, got dtype torch.float32"),
    ("labels-float", "`labels` of a float dtype", lambda b: b.update(labels=b["labels"].float()), {}, r"labels: expected integer token ids \[B, S\] .*got dtype torch.float32"),
    ("position-ids-float-beside-ids", "float `position_ids` beside doc ids (not read for documents)", lambda b: b.update(position_ids=b["position_ids"].float()), {}, "position_ids: expected integer positions, got dtype torch.float32"),
    ("position-ids-negative", "negative `position_ids` beside doc ids", lambda b: b.update(position_ids=b["position_ids"] - 1), {}, "position_ids: expected positions >= 0, got -1"),
    ("doc-ids-negative", "negative doc ids", lambda b: b.update(_packed_seq_ids=-b["_packed_seq_ids"]), {}, "_packed_seq_ids: expected ids >= 0 .*got a negative id"),
    ("doc-ids-float", "float doc ids", lambda b: b.update(_packed_seq_ids=b["_packed_seq_ids"].float()), {}, "_packed_seq_ids: expected bool or integer ids, got dtype torch.float32"),
    ("doc-ids-shape", "doc ids of another shape", lambda b: b.update(_packed_seq_ids=torch.ones(2, 8, dtype=torch.long)), {}, r"_packed_seq_ids: expected shape \[B, S\] = \[2, 7\] like inputs_embeds, got \(2, 8\)"),
    ("mask-not-block-causal", "a 4-D mask that is not block-causal", not_block_causal, {}, "expected a block-causal 4-D mask.*got row 0, query 3"),
    ("mask-rank", "a 3-D `attention_mask`", lambda b: (b.pop("_packed_seq_ids"), b.update(attention_mask=torch.ones(2, 7, 7, dtype=torch.bool))), {}, r"attention_mask: expected 2 dims \[B, S\] or 4 dims \[B, 1, S, S\], got 3 dims"),
    ("mask-additive-values", "an additive mask holding values other than 0 / -inf", lambda b: (b.pop("_packed_seq_ids"), b.update(attention_mask=torch.full((2, 1, 7, 7), -0.5))), {}, "additive 4-D mask must hold 0 .*got the value -0.5"),
    ("mask-shape-beside-ids", "a 2-D `attention_mask` of another shape beside doc ids (not read for documents)", lambda b: b.update(attention_mask=torch.ones(2, 6, dtype=torch.long)), {}, r"attention_mask: expected a 2-D mask of shape \[B, S\] = \[2, 7\], got \[2, 6\]"),
    ("mask-rank-beside-ids", "a 3-D `attention_mask` beside doc ids", lambda b: b.update(attention_mask=torch.ones(2, 7, 7, dtype=torch.bool)), {}, r"attention_mask: expected 2 dims \[B, S\] or 4 dims \[B, 1, S, S\], got 3 dims"),
    ("mask-not-block-causal-beside-ids", "a 4-D mask that is not block-causal beside doc ids", lambda b: (not_block_causal(b), b.update(_packed_seq_ids=torch.ones(2, 7, dtype=torch.long))), {}, "expected a block-causal 4-D mask.*got row 0, query 3"),
    ("mask-type-beside-ids", "an `attention_mask` that is not a tensor beside doc ids", lambda b: b.update(attention_mask=[[1] * 7] * 2), {}, "attention_mask: expected a torch.Tensor, got list"),
    ("loss-mask-shape", "`loss_mask` of a wrong shape", lambda b: None, {"loss_mask": torch.ones(7)}, r"loss_mask: expected shape \[B, S\] = \[2, 7\], got \(7,\)"),
    ("two-devices", "tensors on two devices", lambda b: b.update(labels=torch.zeros(2, 7, dtype=torch.long, device="meta")), {}, r"batch: expected every tensor on one device, got \['cpu', 'meta'\]"),
    ("unknown-exchange", "an unknown K/V exchange name", lambda b: None, {"kv_exchange": "ring"}, "kv_exchange: expected one of 'auto', 'allgather'.*got 'ring'"),
    ("unknown-kernel", "an unknown kernel name", lambda b: None, {"kernel": "triton"}, "kernel: expected one of 'auto', 'varlen'.*got 'triton'"),
    ("unknown-layout", "an unknown layout name", lambda b: None, {"layout": "zigzag2"}, "layout: expected one of 'contiguous'.*got 'zigzag2'"),
    ("window-right", "a window with right > 0 under causal attention", lambda b: None, {"window_sizes": [(4, 2)]}, r"right must be <= 0 \(0 or -1\); got right=2"),
    ("mesh-type", "a mesh that is not a mesh", lambda b: None, {"cp_mesh": "cp"}, "cp_mesh: expected a 1-D DeviceMesh, a ProcessGroup or None, got str"),
    ("batch-type", "a batch that is not a dict", None, {}, "batch: expected a dict of tensors, got list"),
    ("conv-widths", "`conv_widths` that are not widths >= 1", lambda b: None, {"conv_widths": [4, 0]}, r"conv_widths: expected None or a non-empty sequence of convolution widths >= 1, got \[4, 0\]"),
]


def with_deepstack(b, rows=(4, 4)):
    """visual_pos_masks marking 2 tokens of document 1 and 2 of document 3, deepstack levels of ``rows`` rows."""
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 1:3] = True
    mask[1, 0:2] = True
    b["visual_pos_masks"] = mask
    b["_deepstack_visual_embeds"] = [torch.zeros(n, 3) for n in rows]


def mrope_restart(b):
    b.pop("_packed_seq_ids")
    b.pop("attention_mask")
    b["position_ids"] = torch.tensor([[0, 1, 2, 3, 1, 2, 3]] * 2).expand(3, 2, 7).clone()


# Vision-language batches (docs/multimodal.md's table): id, what is malformed, edit, keyword arguments, message
MULTIMODAL_BATCH_ROWS = [
    ("deepstack-lengths", "a `_deepstack_visual_embeds` level whose rows disagree with `visual_pos_masks`", lambda b: with_deepstack(b, (4, 3)), {}, r"_deepstack_visual_embeds\[1\]: expected \[n_vis, H\] with n_vis = 4, one row per visual token of visual_pos_masks \(row 0 document 1: 2, row 1 document 3: 2\), got shape \(3, 3\)"),
    ("deepstack-no-mask", "`_deepstack_visual_embeds` without `visual_pos_masks`", lambda b: (with_deepstack(b), b.pop("visual_pos_masks")), {}, r"_deepstack_visual_embeds: expected visual_pos_masks \[B, S\] beside it"),
    ("deepstack-type", "`_deepstack_visual_embeds` that is not a list of tensors", lambda b: (with_deepstack(b), b.update(_deepstack_visual_embeds=torch.zeros(4, 3))), {}, r"_deepstack_visual_embeds: expected a list of tensors \[n_vis, H\], one per level, got Tensor"),
    ("visual-mask-dtype", "`visual_pos_masks` that is not bool", lambda b: (with_deepstack(b), b.update(visual_pos_masks=b["visual_pos_masks"].long())), {}, "visual_pos_masks: expected a bool tensor \\[B, S\\] \\(True = visual token\\), got dtype torch.int64"),
    ("visual-mask-shape", "`visual_pos_masks` of another shape", lambda b: (with_deepstack(b), b.update(visual_pos_masks=b["visual_pos_masks"][:, :6])), {}, r"visual_pos_masks: expected shape \[B, S\] = \[2, 7\] like inputs_embeds, got \(2, 6\)"),
    ("mrope-restart", "mRoPE `position_ids [3, B, S]` restarting without every axis at 0 (no doc ids, no mask)", mrope_restart, {}, r"position_ids: expected \[n, B, S\] positions that restart at 0 on every axis .*got row 0, position 4 at \(1, 1, 1\) after \(3, 3, 3\) at position 3"),
    ("mrope-length", "mRoPE `position_ids [3, B, S']` with another length", lambda b: b.update(position_ids=torch.zeros(3, 2, 6, dtype=torch.long)), {}, r"position_ids: expected \[B, S\] = \[2, 7\] or \[n, B, S\].*got \(3, 2, 6\)"),
    ("shard-primary-type", "`shard_primary` that is not a bool", lambda b: None, {"shard_primary": 1}, "shard_primary: expected a bool, got int"),
    ("shard-vision-primary", "`shard_vision=True` with the primary stream sharded", lambda b: None, {"shard_vision": True}, r"shard_vision=True: expected shard_primary=False .*got shard_primary=True"),
]


def qkv(shapes, dtypes=(torch.float64,) * 3, devices=("cpu",) * 3):
    return [torch.zeros(s, dtype=d, device=dev) for s, d, dev in zip(shapes, dtypes, devices)]


OK = ((2, 4, 7, 5), (2, 2, 7, 5), (2, 2, 7, 5))
# id, what is malformed, (q, k, v), keyword arguments, expected message
SDPA_ROWS = [
    ("qkv-rank", "q/k/v not `[B, H, L, D]`", qkv(((4, 7, 5),) * 3), {}, r"query expected 4 dims \[B, H, L, D\], got \(4, 7, 5\)"),
    ("qkv-shard", "q/k/v that are not this rank's shard", qkv(((2, 4, 6, 5), (2, 2, 6, 5), (2, 2, 6, 5))), {"enable_gqa": True}, r"expected this rank's shard \[B=2, H, L=7, D\] of the active step, got \(2, 4, 6, 5\)"),
    ("heads-not-multiple", "Hq not a multiple of Hkv", qkv(((2, 3, 7, 5), (2, 2, 7, 5), (2, 2, 7, 5))), {"enable_gqa": True}, "expected Hq a multiple of Hkv, got Hq=3, Hkv=2"),
    ("gqa-off", "Hq != Hkv without `enable_gqa`", qkv(OK), {}, "Hq=4 != Hkv=2 needs enable_gqa=True"),
    ("head-dims", "head dims of q and k that differ", qkv(((2, 4, 7, 5), (2, 4, 7, 4), (2, 4, 7, 5))), {}, "query and key expected the same head dim D, got 5 and 4"),
    ("kv-heads", "k and v with different Hkv", qkv(((2, 4, 7, 5), (2, 2, 7, 5), (2, 1, 7, 5))), {"enable_gqa": True}, "key and value expected the same Hkv, got 2 and 1"),
    ("qkv-dtypes", "q/k/v of different dtypes", qkv(OK, (torch.float64, torch.float32, torch.float64)), {"enable_gqa": True}, "expected one dtype for query/key/value, got torch.float64, torch.float32, torch.float64"),
    ("qkv-devices", "q/k/v on different devices", qkv(OK, devices=("cpu", "meta", "cpu")), {"enable_gqa": True}, r"expected one device for query/key/value, got \['cpu', 'meta'\]"),
    ("sdpa-window-right", "`window_size` with right > 0", qkv(OK), {"enable_gqa": True, "window_size": (2, 1)}, "right must be <= 0"),
    ("noncausal-call", "`is_causal=False` under an active step, without an opt-in", qkv(OK), {"enable_gqa": True, "is_causal": False}, "expected causal attention under an active CP step .*got is_causal=False.*noncausal='causal'.*noncausal='local'"),
    ("attn-mask-call", "an `attn_mask` under an active step, without an opt-in", qkv(OK), {"enable_gqa": True, "attn_mask": torch.ones(7, 7, dtype=torch.bool)}, r"got is_causal=True with an attn_mask of shape \(7, 7\)"),
    ("noncausal-name", "an unknown `noncausal` mode", qkv(OK), {"enable_gqa": True, "is_causal": False, "noncausal": "bidirectional"}, "noncausal expected one of \\('raise', 'causal', 'local'\\), got 'bidirectional'"),
    ("dropout-range", "`dropout_p` outside [0, 1]", qkv(OK), {"enable_gqa": True, "dropout_p": 1.5}, "expected 0 <= dropout_p <= 1, got 1.5"),
    ("temperature-pair", "a NoPE `temperature` that is not a pair", qkv(OK), {"enable_gqa": True, "temperature": (4,)}, r"temperature: expected None or a pair \(floor_scale, attn_scale\) of numbers, got \(4,\)"),
    ("temperature-floor", "a NoPE `temperature` with `floor_scale <= 0`", qkv(OK), {"enable_gqa": True, "temperature": (0, 0.1)}, r"temperature: expected a finite floor_scale > 0 and a finite attn_scale, got \(0, 0.1\)"),
]

def gdr_inputs(L=7, Hk=2, Hv=4, K=3, V=2, dtype=torch.float64):
    return [torch.zeros(2, L, Hk, K, dtype=dtype), torch.zeros(2, L, Hk, K, dtype=dtype), torch.zeros(2, L, Hv, V, dtype=dtype),
            torch.zeros(2, L, Hv, dtype=dtype), torch.zeros(2, L, Hv, dtype=dtype)]


def kda_inputs(L=7, Hk=2, Hv=4, K=3, V=2, decay=None):
    f = torch.float64
    q, k, v, _, beta = gdr_inputs(L, Hk, Hv, K, V)
    return [q, k, v, torch.zeros(2, L, Hv, K, dtype=f) if decay is None else torch.zeros(decay, dtype=f), beta]


def ssd_inputs(L=7, H=4, Dh=3, G=2, N=2):
    f = torch.float64
    return [torch.zeros(2, L, H, Dh, dtype=f), torch.zeros(2, L, H, dtype=f), torch.zeros(H, dtype=f),
            torch.zeros(2, L, G, N, dtype=f), torch.zeros(2, L, G, N, dtype=f)]


def scan_inputs(L=7, I=6, G=2, N=2, A=None):
    f = torch.float64
    return [torch.zeros(2, L, I, dtype=f), torch.zeros(2, L, I, dtype=f), torch.zeros(A or (I, N), dtype=f),
            torch.zeros(2, L, G, N, dtype=f), torch.zeros(2, L, G, N, dtype=f)]


def light_inputs(L=7, H=4, K=3, V=2, Hv=None, slope=None):
    f = torch.float64
    return [torch.zeros(2, L, H, K, dtype=f), torch.zeros(2, L, H, K, dtype=f), torch.zeros(2, L, Hv or H, V, dtype=f),
            torch.full(slope or (H,), 0.1, dtype=f)]


def minimax_layer_with_cache():
    """A MiniMax lightning layer (the blockdiag forward installed) called with a cache under the step."""
    minimax = pytest.importorskip("transformers.models.minimax.modeling_minimax", reason="transformers is not installed")
    from transformers import MiniMaxConfig

    from blockdiag_dist.integrations.hf_mixers import install_lightning

    cfg = MiniMaxConfig(hidden_size=8, num_attention_heads=2, head_dim=4, num_hidden_layers=2, block_size=4,
                        layer_types=["linear_attention", "full_attention"])
    layer = minimax.MiniMaxLightningAttention(cfg, layer_idx=0)
    install_lightning(type(layer))
    return layer(torch.zeros(2, 7, 8), None, None, cache=object())


def mamba1_layer_with_cache():
    """A Jamba Mamba layer (the blockdiag forward installed) called with a cache under the step."""
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba", reason="transformers is not installed")
    from transformers import JambaConfig

    from blockdiag_dist.integrations.hf_mixers import install_mamba1

    cfg = JambaConfig(hidden_size=8, mamba_d_state=2, mamba_dt_rank=2, mamba_expand=1, num_hidden_layers=1,
                      attn_layer_period=2, attn_layer_offset=1)
    layer = jamba.JambaMambaMixer(cfg, layer_idx=0)
    install_mamba1(type(layer))
    return layer(torch.zeros(2, 7, 8), cache=object())


# id, what is malformed, the call under an active step (CP 1, B = 2, L = 7, conv_widths=[4]), expected message
MIXER_ROWS = [
    ("conv-shard", "a convolution given a tensor that is not this rank's shard", lambda: causal_conv(torch.zeros(2, 6, 5), torch.zeros(5, 4)), r"causal_conv: x expected this rank's shard \[B=2, L=7, ...\] of the active step, got \(2, 6, 5\)"),
    ("conv-weight", "a convolution weight that is not depthwise", lambda: causal_conv(torch.zeros(2, 7, 5), torch.zeros(5, 2, 4)), r"expected a depthwise weight \[C, W\] or \[C, 1, W\] with C = 5 channels of x, got \(5, 2, 4\)"),
    ("conv-too-wide", "a convolution wider than the history the step planned", lambda: causal_conv(torch.zeros(2, 7, 5), torch.zeros(5, 6)), r"expected a width of at most 4, the history the step planned \(W - 1 = 3 tokens: conv_widths=\[4\].*got width 6"),
    ("gdr-shard", "gated delta rule inputs that are not this rank's shard", lambda: gated_delta_rule(*gdr_inputs(L=5)), r"gated_delta_rule: q expected this rank's shard \[B=2, L=7, ...\] of the active step, got \(2, 5, 2, 3\)"),
    ("gdr-heads", "value heads not a multiple of the key heads", lambda: gated_delta_rule(*gdr_inputs(Hv=3)), "expected the value heads a multiple of the key heads, got Hv=3, Hk=2"),
    ("gdr-state-dtype", "a recurrent state (summary) dtype below float32", lambda: gated_delta_rule(*gdr_inputs(), state_dtype=torch.bfloat16), r"state_dtype expected one of \['torch.float32', 'torch.float64'\].*got torch.bfloat16"),
    ("gdr-integer", "integer inputs to the gated delta rule", lambda: gated_delta_rule(*gdr_inputs(dtype=torch.int64)), "q expected a floating dtype, got torch.int64"),
    ("kda-shard", "KDA inputs that are not this rank's shard", lambda: kimi_delta_attention(*kda_inputs(L=5)), r"kimi_delta_attention: q expected this rank's shard \[B=2, L=7, ...\] of the active step, got \(2, 5, 2, 3\)"),
    ("kda-decay", "a KDA decay that is not per key channel (one per head, as Gated DeltaNet's)", lambda: kimi_delta_attention(*kda_inputs(decay=(2, 7, 4, 1))), r"kimi_delta_attention: g expected \[B, L, Hv, K\] \(a log decay per key channel\) with Hv=4, K=3, got \(2, 7, 4, 1\)"),
    ("kda-state-dtype", "a KDA state (summary) dtype below float32", lambda: kimi_delta_attention(*kda_inputs(), state_dtype=torch.float16), r"kimi_delta_attention: state_dtype expected one of \['torch.float32', 'torch.float64'\].*got torch.float16"),
    ("ssd-shard", "Mamba2 SSD inputs that are not this rank's shard", lambda: ssd(*ssd_inputs(L=5)), r"ssd: x expected this rank's shard \[B=2, L=7, ...\] of the active step, got \(2, 5, 4, 3\)"),
    ("ssd-groups", "SSD heads not a multiple of the groups of B and C", lambda: ssd(*ssd_inputs(H=3)), "ssd: expected the heads a multiple of the groups, got H=3, G=2"),
    ("ssd-state-dtype", "an SSD state (summary) dtype below float32", lambda: ssd(*ssd_inputs(), state_dtype=torch.bfloat16), r"ssd: state_dtype expected one of \['torch.float32', 'torch.float64'\].*got torch.bfloat16"),
    ("scan-shard", "Mamba1 selective-scan inputs that are not this rank's shard", lambda: selective_scan(*scan_inputs(L=5)), r"selective_scan: x expected this rank's shard \[B=2, L=7, ...\] of the active step, got \(2, 5, 6\)"),
    ("scan-groups", "selective-scan channels not a multiple of the groups of B and C", lambda: selective_scan(*scan_inputs(I=5, A=(5, 2))), "selective_scan: expected the channels a multiple of the groups, got I=5, G=2"),
    ("scan-decay-shape", "a selective-scan decay `A` that is not `[I, N]`", lambda: selective_scan(*scan_inputs(A=(6,))), r"selective_scan: A expected \[I, N\] = \[6, 2\], got \(6,\)"),
    ("scan-state-dtype", "a selective-scan state (summary) dtype below float32", lambda: selective_scan(*scan_inputs(), state_dtype=torch.float16), r"selective_scan: state_dtype expected one of \['torch.float32', 'torch.float64'\].*got torch.float16"),
    ("light-shard", "lightning-attention inputs that are not this rank's shard", lambda: lightning_attention(*light_inputs(L=5)), r"lightning_attention: q expected this rank's shard \[B=2, L=7, ...\] of the active step, got \(2, 5, 4, 3\)"),
    ("light-heads", "lightning-attention values with other heads than the queries", lambda: lightning_attention(*light_inputs(Hv=2)), r"lightning_attention: v expected \[B, L, H, V\] with H=4 \(q's heads\), got \(2, 7, 2, 2\)"),
    ("light-slope", "a lightning-attention slope that is not one decay rate per head", lambda: lightning_attention(*light_inputs(slope=(2, 7, 4))), r"lightning_attention: slope expected a floating tensor of H=4 decay rates \(one per head\), got torch.float64 \(2, 7, 4\)"),
    ("light-state-dtype", "a lightning-attention state (summary) dtype below float32", lambda: lightning_attention(*light_inputs(), state_dtype=torch.bfloat16), r"lightning_attention: state_dtype expected one of \['torch.float32', 'torch.float64'\].*got torch.bfloat16"),
    ("minimax-cache", "a cache given to an installed MiniMax lightning layer under a step", minimax_layer_with_cache, r"MiniMaxLightningAttention \(layer 0\): expected no cache under a CP step \(use_cache=False in training\), got object"),
    ("mamba1-cache", "a cache given to an installed Mamba1 layer under a step", mamba1_layer_with_cache, r"JambaMambaMixer \(layer 0\): expected no cache under a CP step \(use_cache=False in training\), got object"),
]

OTHER_ROWS = [
    ("configure-name", "an unknown name given to `configure_cp_varlen`", lambda: configure_cp_varlen(attn_backend="xformers"), "attn_backend: expected one of 'auto', 'varlen', 'flash'.*got 'xformers'"),
    ("reference-gqa", "`reference_attention` with Hq != Hkv and no `enable_gqa`", lambda: reference_attention(*qkv(OK), torch.ones(2, 7, dtype=torch.long)), "needs enable_gqa=True"),
    ("reference-temperature", "`reference_attention` with a `temperature` that is not numbers", lambda: reference_attention(*qkv(OK), torch.ones(2, 7, dtype=torch.long), enable_gqa=True, temperature=(4, "0.1")), r"temperature: expected a pair \(floor_scale, attn_scale\) of numbers, got \(4, '0.1'\)"),
    ("layout-lengths", "a document of length 0 in `DocLayout.from_seqlens`", lambda: DocLayout.from_seqlens([3, 0]), r"expected document lengths >= 1 \(ints\), got row 0 = \[3, 0\]"),
    ("mixer-no-step", "a mixer called outside a CP step", lambda: causal_conv(torch.zeros(2, 7, 5), torch.zeros(5, 4)), r"causal_conv: expected an active CP step .*got none"),
]


def _snapshot(batch):
    return {k: (v, v.clone() if isinstance(v, torch.Tensor) and not v.is_meta else copy.deepcopy(v)) for k, v in batch.items()}


@pytest.mark.parametrize(
    "edit, kwargs, match", [pytest.param(e, k, m, id=i) for i, _, e, k, m in BATCH_ROWS + MULTIMODAL_BATCH_ROWS]
)
def test_batch_function_rejects_before_mutating(edit, kwargs, match):
    if edit is None:
        with pytest.raises(ValueError, match=match):
            make_cp_blockdiag_batch_and_ctx(None, None, [torch.zeros(1, 2, 3)])
        return
    batch = good_batch()
    edit(batch)
    before = _snapshot(batch)
    kwargs = dict(kwargs)
    with pytest.raises(ValueError, match=match):
        make_cp_blockdiag_batch_and_ctx(kwargs.pop("cp_mesh", None), None, batch, **kwargs)
    assert batch.keys() == before.keys(), "keys were added or removed before the error"
    for k, (obj, content) in before.items():
        assert batch[k] is obj, f"{k} was replaced before the error"
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            assert torch.equal(obj, content), f"{k} was modified in place before the error"


@pytest.mark.parametrize("tensors, kwargs, match", [pytest.param(t, k, m, id=i) for i, _, t, k, m in SDPA_ROWS])
def test_attention_rejects_malformed_inputs(tensors, kwargs, match):
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, good_batch())
    with ctx(), pytest.raises(ValueError, match=match):
        cp_blockdiag_sdpa(*tensors, **{"is_causal": True, **kwargs})


@pytest.mark.parametrize("call, match", [pytest.param(c, m, id=i) for i, _, c, m in MIXER_ROWS])
def test_mixers_reject_malformed_inputs(call, match):
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, good_batch(), conv_widths=[4], expect_attention=False)
    with ctx(), pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call, match", [pytest.param(c, m, id=i) for i, _, c, m in OTHER_ROWS])
def test_other_entry_points_reject_malformed_inputs(call, match):
    try:
        with pytest.raises(ValueError, match=match):
            call()
    finally:
        configure_cp_varlen(attn_backend="auto", kv_exchange="auto")


def test_faults_page_table_lists_every_case():
    """docs/faults.md's table and this file's rows name the same cases (and there are at least 15)."""
    text = FAULTS_PAGE.read_text()
    assert "## Malformed input" in text, "docs/faults.md has no '## Malformed input' section"
    section = text.split("## Malformed input", 1)[1].split("\n## ", 1)[0]
    page_ids = re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.M)
    test_ids = [r[0] for r in BATCH_ROWS + SDPA_ROWS + MIXER_ROWS + OTHER_ROWS]
    assert len(test_ids) >= 15 and len(set(test_ids)) == len(test_ids)
    assert sorted(page_ids) == sorted(test_ids)


def test_multimodal_table_lists_every_case():
    """docs/multimodal.md's malformed-input table names the vision-language batch cases here and those of
    tests/test_vlm.py (the model's own inputs and the collator's documents)."""
    section = MULTIMODAL_PAGE.read_text().split("## Malformed input", 1)[1].split("\n## ", 1)[0]
    page_ids = re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.M)
    for case_id, *_ in MULTIMODAL_BATCH_ROWS:
        assert case_id in page_ids, f"{case_id} is missing from docs/multimodal.md's table"
