"""docs/multimodal.md's step (a tiny Qwen2.5-VL by its own forward, vision tower included) over a CP group, under
torchrun (CPU, gloo):

    torchrun --standalone --nproc-per-node 2 examples/multimodal_train.py       # CP 2

Run as ``python examples/multimodal_train.py`` it is one process (CP 1). Rank 0 prints the step's loss (the mean over
every target, the same at every CP size) and the largest gradient of the vision tower's patch embedding. Needs the
``hf`` extra (transformers).
"""

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.integrations import (
    all_reduce_grads, causal_lm_loss, global_token_count, model_inputs, pack_multimodal_documents,
    register_transformers_attention,
)

IMAGE = 120  # the image placeholder token: one per vision feature


def tiny_qwen2_5_vl() -> Qwen2_5_VLForConditionalGeneration:
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                             "mrope_section": [2, 1, 1]}, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, temporal_patch_size=2,
                           spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1], out_hidden_size=32),
        image_token_id=IMAGE, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    )
    torch.manual_seed(0)  # the same weights on every rank
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation=register_transformers_attention())
    return model.to(torch.float64).train()


def main() -> None:
    if "RANK" in os.environ:  # torchrun: rendezvous from its environment; a stuck collective raises after 5 minutes
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    else:  # one process
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    cp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]

    model = tiny_qwen2_5_vl()
    # every CP rank passes the same full batch: two documents, each holding an image (32 and 16 patches of 24
    # features, merged 2 x 2 into 8 and 4 image tokens); the second document opens with its image
    images = torch.Generator().manual_seed(1)
    docs = [
        {"input_ids": [5, 6, 122] + [IMAGE] * 8 + [123] + list(range(10, 26)),
         "pixel_values": torch.randn(32, 24, generator=images, dtype=torch.float64), "image_grid_thw": [[1, 4, 8]]},
        {"input_ids": [IMAGE] * 4 + [123, 30, 31, 32, 33, 34],
         "pixel_values": torch.randn(16, 24, generator=images, dtype=torch.float64), "image_grid_thw": [[1, 4, 4]]},
    ]
    batch = pack_multimodal_documents(docs, seq_len=40, image_token_id=IMAGE, spatial_merge_size=2,
                                      rope_index=model.model.get_rope_index)  # per-document mRoPE ids [3, 1, 40]

    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch, shard_primary=False)
    with train_ctx():
        logits = model(**model_inputs(batch), use_cache=False).logits  # this rank's rows [1, L, V]
        loss = causal_lm_loss(logits, batch["labels"], global_token_count(batch["labels"], cp_mesh))
        loss.backward()
    all_reduce_grads(model.parameters(), cp_mesh)  # each CP rank holds a partial gradient: sum them
    step_loss = loss.detach().clone()
    dist.all_reduce(step_loss)  # the step's loss: the shares of every rank summed
    vision_grad = model.model.visual.patch_embed.proj.weight.grad.abs().max().item()
    if dist.get_rank() == 0:
        print(f"cp {cp_mesh.size()}: loss {step_loss.item():.10f}, vision tower max |grad| {vision_grad:.6e}")
    dist.barrier()  # every rank done with its collectives before any tears its connections down (gloo aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
