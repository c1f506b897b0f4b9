"""``python -m verify fuzz``: cases drawn by hypothesis; a failure is shrunk to a minimal case and printed as
a one-line command that replays exactly that case. For a third party (an adapter declaring conventions) a
failure is a case the verifier classes ``bug`` (:mod:`verify.classify`): contracts and refusals are not shrunk.

Drawn: CP size, batch rows, sequence length, document runs (ids 0-4, so padding anywhere and reused ids),
heads (MHA / GQA / MQA), head dim, window, and every kernel / exchange / layout the implementation offers,
dtype, doc-id source, activation checkpointing, seed, the q/k projection gain (scores' standard deviation
is about gain squared: up to 25, where the softmax is peaked and float32 kernels differ most), and the attention
variants the implementation offers (sinks, soft-capping, chunks, the NoPE query temperature, bidirectional blocks
and their whole-block form; no blocks with chunks, as in the matrix). A third of the cases judge a mixer of hybrid
models instead of attention (each mixer family the implementation offers: the convolution of width 1-5, the delta
rules with at least 2 key channels, ...).

``--long`` draws long rows instead (documents up to 1,100 tokens, so every varlen size class and the exact
path above 1,024 tokens), at small heads; ``--budget`` bounds the wall time of either.
"""

from __future__ import annotations

import time

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from .cases import CHECKPOINTS, SOURCES, Case
from .report import make_console, write_json
from .runner import impl_info
from .session import CaseResult, Session

__all__ = ["case_strategy", "fuzz", "main"]

CP_SIZES = (1, 2, 3, 4, 8)
GAINS = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0)
LONG_CP_SIZES = (1, 2, 3, 4)
SOFTCAPS = (0.0, 0.0, 0.0, 1.0, 5.0)  # 0 = none (most cases), else the cap
CHUNKS = (-1, -1, -1, 1, 3, 7, 64)  # -1 = none; chunked local attention's chunk length
# The delta rules l2-normalise q and k over their K channels: with K = 1 the normalised value is the sign, its
# gradient only the norm's eps term, and in float32 that gradient is the rounding of 1 - q_n ** 2 (a cancellation),
# uncorrelated between the implementation and the float32 baseline: KDA's q-side gradients reached 1.2x the float32
# limit at K = 1 in 2 of 240 cases (CP 1 and 2 alike), at most 0.27x at K = 2. The fuzzer draws K >= 2 for them.
L2_NORMALISED = frozenset({"gated_delta", "kda"})
TEMPERATURES = (-1, -1, -1, 1, 2, 5)  # -1 = none; the NoPE temperature's floor_scale (attn_scale TEMPERATURE_ATTN_SCALE)


def case_strategy(info, max_cp: int = 8, max_len: int = 40, applicable=None, long: bool = False) -> st.SearchStrategy[Case]:
    """Hypothesis strategy for cases the implementation ``info`` (a runner.ImplInfo) can run; ``long``: one row
    of up to ``max_len`` tokens whose documents may be long (see the module docstring)."""
    cps = [c for c in (LONG_CP_SIZES if long else CP_SIZES) if c <= max_cp] or [1]
    max_run = 1100 if long else 8
    kernels = ["varlen", "dense"] if "kernel" in info.options else [None]
    exchanges = ["auto", "allgather", "a2a", "halo"] if "kv_exchange" in info.options else [None]
    layouts = list(getattr(getattr(info.module, "options", None), "LAYOUTS", None) or ["contiguous"]) if "layout" in info.options else [None]
    windows = ([-1, 0, 5, 64, 300] if long else [-1, 0, 1, 2, 5]) if info.windows else [-1]

    @st.composite
    def draw_case(draw) -> Case:
        B = 1 if long else draw(st.integers(1, 2))
        S = draw(st.integers(max_len // 2 if long else 1, max_len))
        rows = []
        for _ in range(B):
            runs, total = [], 0
            while total < S:
                n = draw(st.integers(1, min(max_run, S - total)))
                runs.append((draw(st.integers(0, 4)), n))
                total += n
            rows.append(tuple(runs))
        hkv = draw(st.sampled_from([1, 2]))
        case = Case(
            rows=tuple(rows),
            cp=draw(st.sampled_from(cps)),
            name="fuzz",
            hq=hkv * draw(st.sampled_from([1, 2] if long else [1, 2, 3])),
            hkv=hkv,
            dim=draw(st.integers(1, 4 if long else 8)),
            window=draw(st.sampled_from(windows)),
            kernel=draw(st.sampled_from(kernels)),
            exchange=draw(st.sampled_from(exchanges)),
            layout=draw(st.sampled_from(layouts)),
            dtype=draw(st.sampled_from(["float64", "float32"])),
            seed=draw(st.integers(0, 2**16)),
            source=draw(st.sampled_from(SOURCES)),
            checkpoint=draw(st.sampled_from(CHECKPOINTS)),
            gain=draw(st.sampled_from(GAINS)),
            sinks="sinks" in info.variants and draw(st.booleans()),
            softcap=draw(st.sampled_from(SOFTCAPS)) if "softcap" in info.variants else 0.0,
            chunk=draw(st.sampled_from(CHUNKS)) if "chunk" in info.variants else -1,
            temperature=draw(st.sampled_from(TEMPERATURES)) if "temperature" in info.variants else -1,
        )
        if "bidirectional" in info.variants and case.chunk < 0 and draw(st.integers(0, 3)) == 0:
            case = Case(**{**case.__dict__, "bidirectional": True,
                           "whole_blocks": info.whole_blocks and draw(st.booleans())})
        if applicable is not None and not applicable(info, case):
            case = Case(**{**case.__dict__, "exchange": "auto"})  # halo is offered only where it applies
        mixers = sorted(getattr(info, "mixers", ()))
        if mixers and not long and draw(st.integers(0, 2)) == 0:  # a third of the cases judge a mixer instead
            layer = draw(st.sampled_from(mixers))
            hkv = case.hkv
            dim = max(case.dim, 2) if layer in L2_NORMALISED else case.dim
            case = Case(**{**case.__dict__, "layer": layer, "dim": dim, "width": draw(st.integers(1, 5)), "window": -1,
                           "kernel": None, "exchange": None, "hq": hkv * draw(st.sampled_from([1, 2])),
                           "gain": 2.0, "source": "packed", "sinks": False, "softcap": 0.0, "chunk": -1,
                           "temperature": -1, "bidirectional": False, "whole_blocks": False})
        return case

    return draw_case()


def fuzz(
    session: Session,
    impl: str,
    *,
    examples: int,
    seed_value: int,
    max_cp: int = 8,
    max_len: int = 40,
    on_result=None,
    long: bool = False,
    budget: float | None = None,
) -> tuple[list[CaseResult], CaseResult | None]:
    """Run ``examples`` drawn cases; on a failure hypothesis shrinks it. Returns every result and the minimal
    failing one (None when all passed). Past ``budget`` seconds, no new draw is run (shrinking a failure found
    before still is)."""
    from .runner import applicable

    from .adapters import OURS
    from .classify import classify

    info = impl_info(impl)
    results: list[CaseResult] = []
    failures: list[CaseResult] = []
    t0 = time.perf_counter()
    third_party = info.conventions is not OURS  # judged by class: only a bug fails (see verify.classify)

    def recheck(case: Case, reference) -> CaseResult:
        return session.run_one(case, impl=impl, reference=reference)

    @seed(seed_value)
    @settings(
        max_examples=examples, database=None, deadline=None, derandomize=False, print_blob=False,
        suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
    )
    @given(case_strategy(info, max_cp, max_len, applicable, long))
    def check(case: Case) -> None:
        if budget is not None and not failures and time.perf_counter() - t0 > budget:
            return
        result = session.run_one(case, impl=impl)
        results.append(result)
        if on_result:
            on_result(result)
        if result.ok:
            return
        if third_party:
            verdict = classify(result, info.conventions, recheck)
            if verdict.cls != "bug":
                return
            result.details = f"bug: {verdict.why}"
        failures.append(result)
        raise AssertionError(result.details or result.status)

    try:
        check()
    except AssertionError:
        pass
    return results, (failures[-1] if failures else None)  # hypothesis replays the minimal example last


def main(args) -> int:
    import torch

    torch.set_num_threads(1)
    console = make_console()
    try:
        impl_info(args.impl)
    except (ImportError, ValueError) as exc:
        console.print(f"verify fuzz: cannot use --impl {args.impl}: {exc}", markup=False)
        return 2
    done = {"n": 0}

    def progress(result: CaseResult) -> None:
        done["n"] += 1
        if done["n"] % 50 == 0:
            console.print(f"fuzz: {done['n']} cases run", markup=False)

    t0 = time.perf_counter()
    with Session(args.impl, case_timeout=args.case_timeout, backend=args.backend or "gloo",
                 keep_after_uniform_error=args.impl != "blockdiag_dist") as session:
        max_len = args.max_len or (1300 if args.long else 40)
        results, minimal = fuzz(session, args.impl, examples=args.examples, seed_value=args.seed, max_cp=args.max_cp,
                                max_len=max_len, on_result=progress, long=args.long, budget=args.budget)
    wall = time.perf_counter() - t0
    if args.json:
        write_json(args.json, results, wall, args.impl, {"fuzz_seed": args.seed, "minimal_failure": minimal.to_dict() if minimal else None})
    if minimal is None:
        cut = f", stopped by the {args.budget:.0f} s budget" if len(results) < args.examples else ""
        longest = max((r.case.seq_len for r in results), default=0)
        console.print(f"PASS: {len(results)} fuzzed cases (seed {args.seed}{cut}) in {wall:.1f} s "
                      f"({len(results) / wall:.1f} cases/s), longest S = {longest}", markup=False)
        return 0
    failed = sum(not r.ok for r in results)
    console.print(f"FAIL: {failed} of {len(results)} fuzzed cases failed (seed {args.seed}); minimal failing case after shrinking:", markup=False)
    console.print(f"  {minimal.case.label()}: {minimal.status}: {minimal.details.splitlines()[0] if minimal.details else ''}", markup=False, soft_wrap=True)
    console.print(f"  reproduce: {minimal.case.command(args.impl)}", markup=False, soft_wrap=True)
    return 1
