"""python -m verify model's console report: a refusal printed once with its count, layers and pages; table cells cut
at word boundaries; what each case exercised (windows, chunks, sinks, softcaps, mixers) described."""

import io

import pytest

from verify.model.check import ModelCase, ModelResult
from verify.model.cli import _refusals, _summary, clip, report_result
from verify.model.harness import describe_exercised, exercised
from rich.console import Console

REFUSAL = ("UnsupportedLayerError: blockdiag_dist: layer 'model.layers.0.mamba' (JambaMambaMixer) is not computed per "
           "document under CP: it is a Mamba selective-scan state-space mixer (a recurrent state and a causal convolution)")


def results(n_cp=(1, 2), dtypes=("float64", "float32"), layouts=("spans-every-rank", "many-short")):
    return [ModelResult(ModelCase(model="jamba", args=("--model", "jamba", "--tiny"), cp=cp, layout=lay, dtype=dt),
                        "unsupported", why="UnsupportedLayerError on every rank", message=REFUSAL)
            for cp in n_cp for dt in dtypes for lay in layouts]


def console():
    buf = io.StringIO()
    return Console(file=buf, width=200), buf


def test_a_refusal_is_printed_once_then_summarised_with_its_count_layers_and_pages():
    c, buf = console()
    rs = results()
    seen: set[str] = set()
    for r in rs:
        report_result(c, r, seen)
    _refusals(c, rs, {"jamba": ["JambaMambaMixer x4 (mamba)"]})
    text = buf.getvalue()
    assert text.count("is not computed per") == 2, text  # the first case in full, the summary's one clipped line
    assert "unsupported in 8 case(s) of jamba (CP 1, 2; float32, float64; layouts many-short, spans-every-rank)" in text
    assert "layers refused under CP: JambaMambaMixer x4 (mamba)" in text
    assert "docs/hybrid.md#what-is-not-here-yet" in text and "docs/hybrid.md#adding-a-recurrence-the-extension-point" in text


def test_distinct_refusals_are_each_printed():
    c, buf = console()
    other = ModelResult(ModelCase(model="bloom", args=("--model", "bloom"), cp=2, layout="many-short"), "unsupported",
                        why="x", message="UnsupportedAttentionError: ALiBi")
    seen: set[str] = set()
    for r in [*results(), other]:
        report_result(c, r, seen)
    text = buf.getvalue()
    assert text.count("UNSUPPORTED") == 2 and "UNSUPPORTED bloom cp2 many-short" in text


@pytest.mark.parametrize("text, width, want", [
    pytest.param("short", 20, "short", id="fits"),
    pytest.param("is not computed per document under CP", 22, "is not computed...", id="word-boundary"),
    pytest.param("a b,  c   d", 20, "a b, c d", id="spaces-folded"),
])
def test_clip_cuts_at_a_word_boundary(text, width, want):
    assert clip(text, width) == want
    assert len(clip(text, width)) <= width


def test_summary_table_cell_does_not_cut_a_word():
    c, buf = console()
    _summary(c, results(n_cp=(1,), dtypes=("float64",), layouts=("many-short",)), ["jamba"], {"jamba": {}})
    assert "computed per docu\\n" not in buf.getvalue().replace("\n", "\\n")
    assert "..." in buf.getvalue()


class _State:
    attention_calls = 3
    attention_kinds = {(-1, -1, False, None), (7, -1, True, None), (-1, 8, False, 50.0)}

    class guard:  # noqa: N801 - the state's attribute
        per_document = ["Qwen3NextGatedDeltaNet"]


def test_exercised_describes_windows_chunks_variants_and_mixers():
    ex = exercised(_State())
    assert ex == {"attention_calls": 3, "windows": [-1, 7], "chunks": [8], "sinks": True, "softcaps": [50.0],
                  "mixers": ["Qwen3NextGatedDeltaNet"]}
    assert describe_exercised(ex) == "causal, window 7; chunks of 8; sinks; softcap 50; mixers Qwen3NextGatedDeltaNet"
    assert exercised(object()) == {} and describe_exercised({}) == ""
