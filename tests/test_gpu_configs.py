"""The per-GPU config tables (issue 22.5): lookup by device name and shape class, the heuristic
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
    from ragattn.triton_kernels import paged_attention as pa

    assert pa.kernel_config(16, 128, 2, device_name=H100) == dict(m_tile=16, BLOCK_N=64, num_warps=4, num_stages=3,
                                                                 waves=4.0)
    assert pa.kernel_config(16, 128, 2, device_name="Some Future GPU")["BLOCK_N"] == 64
    assert pa.kernel_config(128, 256, 4)["m_tile"] * 4 * 256 <= 160 * 1024  # shrunk to fit shared memory
    family = FAMILIES["paged_attention"]
    for key in family.keys:
        kind = key.split("/")[0]
        m_tile = {"decode": 16, "verify": 64, "prefill": 128}[kind]
        assert pa.shape_key(m_tile, int(key.split("/d")[1]), 2) == key
        for cand in family.candidates(key)[:10]:
            with gpu_configs.override("paged_attention", key, cand):
                got = pa.kernel_config(m_tile, int(key.split("/d")[1]), 2, device_name=H100)
            assert all(got[k] == cand[k] for k in ("BLOCK_N", "num_warps", "num_stages", "waves")), (key, cand, got)


def test_paged_splits_never_leave_a_partial_wave():
    """At most waves x SMs programs (the H100 measured a 288-program decode 1.4x slower than a
    256-program one: 24 programs past the 264 slots ran as a second wave)."""
    from ragattn.triton_kernels import paged_attention as pa

    for programs in (1, 7, 32, 100, 256, 263, 264, 1000):
        s = pa.splits_for_sms(programs, 1 << 20, 64, 132, waves=2.0)
        assert s == 1 or programs * s <= 264, (programs, s)
    assert pa.splits_for_sms(32, 32768, 64, 132) == 16  # batch 4 x 8 kv heads: 512 programs = 4 x 132 - 16
    assert pa.splits_for_sms(256, 32768, 64, 132) == 2
    assert pa.splits_for_sms(32, 256, 64, 132) == 1  # 4 key tiles: no split shorter than 4 tiles
