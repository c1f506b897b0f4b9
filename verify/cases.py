"""Verification cases: what one check runs, how it is written as a replay command, and the default matrix.

A case's document layout is written row by row as runs ``id x count``: ``1x5,2x2,3x6,0x3`` is five tokens of
document 1, two of document 2, six of document 3 and three padding tokens; rows are separated by ``/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .families import SPECS

__all__ = ["Case", "LAYERS", "LONG_LAYOUTS", "NAMED_LAYOUTS", "Support", "case_values", "coverage", "coverage_line",
           "default_matrix", "format_rows", "head_shape", "long_cases", "mixer_matrix", "parse_rows"]

Rows = tuple[tuple[tuple[int, int], ...], ...]  # rows of (doc id, run length)

DTYPES = ("float64", "float32", "bfloat16", "float16")
SOURCES = ("packed", "mask4d", "mask2d")
CHECKPOINTS = ("none", "reentrant", "nonreentrant")
LAYERS = ("attention", *SPECS)  # the layer a case judges (verify.runner; verify.mixers for the mixer families': sparse =
# DeepSeek Sparse Attention, the indexer's top-k per document)


def parse_rows(text: str) -> Rows:
    """``"1x3,0x1/2x4"`` -> ``(((1, 3), (0, 1)), ((2, 4),))``; a bare id counts once (``"1,1,2"`` works too)."""
    rows = []
    for row_text in text.strip().split("/"):
        runs = []
        for item in row_text.split(","):
            item = item.strip()
            if not item:
                continue
            ident, _, count = item.partition("x")
            try:
                run = (int(ident), int(count) if count else 1)
            except ValueError:
                raise ValueError(f"layout: expected runs like '1x5' or '0x3', got {item!r} in {text!r}") from None
            if run[0] < 0 or run[1] < 1:
                raise ValueError(f"layout: expected id >= 0 and count >= 1, got {item!r}")
            runs.append(run)
        if not runs:
            raise ValueError(f"layout: expected at least one run per row, got an empty row in {text!r}")
        rows.append(tuple(runs))
    lengths = {sum(n for _, n in r) for r in rows}
    if len(lengths) != 1:
        raise ValueError(f"layout: expected rows of one length, got lengths {sorted(lengths)} in {text!r}")
    return tuple(rows)


def format_rows(rows: Rows) -> str:
    """Inverse of :func:`parse_rows`, merging adjacent runs of one id."""
    out = []
    for row in rows:
        merged: list[list[int]] = []
        for ident, n in row:
            if merged and merged[-1][0] == ident:
                merged[-1][1] += n
            else:
                merged.append([ident, n])
        out.append(",".join(f"{i}x{n}" for i, n in merged))
    return "/".join(out)


@dataclass(frozen=True)
class Case:
    """One verification case. ``None`` for kernel / exchange / layout means "the implementation's default"."""

    rows: Rows
    cp: int
    name: str = "custom"
    hq: int = 2
    hkv: int = 2
    dim: int = 4
    window: int = -1  # left extent of a causal window; -1 = none
    kernel: str | None = None
    exchange: str | None = None
    layout: str | None = None
    dtype: str = "float64"
    seed: int = 0
    source: str = "packed"  # how doc ids reach the implementation: _packed_seq_ids, a 4-D or a 2-D mask
    hidden: int = 6
    checkpoint: str = "none"  # activation checkpointing around the attention call: none | reentrant | nonreentrant
    backend: str | None = None  # SDPA backend forced on the implementation (e.g. "math"); None = torch's choice
    gain: float = 2.0  # gain of the q and k projections: scores have a standard deviation of about gain ** 2
    layer: str = "attention"  # attention | a mixer family's layer (verify.families.SPECS: conv, gated_delta, mamba2, ...)
    width: int = 4  # the convolution's width (layer conv); the indexer's top-k (layer sparse)
    sinks: bool = False  # attention sinks: one learned logit per query head (drawn ~ N(0, 2^2)), its gradient checked
    softcap: float = 0.0  # logit soft-capping softcap * tanh(scores / softcap); 0 = none
    chunk: int = -1  # chunked local attention: chunks of this many positions from each document's start; -1 = none
    temperature: int = -1  # NoPE query temperature (Llama 4): its floor_scale (attn_scale TEMPERATURE_ATTN_SCALE); -1 = none
    bidirectional: bool = False  # bidirectional blocks (Gemma 3's images): one per document of 3+ tokens (case_blocks)
    # with bidirectional: a query sees its whole block beyond the window, (window AND causal) OR block (Gemma 4's and
    # PaliGemma's sliding layers; cp_blockdiag_sdpa(whole_blocks=True)); replayed with --whole-blocks, not rotated
    whole_blocks: bool = False

    def __post_init__(self) -> None:
        if self.layer not in LAYERS:
            raise ValueError(f"layer: expected one of {LAYERS}, got {self.layer!r}")
        if self.width < 1:
            raise ValueError(f"width: expected a convolution width (or an indexer's top-k) >= 1, got {self.width}")
        if self.cp < 1:
            raise ValueError(f"cp: expected >= 1, got {self.cp}")
        if self.hq % self.hkv:
            raise ValueError(f"heads: expected Hq a multiple of Hkv, got {self.hq}:{self.hkv}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source: expected one of {SOURCES}, got {self.source!r}")
        if not self.gain > 0:
            raise ValueError(f"gain: expected > 0, got {self.gain}")
        if not self.softcap >= 0:
            raise ValueError(f"softcap: expected > 0 (or 0 = none), got {self.softcap}")
        if self.chunk == 0 or self.chunk < -1:
            raise ValueError(f"chunk: expected >= 1 (or -1 = none), got {self.chunk}")
        if self.temperature == 0 or self.temperature < -1:
            raise ValueError(f"temperature: expected a floor_scale >= 1 (or -1 = none), got {self.temperature}")
        if self.whole_blocks and not self.bidirectional:
            raise ValueError("whole_blocks: expected bidirectional=True with it (whole blocks widen the blocks), got "
                             "bidirectional=False")
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint: expected one of {CHECKPOINTS}, got {self.checkpoint!r}")
        if self.backend is not None:
            from .tolerances import sdpa_backend

            sdpa_backend(self.backend)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def seq_len(self) -> int:
        return sum(n for _, n in self.rows[0])

    @property
    def variants(self) -> tuple[str, ...]:
        """The attention variants the case asks for: ``sinks``, ``softcap``, ``chunk``, ``temperature``,
        ``bidirectional``."""
        return tuple(n for n, on in (("sinks", self.sinks), ("softcap", self.softcap > 0), ("chunk", self.chunk > 0),
                                     ("temperature", self.temperature > 0), ("bidirectional", self.bidirectional)) if on)

    def blocks(self) -> list[list[int]]:
        """The bidirectional block ids of the case's rows (:func:`case_blocks`)."""
        return case_blocks(self.doc_ids())

    def doc_ids(self) -> list[list[int]]:
        return [[i for i, n in row for _ in range(n)] for row in self.rows]

    def label(self) -> str:
        opts = "/".join(x for x in (self.kernel, self.exchange, self.layout) if x)
        win = f" w{self.window}" if self.window >= 0 else ""
        ckpt = f" ckpt-{self.checkpoint}" if self.checkpoint != "none" else ""
        sdpa = f" sdpa-{self.backend}" if self.backend else ""
        gain = f" gain{self.gain:g}" if self.gain != 2.0 else ""
        if self.layer != "attention":
            kind = SPECS[self.layer].label(self)
            return f"{kind} {self.name} cp{self.cp} {self.layout or ''} {self.dtype}{ckpt}".replace("  ", " ")
        var = ("" if not self.sinks else " sinks") + (f" cap{self.softcap:g}" if self.softcap > 0 else "") + (
            f" chunk{self.chunk}" if self.chunk > 0 else "") + (f" temp{self.temperature}" if self.temperature > 0 else "") + (
            (" bidir-whole" if self.whole_blocks else " bidir") if self.bidirectional else "")
        return f"{self.name} cp{self.cp} {self.hq}:{self.hkv}x{self.dim}{win}{var} {opts} {self.dtype} {self.source}{ckpt}{sdpa}{gain}".replace("  ", " ")

    def args(self) -> list[str]:
        """Command-line arguments of ``python -m verify case`` that replay exactly this case."""
        a = ["--rows", format_rows(self.rows), "--cp", str(self.cp), "--heads", f"{self.hq}:{self.hkv}",
             "--dim", str(self.dim), "--dtype", self.dtype, "--seed", str(self.seed), "--source", self.source,
             "--hidden", str(self.hidden)]
        if self.window >= 0:
            a += ["--window", str(self.window)]
        if self.checkpoint != "none":
            a += ["--checkpoint", self.checkpoint]
        if self.backend:
            a += ["--sdpa-backend", self.backend]
        if self.gain != 2.0:
            a += ["--gain", repr(self.gain)]
        if self.sinks:
            a += ["--sinks"]
        if self.softcap > 0:
            a += ["--softcap", repr(self.softcap)]
        if self.chunk > 0:
            a += ["--chunk", str(self.chunk)]
        if self.temperature > 0:
            a += ["--temperature", str(self.temperature)]
        if self.bidirectional:
            a += ["--bidirectional"]
        if self.whole_blocks:
            a += ["--whole-blocks"]
        if self.layer != "attention":
            a += ["--layer", self.layer] + SPECS[self.layer].args(self)
        for flag, value in (("--kernel", self.kernel), ("--exchange", self.exchange), ("--layout", self.layout)):
            if value:
                a += [flag, value]
        if self.name != "custom":
            a += ["--name", self.name]
        return a

    def command(self, impl: str | None = None) -> str:
        extra = ["--impl", impl] if impl and impl != "blockdiag_dist" else []
        return "python -m verify case " + " ".join(shlex.quote(x) for x in self.args() + extra)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rows"] = format_rows(self.rows)
        return d


def add_case_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", required=True, help="layout as runs, e.g. 1x5,2x2,0x3 (rows separated by /)")
    p.add_argument("--cp", type=int, required=True)
    p.add_argument("--heads", default="2:2", help="Hq:Hkv")
    p.add_argument("--dim", type=int, default=4)
    p.add_argument("--window", type=int, default=-1)
    p.add_argument("--kernel")
    p.add_argument("--exchange")
    p.add_argument("--layout")
    p.add_argument("--dtype", default="float64", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", default="packed", choices=SOURCES)
    p.add_argument("--hidden", type=int, default=6)
    p.add_argument("--name", default="custom")
    p.add_argument("--checkpoint", default="none", choices=CHECKPOINTS)
    p.add_argument("--gain", type=float, default=2.0, help="q/k projection gain; scores have std ~ gain**2 (peaked softmax from ~4)")
    p.add_argument("--sdpa-backend", default=None, help="force the implementation onto one SDPA backend (math, flash_attention, ...)")
    p.add_argument("--layer", default="attention", choices=LAYERS, help="the layer judged: attention, or a mixer of hybrid models")
    p.add_argument("--width", type=int, default=4, help="the convolution's width (--layer conv), the indexer's top-k (--layer sparse)")
    p.add_argument("--sinks", action="store_true", help="attention sinks: one learned logit per query head")
    p.add_argument("--softcap", type=float, default=0.0, help="logit soft-capping softcap * tanh(scores / softcap)")
    p.add_argument("--chunk", type=int, default=-1, help="chunked local attention: chunk length from each document's start")
    p.add_argument("--temperature", type=int, default=-1, metavar="FLOOR_SCALE",
                   help="NoPE query temperature (Llama 4) with this floor_scale, from each query's position in its document")
    p.add_argument("--bidirectional", action="store_true",
                   help="bidirectional blocks (Gemma 3's images): the middle half of each document of 3+ tokens is one block")
    p.add_argument("--whole-blocks", action="store_true",
                   help="with --bidirectional: a query sees its whole block beyond the window (Gemma 4, PaliGemma 2)")


def case_from_args(ns: argparse.Namespace) -> Case:
    hq, _, hkv = ns.heads.partition(":")
    return Case(
        rows=parse_rows(ns.rows), cp=ns.cp, name=ns.name, hq=int(hq), hkv=int(hkv or hq), dim=ns.dim,
        window=ns.window, kernel=ns.kernel, exchange=ns.exchange, layout=ns.layout, dtype=ns.dtype, seed=ns.seed,
        source=ns.source, hidden=ns.hidden, checkpoint=ns.checkpoint, backend=ns.sdpa_backend, gain=ns.gain,
        layer=ns.layer, width=ns.width,
        sinks=ns.sinks, softcap=ns.softcap, chunk=ns.chunk, temperature=ns.temperature, bidirectional=ns.bidirectional,
        whole_blocks=ns.whole_blocks,
    )


def case_blocks(doc_ids: list[list[int]]) -> list[list[int]]:
    """Bidirectional block ids for doc ids (rows of ints, 0 = padding): in every document of ``n >= 3`` tokens, its
    positions ``[n // 4, n // 4 + max(2, n // 2))`` form block 1 (an image in the middle half; in the named layouts'
    long documents it often crosses a rank edge); 0 elsewhere.

    >>> case_blocks([[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 0]])
    [[0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]]
    """
    out = []
    for row in doc_ids:
        blocks = [0] * len(row)
        start = 0
        while start < len(row):
            end = start
            while end < len(row) and row[end] == row[start]:
                end += 1
            n = end - start
            if row[start] != 0 and n >= 3:
                lo = start + n // 4
                for p in range(lo, min(end, lo + max(2, n // 2))):
                    blocks[p] = 1
            start = end
        out.append(blocks)
    return out


# ---- named layouts: functions of the CP size -> rows --------------------------------------------------
def _row(*runs: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    return tuple(r for r in runs if r[1] > 0)


def _one_long(cp: int) -> Rows:
    return (_row((1, 3 * cp + 2)),)


def _many_short(cp: int) -> Rows:
    lengths = [2, 1, 3, 2, 1, 2, 3, 1] * cp
    return (tuple((i + 1, n) for i, n in enumerate(lengths[: 2 * cp + 2])),)


def _spans_every_rank(cp: int) -> Rows:
    L = 4
    return (_row((1, 2), (2, cp * L - 3), (3, 1)),)  # document 2 starts on rank 0 and ends on the last rank


def _rank_edges(cp: int) -> Rows:
    L = 3
    return (tuple((i + 1, L) for i in range(cp)),)  # each document is exactly one rank's shard


def _single_tokens(cp: int) -> Rows:
    return (tuple((i % 3 + 1, 1) for i in range(2 * cp + 1)),)


def _padding_rank(cp: int) -> Rows:
    L = 3
    real = max(1, (cp - 1) * L)
    return (_row((1, real - real // 2), (2, real // 2), (0, L)),)  # the last rank holds only padding


def _not_divisible(cp: int) -> Rows:
    return (_row((1, 2 * cp + 1), (2, cp + (1 if cp > 1 else 0))),)


def _s_lt_cp(cp: int) -> Rows:
    return (_row((1, max(1, cp - 1) - max(0, (cp - 1) // 2)), (2, max(0, (cp - 1) // 2))),)


def _middle_padding(cp: int) -> Rows:
    return (_row((1, 2), (0, 2), (2, cp + 1), (0, 1), (3, 2)),)


def _reused_ids(cp: int) -> Rows:
    return (_row((1, 2), (2, cp), (1, 2), (2, 1), (1, cp)),)


def _two_rows(cp: int) -> Rows:
    S = 3 * cp + 1
    return (_row((1, S - 2), (2, 2)), _row((0, 1), (1, 2), (2, S - 5), (0, 2)) if S > 5 else _row((1, S)))


NAMED_LAYOUTS: dict[str, Callable[[int], Rows]] = {
    "one-long": _one_long,
    "many-short": _many_short,
    "spans-every-rank": _spans_every_rank,
    "rank-edges": _rank_edges,
    "single-tokens": _single_tokens,
    "padding-rank": _padding_rank,
    "s-not-divisible": _not_divisible,
    "s-lt-cp": _s_lt_cp,
    "middle-padding": _middle_padding,
    "reused-ids": _reused_ids,
    "two-rows": _two_rows,
}

HEADS = ((2, 2), (4, 2), (3, 1))  # MHA, GQA, MQA
CHECKPOINT_CYCLE = ("none", "reentrant", "none", "nonreentrant")  # half the cases recompute under checkpointing
DIMS = (4, 3, 5)  # odd head dims included
WINDOWS = (-1, 2, -1, 0)
VARIANT_NAMES = ("sinks", "chunk", "softcap", "temperature", "bidirectional")  # the attention variants a case may ask for
# attention variants as (sinks, softcap, chunk). The chunk length (3) and the layouts' documents (which rarely start
# at a multiple of 3) make chunks counted from the row differ from chunks counted from each document; softcap 5
# bends scores of standard deviation ~4 (gain 2) markedly.
VARIANT_VALUES = {"sinks": (True, 0.0, -1), "chunk": (False, 0.0, 3), "softcap": (False, 5.0, -1)}
NO_VARIANT = (False, 0.0, -1)
# The NoPE query temperature (Llama 4) rotates as a dimension of its own, on or off beside the other variants (every
# one of them meets it): floor_scale 2 and attn_scale 0.5 scale a query by 1.35 at position 1 of its document and by
# 2.2 at position 20, so that positions counted from the row instead are far off (Llama 4 ships 8192 and 0.1).
TEMPERATURE_FLOOR, TEMPERATURE_ATTN_SCALE = 2, 0.5


def head_shape(hq: int, hkv: int) -> str:
    """``MHA`` (Hq = Hkv), ``MQA`` (Hkv = 1 < Hq) or ``GQA``."""
    return "MHA" if hq == hkv else "MQA" if hkv == 1 else "GQA"


@dataclass(frozen=True)
class Support:
    """What an implementation declares beyond its options (kernels, exchanges, sharding layouts): the doc-id sources
    it reads, whether it takes ``window_size``, and the attention variants it carries. The matrix draws every
    rotated value from these (:func:`default_matrix`), and its coverage is counted against them
    (:func:`coverage`)."""

    sources: tuple[str, ...] = SOURCES
    windows: bool = True
    variants: tuple[str, ...] = VARIANT_NAMES

    def __post_init__(self) -> None:
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise ValueError(f"Support.sources: expected a non-empty subset of {SOURCES}, got {self.sources!r}")
        bad = [v for v in self.variants if v not in VARIANT_NAMES]
        if bad:
            raise ValueError(f"Support.variants: expected a subset of {VARIANT_NAMES}, got {self.variants!r}")
        # canonical order, so that equal declarations give equal matrices
        object.__setattr__(self, "sources", tuple(s for s in SOURCES if s in self.sources))
        object.__setattr__(self, "variants", tuple(v for v in VARIANT_NAMES if v in self.variants))

    def rotations(self) -> dict[str, tuple]:
        """Per covered dimension, the values in the order they rotate (a value may repeat: windows and variants
        alternate with "none", so that about half the cases are plain)."""
        singles = [VARIANT_VALUES[v] for v in self.variants if v in VARIANT_VALUES]
        variants: list[tuple[bool, float, int]] = []
        for v in singles:
            variants += [NO_VARIANT, v]
        if len(singles) > 1:  # every declared variant together
            together = (any(v[0] for v in singles), max(v[1] for v in singles), max(v[2] for v in singles))
            variants += [NO_VARIANT, together]
        return {
            "source": self.sources,
            "heads": HEADS,
            "window": WINDOWS if self.windows else (-1,),
            "variant": tuple(variants) or (NO_VARIANT,),
            "temperature": (-1, TEMPERATURE_FLOOR) if "temperature" in self.variants else (-1,),
            "bidirectional": (False, True) if "bidirectional" in self.variants else (False,),
        }

    def values(self) -> dict[str, tuple[str, ...]]:
        """Per covered dimension, the distinct values (as :func:`case_values` names them) every layout must meet."""
        out = {}
        for dim, values in self.rotations().items():
            named = [_value_name(dim, v) for v in values]
            out[dim] = tuple(dict.fromkeys(named))
        return out


COVERED = ("source", "heads", "window", "variant", "temperature", "bidirectional")  # the dimensions every layout meets (Support.rotations)
# where each rotation starts for case number k (kept from the counter the matrix used before it was a covering)
_OFFSET = {"source": lambda k: k // 5, "heads": lambda k: k, "window": lambda k: k // 2, "variant": lambda k: k // 2 + k // 16,
           "temperature": lambda k: k // 3, "bidirectional": lambda k: k // 4 + 1}


def _value_name(dim: str, value) -> str:
    if dim == "source":
        return value
    if dim == "heads":
        return head_shape(*value)
    if dim == "window":
        return "none" if value < 0 else str(value)
    if dim == "temperature":
        return "none" if value < 0 else "temperature"
    if dim == "bidirectional":
        return "bidirectional" if value else "none"
    sinks, softcap, chunk = value
    return "+".join(n for n, on in (("sinks", sinks), ("chunk", chunk > 0), ("softcap", softcap > 0)) if on) or "none"


def case_values(case: Case) -> dict[str, str]:
    """The case's value of each covered dimension, named as :meth:`Support.values` names them."""
    return {"source": case.source, "heads": head_shape(case.hq, case.hkv),
            "window": "none" if case.window < 0 else str(case.window),
            "variant": _value_name("variant", (case.sinks, case.softcap, case.chunk)),
            "temperature": _value_name("temperature", case.temperature),
            "bidirectional": _value_name("bidirectional", case.bidirectional)}


def _draw(rows: Rows, cp: int, name: str, slot: tuple, dtype: str, k: int, rot: dict[str, tuple],
          need: dict[str, set[str]], plain: bool = False) -> Case:
    """Case number ``k`` of one (CP size, layout, dtype): each covered dimension takes, from where its rotation
    starts for ``k``, the first value this group still has to meet (else the value there); ``plain``: no window
    and no variant. Head dim and checkpointing rotate by ``k`` alone."""
    chosen = {}
    for dim, values in rot.items():
        start = _OFFSET[dim](k) % len(values)
        order = values[start:] + values[:start]
        chosen[dim] = next((v for v in order if _value_name(dim, v) in need[dim]), order[0])
    if chosen["bidirectional"] and chosen["variant"][2] > 0 and "bidirectional" in need["bidirectional"] \
            and _value_name("variant", chosen["variant"]) not in need["variant"]:
        # chunked attention has no bidirectional blocks: a chunk this group has met already gives way to the blocks
        start = _OFFSET["variant"](k) % len(rot["variant"])
        order = rot["variant"][start:] + rot["variant"][:start]
        chosen["variant"] = next((v for v in order if v[2] <= 0), chosen["variant"])
    if plain:
        chosen["window"], chosen["variant"], chosen["temperature"], chosen["bidirectional"] = -1, NO_VARIANT, -1, False
    kernel, exchange, layout = slot
    sinks, softcap, chunk = chosen["variant"]
    temperature = chosen["temperature"]
    return Case(
        rows=rows, cp=cp, name=name, hq=chosen["heads"][0], hkv=chosen["heads"][1], dim=DIMS[(k // 3) % len(DIMS)],
        window=chosen["window"], kernel=kernel, exchange=exchange, layout=layout, dtype=dtype, seed=k,
        source=chosen["source"], checkpoint=CHECKPOINT_CYCLE[(k // 7) % len(CHECKPOINT_CYCLE)],
        sinks=sinks, softcap=softcap, chunk=chunk, temperature=temperature,
        # chunked attention has no bidirectional blocks (Llama 4 has no images bidirectional)
        bidirectional=chosen["bidirectional"] and chunk < 0,
    )


def default_matrix(
    cps: Sequence[int] = (1, 2, 3, 4, 8),
    dtypes: Sequence[str] = ("float64", "float32"),
    kernels: Sequence[str | None] = ("varlen", "dense"),
    exchanges: Sequence[str | None] = ("auto", "allgather", "halo", "a2a"),
    layouts: Sequence[str | None] = (None,),
    applicable: Callable[[Case], bool] | None = None,
    support: Support = Support(),
    cover: bool = True,
) -> Iterator[Case]:
    """Every named layout at every CP size, for every kernel x exchange x layout x dtype the implementation takes
    (``applicable``), plus what a covering needs: at every CP size, every named layout meets every doc-id source,
    head shape (MHA, GQA, MQA), window and attention variant of ``support`` at least once per dtype, and each kernel
    offered runs the plain attention (no window, no variant) there first.

    The covered values are drawn from ``support`` only, never dropped afterwards: for each (CP size, layout,
    dtype) every case takes, per dimension, the next value in rotation that the group has not met yet; when the
    offered kernels, exchanges and sharding layouts give fewer cases than a group needs, cases of the first
    applicable option are added until it has met every value. Head dims and activation checkpointing rotate
    across the cases. :func:`coverage` counts what a list of cases met. ``cover=False``: the values rotate by the
    case counter alone and no case is added: one case per option, as ``verify gpu`` sizes its matrix to its time
    budget (no guarantee; its coverage is what :func:`coverage` counts)."""
    rot = support.rotations()
    k = 0
    for cp in cps:
        for name, make in NAMED_LAYOUTS.items():
            if name == "s-lt-cp" and cp == 1:
                continue  # S < CP needs CP >= 2
            rows = make(cp)
            slots = [(kernel, exchange, layout) for kernel in kernels for exchange in exchanges for layout in layouts]
            need = {dtype: {dim: set(values) if cover else set() for dim, values in support.values().items()}
                    for dtype in dtypes}

            def met(case: Case) -> bool:
                """Take the case's values off its group's needs; whether it met anything new."""
                new = False
                for dim, value in case_values(case).items():
                    if value in need[case.dtype][dim]:
                        need[case.dtype][dim].discard(value)
                        new = True
                return new

            plain_met: set[tuple] = set()  # (kernel, dtype): each kernel's first case is the plain attention

            for slot in slots:
                for dtype in dtypes:
                    plain = cover and (slot[0], dtype) not in plain_met
                    case = _draw(rows, cp, name, slot, dtype, k, rot, need[dtype], plain)
                    k += 1
                    if applicable is None or applicable(case):
                        met(case)
                        plain_met.add((slot[0], dtype))
                        yield case
            for dtype in dtypes if cover else ():  # a covering: cases until the group has met every value
                while any(need[dtype].values()):
                    for slot in slots:
                        case = _draw(rows, cp, name, slot, dtype, k, rot, need[dtype])
                        if (applicable is None or applicable(case)) and met(case):
                            k += 1
                            yield case
                            break
                    else:
                        break  # no option takes what is left: coverage() reports the pairs never met


def coverage(cases: Sequence[Case], cps: Sequence[int], dtypes: Sequence[str], support: Support = Support()
             ) -> dict[str, dict]:
    """Per covered dimension, the (named layout, value) pairs of ``support`` that the attention cases met at every
    CP size in ``cps`` (where the layout exists) and dtype in ``dtypes``:
    ``{"layout x source": {"met": 33, "total": 33, "missing": ["reused-ids x mask2d (CP 2 float32)", ...]}, ...}``."""
    seen: set[tuple] = set()
    for c in cases:
        if c.layer == "attention" and c.name in NAMED_LAYOUTS:
            for dim, value in case_values(c).items():
                seen.add((c.cp, c.dtype, c.name, dim, value))
    out: dict[str, dict] = {}
    for dim, values in support.values().items():
        met, missing = 0, []
        for name in NAMED_LAYOUTS:
            for value in values:
                gaps = [f"CP {cp} {dtype}" for cp in cps for dtype in dtypes
                        if not (name == "s-lt-cp" and cp == 1) and (cp, dtype, name, dim, value) not in seen]
                if gaps:
                    missing.append(f"{name} x {value} ({', '.join(gaps)})")
                else:
                    met += 1
        out[f"layout x {dim}"] = {"met": met, "total": len(NAMED_LAYOUTS) * len(values), "missing": missing}
    return out


def coverage_line(cov: dict[str, dict]) -> str:
    """``pairs met: layout x source 33/33, layout x heads 33/33, ...`` (at every CP size and dtype run)."""
    return "pairs met at every CP size and dtype: " + ", ".join(f"{k} {v['met']}/{v['total']}" for k, v in cov.items())


MIXER_HEADS = ((2, 2), (4, 2), (3, 1))  # gated delta rule: (value heads, key heads)
MIXER_WIDTHS = (4, 2, 4, 3)  # convolution widths, rotating (4 is Qwen3-Next's)


def mixer_matrix(
    cps: Sequence[int] = (1, 2, 3, 4, 8),
    dtypes: Sequence[str] = ("float64", "float32"),
    layouts: Sequence[str | None] = (None,),
    layers: Sequence[str] = tuple(SPECS),
) -> Iterator[Case]:
    """Every named layout at every CP size once per mixer layer (or, for a layer whose spec says
    ``layouts_per_cp``, that many named layouts per CP size, rotating through them all); layout, dtype, heads,
    widths and activation checkpointing rotate across the cases (a mixer's plan depends on the layout and CP size,
    not on an exchange or a kernel option: one case per layout and CP size covers it)."""
    k = 0
    names = list(NAMED_LAYOUTS)
    thin = {layer: SPECS[layer].layouts_per_cp for layer in layers if SPECS[layer].layouts_per_cp}
    turn = dict.fromkeys(thin, 0)  # the next named layout of each thin layer
    chosen: dict[tuple[str, int], set[str]] = {}
    for cp in cps:
        for layer, n in thin.items():
            pick: set[str] = set()
            while len(pick) < min(n, len(names) - (cp == 1)):
                name = names[turn[layer] % len(names)]
                turn[layer] += 1
                if not (name == "s-lt-cp" and cp == 1):
                    pick.add(name)
            chosen[(layer, cp)] = pick
        for name, make in NAMED_LAYOUTS.items():
            if name == "s-lt-cp" and cp == 1:
                continue
            rows = make(cp)
            for layer in layers:
                if layer in thin and name not in chosen[(layer, cp)]:
                    continue
                hq, hkv = MIXER_HEADS[k % len(MIXER_HEADS)]
                yield Case(rows=rows, cp=cp, name=name, hq=hq, hkv=hkv, dim=DIMS[(k // 3) % len(DIMS)],
                           layout=layouts[k % len(layouts)], dtype=dtypes[(k // len(layers)) % len(dtypes)], seed=k,
                           checkpoint=CHECKPOINT_CYCLE[(k // 5) % len(CHECKPOINT_CYCLE)], layer=layer,
                           width=MIXER_WIDTHS[(k // 2) % len(MIXER_WIDTHS)])
                k += 1


# Long layouts: pieces in every varlen size-class regime (exact up to 16, multiples of 16 up to 128, then
# eighths of each octave up to 1024, exact above), including a document longer than EXACT_ABOVE cut by a rank
# boundary. Fixed (not functions of CP), few cases, small heads: float64 references of S ~ 1,000 are cheap.
LONG_LAYOUTS: dict[str, str] = {
    "size-classes": "1x600,2x7,3x300,4x150,5x100,6x40,7x16,0x3",  # S = 1216: classes 640, 7, 320, 160, 112, 48, 16
    "exact-path": "1x40,2x1030,3x20,0x6",  # S = 1096: at CP 2 the 1030-token document straddles the boundary
}
LONG_PLAN = (  # (layout, CP sizes, window) -> one case per sharding layout offered, dtypes alternating
    ("size-classes", (1, 4), -1),
    ("size-classes", (2,), 64),
    ("exact-path", (1, 2), -1),
    ("exact-path", (2,), 100),
)


def long_cases(
    cps: Sequence[int] = (1, 2, 4),
    dtypes: Sequence[str] = ("float64", "float32"),
    layouts: Sequence[str | None] = (None,),
    kernel: str | None = "varlen",
) -> list[Case]:
    """The long layouts at a few CP sizes, with and without a window, on every sharding layout."""
    out = []
    for j, (name, sizes, window) in enumerate(LONG_PLAN):
        for cp in sizes:
            if cp not in cps:
                continue
            for i, layout in enumerate(layouts):
                out.append(Case(rows=parse_rows(LONG_LAYOUTS[name]), cp=cp, name=name, hq=2, hkv=1, dim=4,
                                window=window, kernel=kernel, layout=layout, dtype=dtypes[(i + j) % len(dtypes)],
                                seed=len(out)))
    return out


GROWTH_ROWS = "1x23,2x9,0x2,3x30"  # one fixed layout (S = 64) for the error-vs-CP-size check
GROWTH_LIMIT = 2.0  # float32 error may grow at most this much from CP 1 to the largest CP size


def growth_cases(cps: Sequence[int] = (1, 2, 4, 8), seeds: Sequence[int] = range(6), **options) -> list[Case]:
    """float32 cases of one fixed layout at every CP size: the verifier compares their largest errors."""
    rows = parse_rows(GROWTH_ROWS)
    return [Case(rows=rows, cp=cp, name="cp-growth", hq=4, hkv=2, dim=8, dtype="float32", seed=seed, **options)
            for cp in cps for seed in seeds]


def error_growth(results) -> dict[int, float] | None:
    """Largest relative error (outputs and gradients) per CP size over the ``cp-growth`` results."""
    per_cp: dict[int, float] = {}
    for r in results:
        if r.case.name != "cp-growth" or not r.metrics:
            continue
        worst = max(r.rel(n) for n in r.metrics if not r.metrics[n].get("exact") and "bytes" not in n)
        per_cp[r.case.cp] = max(per_cp.get(r.case.cp, 0.0), worst)
    return dict(sorted(per_cp.items())) if len(per_cp) > 1 else None
