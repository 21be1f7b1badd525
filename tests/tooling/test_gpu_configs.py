"""The per-GPU config tables: lookup by device name and shape class, the heuristic
default for unknown GPUs and the interpreter, and the committed tables' own consistency."""
import glob
import json
import os
import re

import pytest
import torch

from ragattn.triton_kernels import gpu_configs
from ragattn.triton_kernels import key_attention_scores as kas
from ragattn.triton_kernels import varlen_attention as va

TABLES = sorted(glob.glob(os.path.join(gpu_configs.CONFIG_DIR, "*.json")))
H100 = "NVIDIA H100 80GB HBM3"


def _table(family):
    return json.load(open(gpu_configs.table_path(family, gpu_configs.CONFIG_DIR)))


@pytest.mark.parametrize("path", TABLES, ids=[os.path.basename(p) for p in TABLES])
def test_committed_tables_are_well_formed(path):
    table = json.load(open(path))
    assert table["family"] == os.path.basename(path)[:-5]
    devices = table["devices"]
    assert {"default", "interpreter"} <= set(devices)
    for name, entry in devices.items():
        assert entry["source"], name
        if name not in ("default", "interpreter"):
            # every GPU entry says whether it was measured (where: the commit) or modelled
            assert "modelled" in entry["source"] or re.search(r"measured .*commit [0-9a-f]{7}", entry["source"]), name
        for key, cfg in entry["configs"].items():
            assert cfg["num_warps"] in (1, 2, 4, 8, 16) and cfg["num_stages"] >= 1, (name, key)
            assert all(cfg[k] & (cfg[k] - 1) == 0 for k in ("BLOCK_M", "BLOCK_N")), (name, key)
            # a GPU entry's keys are shape classes the default knows (no typo falls back silently)
            assert name == "interpreter" or key in devices["default"]["configs"], (name, key)


@pytest.mark.parametrize("name, entry", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H200", "NVIDIA H200"),
    ("NVIDIA GH200 480GB", "NVIDIA H200"),
    ("NVIDIA A100-SXM4-80GB", "default"),
    ("Some Future GPU", "default"),
    (None, "interpreter"),
])
def test_device_names_find_their_entry(name, entry):
    for family in ("varlen_attention", "key_attention_scores", "paged_attention"):
        assert gpu_configs.device_entry_name(_table(family), name) == entry


def test_missing_shape_keys_fall_back_to_default_and_star(tmp_path, monkeypatch):
    table = {"family": "fam", "devices": {
        "default": {"source": "d", "configs": {"a": {"x": 1}, "*": {"x": 9}}},
        "GPU X": {"match": ["X1"], "source": "modelled", "configs": {"a": {"x": 2}}},
        "interpreter": {"source": "i", "configs": {"*": {"x": 3}}}}}
    (tmp_path / "fam.json").write_text(json.dumps(table))
    monkeypatch.setenv("RAGATTN_CONFIG_DIR", str(tmp_path))
    gpu_configs.clear_cache()
    try:
        assert gpu_configs.get_config("fam", "GPU X", "a") == {"x": 2}
        assert gpu_configs.get_config("fam", "big X1 card", "a") == {"x": 2}
        assert gpu_configs.get_config("fam", "GPU X", "b") == {"x": 9}  # default's "*"
        assert gpu_configs.get_config("fam", "other", "a") == {"x": 1}
        assert gpu_configs.get_config("fam", None, "a") == {"x": 3}
        cfg, where = gpu_configs.lookup("fam", "GPU X", "b")
        assert where.startswith("default[*]")
        gpu_configs.get_config("fam", "GPU X", "a")["x"] = 7  # a copy
        assert gpu_configs.get_config("fam", "GPU X", "a") == {"x": 2}
        with gpu_configs.override("fam", "a", {"x": 5}):
            assert gpu_configs.get_config("fam", "GPU X", "a") == {"x": 5}
            assert gpu_configs.get_config("fam", None, "a") == {"x": 3}  # the interpreter is never overridden
        assert gpu_configs.get_config("fam", "GPU X", "a") == {"x": 2}
        del table["devices"]["default"]["configs"]["*"]
        (tmp_path / "fam.json").write_text(json.dumps(table))
        gpu_configs.clear_cache()
        with pytest.raises(KeyError, match="no entry for shape 'b'"):
            gpu_configs.get_config("fam", "GPU X", "b")
    finally:
        monkeypatch.delenv("RAGATTN_CONFIG_DIR")
        gpu_configs.clear_cache()


@pytest.mark.parametrize("device_name", ["default", H100, "NVIDIA H200", "Unknown GPU"])
def test_every_launch_finds_a_config(device_name):
    """Every (kernel, dtype, head dim, window) the varlen launchers and every (dtype, head dim) the
    key_attention_scores launcher can ask has an entry on every device (default fallback)."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_dim in (16, 32, 64, 80, 96, 128, 192, 256):
            for kernel in ("fwd", "dq", "dkdv"):
                for window in (False, True):
                    c = gpu_configs.get_config("varlen_attention", device_name,
                                               va.config_key(head_dim, kernel, dtype, window))
                    assert c["BLOCK_M"] >= 16 and c["BLOCK_N"] >= 16 and c["num_warps"] >= 1 and c["num_stages"] >= 1
            cfg = kas.kernel_config(dtype, head_dim, device_name)
            assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "waves"} <= set(cfg)


def test_default_entries_keep_the_pre_table_configs():
    """The heuristic default is the launch config the kernels had before the tables (spill-free for sm_90);
    the interpreter (this process: TRITON_INTERPRET=1) takes its own entry whatever the device."""

    def varlen(head_dim, kernel, dtype, window, device="default"):
        c = gpu_configs.get_config("varlen_attention", device, va.config_key(head_dim, kernel, dtype, window))
        return c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]

    assert varlen(128, "fwd", torch.bfloat16, False) == (64, 32, 4, 3)
    assert varlen(128, "fwd", torch.bfloat16, True) == (64, 16, 4, 3)
    assert varlen(80, "fwd", torch.float16, True) == (64, 16, 4, 3)  # padded to 128
    assert varlen(256, "dkdv", torch.float32, False) == (16, 16, 16, 1)
    assert varlen(64, "dq", torch.float32, True) == (32, 16, 4, 1)
    assert varlen(128, "fwd", torch.bfloat16, False, H100) == (128, 32, 8, 3)
    assert varlen(256, "fwd", torch.bfloat16, False, H100) == (64, 32, 8, 2)  # not in the H100 entry: default
    assert va._INTERPRET and va._config(128, "fwd", torch.bfloat16, False, H100) == (32, 32, 4, 1)
    assert kas.launch_config(torch.bfloat16, 128, on_gpu=True) == (128, 128, 8)
    assert kas.launch_config(torch.float32, 128, on_gpu=True) == (64, 64, 8)
    assert kas.launch_config(torch.bfloat16, 128, on_gpu=False) == (64, 64, 4)


def test_splits_fill_the_sms_without_a_straggling_wave():
    # q64 x k32K, GQA 4 (256 packed rows), 8 kv heads, 128-row tiles: 16 programs before the split
    assert kas.splits_for_sms(2, 1, 8, 256, 132, waves=2.0) == 16  # 256 programs <= 264
    assert kas.splits_for_sms(2, 1, 8, 256, 132, waves=4.0) == 33
    assert kas.splits_for_sms(2, 1, 8, 512, 132, waves=3.0) == 24  # the H100 entry: 384 programs <= 396 slots
    assert kas.splits_for_sms(2, 1, 8, 8, 132, waves=4.0) == 2  # at least 4 key tiles a split
    assert kas.splits_for_sms(300, 4, 8, 256, 132) == 1


def test_paged_attention_reads_its_table_and_every_tune_candidate():
    """The paged launcher's config comes from its table (the H100's measured decode entry, the
    heuristic elsewhere), and every candidate bench.tune sweeps reaches the launcher whole under
    ``override`` (a candidate the launcher could not read was skipped: the first GPU tune run
    skipped them all on a KeyError)."""
    from bench.tune import FAMILIES
    from ragattn.triton_kernels import paged_plan as pa

    assert pa.kernel_config(16, 128, 2, device_name=H100) == dict(m_tile=16, BLOCK_N=64, num_warps=4, num_stages=3,
                                                                 waves=4.0)
    assert pa.kernel_config(16, 128, 2, device_name="Some Future GPU")["BLOCK_N"] == 64
    assert pa.kernel_config(128, 256, 4)["m_tile"] * 4 * 256 <= 160 * 1024  # shrunk to fit shared memory
    family = FAMILIES["paged_attention"]
    for key in family.keys:
        kind, _, dclass = key.split("/")[:3]
        m_tile, window = {"decode": 16, "verify": 64, "prefill": 128}[kind], key.endswith("/window")
        assert pa.table_key(m_tile, int(dclass[1:]), 2, window, H100) == key
        for cand in family.candidates(key)[:10]:
            with gpu_configs.override("paged_attention", key, cand):
                got = pa.kernel_config(m_tile, int(dclass[1:]), 2, device_name=H100, window=window)
            assert all(got[k] == cand[k] for k in ("BLOCK_N", "num_warps", "num_stages", "waves")), (key, cand, got)
            assert got.get("edge_loop") == cand.get("edge_loop"), (key, cand, got)


def test_window_decode_reads_its_own_class_where_the_entry_has_one():
    """Under a window, decode tiles read the ``/window`` variant of their class where the device's
    entry names it (the H100's: the edge loop, 5 stages) and the plain class elsewhere (no window,
    other head dims, the interpreter's "*"); the launch carries ``edge_loop`` to the kernel."""
    import torch

    from ragattn.triton_kernels import paged_plan as pa

    assert pa.kernel_config(16, 128, 2, device_name=H100, window=True) == dict(
        m_tile=16, BLOCK_N=64, num_warps=4, num_stages=5, waves=4.0, edge_loop=True)
    assert "edge_loop" not in pa.kernel_config(16, 128, 2, device_name=H100)
    assert pa.table_key(16, 64, 2, True, H100) == "decode/16bit/d64"
    assert pa.table_key(16, 128, 2, True, None) == "decode/16bit/d128"
    cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([300], dtype=torch.int32)
    plan = pa.plan_paged_attention(cu, lens, num_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float16,
                                   window_left=50)
    assert len(plan.launch()) == pa.LAUNCH_FIELDS and plan.launch()[-1] == plan.edge_loop


def test_paged_splits_never_leave_a_partial_wave():
    """At most waves x SMs programs: programs past a whole number of waves run as a further, mostly
    empty wave (e.g. 288 programs on an H100's 264 slots)."""
    from ragattn.triton_kernels import paged_plan as pa

    for programs in (1, 7, 32, 100, 256, 263, 264, 1000):
        s = pa.splits_for_sms(programs, 1 << 20, 64, 132, waves=2.0)
        assert s == 1 or programs * s <= 264, (programs, s)
    assert pa.splits_for_sms(32, 32768, 64, 132) == 16  # batch 4 x 8 kv heads: 512 programs = 4 x 132 - 16
    assert pa.splits_for_sms(256, 32768, 64, 132) == 2
    assert pa.splits_for_sms(32, 256, 64, 132) == 1  # 4 key tiles: no split shorter than 4 tiles


def test_deeper_decode_prefetch_is_not_shrunk():
    """A 64-key decode tile at 5 stages (two K and two V tiles in flight: ~72 KB on sm_90) reaches the
    kernel as configured; the launcher's old model (164 KB against 160) cut it to 4 stages. Tiles
    that do not fit are still shrunk."""
    from ragattn.triton_kernels import paged_plan as pa

    five = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=5, waves=4.0)
    with gpu_configs.override("paged_attention", "decode/16bit/d128", five):
        assert pa.kernel_config(16, 128, 2, device_name=H100)["num_stages"] == 5
    assert pa.smem_bytes(16, 64, 128, 2, 5) < 80 * 1024 < pa.smem_bytes(16, 128, 128, 2, 5)
    assert pa.kv_buffers(16, 3) == pa.kv_buffers(16, 4) == 1 and pa.kv_buffers(16, 5) == 2
    assert pa.kv_buffers(128, 3) == 2 and pa.kv_buffers(128, 5) == 3
    big = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=5, waves=4.0)
    with gpu_configs.override("paged_attention", "prefill/16bit/d256", big):
        cfg = pa.kernel_config(128, 256, 2, device_name=H100)
    assert pa.smem_bytes(cfg["m_tile"], cfg["BLOCK_N"], 256, 2, cfg["num_stages"]) <= pa.SMEM_BUDGET


def test_tune_sweeps_decode_stages_and_the_prefill_tile_height():
    from bench.tune import FAMILIES
    from ragattn.triton_kernels import paged_plan as pa

    family = FAMILIES["paged_attention"]
    decode = family.candidates("decode/16bit/d128")
    assert {c["num_stages"] for c in decode} == {2, 3, 4, 5}
    prefill = family.candidates("prefill/16bit/d128")
    assert {c["BLOCK_M"] for c in prefill} == {64, 128} and {c["num_stages"] for c in prefill} == {2, 3, 4, 5}
    for key, cands in (("decode/16bit/d128", decode), ("prefill/16bit/d128", prefill)):
        m_tile = 16 if key.startswith("decode") else 128
        for cand in cands:  # every candidate runs as listed: none is shrunk by the launcher
            with gpu_configs.override("paged_attention", key, cand):
                got = pa.kernel_config(m_tile, 128, 2, device_name=H100)
            assert (got["m_tile"], got["BLOCK_N"], got["num_stages"]) == (min(m_tile, cand["BLOCK_M"]), cand["BLOCK_N"],
                                                                           cand["num_stages"]), (key, cand, got)
    # the quick run: the table's current config first, then the variants the static report points to
    quick = family.quick_candidates("decode/16bit/d128", H100)
    assert quick[0] == gpu_configs.get_config("paged_attention", H100, "decode/16bit/d128")
    assert any(c["num_stages"] == 5 and c["BLOCK_N"] == 64 for c in quick)
    quick = family.quick_candidates("prefill/16bit/d128", H100)
    assert quick[0]["BLOCK_M"] == 128 and any(c["BLOCK_M"] == 64 for c in quick)
    assert any(not c.get("pipeline_v") for c in quick) and quick[0].get("pipeline_v")
    for fam in FAMILIES.values():
        for key in fam.quick_keys:
            assert key in fam.keys and 2 <= len(fam.quick_candidates(key, H100)) <= 8, (fam.name, key)


def test_tune_list_prints_what_it_would_time(capsys):
    from bench import tune

    assert tune.main(["paged_attention", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("paged_attention decode/16bit/d128: ") and "prefill/16bit/d128: " in out
    assert f"the current config for {H100!r} first" in out and "'num_stages': 5" in out
    assert tune.main(["paged_attention", "--list", "--full", "--keys", "prefill/16bit/d128", "--max-candidates", "3"]) == 0
    out = capsys.readouterr().out
    assert "(full sweep, nearest first)" in out and out.count("{'BLOCK_M'") == 3
    assert tune.main(["paged_attention", "--device", "cpu"]) == 2


def test_tune_stops_at_its_budget_and_keeps_the_current_config_within_noise():
    """Each class gets an equal share of the time left; the first candidate (the current config)
    always runs; a variant must beat it by more than MIN_GAIN to replace it; the table lists all."""
    from bench import tune

    fam = tune.FAMILIES["paged_attention"]
    now = [0.0]
    times = {2: 100.0, 5: 99.5, 4: 90.0}

    def timer(key, cfg):
        now[0] += 10.0  # each candidate takes 10 s
        return times.get(cfg["num_stages"], 200.0)

    def cands(key):
        return [dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=s, waves=4.0) for s in (2, 5, 3, 4)]

    res = tune.tune_family(fam, ["decode/16bit/d128", "prefill/16bit/d128"], timer, log=lambda s: None,
                           candidates=cands, budget_s=50.0, clock=lambda: now[0])
    first, second = res["decode/16bit/d128"], res["prefill/16bit/d128"]
    assert first["tried"] == 3 and first["untimed"] == 1  # 25 s share: starts at 0, 10, 20; not at 30
    assert first["config"]["num_stages"] == 2  # 99.5 us is within 1% of 100: the current config stays
    assert second["tried"] == 3  # 20 s left at 30 s: starts at 30, 40, 50 (60 is past the budget)
    table = tune.results_table("paged_attention", res)
    assert "| decode/16bit/d128 | BLOCK_M=16, BLOCK_N=64, num_stages=2, num_warps=4, waves=4.0 | 100.0 | 1.000x | chosen (current) |" in table
    assert "1 more not timed (budget)" in table
    times[3] = 50.0
    now[0] = 0.0
    res = tune.tune_family(fam, ["decode/16bit/d128"], timer, log=lambda s: None, candidates=cands)
    assert res["decode/16bit/d128"]["config"]["num_stages"] == 3 and res["decode/16bit/d128"]["tried"] == 4
