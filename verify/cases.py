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

__all__ = ["Case", "LAYERS", "LONG_LAYOUTS", "NAMED_LAYOUTS", "default_matrix", "format_rows", "long_cases", "mixer_matrix",
           "parse_rows"]

Rows = tuple[tuple[tuple[int, int], ...], ...]  # rows of (doc id, run length)

DTYPES = ("float64", "float32", "bfloat16", "float16")
SOURCES = ("packed", "mask4d", "mask2d")
CHECKPOINTS = ("none", "reentrant", "nonreentrant")
LAYERS = ("attention", "conv", "gated_delta", "mamba2")  # the layer a case judges (verify.runner; verify.mixers for the others)


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
    layer: str = "attention"  # attention | conv (causal depthwise convolution) | gated_delta (Gated DeltaNet) | mamba2 (SSD)
    width: int = 4  # the convolution's width (layer conv)
    sinks: bool = False  # attention sinks: one learned logit per query head (drawn ~ N(0, 2^2)), its gradient checked
    softcap: float = 0.0  # logit soft-capping softcap * tanh(scores / softcap); 0 = none
    chunk: int = -1  # chunked local attention: chunks of this many positions from each document's start; -1 = none

    def __post_init__(self) -> None:
        if self.layer not in LAYERS:
            raise ValueError(f"layer: expected one of {LAYERS}, got {self.layer!r}")
        if self.width < 1:
            raise ValueError(f"width: expected a convolution width >= 1, got {self.width}")
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
        """The attention variants the case asks for: ``sinks``, ``softcap``, ``chunk``."""
        return tuple(n for n, on in (("sinks", self.sinks), ("softcap", self.softcap > 0), ("chunk", self.chunk > 0)) if on)

    def doc_ids(self) -> list[list[int]]:
        return [[i for i, n in row for _ in range(n)] for row in self.rows]

    def label(self) -> str:
        opts = "/".join(x for x in (self.kernel, self.exchange, self.layout) if x)
        win = f" w{self.window}" if self.window >= 0 else ""
        ckpt = f" ckpt-{self.checkpoint}" if self.checkpoint != "none" else ""
        sdpa = f" sdpa-{self.backend}" if self.backend else ""
        gain = f" gain{self.gain:g}" if self.gain != 2.0 else ""
        if self.layer != "attention":
            kind = {"conv": f"conv w{self.width} C{self.hq * self.dim}", "gated_delta": f"gdr {self.hq}:{self.hkv}x{self.dim}",
                    "mamba2": f"ssd {self.hq}:{self.hkv}x{self.dim}"}[self.layer]
            return f"{kind} {self.name} cp{self.cp} {self.layout or ''} {self.dtype}{ckpt}".replace("  ", " ")
        var = ("" if not self.sinks else " sinks") + (f" cap{self.softcap:g}" if self.softcap > 0 else "") + (
            f" chunk{self.chunk}" if self.chunk > 0 else "")
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
        if self.layer != "attention":
            a += ["--layer", self.layer] + (["--width", str(self.width)] if self.layer == "conv" else [])
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
    p.add_argument("--width", type=int, default=4, help="the convolution's width (--layer conv)")
    p.add_argument("--sinks", action="store_true", help="attention sinks: one learned logit per query head")
    p.add_argument("--softcap", type=float, default=0.0, help="logit soft-capping softcap * tanh(scores / softcap)")
    p.add_argument("--chunk", type=int, default=-1, help="chunked local attention: chunk length from each document's start")


def case_from_args(ns: argparse.Namespace) -> Case:
    hq, _, hkv = ns.heads.partition(":")
    return Case(
        rows=parse_rows(ns.rows), cp=ns.cp, name=ns.name, hq=int(hq), hkv=int(hkv or hq), dim=ns.dim,
        window=ns.window, kernel=ns.kernel, exchange=ns.exchange, layout=ns.layout, dtype=ns.dtype, seed=ns.seed,
        source=ns.source, hidden=ns.hidden, checkpoint=ns.checkpoint, backend=ns.sdpa_backend, gain=ns.gain,
        layer=ns.layer, width=ns.width,
        sinks=ns.sinks, softcap=ns.softcap, chunk=ns.chunk,
    )


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
# attention variants, rotated in place (not multiplied): (sinks, softcap, chunk). The chunk length (3) and the
# layouts' documents (which rarely start at a multiple of 3) make chunks counted from the row differ from
# chunks counted from each document; softcap 5 bends scores of standard deviation ~4 (gain 2) markedly.
VARIANTS = ((False, 0.0, -1), (True, 0.0, -1), (False, 0.0, -1), (False, 0.0, 3), (False, 0.0, -1), (False, 5.0, -1),
            (False, 0.0, -1), (True, 5.0, 3))


def default_matrix(
    cps: Sequence[int] = (1, 2, 3, 4, 8),
    dtypes: Sequence[str] = ("float64", "float32"),
    kernels: Sequence[str | None] = ("varlen", "dense"),
    exchanges: Sequence[str | None] = ("auto", "allgather", "halo", "a2a"),
    layouts: Sequence[str | None] = (None,),
    applicable: Callable[[Case], bool] | None = None,
) -> Iterator[Case]:
    """Every named layout at every CP size, for every kernel x exchange x layout x dtype; heads, head dims,
    windows, doc-id sources, activation checkpointing and attention variants (sinks, softcap, chunks) rotate
    across the cases so that each value meets every layout."""
    k = 0
    for cp in cps:
        for name, make in NAMED_LAYOUTS.items():
            if name == "s-lt-cp" and cp == 1:
                continue  # S < CP needs CP >= 2
            rows = make(cp)
            for kernel in kernels:
                for exchange in exchanges:
                    for layout in layouts:
                        for dtype in dtypes:
                            hq, hkv = HEADS[k % len(HEADS)]
                            sinks, softcap, chunk = VARIANTS[(k // 2 + k // 16) % len(VARIANTS)]
                            case = Case(
                                rows=rows, cp=cp, name=name, hq=hq, hkv=hkv, dim=DIMS[(k // 3) % len(DIMS)],
                                window=WINDOWS[(k // 2) % len(WINDOWS)], kernel=kernel, exchange=exchange,
                                layout=layout, dtype=dtype, seed=k, source=SOURCES[(k // 5) % len(SOURCES)],
                                checkpoint=CHECKPOINT_CYCLE[(k // 7) % len(CHECKPOINT_CYCLE)],
                                sinks=sinks, softcap=softcap, chunk=chunk,
                            )
                            k += 1
                            if applicable is None or applicable(case):
                                yield case


MIXER_HEADS = ((2, 2), (4, 2), (3, 1))  # gated delta rule: (value heads, key heads)
MIXER_WIDTHS = (4, 2, 4, 3)  # convolution widths, rotating (4 is Qwen3-Next's)


def mixer_matrix(
    cps: Sequence[int] = (1, 2, 3, 4, 8),
    dtypes: Sequence[str] = ("float64", "float32"),
    layouts: Sequence[str | None] = (None,),
    layers: Sequence[str] = ("conv", "gated_delta", "mamba2"),
) -> Iterator[Case]:
    """Every named layout at every CP size once per mixer layer; layout, dtype, heads, widths and activation
    checkpointing rotate across the cases (a mixer's plan depends on the layout and CP size, not on an exchange
    or a kernel option: one case per layout and CP size covers it)."""
    k = 0
    for cp in cps:
        for name, make in NAMED_LAYOUTS.items():
            if name == "s-lt-cp" and cp == 1:
                continue
            rows = make(cp)
            for layer in layers:
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
