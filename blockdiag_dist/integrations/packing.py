"""Pack variable-length documents into fixed-length rows, with the labels and ids that block-diagonal CP needs.

Shape legend: R packed rows, S sequence length (tokens per row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "PackingCollator", "pack_documents", "shift_labels"]

IGNORE_INDEX = -100  # label of positions with no next-token target (padding, last token of a document)


def _as_tokens(doc: Any, index: int) -> Tensor:
    t = torch.as_tensor(doc)
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.numel() == 0:
        raise ValueError(
            f"docs[{index}]: expected a non-empty 1-D sequence of integer token ids, got {t.dtype} of shape "
            f"{tuple(t.shape)}"
        )
    return t.to(torch.int64)


def fill_rows(lengths: Sequence[int], seq_len: int, rows: int | None) -> list[list[int]]:
    """Documents in order into rows of ``seq_len`` tokens, a new row whenever the next does not fit: the indices
    of each row's documents, ``rows`` rows (the last ones empty) or as many as needed (``rows=None``). Every
    length is at most ``seq_len`` (the callers check, naming the document)."""
    row_docs: list[list[int]] = []
    used = seq_len  # forces a new row for the first document
    for i, n in enumerate(lengths):
        if used + n > seq_len:
            row_docs.append([])
            used = 0
        row_docs[-1].append(i)
        used += n
    if rows is not None and len(row_docs) > rows:
        raise ValueError(f"rows: the documents need {len(row_docs)} rows of {seq_len} tokens, expected at most {rows}")
    return row_docs + [[] for _ in range(0 if rows is None else rows - len(row_docs))]


def empty_rows(R: int, seq_len: int, padding_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """``input_ids`` (padding), ``labels`` (no target) and ``_packed_seq_ids`` (0: padding) of ``R`` empty rows,
    int64 ``[R, seq_len]`` each."""
    full = lambda v: torch.full((R, seq_len), v, dtype=torch.int64)  # noqa: E731
    return full(padding_token_id), full(IGNORE_INDEX), full(0)


def pack_documents(
    docs: Sequence[Sequence[int] | Tensor], seq_len: int, *, rows: int | None = None, padding_token_id: int = 0
) -> dict[str, Tensor]:
    """Pack documents, in order, into rows of ``seq_len`` tokens (next-fit: a document that does not fit in
    the current row starts a new one; the rest of a row is padding). Documents are never split.

    Returns int64 tensors ``[R, S]`` (``R = rows`` when given, else as many rows as needed):

    - ``input_ids``: the tokens, ``padding_token_id`` on padding;
    - ``labels``: next-token targets aligned with positions, ``labels[t] = input_ids[t + 1]`` when ``t + 1``
      is in the same document, else ``-100`` (padding and each document's last token). They are pre-shifted,
      so a model under CP must not shift them again;
    - ``_packed_seq_ids``: 1-based index of the document in its row, 0 on padding;
    - ``position_ids``: position inside the document (0 at each document start), 0 on padding.

    >>> b = pack_documents([[5, 6, 7], [8, 9], [4]], seq_len=4)
    >>> b["input_ids"].tolist(), b["labels"].tolist()
    ([[5, 6, 7, 0], [8, 9, 4, 0]], [[6, 7, -100, -100], [9, -100, -100, -100]])
    >>> b["_packed_seq_ids"].tolist(), b["position_ids"].tolist()
    ([[1, 1, 1, 0], [1, 1, 2, 0]], [[0, 1, 2, 0], [0, 1, 0, 0]])
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len: expected an int >= 1, got {seq_len!r}")
    if not isinstance(padding_token_id, int):
        raise ValueError(f"padding_token_id: expected an int, got {type(padding_token_id).__name__}")
    if rows is not None and (not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows: expected None or an int >= 1, got {rows!r}")
    tokens = [_as_tokens(d, i) for i, d in enumerate(docs)]
    for i, t in enumerate(tokens):
        if t.numel() > seq_len:
            raise ValueError(f"docs[{i}]: expected at most seq_len = {seq_len} tokens, got {t.numel()}")
    row_docs = [[tokens[i] for i in row] for row in fill_rows([t.numel() for t in tokens], seq_len, rows)]
    input_ids, labels, seq_ids = empty_rows(len(row_docs), seq_len, padding_token_id)
    position_ids = torch.zeros((len(row_docs), seq_len), dtype=torch.int64)
    for r, ds in enumerate(row_docs):
        start = 0
        for index, t in enumerate(ds, start=1):
            end = start + t.numel()
            input_ids[r, start:end] = t
            labels[r, start : end - 1] = t[1:]
            seq_ids[r, start:end] = index
            position_ids[r, start:end] = torch.arange(t.numel())
            start = end
    return {"input_ids": input_ids, "labels": labels, "_packed_seq_ids": seq_ids, "position_ids": position_ids}


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Labels in transformers' convention (the model shifts them: position ``t`` predicts ``labels[t + 1]``) as
    the pre-shifted targets CP needs: ``out[:, t] = labels[:, t + 1]``, ``ignore_index`` at the last position.
    ``labels [B, S]`` -> ``[B, S]``.

    transformers' ``DataCollatorWithFlattening`` puts ``-100`` on every document's first token, so after the
    shift a document's last token has no target (it would predict the next document's first):

    >>> shift_labels(torch.tensor([[-100, 6, 7, -100, 9]])).tolist()
    [[6, 7, -100, 9, -100]]
    """
    if not isinstance(labels, Tensor) or labels.dim() != 2 or labels.is_floating_point():
        got = f"{labels.dtype} of shape {tuple(labels.shape)}" if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"shift_labels: expected an integer tensor [B, S], got {got}")
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)


@dataclass(frozen=True)
class PackingCollator:
    """A ``collate_fn`` for ``torch.utils.data.DataLoader``: packs a list of documents with
    :func:`pack_documents`. A feature is a token sequence, a 1-D tensor, or a mapping with ``"input_ids"``
    (as a tokenized Hugging Face dataset yields).

    >>> collate = PackingCollator(seq_len=4, rows=1)
    >>> collate([{"input_ids": [1, 2]}, [3]])["labels"].tolist()
    [[2, -100, -100, -100]]
    """

    seq_len: int
    rows: int | None = None
    padding_token_id: int = 0

    def __call__(self, features: Sequence[Sequence[int] | Tensor | Mapping[str, Any]]) -> dict[str, Tensor]:
        docs = [f["input_ids"] if isinstance(f, Mapping) else f for f in features]
        return pack_documents(docs, self.seq_len, rows=self.rows, padding_token_id=self.padding_token_id)
