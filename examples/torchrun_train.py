"""The training step of docs/trainer.md over a ("dp", "cp") mesh, under torchrun (CPU, gloo):

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py             # CP 2
    torchrun --standalone --nproc-per-node 4 examples/torchrun_train.py --dp 2      # 2 replicas x CP 2

Run as ``python examples/torchrun_train.py`` it is one process (CP 1). Rank 0 prints the loss of every step: the
mean over every target of the step, the same at every CP size for the same documents.
"""

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.integrations import PackingCollator, all_reduce_grads, causal_lm_loss, global_token_count


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids):          # [B, L] each; position_ids would drive RoPE
        x = self.embed(input_ids)                         # [B, L, dim]
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # each [B, heads, L, D]
        o = cp_blockdiag_sdpa(q, k, v, is_causal=True)    # causal inside each document, across CP ranks
        return self.head(x + o.transpose(1, 2).flatten(2))  # [B, L, vocab]


def main() -> None:
    p = argparse.ArgumentParser(description="The trainer.md step under torchrun: DP x CP on CPU (gloo)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (the CP size is world / dp)")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    if "RANK" in os.environ:  # torchrun: rendezvous from its environment; a stuck collective raises after 5 minutes
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    else:  # one process
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    world = dist.get_world_size()
    if world % args.dp:
        raise ValueError(f"--dp: expected a divisor of the world size {world}, got {args.dp}")
    mesh = init_device_mesh("cpu", (args.dp, world // args.dp), mesh_dim_names=("dp", "cp"))
    cp_mesh, replica = mesh["cp"], mesh["dp"].get_local_rank()

    torch.manual_seed(0)                                  # the same initial weights on every rank
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collate = PackingCollator(seq_len=16, rows=2)        # input_ids, labels, _packed_seq_ids, position_ids [2, 16]
    data = torch.Generator().manual_seed(replica)        # every CP rank of a replica draws the same documents
    for step in range(args.steps):
        docs = [torch.randint(1, 64, (n,), generator=data) for n in (5, 9, 3, 12)]
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, collate(docs))  # this rank's rows
        num_tokens = global_token_count(batch["labels"], mesh)   # targets on all DP x CP ranks
        with train_ctx():
            logits = model(batch["input_ids"], batch["position_ids"])
            loss = causal_lm_loss(logits, batch["labels"], num_tokens)  # this rank's share of the mean
            loss.backward()
        all_reduce_grads(model.parameters(), mesh)       # sum over dp and cp
        optimizer.step()
        optimizer.zero_grad()
        step_loss = loss.detach().clone()
        dist.all_reduce(step_loss)                        # the step's loss: the shares of every rank summed
        if dist.get_rank() == 0:
            print(f"step {step}: loss {step_loss.item():.6f} (dp {args.dp} x cp {cp_mesh.size()})")
    dist.barrier()  # every rank done with its collectives before any tears its connections down (gloo aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
