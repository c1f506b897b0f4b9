"""The chunk layout the chunked kernels share (:mod:`.gated_delta`, :mod:`.ssd`): the tokens of many pieces,
packed one piece after another with boundaries ``cu``, each piece padded to whole chunks on its own, the chunks
stored step-major (step ``i`` holds chunk ``i`` of every piece that has one, the pieces sorted by chunk count), so
that a kernel's intra-chunk work is one batched computation over every chunk of every piece and its scan over
chunks runs ``max(chunks per piece)`` steps, each over the pieces still running, on contiguous slices.

Main entries: :func:`plan_chunks` (the layout, once per pass and step), :func:`to_chunks` (packed tokens ->
chunks), :func:`carry_chunks` (the scan of the pieces' states through their chunks).

Shape legend: T packed tokens, P pieces, H heads, NC chunks of all pieces, C chunk length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ChunkMeta", "carry_chunks", "plan_chunks", "to_chunks"]


@dataclass(frozen=True, eq=False)
class ChunkMeta:
    """Where every packed token goes in the step-major chunk buffer, for pieces with boundaries ``cu``."""

    cu: tuple[int, ...]
    chunk: int
    dest: Tensor  # int64 [T]: slot * chunk + offset in the chunk of each packed token
    active: tuple[int, ...]  # pieces still running at each scan step (non-increasing)
    step_offset: tuple[int, ...]  # first slot of each step
    order: Tensor  # int64 [P]: piece of each sorted position (most chunks first)
    inverse: Tensor  # int64 [P]: sorted position of each piece
    cu_device: Tensor  # int64 [P + 1] on the device (for the fla kernel)

    @property
    def num_pieces(self) -> int:
        return len(self.cu) - 1

    @property
    def num_chunks(self) -> int:
        return sum(self.active)

    def to(self, device: torch.device | str) -> ChunkMeta:
        return ChunkMeta(self.cu, self.chunk, self.dest.to(device), self.active, self.step_offset, self.order.to(device),
                         self.inverse.to(device), self.cu_device.to(device))


def plan_chunks(cu: Sequence[int], chunk: int = 64, device: torch.device | str = "cpu") -> ChunkMeta:
    """The chunk layout of pieces ``cu`` (boundaries ``[0, ..., T]``, every piece non-empty).

    >>> meta = plan_chunks([0, 3, 4], chunk=2)  # pieces of 3 and 1 tokens: chunks (2, 1)
    >>> meta.active, meta.step_offset, meta.dest.tolist()
    ((2, 1), (0, 2), [0, 1, 4, 2])
    """
    cu_t = torch.as_tensor(list(cu), dtype=torch.int64)
    lens = cu_t.diff()
    if lens.numel() and int(lens.min()) < 1:
        raise ValueError(f"plan_chunks: expected non-empty pieces, got lengths {lens.tolist()}")
    nch = (lens + chunk - 1) // chunk
    order = torch.sort(-nch, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    steps = int(nch.max()) if nch.numel() else 0
    active = [int((nch > i).sum()) for i in range(steps)]
    step_offset = [0]
    for n in active[:-1]:
        step_offset.append(step_offset[-1] + n)
    piece = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    offset = torch.arange(int(cu_t[-1])) - cu_t[:-1][piece]
    slot = torch.tensor(step_offset, dtype=torch.int64)[offset // chunk] + inverse[piece] if steps else offset
    dest = slot * chunk + offset % chunk
    return ChunkMeta(tuple(int(c) for c in cu_t), chunk, dest.to(device), tuple(active), tuple(step_offset),
                     order.to(device), inverse.to(device), cu_t.to(device))


def to_chunks(x: Tensor, meta: ChunkMeta) -> Tensor:
    """``[T, H, ...]`` -> ``[NC, H, C, ...]`` (zeros where a piece's last chunk is not full)."""
    C = meta.chunk
    buf = x.new_zeros((meta.num_chunks * C, *x.shape[1:])).index_copy(0, meta.dest, x)
    return buf.view(meta.num_chunks, C, *x.shape[1:]).transpose(1, 2)


def carry_chunks(meta: ChunkMeta, S: Tensor, step) -> tuple[Tensor, Tensor]:
    """Carry the pieces' states ``S [P, ...]`` (in ``meta.order``) through their chunks, one chunk of every active
    piece per step: ``step(sl, S_run)`` gets the chunk rows ``sl`` of the ``n`` pieces active at that step and their
    states ``S_run [n, ...]`` and returns ``(out [n, ...], S_next [n, ...])``. Returns every chunk's output in
    chunk order (``[NC, ...]``) and the states leaving the pieces (``[P, ...]``, ``meta.order``)."""
    outs = []
    P = S.shape[0]
    for n, off in zip(meta.active, meta.step_offset):
        out, S_next = step(slice(off, off + n), S[:n])
        outs.append(out)
        S = S_next if n == P else torch.cat([S_next, S[n:]])
    return torch.cat(outs), S
