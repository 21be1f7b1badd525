"""The static sm_90 report's gates (bench/sm90.py): no GPU needed.

Compiles a representative subset of the Triton kernels at their benchmark configurations (one per
kernel family and launch shape: the full set is ``python -m ragattn.bench.sm90``) and every CUDA
kernel, and fails on a spill in a forward kernel, shared memory over the H100's per-CTA limit, or
a forward main loop without asynchronous copies. Known defects are listed in ``KNOWN_DEFECTS``:
the test also fails when one of them is fixed and the list is not updated.
"""
import json

import pytest

from tests.helpers import run_compile_check

# (kernel label substring, defect) pairs that the report shows today; keep in sync with the report.
KNOWN_DEFECTS: set = set()

# one spec per kernel family and launch shape (labels from bench.sm90.triton_specs)
SUBSET = [
    "varlen_attention._fwd_kernel [varlen_attention/fwd_chunks64x500+50]",
    "paged_attention._paged_attention_kernel [paged_attention/sparse_prefill]",
    "[paged_attention/decode]",  # the paged kernel with split-KV and its merge
    "paged_attention._paged_attention_kernel [paged_attention/decode_window]",
    "merge_attention_states._merge_two_kernel",
    "key_attention_scores._row_lse_kernel",
]

_CODE = r"""
import json
from ragattn.bench.sm90 import analyse_triton_all
print(json.dumps(analyse_triton_all(SELECT, workers=2)))
print("compiled")
"""


def defects(row: dict) -> set:
    """The gate's findings for one report row (Triton or CUDA)."""
    from ragattn.bench.sm90 import H100

    label = f"{row['kernel']} [{row['case']}]" if "case" in row else row["kernel"]
    found = set()
    forward = row.get("forward", True)
    if forward and (row["spill_stores"] or row["spill_loads"]):
        found.add((label, "spills"))
    if row.get("smem", row.get("static_smem", 0)) > H100["smem_per_cta"]:
        found.add((label, "shared memory over the limit"))
    if forward and row.get("has_main_loop") and not row["cp_async"]:
        found.add((label, "not pipelined"))
    return found


def assert_known_defects(rows: list, labels: set) -> None:
    """The rows' defects are exactly the KNOWN_DEFECTS of the kernels compiled (``labels``)."""
    found = set().union(*(defects(r) for r in rows))
    expected = {d for d in KNOWN_DEFECTS if d[0] in labels}
    assert found - expected == set(), f"new defects: {sorted(found - expected)}"
    assert expected - found == set(), f"fixed: remove from KNOWN_DEFECTS: {sorted(expected - found)}"


def test_triton_kernels_at_benchmark_configs():
    out = run_compile_check(_CODE.replace("SELECT", repr(SUBSET)))
    rows = json.loads(out.strip().splitlines()[-2])
    assert len(rows) >= len(SUBSET)
    for r in rows:
        assert r["regs"] > 0 and 0 < r["ctas_per_sm"] <= 32, r
    assert_known_defects(rows, {f"{r['kernel']} [{r['case']}]" for r in rows})


def test_cuda_kernels_at_launch_bounds():
    from ragattn.bench.sm90 import analyse_cuda, nvcc_version

    if nvcc_version() is None:
        pytest.skip("nvcc not found")
    # verify_draft only: the kv_cache file's 30 instantiations take minutes of nvcc on 2 cores
    rows = analyse_cuda(["verify_draft_kernels.cu"])
    assert len(rows) == 6  # logits dtype x one-hot drafts
    for r in rows:
        # issue 15.7: 1024-thread CTAs capped registers at 64 and three variants spilled; 256-thread CTAs
        # with __launch_bounds__(256, 2) leave up to 128 registers and two CTAs per SM
        assert r["threads"] == 256 and 0 < r["regs"] <= 128 and r["ctas_per_sm"] >= 2, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    assert_known_defects(rows, {r["kernel"] for r in rows})
    # issue 15.7: one CTA per row used 64 of the 132 SMs at B = 64 (modelled); a cluster per row fills them
    from ragattn.bench.sm90 import verify_draft_coverage

    cover = {c["batch"]: c for c in verify_draft_coverage(rows)}
    assert cover[64]["sms_used"] >= 128 and cover[64]["waves"] == 1, cover[64]


def test_verify_draft_cluster_rule():
    """The launcher's CTAs-per-row rule (mirrored in bench.sm90): at least one CTA per SM where a
    cluster of at most 8 can give it, 1 before sm_90, always a divisor of the 8 vocabulary slices."""
    from ragattn.bench.sm90 import verify_draft_cluster_size

    assert [verify_draft_cluster_size(b) for b in (1, 8, 17, 33, 64, 66, 128, 132, 4096)] == [8, 8, 8, 4, 4, 2, 2, 1, 1]
    assert verify_draft_cluster_size(64, cc_major=8) == 1
    assert verify_draft_cluster_size(64, sms=114) == 2  # H100 PCIe
    from pathlib import Path

    csrc = Path(__file__).resolve().parent.parent / "csrc" / "speculative"
    header = (csrc / "verify_draft_kernels.cuh").read_text()  # the rule the mirror copies
    assert "while (c < 8 && batch * c < num_sms) c *= 2;" in header and "if (cc_major < 9) return c;" in header
    assert "constexpr int kSlices = 8;" in (csrc / "verify_draft_math.h").read_text()


def test_occupancy_model():
    from ragattn.bench.sm90 import ctas_per_sm

    assert ctas_per_sm(255, 0, 256) == (1, "registers")  # 255 regs -> 256 x 32 per warp, 8 warps/SM
    assert ctas_per_sm(16, 0, 256) == (8, "threads")
    assert ctas_per_sm(16, 0, 32) == (32, "ctas")
    assert ctas_per_sm(64, 100 * 1024, 128) == (2, "shared")
