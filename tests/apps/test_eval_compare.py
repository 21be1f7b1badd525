"""eval-compare: two eval runs side by side, refused when they answered different questions."""
import json
import random

import pytest

from ragattn.apps import eval as ev
from ragattn.apps import eval_compare as ec


def _run(seed, methods=("full-prefill", "block-attention"), questions=("e1", "e2", "e3"), commit="abc"):
    rng = random.Random(seed)
    rows = [ev.Row(top_k=k, question_id=q, multi_hop=i % 2 == 1, support_retrieved=True, method=m, ratio=None,
                   context_tokens=500 + k, ttft_ms=rng.uniform(5, 50), speedup=rng.uniform(1, 9), answer="x",
                   em=rng.random() < 0.6, f1=rng.random(), first_token_match=m == "full-prefill" or rng.random() < 0.5,
                   kl=0.0 if m == "full-prefill" else rng.uniform(0.01, 1.0), answer_match=rng.random() < 0.5,
                   recomputed=None, select_ms=None)
            for k in (8, 16) for i, q in enumerate(questions) for m in methods]
    config = dict(command="python -m ragattn eval", commit=commit, date="2026-12-04 00:00 UTC", corpus="c",
                  questions=len(questions), multi_hop=1)
    return dict(config=config, aggregates=ev.aggregate(rows), rows=[r.__dict__ for r in rows])


def test_compare_pairs_and_table():
    before, after = _run(1), _run(2, methods=("full-prefill", "block-attention", "no-context"), commit="def")
    pairs = ec.compare(before, after)
    assert [(p["top_k"], p["method"]) for p in pairs] == [(8, "full-prefill"), (8, "block-attention"),
                                                          (16, "full-prefill"), (16, "block-attention")]
    b = {(a["top_k"], a["method"]): a for a in before["aggregates"]}
    assert pairs[1]["before"] is b[8, "block-attention"]
    text = ec.format_compare(pairs, before, after)
    assert "## top-8" in text and "## top-16" in text and "no-context" not in text
    p = pairs[1]
    want = f"{100 * p['before']['em']:.1f} -> {100 * p['after']['em']:.1f}"
    assert want in text.split("## top-16")[0]


def test_different_questions_are_refused():
    with pytest.raises(ec.CompareError, match="different questions"):
        ec.compare(_run(1), _run(2, questions=("e1", "e2")))


def test_cli(tmp_path, capsys):
    for name, seed in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(_run(seed)))
    assert ec.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "compare.md").read_text().startswith("# ragattn eval: before -> after")
    assert (tmp_path / "c" / "compare.png").stat().st_size > 5000
    capsys.readouterr()
    assert ec.main([str(tmp_path / "a"), str(tmp_path / "nope"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "results.json is missing" in err[0]
