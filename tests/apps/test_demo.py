"""`python -m ragattn demo` on a reduced question set, and its error paths."""
import io

import pytest
import torch

from ragattn.apps import demo
from ragattn.__main__ import main as cli_main

pytestmark = pytest.mark.slow  # minutes: `pytest -m "not slow"` skips it for a quick run


@pytest.fixture(scope="module")
def model_tok(request):
    try:
        return request.getfixturevalue("smollm2")  # shared session fixture (tests/conftest.py)
    except pytest.FixtureLookupError:
        return demo.load_model("smollm2", "cpu")


def test_demo_runs_and_agrees_with_baseline(model_tok):
    args = demo.parse_args(["--limit", "2", "--max-new-tokens", "8", "--no-progress", "--top-k", "3", "--repeats", "1"])
    out = io.StringIO()
    rows = demo.run(args, model_and_tokenizer=model_tok, out=out)
    text = out.getvalue()
    assert "| full-prefill |" in text and "aggregate per method" in text
    base = [r for r in rows if r.method == "full-prefill"]
    assert len(base) == 2 and all(r.kl == 0 and r.first_token_match for r in base)
    assert sum(r.em for r in base) >= 1  # the real model answers the shipped questions
    methods = {r.method for r in rows}
    assert methods == set(demo.METHOD_NAMES) and len(rows) == 2 * len(methods)  # none skipped
    for r in rows:
        assert r.ttft_ms > 0 and r.context_tokens > 100
    # every method that ran is exact w.r.t. its own definition, so it stays close to the baseline
    # on the first token for at least one question (they differ from full prefill by the mask only)
    # (REFRAG approximates the context by chunk embeddings: without a trained projector it is not
    # close to the baseline, and the report says so)
    for m in methods - {"full-prefill", "refrag"}:
        assert any(r.first_token_match for r in rows if r.method == m), m
    assert "note: refrag: k = 16, " in text
    if "UNTRAINED PROJECTOR" not in text:
        assert "the shipped weights" in text or "trained checkpoint" in text


def test_demo_user_question(model_tok):
    args = demo.parse_args(["--question", "Which planet has rings of ice and rock?", "--method", "full-prefill",
                            "--max-new-tokens", "4", "--no-progress", "--top-k", "2", "--repeats", "2"])
    out = io.StringIO()
    rows = demo.run(args, model_and_tokenizer=model_tok, out=out)
    assert [r.method for r in rows] == ["full-prefill"] and "| user1 |" in out.getvalue()


def test_demo_errors(tmp_path, capsys):
    assert cli_main(["demo", "--corpus", str(tmp_path / "absent")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli_main(["demo", "--model", "gpt-17"]) == 2
    assert "unsupported model 'gpt-17'" in capsys.readouterr().err
    assert cli_main(["demo", "--method", "nope"]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert cli_main(["bogus"]) == 2


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def test_demo_bad_device_is_a_one_line_error(capsys):
    assert cli_main(["demo", "--device", "xyz", "--no-progress"]) == 2
    _one_line_error(capsys, "unknown device 'xyz'")
    assert cli_main(["demo", "--device", "meta", "--no-progress"]) == 2
    _one_line_error(capsys, "not supported")


def test_demo_passage_longer_than_the_window(model_tok, tmp_path, capsys, monkeypatch):
    import json

    long_text = " ".join(f"word{i % 50}" for i in range(9000))      # > SmolLM2's 8192 positions
    (tmp_path / "passages.jsonl").write_text(
        json.dumps({"id": "p1", "title": "Long", "text": long_text}) + "\n"
        + json.dumps({"id": "p2", "title": "Short", "text": "Mars has two moons."}) + "\n")
    (tmp_path / "questions.jsonl").write_text(
        json.dumps({"id": "q1", "question": "How many moons has Mars?", "answers": ["two"]}) + "\n")
    monkeypatch.setattr(demo, "load_model", lambda name, device: model_tok)
    assert cli_main(["demo", "--corpus", str(tmp_path), "--top-k", "2", "--no-progress"]) == 2
    _one_line_error(capsys, "question q1", "exceeds the model's window (8192 tokens)")


def test_report_columns_and_reading():
    """Selection and recompute times are columns (a dash where a method has none), timings say how
    many runs they are the median of, and a line under the tables says how to read them."""
    def row(method, **kw):
        return demo.Row(question_id="q1", question="?", method=method, context_tokens=1600, ttft_ms=100.0,
                        speedup=2.0, answer="a", first_token_match=True, kl=0.0, em=True, repeats=3, **kw)

    text = demo.format_report([row("full-prefill"), row("fusionrag", select_ms=12.5, recompute_ms=40.0)],
                              ["full-prefill", "fusionrag"], has_gold=True, model_name="m", device="cpu", top_k=20)
    assert "| select ms | recompute ms |" in text and "median of 3 run(s)" in text
    assert "| 2.00x TTFT | - | - |" in text and "| 2.00x TTFT | 12.5 | 40.0 |" in text
    reading = [ln for ln in text.splitlines() if ln.startswith("reading: ")]
    assert len(reading) == 1
    for needle in ("1st tok", "KL", "EM", "decode", "REFRAG needs a trained"):
        assert needle in reading[0], needle


def test_median_result_keeps_the_first_answer():
    t = torch.zeros(3)
    runs = [demo.Result(0.3, t, [1, 2], 10.0, select_s=0.1), demo.Result(0.1, t, [1], float("nan"), select_s=0.3),
            demo.Result(0.2, t, [1], float("nan"), select_s=0.2)]
    res = demo.median_result(runs)
    assert res.tokens == [1, 2] and res.ttft_s == 0.2 and res.decode_tps == 10.0 and res.select_s == 0.2
    assert res.recompute_s != res.recompute_s   # none measured: NaN, shown as "-"
