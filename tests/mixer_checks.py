"""Functions that the mixer tests run on every rank of a verify.pool.WorkerPool (importable by the spawned
workers): each builds its inputs from a seed on every rank, runs one step and returns plain numbers or arrays."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
from verify.pool import worker_info

HYBRID_DOC = Path(__file__).resolve().parents[1] / "docs" / "hybrid.md"


def docs_example(name: str):
    """The ```python block of docs/hybrid.md that defines ``name``, executed; returns the namespace."""
    blocks = re.findall(r"```python\n(.*?)```", HYBRID_DOC.read_text(), re.S)
    code = next(b for b in blocks if f"def {name}(" in b)
    ns: dict = {"__name__": "__docs__"}
    exec(compile(code, f"{HYBRID_DOC.name} ({name})", "exec"), ns)
    return ns


def doc_cumsum_step(ids: list[list[int]], layout: str, channels: int = 3) -> dict:
    """docs/hybrid.md's doc_cumsum at this pool's CP size: local output rows (with their global positions) and
    this rank's part of the gradient of ``(y * w).sum()`` w.r.t. the full input."""
    env = worker_info()
    doc_cumsum = docs_example("doc_cumsum")["doc_cumsum"]
    ids_t = torch.tensor(ids)
    B, S = ids_t.shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, channels, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, S, channels, generator=g, dtype=torch.float64)
    ctx, batch = make_cp_blockdiag_batch_and_ctx(env["cp_mesh"], None, {"inputs_embeds": x, "_packed_seq_ids": ids_t,
                                                 "w": w}, layout=layout, expect_attention=False)
    with ctx():
        y = doc_cumsum(batch["inputs_embeds"], ctx.state)
        (y * batch["w"]).sum().backward()
    return {"y": y.detach().numpy(), "positions": ctx.state.positions.tolist(), "dx": x.grad.numpy()}
