"""`python -m ragattn eval`: argument errors, the method registry, the metrics, and one tiny end-to-end
run with SmolLM2 (3 questions, top-2, a few methods)."""
import json

import pytest

from ragattn.apps import eval as ev
from ragattn.__main__ import main as cli_main
from ragattn.apps.corpus import token_f1


@pytest.mark.parametrize("argv, msg", [
    (["--top-k", "0"], "--top-k needs integers >= 1"),
    (["--top-k", "8,x"], "comma-separated list of integers"),
    (["--ratios", "15,150"], "in [0, 100]"),
    (["--ratios", "nan"], "in [0, 100]"),
    (["--ratios", "a"], "list of percentages"),
    (["--limit", "-1"], "--limit must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--fusion-neighbours", "-2"], "--fusion-neighbours must be >= 0"),
    (["--methods", "fusionrag,nope"], "unknown method(s) ['nope']"),
])
def test_bad_arguments_exit_2_with_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        ev.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: python -m ragattn eval: ") and err.count("\n") == 1 and msg in err, err


def test_run_errors_exit_2(tmp_path, capsys):
    for argv, msg in [(["--corpus", str(tmp_path / "absent")], "is not a folder"),
                      (["--top-k", "500"], "exceeds the corpus's"),
                      (["--model", "gpt-17"], "unsupported model 'gpt-17'")]:
        assert cli_main(["eval", "--no-progress", "--out", str(tmp_path / "o"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and msg in err, err


def test_registry_resolves_present_methods_and_skips_absent_modules():
    avail = ev.available_methods()
    assert ev.BASELINE in avail and {"turborag-composite", "turborag-reordered", "block-attention"} <= set(avail)
    names = [m.name for m in ev.REGISTRY]
    assert len(names) == len(set(names))
    # ablations run only when named
    assert "fusionrag-standalone" in avail and "fusionrag-standalone" not in ev.parse_args([]).methods
    assert ev.parse_args(["--methods", "fusionrag-standalone"]).methods == [ev.BASELINE, "fusionrag-standalone"]
    ghost = ev.Method("ghost", "ragattn.methods.not_written_yet", "answer")
    assert ghost.resolve() is None and "ghost" not in ev.available_methods((*ev.REGISTRY, ghost))
    assert ev.Method("m", "ragattn.methods.generate", "not_there").resolve() is None  # no such function
    # an import failing on something other than the method's own module (a missing dependency) raises
    with pytest.raises(ModuleNotFoundError):
        ev.Method("x", "ragattn.nonexistent_pkg.mod", "f").resolve()


def test_token_f1_squad_style():
    assert token_f1("The Tallowmere.", ["Tallowmere"]) == 1.0
    assert token_f1("It was Saltcombe Reach", ["Saltcombe Reach"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert token_f1("no idea", ["Lusk", "Morl"]) == 0.0
    assert token_f1("", ["Lusk"]) == 0.0
    assert token_f1("green and black", ["green and black", "green"]) == 1.0


@pytest.fixture(scope="module")
def model_tok(request):
    try:
        return request.getfixturevalue("smollm2")
    except pytest.FixtureLookupError:  # pragma: no cover
        pytest.skip("no smollm2 fixture")


def test_eval_end_to_end_tiny(model_tok, tmp_path):
    methods = [m for m in ("block-attention", "fusionrag", "cacheblend") if m in ev.available_methods()]
    args = ev.parse_args(["--limit", "3", "--top-k", "2", "--ratios", "0,100", "--max-new-tokens", "2",
                          "--methods", ",".join(methods), "--fusion-neighbours", "2", "--no-progress",
                          "--out", str(tmp_path)])
    res = ev.run(args, model_and_tokenizer=model_tok)
    rows, aggs = res["rows"], res["aggregates"]
    ratio_methods = [m for m in methods if m in ("fusionrag", "cacheblend")]
    per_q = 1 + (len(methods) - len(ratio_methods)) + 2 * len(ratio_methods)
    assert len(rows) == 3 * per_q
    assert {r["question_id"] for r in rows} == {"e001", "e002", "e003"}
    for r in rows:
        assert r["ttft_ms"] > 0 and r["context_tokens"] > 100 and 0 <= r["f1"] <= 1
        if r["method"] == ev.BASELINE:
            assert r["kl"] == 0 and r["first_token_match"] and r["answer_match"] and r["speedup"] == 1
    for m in ratio_methods:  # at 100% recompute the method is full attention again
        full = [r for r in rows if r["method"] == m and r["ratio"] == 100]
        assert len(full) == 3 and all(r["first_token_match"] and r["kl"] < 1e-4 for r in full), full
    assert {(a["method"], a["ratio"]) for a in aggs} == {(r["method"], r["ratio"]) for r in rows}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["questions"] == 3 and len(saved["rows"]) == len(rows)
    md = (tmp_path / "results.md").read_text()
    assert "## top-2" in md and "| full-prefill | - |" in md
    assert (tmp_path / "results.png").stat().st_size > 10_000


def test_report_names_the_corpus_without_a_machines_folders(tmp_path, monkeypatch):
    from ragattn.apps.corpus import EVAL_CORPUS
    from ragattn.apps.eval import shown_path

    assert shown_path(EVAL_CORPUS) == "ragattn/data/qa_eval"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    assert shown_path(tmp_path / "mine") == "mine"
