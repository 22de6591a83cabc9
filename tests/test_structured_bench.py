"""`bench/structured_bench.py` on a tiny budget (llguidance only, 5 tokens, batch 1, 3 steps), so the
bench cannot rot: every row it writes is there, with its keys, and its times are positive."""
import json

import pytest
from bench import structured_bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_rows_are_sane():
    lines = []
    rows = structured_bench.run(["llguidance"], [1], num_tokens=5, steps=3, rounds=1, repeats=2,
                                emit=lines.append)
    assert [json.loads(line) for line in lines] == rows
    engine = {(r["what"], r.get("schema")): r for r in rows if r["bench"] == "engine"}
    assert sorted(engine, key=str) == sorted(
        [("import", None), ("tokenizer", None), ("compile", "person"), ("walk", "person"),
         ("compile", "json_object"), ("walk", "json_object")], key=str)
    assert engine["import", None]["s"] > 0 and engine["tokenizer", None]["ms"] > 0
    for schema in structured_bench.SCHEMAS:
        assert engine["compile", schema]["ms"] > 0
        walk = engine["walk", schema]
        assert walk["tokens"] == 5 and walk["refused"] == 0
        assert all(walk[k][s] > 0 for k in ("mask_us", "accept_us") for s in ("median", "p90", "mean"))
    masks = {r["grammar"]: r for r in rows if r["bench"] == "mask_cost"}
    assert sorted(masks) == ["person", "text"]
    for r in masks.values():
        assert r["batch"] == 1 and min(r["fill_ms"], r["apply_ms"], r["advance_ms"]) > 0
        assert r["total_ms"] == pytest.approx(r["fill_ms"] + r["apply_ms"] + r["advance_ms"])
    (step,) = [r for r in rows if r["bench"] == "engine_step"]
    assert step["batch"] == 1 and step["plain_ms"] > 0 and step["grammar_ms"] > 0
    assert step["added_ms"] == pytest.approx(step["grammar_ms"] - step["plain_ms"])


def test_an_engine_that_does_not_import_is_reported_and_skipped(monkeypatch):
    class Missing(structured_bench.Llguidance):
        name = module = "glmc_no_such_grammar_engine"
    monkeypatch.setitem(structured_bench.ENGINES, "missing", Missing)
    (row,) = structured_bench.engine_rows(["missing"], None, 4096, num_tokens=5, repeats=1)
    assert row["engine"] == "missing" and row["error"].startswith("not importable")
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        structured_bench.run(["nope"], [], 5, 1, 1, 1, emit=print)
