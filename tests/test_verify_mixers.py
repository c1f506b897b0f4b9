"""The verifier judges the mixers of hybrid models as it judges attention: our convolution, gated delta rule,
Mamba2 SSD, KDA, DeepSeek Sparse Attention, Mamba1's selective scan and lightning attention pass hard cases (a rank holding only padding
under non-reentrant checkpointing, documents over every rank, balanced layouts, B > 1), every planted mixer bug is reported as a numerical failure, the replay command
rebuilds a mixer case, and fuzzing draws mixer layers."""

from __future__ import annotations

import pytest

from verify.cases import NAMED_LAYOUTS, Case, case_from_args, mixer_matrix, parse_rows
from verify.cli import _parser
from verify.families import SPECS

pytestmark = pytest.mark.usefixtures("one_thread")


def case(name: str, cp: int, layer: str, **kw) -> Case:
    kw.setdefault("hq", 4)
    kw.setdefault("hkv", 2)
    return Case(rows=NAMED_LAYOUTS[name](cp), cp=cp, name=name, layer=layer, **kw)


# L = 2 at CP 4: document 2 covers ranks 0-2, and rank 2's first token reads history from ranks 0 and 1
SHORT_PIECES = Case(rows=parse_rows("1x1,2x5,0x2"), cp=4, hq=4, hkv=2, name="short-pieces", layer="conv", width=4)

HARD = [
    case("padding-rank", 4, "gated_delta", checkpoint="nonreentrant", dtype="float32"),
    case("padding-rank", 4, "conv", checkpoint="nonreentrant", dtype="float32"),
    case("spans-every-rank", 4, "gated_delta", layout="balanced", checkpoint="reentrant"),
    case("two-rows", 3, "gated_delta", layout="auto", dtype="float32"),
    SHORT_PIECES,
    case("spans-every-rank", 3, "conv", layout="balanced", width=3),
    case("padding-rank", 4, "mamba2", checkpoint="nonreentrant", dtype="float32"),
    case("two-rows", 3, "mamba2", layout="balanced", checkpoint="reentrant"),
    case("padding-rank", 4, "kda", layout="balanced", checkpoint="nonreentrant", dtype="float32"),
    case("spans-every-rank", 4, "kda", checkpoint="reentrant"),
    # DeepSeek Sparse Attention: a rank of padding only takes part in the exchange's backward
    case("padding-rank", 4, "sparse", width=3, dtype="float32", checkpoint="nonreentrant"),
    case("two-rows", 3, "sparse", width=2, layout="balanced", checkpoint="reentrant"),
    case("padding-rank", 4, "mamba1", checkpoint="nonreentrant", dtype="float32"),
    case("spans-every-rank", 3, "mamba1", layout="balanced", checkpoint="reentrant"),
    case("padding-rank", 4, "lightning", layout="balanced", checkpoint="nonreentrant", dtype="float32"),
]


def test_our_mixers_pass_hard_cases(session):
    results = session.run(HARD)
    bad = [f"{r.case.label()}: {r.status}: {r.details}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    assert {r.mode for r in results if r.case.layer != "sparse"} <= {"summary", "history"}, [r.mode for r in results]
    assert {r.mode for r in results if r.case.layer == "sparse"} <= {"halo", "a2a"}, [r.mode for r in results]


# bug -> cases where it shows (the numbers, not only the exchange's byte count)
MUTANT_CASES = {
    "mixer_state_leak": [case("many-short", 2, "gated_delta"), case("many-short", 2, "mamba2"), case("many-short", 2, "kda"),
                         case("many-short", 2, "mamba1"), case("many-short", 2, "lightning")],
    "mixer_reset_late": [case("many-short", 2, "gated_delta"), case("two-rows", 3, "gated_delta", layout="balanced"),
                         case("two-rows", 3, "mamba2", layout="balanced"), case("two-rows", 3, "mamba1", layout="balanced")],
    "mixer_summary_bf16": [case("spans-every-rank", 4, "gated_delta", dtype="float32"),
                           case("spans-every-rank", 4, "mamba2", dtype="float32"),
                           case("spans-every-rank", 4, "kda", dtype="float32"),
                           case("spans-every-rank", 4, "mamba1", dtype="float32"),
                           case("spans-every-rank", 4, "lightning", dtype="float32")],
    # a continuing piece that starts inside a rank's row (balanced layouts): counted from the row, its entering
    # state decays too much
    "mixer_decay_per_rank": [case("spans-every-rank", 3, "kda", layout="balanced"),
                             case("padding-rank", 4, "kda", layout="balanced", dtype="float32"),
                             case("spans-every-rank", 3, "lightning", layout="balanced"),
                             case("two-rows", 4, "lightning", layout="balanced", dtype="float32")],
    # a continuing piece with other tokens before it in its rank's row: balanced layouts (a rank's second chunk)
    "mixer_scan_decay_per_rank": [case("spans-every-rank", 2, "mamba1", layout="balanced"),
                                  case("two-rows", 4, "mamba1", layout="balanced", dtype="float32")],
    # the transitions matter where a document crosses a piece held by another rank: over 3+ ranks
    "mixer_ssd_no_decay": [case("spans-every-rank", 4, "mamba2"), case("spans-every-rank", 3, "mamba2", layout="balanced")],
    "mixer_conv_unmasked": [case("many-short", 2, "conv")],
    "mixer_history_wrong_rank": [case("two-rows", 3, "conv", layout="balanced", dtype="float32"),
                                 SHORT_PIECES],
    "mixer_topk_over_row": [case("many-short", 1, "sparse", width=2), case("two-rows", 3, "sparse", width=2, layout="balanced")],
    # right in the sum over the ranks; the rank of padding only gives the expansion's weights no gradient
    "mixer_expand_unused": [case("padding-rank", 4, "sparse", width=3, dtype="float32"),
                            case("padding-rank", 3, "sparse", width=2, layout="auto")],
}


@pytest.mark.parametrize("bug", sorted(MUTANT_CASES))
def test_every_planted_mixer_bug_is_reported(session, bug):
    results = session.run(MUTANT_CASES[bug], impl=f"verify.mutants.{bug}")
    for r in results:
        assert r.status == "fail", f"{bug}: {r.case.label()}: {r.status} {r.details}"
        numeric = [m for m in r.failed_metrics if m in ("out", "dinputs_embeds") or m.startswith("d")]
        assert numeric, f"{bug}: {r.case.label()} failed only on {r.failed_metrics}"
        assert r.case.command(r.impl).endswith(f"--impl verify.mutants.{bug}")
    # and our implementation passes the same cases
    assert all(r.ok for r in session.run(MUTANT_CASES[bug])), bug


def test_mixer_case_replay_command_round_trips():
    c = Case(rows=parse_rows("1x3,0x2/2x5"), cp=3, hq=4, hkv=1, dim=5, layout="balanced", dtype="float32", seed=7,
             checkpoint="reentrant", layer="conv", width=3, name="x")
    argv = c.command().split()[4:]
    assert case_from_args(_parser().parse_args(["case", *argv])) == c


def test_mixer_matrix_covers_every_named_layout_and_cp_size_once_per_layer():
    cases = list(mixer_matrix(cps=(1, 2, 8), layouts=("contiguous", "balanced", "auto")))
    for layer in (name for name, s in SPECS.items() if not s.layouts_per_cp):
        mine = [(c.name, c.cp) for c in cases if c.layer == layer]
        assert len(mine) == len(set(mine)) == 3 * len(NAMED_LAYOUTS) - 1  # s-lt-cp needs CP >= 2
    # mamba1 and lightning (their plan and folds are run_recurrence's, judged in full above): 4 named layouts per CP
    # size, rotating
    thin = list(mixer_matrix(cps=(1, 2, 3, 4, 8)))
    for layer in ("mamba1", "lightning"):
        mine = [(c.name, c.cp) for c in thin if c.layer == layer]
        assert len(mine) == len(set(mine)) == 5 * 4 and {n for n, _ in mine} == set(NAMED_LAYOUTS)
        assert {cp for _, cp in mine} == {1, 2, 3, 4, 8} and ("s-lt-cp", 1) not in mine
    assert {c.layout for c in cases} == {"contiguous", "balanced", "auto"}
    assert {c.dtype for c in cases} == {"float64", "float32"} and {c.checkpoint for c in cases} == {"none", "reentrant", "nonreentrant"}


def test_fuzzing_draws_mixer_layers_and_every_attention_variant():
    from hypothesis import HealthCheck, given, settings

    from verify.fuzz import L2_NORMALISED, case_strategy
    from verify.runner import impl_info

    seen, variants = set(), set()

    @settings(max_examples=300, database=None, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case_strategy(impl_info("blockdiag_dist")))
    def draw(c):
        seen.add(c.layer)
        variants.update(c.variants + (("whole_blocks",) if c.whole_blocks else ()))
        assert not (c.bidirectional and c.chunk > 0), c.label()  # no blocks with chunks, as in the matrix
        assert c.layer not in L2_NORMALISED or c.dim >= 2, c.label()

    draw()
    assert seen == {"attention", *SPECS}
    assert variants == {"sinks", "chunk", "softcap", "temperature", "bidirectional", "whole_blocks"}


def test_the_sparse_reference_selects_on_the_implementations_device():
    """Which of equal indexer scores ``topk`` keeps differs between CPU and CUDA: the reference's scores and top-k
    run where the case's tensors are (the implementation gets its indexer inputs on its device), not where the
    seeded inputs were drawn. The ``meta`` device stands in for a GPU."""
    import torch

    c = case("one-long", 1, "sparse", width=4, dtype="float32")
    seen = {}

    def reference(q, k, v, iq, iw, ik, ids, topk, **kw):
        seen.update(q=q.device, iq=iq.device, iw=iw.device, ik=ik.device)
        return (q,)

    mix = SPECS["sparse"].reference_mix(reference, None, torch.float32, case=c)
    B, S, H, D = c.batch_size, c.seq_len, c.hq, c.dim
    latent = torch.empty(B, S, D + 2, device="meta")

    def expand(rows):
        return rows.new_empty(rows.shape[0], H, D), rows.new_empty(rows.shape[0], H, D + 1)

    mix(torch.empty(B, H, S, D, device="meta"), latent, expand)
    assert seen == {"q": torch.device("meta"), "iq": torch.device("meta"), "iw": torch.device("meta"),
                    "ik": torch.device("meta")}
