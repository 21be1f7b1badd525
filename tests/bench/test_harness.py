"""The benchmark harness's own logic on the CPU: impossible figures raise with the
case's name, the bytes a case counts are bytes its call sees, every case binds its own inputs,
the commit comes from ragattn's own repository only, and ``bench.tune`` refuses a CPU, enumerates
its sweep and writes its table (with a fake timer)."""
import json
import os
import shutil
import subprocess

import pytest
import torch

from bench import harness, provenance, tune
from bench.harness import BytesNotTouched, Case, PeakExceeded

CPU = torch.device("cpu")


@pytest.fixture
def fixed_peaks(monkeypatch):
    monkeypatch.setattr(harness, "measured_copy_bandwidth", lambda device: 10.0)  # GB/s
    monkeypatch.setattr(harness, "measured_matmul_tflops", lambda device, dtype=None: 1.0)  # TFLOP/s


def _case(nbytes, flops=None, peak="copy", **kw):
    x = torch.ones(1024)  # 4096 bytes
    return Case("fam", "the_case", run=lambda: x.add_(1.0), bytes=nbytes, flops=flops, peak=peak, **kw)


def test_over_100_percent_of_the_copy_peak_raises_with_the_case_name(fixed_peaks, monkeypatch):
    monkeypatch.setattr(harness, "time_us", lambda fn, device, **kw: 0.1)  # 4096 B in 0.1 us: 41 GB/s > 10
    with pytest.raises(PeakExceeded, match=r"fam/'the_case' \(ragattn\): 410% of the measured copy peak"):
        harness.measure_case(_case(4096), CPU)
    monkeypatch.setattr(harness, "time_us", lambda fn, device, **kw: 1.0)  # 4.1 GB/s: 41%
    rows = harness.measure_case(_case(4096), CPU)
    assert rows[0]["pct_peak"] == pytest.approx(40.96)


def test_over_100_percent_of_the_matmul_peak_raises(fixed_peaks, monkeypatch):
    monkeypatch.setattr(harness, "time_us", lambda fn, device, **kw: 1.0)
    with pytest.raises(PeakExceeded, match="the_case.*matmul peak"):
        harness.measure_case(_case(None, flops=2e6, peak="matmul"), CPU)  # 2 TFLOP/s > 1
    assert harness.measure_case(_case(None, flops=5e5, peak="matmul"), CPU)[0]["pct_peak"] == pytest.approx(50.0)


def test_a_baseline_over_the_peak_raises_too(fixed_peaks, monkeypatch):
    times = iter([1.0, 0.01])  # ragattn 41%, the baseline 4096%
    monkeypatch.setattr(harness, "time_us", lambda fn, device, **kw: next(times))
    with pytest.raises(PeakExceeded, match=r"\(slow\)"):
        harness.measure_case(_case(4096, baselines={"slow": lambda: None}), CPU)


def test_bytes_beyond_what_the_call_sees_raise():
    """4096 bytes of tensor; counting 8192 is only allowed for a two-pass case."""
    with pytest.raises(BytesNotTouched, match="the_case.*counts 8192 bytes.*4096 bytes"):
        harness.check_bytes_touched(_case(8192))
    harness.check_bytes_touched(_case(8192, passes=2))
    harness.check_bytes_touched(_case(4096))


def test_touched_bytes_sees_list_arguments_and_outputs():
    import ragattn

    layers = [torch.randn(6, 2, 8) for _ in range(3)]  # 3 x 384 B
    rows = torch.tensor([1, 4])  # 16 B
    delta = torch.tensor([3, -2], dtype=torch.int32)  # 8 B
    inv_freq = torch.rand(4)  # 16 B
    got = harness.touched_bytes(lambda: ragattn.rerotate_keys_(layers, rows, delta, inv_freq, 8, False))
    assert got == 3 * 384 + 16 + 8 + 16
    a = torch.randn(5, 7)
    assert harness.touched_bytes(lambda: a @ a.T) == 140 + 100  # input and the new output


def test_kv_cache_cases_bind_their_own_inputs():
    """Lambdas built in a loop run the last shape's inputs unless each binds its own. Each case's
    call must see at least the bytes it counts (the check raises on the pre-fix module), and the
    large shape's call must touch more than the small one's."""
    from bench import bench_kv_cache

    cases = {c.name: c for spec in bench_kv_cache.cases(CPU, "cpu") for c in spec.build_all()}
    for c in cases.values():
        harness.check_bytes_touched(c)
    big, small = (harness.touched_bytes(cases[f"copy_kv_ {t}"].run) for t in ("N256", "chunk32"))
    assert big > 4 * small
    assert cases["copy_kv_ N256"].config()["rows"] == 256 and cases["copy_kv_ chunk32"].config()["rows"] == 32


def test_every_case_counts_bytes_its_call_sees():
    """What ``measure_case`` checks before timing, for every small case of every family."""
    checked = 0
    for c in harness.collect_cases(CPU, "cpu"):
        if c.bytes is not None:
            harness.check_bytes_touched(c)
            checked += 1
    assert checked >= 15


def test_the_table_shows_config_and_wall_columns():
    row = dict(family="f", case="c", impl="ragattn", time_us=2.0, speedup_of_ragattn=1.0, wall_us=3.5,
               config={"BLOCK_M": 64, "num_warps": 4})
    text = harness.format_table([row])
    assert "synced wall (us)" in text and "| 3.5 | BLOCK_M=64 num_warps=4 |" in text


# ---------------------------------------------------------------------------------------------
# provenance: ragattn's own commit only
def _copy_tree(dst):
    root = provenance.source_root()
    for m in provenance._MARKERS:
        os.makedirs(os.path.join(dst, os.path.dirname(m)), exist_ok=True)
        shutil.copy(os.path.join(root, m), os.path.join(dst, m))
    return str(dst)


def _git(cwd, *args):
    subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_copy_inside_another_repository_does_not_report_its_commit(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    (other / "f.txt").write_text("x")
    _git(other, "add", "f.txt")
    _git(other, "commit", "-qm", "other")
    copy = _copy_tree(other / "vendored" / "ragattn_copy")
    assert provenance.git_commit(copy) is None
    assert provenance.project_commit(copy, env={}) == "unknown"
    assert provenance.project_commit(copy, env={"RAGATTN_COMMIT": "abc1234"}) == "abc1234"
    with open(os.path.join(copy, "RAGATTN_COMMIT"), "w") as f:
        f.write("def5678\n")
    assert provenance.project_commit(copy, env={}) == "def5678"
    assert provenance.project_commit(copy, env={"RAGATTN_COMMIT": "abc1234"}) == "abc1234"  # env first


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_ragattn_own_repository_reports_its_commit(tmp_path):
    repo = _copy_tree(tmp_path / "ragattn")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "ragattn")
    head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert provenance.project_commit(repo, env={"RAGATTN_COMMIT": "ignored"}) == head
    with open(os.path.join(repo, "ragattn", "__init__.py"), "a") as f:
        f.write("# edit\n")
    assert provenance.project_commit(repo, env={}) == head + "-dirty"


def test_a_tree_that_is_not_ragattn_is_never_asked(tmp_path):
    assert provenance.git_commit(str(tmp_path)) is None
    assert provenance.project_commit(str(tmp_path), env={}) == "unknown"


# ---------------------------------------------------------------------------------------------
# bench.tune on the CPU: refuses to time, enumerates, writes
def test_tune_refuses_a_cpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["varlen_attention"]) == 2
    assert "refusing to tune on this machine (no CUDA GPU" in capsys.readouterr().err


def test_tune_lists_its_sweep(capsys):
    assert tune.main(["key_attention_scores", "--keys", "16bit/d128", "--list", "--max-candidates", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("key_attention_scores 16bit/d128: ") and out.count("{'BLOCK_M'") == 2


def test_sweep_enumeration_respects_shared_memory():
    fwd128 = tune.varlen_candidates("fwd/16bit/d128")
    fwd256 = tune.varlen_candidates("fwd/16bit/d256")
    assert dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3) in fwd128  # the FA-style anchor
    assert dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True) in fwd128
    assert not any(c.get("tma") for c in tune.varlen_candidates("dq/16bit/d128"))
    # nearest the anchors first: a short lease times the plausible ones
    assert fwd128[:2] == [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                          dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True)]
    assert tune.key_attention_scores_candidates("16bit/d128")[0] == tune.ANCHORS["key_attention_scores"]
    assert tune.varlen_candidates("dkdv/16bit/d128")[0] == tune.ANCHORS["bwd"]
    assert dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4) not in fwd256  # 320 KB of tiles
    assert all(tune._smem_bytes(c["BLOCK_M"], c["BLOCK_N"], 256, c["num_stages"], 2) <= tune.SMEM_LIMIT for c in fwd256)
    assert len(fwd256) < len(fwd128)
    for fam in tune.FAMILIES.values():
        for key in fam.keys:
            cands = fam.candidates(key)
            assert cands and len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands), key


def test_sweep_picks_the_fastest_and_skips_failures():
    cands = [dict(a=1), dict(a=2), dict(a=3), dict(a=4)]
    times = {1: 5.0, 2: 3.0, 3: None, 4: 3.0}

    def timer(cfg):
        t = times[cfg["a"]]
        if t is None:
            raise RuntimeError("out of resources: shared memory")
        return t

    log = []
    best, timings = tune.sweep(cands, timer, log.append)
    assert best == dict(a=2) and [c["a"] for c, _ in timings] == [1, 2, 4]
    assert any("skip {'a': 3}: RuntimeError: out of resources" in line for line in log)
    assert tune.sweep([dict(a=3)], timer)[0] is None


def test_tune_writes_the_table_entry(tmp_path):
    """The fake timer favours one candidate per key; the entry lands under the device's name, merged
    into a copy of the committed table (default and other devices kept), and the launchers read it."""
    from ragattn.triton_kernels import gpu_configs

    fam = tune.FAMILIES["key_attention_scores"]
    want = {"16bit/d128": fam.candidates("16bit/d128")[5], "16bit/d64": fam.candidates("16bit/d64")[0]}

    def timer(key, cfg):
        return 1.0 if cfg == want[key] else 2.0

    results = tune.tune_family(fam, list(want), timer, log=lambda s: None)
    assert {k: r["config"] for k, r in results.items()} == want
    path = gpu_configs.write_entry(fam.name, "Fake GPU 9000", {k: r["config"] for k, r in results.items()},
                                   tune.source_text("Fake GPU 9000", "abc1234", results), folder=str(tmp_path))
    table = json.load(open(path))
    committed = json.load(open(gpu_configs.table_path(fam.name, gpu_configs.CONFIG_DIR)))
    assert set(table["devices"]) == set(committed["devices"]) | {"Fake GPU 9000"}
    entry = table["devices"]["Fake GPU 9000"]
    assert entry["configs"] == want and "commit abc1234" in entry["source"] and "16bit/d128 1.0 us" in entry["source"]
    old = os.environ.get("RAGATTN_CONFIG_DIR")
    os.environ["RAGATTN_CONFIG_DIR"] = str(tmp_path)
    try:
        gpu_configs.clear_cache()
        assert gpu_configs.get_config(fam.name, "Fake GPU 9000", "16bit/d128") == want["16bit/d128"]
        assert gpu_configs.get_config(fam.name, "Fake GPU 9000", "16bit/d256") == committed["devices"]["default"]["configs"]["16bit/d256"]
        # a second run merges: the d64 key stays, d128 changes
        gpu_configs.write_entry(fam.name, "Fake GPU 9000", {"16bit/d128": want["16bit/d64"]}, "again", folder=str(tmp_path))
        entry = json.load(open(path))["devices"]["Fake GPU 9000"]
        assert entry["configs"] == {"16bit/d128": want["16bit/d64"], "16bit/d64": want["16bit/d64"]}
        assert entry["source"].startswith("again (keys: 16bit/d128); other keys: measured")
    finally:
        if old is None:
            os.environ.pop("RAGATTN_CONFIG_DIR")
        else:
            os.environ["RAGATTN_CONFIG_DIR"] = old
        gpu_configs.clear_cache()


def test_a_row_over_the_peak_remeasures_the_peak_before_raising(monkeypatch):
    """A peak measured while the machine was busy is too low: the row is checked against a fresh
    measurement, and raises only if it still passes 100%."""
    case = _case(4096)
    row = {"impl": "ragattn", "GB/s": 41.0, "pct_peak": 410.0, "time_us": 0.1}
    monkeypatch.setattr(harness, "measured_copy_bandwidth", lambda device: 50.0)
    harness.check_peak(case, row, CPU)
    assert row["pct_peak"] == pytest.approx(82.0)
    row["pct_peak"] = 410.0
    monkeypatch.setattr(harness, "measured_copy_bandwidth", lambda device: 20.0)
    with pytest.raises(PeakExceeded, match="205%"):
        harness.check_peak(case, row, CPU)


def test_a_row_a_little_over_the_measured_peak_stands(monkeypatch):
    """torch's copy is not the hardware's limit: SDPA's decode read 3086 GB/s where an H100's copy
    measured 3020 (102%), and stopped the whole paged_attention family. Up to 125% stands."""
    case = _case(4096)
    monkeypatch.setattr(harness, "measured_copy_bandwidth", lambda device: 3020.0)
    row = {"impl": "sdpa", "GB/s": 3086.0, "pct_peak": 102.2, "time_us": 1391.7}
    harness.check_peak(case, row, CPU)
    assert row["pct_peak"] == pytest.approx(100 * 3086 / 3020)
    row.update({"GB/s": 3900.0, "pct_peak": 129.1})
    with pytest.raises(PeakExceeded, match="129%"):
        harness.check_peak(case, row, CPU)


# ---------------------------------------------------------------------------------------------
# FlexAttention baselines: compiled on CUDA (checked), the window one computes the window
def test_the_flex_backward_baseline_requires_a_compiled_graph():
    from bench.bench_varlen_attention import require_compiled_graph

    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="did not run a compiled graph"):
        require_compiled_graph(x * 2)
    require_compiled_graph(torch.compile(lambda t: t * 2, backend="aot_eager", fullgraph=True)(x))


def test_flex_window_baseline_computes_the_window():
    """The sliding-window FlexAttention baseline (a window mask_mod) gives ragattn's output (on the
    CPU it runs eagerly: its time means nothing, its values do)."""
    from bench import bench_varlen_attention as bva

    case = bva._window_case(CPU, "cpu", harness.Rand(CPU, 1))
    assert {"flex_attention_window", "sdpa_dense_band_mask"} <= set(case.baselines)
    out, _ = case.run()
    for name in ("flex_attention_window", "sdpa_dense_band_mask"):
        got = case.baselines[name]()[0].transpose(0, 1)  # [1, H, L, D] -> [L, H, D]
        assert (got.float() - out.float()).abs().max() < 1e-4, name


def test_the_runner_keeps_every_row_and_skips_only_the_failing_case(tmp_path, monkeypatch, fixed_peaks):
    """``python -m bench``: each row reaches results.jsonl as soon as it is measured; a case whose
    build or measurement raises (here: an impossible byte count, then a build error) is recorded with
    its error and skipped, the next case still runs; only the cases asked for are built, and
    ``--resume`` skips the cases already measured."""
    import types

    from bench import __main__ as runner

    built = []

    def make(name, fail=None):
        def build():
            built.append(name)
            if fail == "build":
                raise MemoryError("no room for the inputs")
            x = torch.ones(1024)
            return Case("zz", name, run=lambda: x.add_(1.0), bytes=4096 if fail != "peak" else 4096e6)
        return harness.LazyCase("zz", name, build)

    fake = types.SimpleNamespace(__name__="bench.bench_fake", FAMILIES=("zz",),
                                 cases=lambda device, size: [make("a"), make("b", "peak"), make("c", "build"),
                                                             make("d"), make("skipped_e")])
    monkeypatch.setattr(harness, "load_modules", lambda: [fake])
    monkeypatch.setattr(harness, "time_us", lambda fn, device, **kw: 1.0)
    out = tmp_path / "res"
    rc = runner.main(["--device", "cpu", "--only", "a,b,c,d", "--out", str(out)])
    assert rc == 1 and built == ["a", "b", "c", "d"]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert "meta" in records[0]
    got = [(r.get("key"), "error" in r) for r in records[1:]]
    assert got == [("a", False), ("b", True), ("c", True), ("d", False)], got
    assert "BytesNotTouched" in records[2]["error"] and "MemoryError" in records[3]["error"]
    md = (out / "results.md").read_text()
    assert "| zz | a |" in md and "| zz | d |" in md and "## Cases that failed" in md and "zz/b" in md
    built.clear()
    runner.main(["--device", "cpu", "--only", "a,b,c,d", "--out", str(out), "--resume"])
    assert built == ["b", "c"]   # a and d are in results.jsonl already


def test_rand_makes_inputs_on_the_device_from_its_seed():
    a, b = harness.Rand(CPU, 3), harness.Rand(CPU, 3)
    x = a.randn(4, 5, dtype=torch.bfloat16)
    assert x.dtype == torch.bfloat16 and x.shape == (4, 5) and torch.equal(x, b.randn(4, 5, dtype=torch.bfloat16))
    assert not torch.equal(a.randn(4, 5), harness.Rand(CPU, 4).randn(4, 5))
