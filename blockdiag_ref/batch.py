"""Resolve per-position document ids ``[B, S]`` (0 = padding) from a training batch.

Precedence, the seed's ``_cp_blockdiag_doc_ids`` order first:

1. ``batch["_packed_seq_ids"]``  ``[B, S]`` document index per token (bool or integer);
2. ``batch["attention_mask"]``   4-D ``[B, 1, S, S]`` block-causal mask, bool (True = attend) or additive
   float (0 = attend, -inf or <= -1e4 = masked). Every document in it is recovered, not only the diagonal's
   validity: reading the diagonal alone merges the documents of a pack;
3. ``batch["attention_mask"]``   2-D ``[B, S]`` indexed ids (0 = padding), or a 0/1 validity mask. A validity
   mask says which tokens are real, not where documents start: with 2-D ``position_ids`` it is split where
   positions restart at 0 (as in 4);
4. ``batch["cu_seq_lens_q"]``    ``[n + 1]`` boundaries of the documents of one packed row (``B = 1``), rising
   strictly from 0 to ``S`` (what transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
   adds, the ``cu_seqlens`` of flash-attn's varlen call): one document per segment, read in ``O(documents)``
   with no per-token read. ``cu_seq_lens_k``, when given, must be the same boundaries, and 2-D ``position_ids``
   beside them must number each document's tokens on from the row's first position, checked at each document's
   first and last token (see :func:`boundaries_name_documents`);
5. ``batch["position_ids"]``     2-D ``[B, S]`` per-document positions (what transformers'
   ``DataCollatorWithFlattening`` emits): a document starts at each row's first token and wherever the
   position is 0. ``[n, B, S]`` positions (mRoPE: temporal, height, width) the same way: a document starts where
   every component is 0, its first token's position whether it is text or an image's first patch (see
   :func:`doc_ids_from_position_ids`);
6. otherwise one document per row (all ones).

Anything malformed raises ``ValueError`` naming what was expected and what was got.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .layout import DocLayout, _check_doc_ids

__all__ = ["doc_ids_from_4d_mask", "doc_ids_from_batch", "doc_ids_from_position_ids", "layout_from_batch"]

ADDITIVE_MASKED_AT_MOST = -1e4


def doc_ids_from_4d_mask(mask: Tensor) -> Tensor:
    """Doc ids ``[B, S]`` from a 4-D block-causal mask ``[B, 1, S, S]``.

    A position whose diagonal entry is masked is padding (its row is not read). Every other row must be
    exactly block-causal: it sees the keys of its own document up to itself, and nothing else.

    >>> m = DocLayout.from_seqlens([2, 3], pad=1).materialize_mask()
    >>> doc_ids_from_4d_mask(m)
    tensor([[1, 1, 2, 2, 2, 0]])
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        raise ValueError(f"attention_mask: expected a 4-D mask [B, 1, S, S], got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    elif mask.is_floating_point():
        m = mask[:, 0]
        attend = m == 0
        masked = m <= ADDITIVE_MASKED_AT_MOST
        if not bool((attend | masked).all()):
            bad = m[~(attend | masked)][0].item()
            raise ValueError(
                f"attention_mask: an additive 4-D mask must hold 0 (attend) or -inf / <= {ADDITIVE_MASKED_AT_MOST:g} "
                f"(masked), got the value {bad!r}"
            )
        allowed = attend
    else:
        raise ValueError(f"attention_mask: expected a bool or additive float 4-D mask, got dtype {mask.dtype}")
    allowed = allowed.cpu()
    B, S, _ = allowed.shape
    real = allowed.diagonal(dim1=1, dim2=2)
    sees_prev = torch.nn.functional.pad(allowed.diagonal(offset=-1, dim1=1, dim2=2), (1, 0), value=False)
    new_doc = real & ~sees_prev
    ids = torch.cumsum(new_doc.to(torch.int64), dim=1) * real
    expected = DocLayout.from_doc_ids(ids).materialize_mask()[:, 0]
    wrong = (expected != allowed) & real[:, :, None]
    if bool(wrong.any()):
        b, i, j = (int(x) for x in wrong.nonzero()[0])
        raise ValueError(
            "attention_mask: expected a block-causal 4-D mask (each real row sees exactly its own document "
            f"up to itself); got row {b}, query {i}, key {j} = {bool(allowed[b, i, j])} where the documents "
            f"read from the mask give {bool(expected[b, i, j])}"
        )
    return ids


def check_integer_positions(positions: Tensor) -> None:
    """Positions are integers (any integer dtype): refused otherwise, naming the dtype got."""
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"position_ids: expected integer positions, got dtype {positions.dtype}")


def doc_ids_from_position_ids(position_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """Doc ids ``[B, S]`` from per-document positions ``[B, S]`` or ``[n, B, S]``: a document starts at a row's
    first token and wherever the position is 0 (on every one of the ``n`` components); ``valid`` (``[B, S]``,
    nonzero = real token) marks padding.

    mRoPE positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL ``get_rope_index``): text tokens count on from the previous
    position on every axis, ``(p, p, p)``; an image at ``s`` gives its patch ``(i, j, k)`` the position
    ``(s + i, s + j, s + k)`` and the text after it continues past ``s + max(h, w)``. So a document's first
    token is ``(0, 0, 0)``, text or image, and ``(0, 0, 0)`` appears nowhere else in it; and the positions whose
    components are all equal (text tokens, each image's first patch) never decrease along a document. A restart
    those rules cannot read (such a position below an earlier one of the same document, without every axis at
    0) is evidence of a document boundary the ids do not mark: it raises rather than merging documents.

    >>> doc_ids_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    tensor([[1, 1, 1, 2, 2, 3, 3, 3, 3]])
    >>> doc_ids_from_position_ids(torch.tensor([[[0, 1, 1, 1, 1, 3, 0, 0, 0, 0, 2]],
    ...                                         [[0, 1, 1, 2, 2, 3, 0, 0, 1, 1, 2]],
    ...                                         [[0, 1, 2, 1, 2, 3, 0, 1, 0, 1, 2]]]))
    tensor([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
    """
    if not isinstance(position_ids, Tensor) or position_ids.dim() not in (2, 3):
        got = tuple(position_ids.shape) if isinstance(position_ids, Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids: expected a tensor [B, S] or [n, B, S], got {got}")
    check_integer_positions(position_ids)
    pos = position_ids.to(torch.int64).cpu()
    if bool((pos < 0).any()):
        raise ValueError(f"position_ids: expected positions >= 0, got {int(pos.min())}")
    pos = pos[None] if pos.dim() == 2 else pos  # [n, B, S]
    starts = (pos == 0).all(0)
    starts[:, 0] = True
    ids = torch.cumsum(starts.to(torch.int64), dim=1)
    if pos.shape[0] > 1:
        _check_mrope_restarts(pos, ids, valid)
    return ids if valid is None else ids * (valid.cpu() != 0)


def _check_mrope_restarts(pos: Tensor, ids: Tensor, valid: Tensor | None) -> None:
    """Raise where a position whose components are all equal is below an earlier one of the same document."""
    diagonal = (pos == pos[:1]).all(0)  # [B, S]
    if valid is not None:
        diagonal &= valid.cpu() != 0
    for b in range(pos.shape[1]):
        where = diagonal[b].nonzero().flatten()
        values, docs = pos[0, b, where], ids[b, where]
        bad = ((docs[1:] == docs[:-1]) & (values[1:] < values[:-1])).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            p, q = int(where[i + 1]), int(where[i])
            raise ValueError(
                f"position_ids: expected [n, B, S] positions that restart at 0 on every axis where a document "
                f"starts (mRoPE: a document's first token is {tuple([0] * pos.shape[0])}); got row {b}, position "
                f"{p} at {tuple(pos[:, b, p].tolist())} after {tuple(pos[:, b, q].tolist())} at position {q} in the "
                f"same document: a restart the positions do not mark. Pass _packed_seq_ids (or per-document "
                "positions from 0)"
            )


def doc_ids_from_batch(
    batch: Mapping[str, Any],
    seq_len: int,
    batch_size: int,
    device: torch.device | str | None = None,
) -> Tensor:
    """Doc ids int64 ``[batch_size, seq_len]`` (0 = padding) for ``batch``, by the precedence above."""
    expected = (batch_size, seq_len)
    positions = batch.get("position_ids")
    if positions is not None and not isinstance(positions, Tensor):
        raise ValueError(f"position_ids: expected a torch.Tensor, got {type(positions).__name__}")
    if positions is not None and not (
        (positions.dim() == 2 and tuple(positions.shape) == expected)
        or (positions.dim() == 3 and tuple(positions.shape[1:]) == expected)
    ):
        raise ValueError(
            f"position_ids: expected shape [B, S] = {list(expected)} or [n, B, S] (mRoPE), got {tuple(positions.shape)}"
        )
    ids = batch.get("_packed_seq_ids")
    if ids is not None:
        ids = _check_doc_ids(ids, "_packed_seq_ids")
        if tuple(ids.shape) != expected:
            raise ValueError(f"_packed_seq_ids: expected shape [B, S] = {list(expected)}, got {list(ids.shape)}")
        return ids.to(device) if device is not None else ids
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise ValueError(f"attention_mask: expected a torch.Tensor, got {type(mask).__name__}")
        if mask.dim() == 4:
            if tuple(mask.shape) != (batch_size, 1, seq_len, seq_len):
                raise ValueError(
                    f"attention_mask: expected a 4-D mask of shape [B, 1, S, S] = "
                    f"{[batch_size, 1, seq_len, seq_len]}, got {list(mask.shape)}"
                )
            ids = doc_ids_from_4d_mask(mask)
        elif mask.dim() == 2:
            ids = _check_doc_ids(mask, "attention_mask")
            if tuple(ids.shape) != expected:
                raise ValueError(f"attention_mask: expected a 2-D mask of shape [B, S] = {list(expected)}, got {list(ids.shape)}")
            if positions is not None and int(ids.max()) <= 1:  # validity only: documents from the positions
                ids = doc_ids_from_position_ids(positions, valid=ids).to(ids.device)
        else:
            raise ValueError(
                f"attention_mask: expected 2 dims [B, S] or 4 dims [B, 1, S, S], got {mask.dim()} dims "
                f"with shape {tuple(mask.shape)}"
            )
        return ids.to(device) if device is not None else ids
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"batch: expected B >= 1 and S >= 1, got B={batch_size}, S={seq_len}")
    if boundaries_name_documents(batch):
        ids = _layout_from_boundaries(batch, seq_len, batch_size).doc_ids
        return ids.to(device) if device is not None else ids
    if positions is not None:
        ids = doc_ids_from_position_ids(positions)
        return ids.to(device) if device is not None else ids
    return torch.ones(batch_size, seq_len, dtype=torch.int64, device=device)


def boundaries_name_documents(batch: Mapping[str, Any]) -> bool:
    """Whether the documents of ``batch`` come from its ``cu_seq_lens_q`` (no doc ids, no mask): then
    :func:`layout_from_batch` reads them in ``O(documents)``, and the positions beside them are checked at each
    document's first and last token only (tokens between are the model's to number, as for flash-attn's varlen
    call given the same boundaries)."""
    return (batch.get("_packed_seq_ids") is None and batch.get("attention_mask") is None
            and batch.get("cu_seq_lens_q") is not None)


def _boundaries(batch: Mapping[str, Any], name: str) -> np.ndarray:
    """``batch[name]`` as int64 on the host: a 1-D integer tensor, or a list of ints."""
    value = batch[name]
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name}: expected 1-D integer boundaries [n + 1], got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        return value.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(value, (list, tuple)) and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                                                for x in value):
        return np.asarray(value, dtype=np.int64).reshape(-1)
    raise ValueError(f"{name}: expected a 1-D integer tensor or a list of ints [n + 1], got {type(value).__name__}")


def _shown(a: np.ndarray, edge: int = 6) -> str:
    """``[0, 3, 7]``, or the first and last ``edge`` entries of long boundaries with the count between."""
    if a.size <= 2 * edge:
        return str(a.tolist())
    head, tail = ", ".join(map(str, a[:edge].tolist())), ", ".join(map(str, a[-edge:].tolist()))
    return f"[{head}, ... {a.size - 2 * edge} more ..., {tail}]"


def _layout_from_boundaries(batch: Mapping[str, Any], seq_len: int, batch_size: int) -> DocLayout:
    """The documents of one packed row from ``cu_seq_lens_q`` (see :func:`boundaries_name_documents`)."""
    cu = _boundaries(batch, "cu_seq_lens_q")
    if batch_size != 1:
        raise ValueError(f"cu_seq_lens_q: expected the boundaries of one packed row (B = 1), got B = {batch_size}; "
                         "for several rows pass _packed_seq_ids or per-document position_ids")
    if cu.size < 2 or cu[0] != 0 or cu[-1] != seq_len or (np.diff(cu) <= 0).any():
        raise ValueError(f"cu_seq_lens_q: expected document boundaries rising strictly from 0 to S = {seq_len} (one "
                         f"packed row), got {_shown(cu)}")
    if batch.get("cu_seq_lens_k") is not None:
        cu_k = _boundaries(batch, "cu_seq_lens_k")
        if cu_k.shape != cu.shape or (cu_k != cu).any():
            raise ValueError(f"cu_seq_lens_k: expected the boundaries of cu_seq_lens_q {_shown(cu)} (self-attention "
                             f"over the packed row), got {_shown(cu_k)}")
    positions = batch.get("position_ids")
    if isinstance(positions, Tensor) and positions.dim() == 2:
        _check_positions_at_boundaries(positions, cu)
    return DocLayout._of_segments(np.stack([np.zeros(cu.size - 1, dtype=np.int64), cu[:-1], cu[1:]], 1), 1, seq_len)


def _check_positions_at_boundaries(positions: Tensor, cu: np.ndarray) -> None:
    """Each document of ``cu`` numbers its tokens from the row's first position on: checked at its first and last
    token (a gather of ``2 n`` positions, wherever they live)."""
    check_integer_positions(positions)
    at = np.concatenate([cu[:-1], cu[1:] - 1])
    got = positions[0, torch.from_numpy(at).to(positions.device)].cpu().numpy().astype(np.int64)
    n = cu.size - 1
    first = got[0]
    want = np.concatenate([np.full(n, first), first + np.diff(cu) - 1])
    bad = np.flatnonzero(got != want)
    if first < 0 or bad.size:
        i = int(bad[0]) if bad.size else 0
        doc = i % n
        edge = "first" if i < n else "last"
        raise ValueError(
            f"position_ids: expected each document of cu_seq_lens_q to number its tokens from the row's first "
            f"position {int(first)} (>= 0) on; got {int(got[i])} at its {edge} token, position {int(at[i])} of "
            f"document {doc} (tokens [{int(cu[doc])}, {int(cu[doc + 1])}))"
            + (f" where {int(want[i])} was expected" if bad.size else "")
        )


def positions_name_documents(batch: Mapping[str, Any], seq_len: int, batch_size: int) -> bool:
    """Whether the documents of ``batch`` come from 2-D integer ``position_ids [B, S]`` alone (no doc ids, no
    mask, no boundaries): then :func:`layout_from_batch` reads them in one pass, checking them as it goes."""
    positions = batch.get("position_ids")
    return (batch.get("_packed_seq_ids") is None and batch.get("attention_mask") is None
            and batch.get("cu_seq_lens_q") is None
            and isinstance(positions, Tensor) and positions.dim() == 2
            and tuple(positions.shape) == (batch_size, seq_len) and seq_len >= 1 and batch_size >= 1
            and not (positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool))


def _starts(flat: Tensor, seq_len: int, on_host: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(indices, values) of the positions of ``flat`` (rows of ``seq_len``, concatenated) that start a document:
    those ``<= 0`` (so any negative one is among them) and every row's first. One pass: on the host by numpy (its
    comparison and ``flatnonzero`` read about twice as fast as torch's), on a device there, so that only the
    starts are copied to the host, not the positions."""
    if on_host is None:
        on_host = flat.device.type == "cpu"
    if on_host:
        a = flat.cpu().numpy()
        mask = a <= 0
        mask[::seq_len] = True
        index = np.flatnonzero(mask)
        return index, a[index]
    mask = flat <= 0
    mask[::seq_len] = True
    index = torch.nonzero(mask).flatten()
    return index.cpu().numpy(), flat[index].cpu().numpy()


def layout_from_batch(batch: Mapping[str, Any], seq_len: int, batch_size: int) -> DocLayout:
    """The :class:`DocLayout` of ``batch``: the documents :func:`doc_ids_from_batch` gives, by the same precedence.

    Where they come from ``cu_seq_lens_q`` (what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
    adds), they are read from the boundaries alone, in ``O(documents)``. Where they come from 2-D ``position_ids``
    alone (no ``_packed_seq_ids``, no ``attention_mask``: what transformers' ``DataCollatorWithFlattening`` and
    TRL's packing give), the documents are read from where the positions are 0 in one pass. Neither builds a
    doc-id tensor (the layout builds one if it is read).

    >>> layout_from_batch({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}, 9, 1).seqlens
    [[3, 2, 4]]
    >>> layout_from_batch({"cu_seq_lens_q": torch.tensor([0, 3, 5, 9], dtype=torch.int32)}, 9, 1).seqlens
    [[3, 2, 4]]
    """
    if boundaries_name_documents(batch):
        return _layout_from_boundaries(batch, seq_len, batch_size)
    if not positions_name_documents(batch, seq_len, batch_size):
        # its checks, its errors; the ids read on the host, wherever the batch lives
        return DocLayout.from_doc_ids(doc_ids_from_batch(batch, seq_len, batch_size, device="cpu"))
    run_start, values = _starts(batch["position_ids"].detach().reshape(-1), seq_len)
    if (values < 0).any():
        raise ValueError(f"position_ids: expected positions >= 0, got {int(values.min())}")
    run_end = np.append(run_start[1:], batch_size * seq_len)
    row = run_start // seq_len
    return DocLayout._of_segments(np.stack([row, run_start - row * seq_len, run_end - row * seq_len], 1),
                                  batch_size, seq_len)
