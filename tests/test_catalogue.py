"""``python -m verify model --catalogue``: the sweep machinery.

- the parent gives every model a deadline: a child that hangs in a model or dies in one has that model classed
  ``hang`` / ``crash`` and the rest of its chunk runs in a new child (a fake child, no torch);
- who raised, from a traceback (``origin_of``);
- three model types through the real sweep in one pool session: one passes, one is refused on every rank, one
  cannot be built (transformers' own class does not take its default config), and the page keeps its hand-written
  part when regenerated.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from verify.model.catalogue import BEGIN, END, Supervisor, classify, origin_of, summarise, write_page

# a child that journals like verify.model.catalogue's: "ok*" pass, "stuck" never finishes, "dies" exits 3
FAKE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    names, journal = sys.argv[1].split(","), sys.argv[2]
    def put(item):
        with open(journal, "a") as f:
            f.write(json.dumps(item) + "\\n")
    for name in names:
        put({"event": "start", "name": name})
        if name == "stuck":
            time.sleep(600)
        if name == "dies":
            os._exit(3)
        put({"event": "done", "name": name, "record": {"entry": None, "build": None, "info": {}, "results": [],
                                                       "fake": name}})
""")


def test_supervisor_classes_a_hang_and_a_crash_and_runs_the_rest(tmp_path):
    seen = []
    sup = Supervisor(lambda names, journal: [sys.executable, "-c", FAKE_CHILD, ",".join(names), journal],
                     str(tmp_path), model_timeout=3.0, start_timeout=60.0, chunk=3, on_record=seen.append)
    records = sup.run(["ok1", "stuck", "ok2", "dies", "ok3", "ok4"])
    assert sorted(records) == ["dies", "ok1", "ok2", "ok3", "ok4", "stuck"]
    assert records["stuck"]["sweep_failure"]["kind"] == "hang"
    assert "--model-timeout" in records["stuck"]["sweep_failure"]["message"]
    assert records["dies"]["sweep_failure"]["kind"] == "crash"
    assert "exited with code 3" in records["dies"]["sweep_failure"]["message"]
    for name in ("ok1", "ok2", "ok3", "ok4"):  # the entries after a hang or a crash ran in a new child
        assert records[name].get("fake") == name
    assert classify(records["stuck"], [1, 2])[2]["class"] == "hang"
    assert len(seen) == 6


def test_origin_names_who_raised():
    tb = textwrap.dedent("""\
        --- rank 0 ---
        Traceback (most recent call last):
          File "/x/verify/pool.py", line 107, in _worker_main
          File "/x/site-packages/transformers/models/foo/modeling_foo.py", line 12, in forward
          File "/x/site-packages/torch/nn/functional.py", line 3, in linear
        RuntimeError: boom
        --- rank 1 ---
          File "/x/blockdiag_dist/guard.py", line 1, in f
        """)
    assert origin_of(tb) == ("transformers", "transformers/models/foo/modeling_foo.py:12 in forward")
    assert origin_of('File "/y/blockdiag_dist/guard.py", line 5, in before_call')[0] == "blockdiag_dist"
    assert origin_of("no traceback") == ("", "")


pytest.importorskip("transformers", reason="the catalogue sweep needs the hf extra (transformers)")


@pytest.mark.usefixtures("one_thread")
def test_sweep_classes_pass_refused_and_cannot_build(tmp_path):
    from verify.model.catalogue import sweep
    from verify.model.run import ModelSession

    journal = str(tmp_path / "journal.jsonl")
    names = ["qwen2", "rwkv", "llama4:causal-lm"]
    with ModelSession(case_timeout=180.0) as session:
        sweep(names, journal, cps=(1, 2), session=session)
    lines = [json.loads(line) for line in open(journal)]
    assert [x["event"] for x in lines] == ["start", "done"] * 3
    records = {x["name"]: x["record"] for x in lines if x["event"] == "done"}
    summary = summarise(records, [1, 2])
    rows = summary["rows"]
    assert rows["qwen2"]["class"] == "pass", rows["qwen2"]
    assert {r["class"] for r in rows["rwkv"]["per_cp"].values()} == {"refused"}
    assert "RwkvSelfAttention" in rows["rwkv"]["per_cp"]["2"]["message"]
    assert rows["rwkv"]["family"].startswith("an RWKV time-mixing layer")
    build = rows["llama4:causal-lm"]["per_cp"]["1"]
    assert build["class"] == "cannot build" and build["origin"] == "transformers", build
    assert summary["counts"]["2"] == {"pass": 1, "refused": 1, "cannot build": 1} and summary["silent"] == []

    page = tmp_path / "models.md"
    data = {"command": "python -m verify model --catalogue", "cps": [1, 2], "layout": "spans-every-rank",
            "rows": {"1": [[[1, 6], [2, 3]]], "2": [[[1, 12], [2, 6]]]}, "types": 3, "wall_seconds": 1.0, "stamp": "now",
            "environment": {"transformers": "5", "torch": "2", "python": "3"}, "summary": summary,
            "records": records}
    write_page(str(page), json.loads(json.dumps(data)))
    text = page.read_text()
    assert BEGIN in text and END in text and "`rwkv`" in text and "Silent failures found: none" in text
    page.write_text(text.replace("# Which models", "# Which models (edited by hand)"))
    write_page(str(page), json.loads(json.dumps(data)))
    assert "# Which models (edited by hand)" in page.read_text()  # the hand-written part survives


def test_update_merges_a_rerun_into_an_earlier_sweep_and_says_so(tmp_path):
    """--update: the earlier sweep's records stay, the re-run types replace theirs, in catalogue order; the page
    keeps the sweep's stamp and names the re-run; an earlier sweep at other CP sizes, or no --only, is refused."""
    import argparse

    from verify.model.catalogue import _earlier_records, entries, generated, merge_update

    names = [e.name for e in entries()]
    first, second = names[0], names[1]
    chosen, records = merge_update({second: {"v": "old"}, first: {"v": "old"}}, {second: {"v": "new"}})
    assert [e.name for e in chosen] == [first, second] and records == {first: {"v": "old"}, second: {"v": "new"}}

    path = tmp_path / "catalogue.json"
    path.write_text(json.dumps({"cps": [1, 2], "records": {}}))
    args = argparse.Namespace(only=first, json=str(path))
    assert _earlier_records(args, [1, 2])["cps"] == [1, 2]
    with pytest.raises(ValueError, match=r"expected results at CP sizes \[1, 4\].*got CP sizes \[1, 2\]"):
        _earlier_records(args, [1, 4])
    with pytest.raises(ValueError, match="expected --only"):
        _earlier_records(argparse.Namespace(only=None, json=str(path)), [1, 2])

    summary = summarise({}, [1, 2])
    data = {"command": "c", "cps": [1, 2], "layout": "spans-every-rank", "rows": {"1": [], "2": []}, "types": 0,
            "wall_seconds": 1700.0, "stamp": "then", "environment": {"transformers": "5", "torch": "2", "python": "3"},
            "summary": summary, "records": {}, "updates": [{"stamp": "now", "seconds": 24.0, "names": [first]}]}
    text = generated(data)
    assert "Measured then" in text and f"Re-run now (`--update`, 24 s): `{first}`." in text


# ---- the shrinker on the catalogue's awkward configs (meta device, no pools) ----------------------------------
@pytest.mark.parametrize("model, check", [
    pytest.param("bart", lambda c: c.decoder_layers == 2 and c.d_model == 64 and c.decoder_ffn_dim == 64, id="encoder-decoder-depth"),
    pytest.param("mamba2", lambda c: c.num_heads * c.head_dim == c.expand * c.hidden_size, id="mamba2-heads-x-dim"),
    pytest.param("bamba", lambda c: c.mamba_n_heads * c.mamba_d_head == c.mamba_expand * c.hidden_size, id="bamba-heads-x-dim"),
    pytest.param("inkling2", lambda c: c.vision_config.text_hidden_size == c.text_config.hidden_size, id="tied-width"),
    pytest.param("cwm", lambda c: c.hidden_size % c.num_attention_heads == 0, id="heads-divide-hidden"),
    pytest.param("bailing_hybrid", lambda c: c.num_hidden_layers < 42 and {"linear_attention", "full_attention"} <= set(c.layer_types),
                 id="config-rebuilt-differently"),
    pytest.param("kimi_linear", lambda c: c.linear_num_heads * c.linear_head_dim <= 64 and "linear_attention" in c.layer_types,
                 id="linear-attention-heads"),  # 32 heads of 128: a K x K state per head made its truth a minute a case
    pytest.param("glm5_next", lambda c: c.text_config.index_topk % c.text_config.index_kpool == 0,
                 id="pooled-indexer"),  # its config refuses a top-k that is not a multiple of the pool
    pytest.param("paligemma", lambda c: c.vision_config.num_hidden_layers == 2 and c.vision_config.projection_dim == 64,
                 id="parent-set-attribute"),
    pytest.param("gemma3n_text", lambda c: max(c.intermediate_size) <= 64 and c.vocab_size_per_layer_input == 128,
                 id="per-layer-widths"),
    pytest.param("evolla", lambda c: True, id="image-text-only-type-without-vision-config"),
])
def test_shrinker_builds_the_catalogues_awkward_configs(model, check):
    from verify.model.catalogue import MAX_PARAMETERS, _parameters
    from verify.model.zoo import meta_build, resolve

    p = resolve(model, tiny=True)
    assert check(p.config), p.tiny.changes
    size, _ = _parameters(meta_build(p.auto)(p.config))
    assert size < MAX_PARAMETERS


def test_a_case_judged_again_with_every_op_in_float64_is_classed_by_that_run():
    """The session judges a float64 difference at the model's own precision again with every op in float64
    (verify.model.run.with_exact_run) and keeps that run inside the case's result: a pass there is a pass that names
    the rounding, a failure there too is wrong, with the exact run's reason. An earlier sweep's record, whose exact
    run is a result of its own beside the case, is classed the same way."""

    def result(cls, exact, worst, why="", again=None, rounding=False):
        verdict = {"worst_grad": worst, **({"rounding_only": True} if rounding else {})}
        return {"case": {"cp": 2, "exact": exact}, "class": cls, "why": why, "message": "", "verdict": verdict,
                "packed": {"status": "ok"}, "notes": [], "reproduce": "python -m verify model ...", "details": "",
                "again": again or {}}

    exact_pass = result("pass", True, 8e-16)
    exact_bug = result("bug", True, 2e-3, why="first wrong module model.layers.0.self_attn")
    rounding = {"results": [result("pass", False, 3e-7, rounding=True, again=exact_pass)]}
    wrong = {"results": [result("bug", False, 2e-3, why="first wrong module x", again=exact_bug)]}
    earlier = {"results": [result("bug", False, 3e-7, why="first wrong module x"), exact_pass]}
    for record in (rounding, earlier):
        row = classify(record, [2])[2]
        assert row["class"] == "pass" and row["reason"].startswith("passes with every op in float64"), row
        assert "(worst gradient 3.0e-07)" in row["reason"], row
    row = classify(wrong, [2])[2]
    expected = "wrong with every op in float64 too: first wrong module model.layers.0.self_attn"
    assert row["class"] == "wrong" and row["reason"] == expected, row
