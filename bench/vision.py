"""The vision tower's cost under CP: a vision-language model's step (its own forward and backward) at CP 2 with the
tower replicated (every rank runs every image) against the tower's images sharded across the ranks by cost
(``shard_vision=True``), measured in alternation on the same process group.

The model: Qwen2.5-VL's architecture with a tower of 4 blocks (hidden 256, windows of 8 x 8 patches, the last
block over whole images) in front of a one-layer decoder (hidden 64), so the tower is most of the step; images of
16 x 16 and 16 x 32 patches.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.integrations import causal_lm_loss, model_inputs, pack_multimodal_documents, register_transformers_attention
from verify.pool import worker_info

__all__ = ["GRIDS", "vision_steps"]

IMAGE = 120
GRIDS = {"quick": [(1, 16, 16), (1, 16, 32), (1, 16, 16), (1, 16, 16)],
         "full": [(1, 16, 16), (1, 16, 32), (1, 16, 16), (1, 32, 16), (1, 16, 16), (1, 16, 32), (1, 16, 16), (1, 16, 16)]}


def _model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}),
        vision_config=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, patch_size=2,
                           temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[3],
                           out_hidden_size=64),
        image_token_id=IMAGE, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation=register_transformers_attention()).train()


def _batch(grids) -> dict:
    g = torch.Generator().manual_seed(0)
    docs = []
    for t, h, w in grids:
        docs.append({"input_ids": [5, 122] + [IMAGE] * (t * h * w // 4) + [123] + list(range(10, 40)),
                     "pixel_values": torch.randn(t * h * w, 24, generator=g), "image_grid_thw": [[t, h, w]]})
    seq_len = sum(len(d["input_ids"]) for d in docs)
    return pack_multimodal_documents(docs, seq_len, image_token_id=IMAGE, spatial_merge_size=2)


def vision_steps(size: str, reps: int) -> dict:
    """Median step seconds (the slowest rank's, between barriers) of the replicated and the sharded tower, in
    alternation, and each mode's loss (the same step computes the same loss)."""
    mesh = worker_info()["cp_mesh"]
    model = _model()
    full = _batch(GRIDS[size])
    times: dict[str, list[float]] = {"replicated": [], "sharded": []}
    losses = {}
    for rep in range(reps + 1):  # the first round warms up
        for mode in times:
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t = time.perf_counter()
            ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, dict(full), shard_primary=False,
                                                         shard_vision=mode == "sharded")
            with ctx():
                logits = model(**model_inputs(batch), use_cache=False).logits
                loss = causal_lm_loss(logits, batch["labels"], 1)
                loss.backward()
            dist.barrier()
            if rep:
                times[mode].append(time.perf_counter() - t)
            losses[mode] = float(loss.detach())
    total = torch.tensor([losses["replicated"], losses["sharded"]], dtype=torch.float64)
    dist.all_reduce(total)
    return {
        "seconds": {mode: statistics.median(ts) for mode, ts in times.items()},
        "images": len(GRIDS[size]),
        "patches": sum(t * h * w for t, h, w in GRIDS[size]),
        "loss": {"replicated": float(total[0]), "sharded": float(total[1])},
    }
