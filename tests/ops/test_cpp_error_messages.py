"""Every C++ check family raises its documented error with its exact message, and the
messages are built without iostreams (csrc/common/check_message.h says why: on the GPU image,
torch 2.11.0+cu130 with g++ 13.3, a TORCH_CHECK message that streamed an integer crashed the
process before the error was raised).

One case per check function, through the C++ entry points (``torch.ops.ragattn.*``), with the
integers, shapes, dtypes and floats of each message spelled out: the formatting of the new
message builder must equal what the iostream builder printed (the other test files match parts of
these messages, and the Python twins of the checks print the same)."""
import re
from pathlib import Path

import pytest
import torch

import ragattn  # noqa: F401  (registers torch.ops.ragattn)

ROOT = Path(__file__).resolve().parents[2]


def test_csrc_builds_no_message_with_iostreams():
    """No TORCH_CHECK* (whose message builder streams into a std::ostringstream) and no string
    streams anywhere in csrc/: every check goes through RAGATTN_CHECK*."""
    banned = re.compile(r"\b(TORCH_CHECK\w*|TORCH_INTERNAL_ASSERT\w*|AT_ERROR|AT_ASSERT\w*|TORCH_WARN\w*)\s*\(|"
                        r"\b(o|i)?stringstream\b|<sstream>|<iostream>|std::(cout|cerr|clog)\b")
    offenders = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".h", ".cuh", ".cpp", ".cu") or path.name == "check_message.h":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if banned.search(code):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def _rope(n=32):
    return 1.0 / (10000 ** (torch.arange(0, n, 2).float() / n))


def _kv_cases(dev):
    L = [torch.randn(10, 2, 32, device=dev)]
    one = torch.ones(1, dtype=torch.int32, device=dev)
    f = _rope().to(dev)
    ix = lambda *v: torch.tensor(v, device=dev)  # noqa: E731
    rot = torch.ops.ragattn.rerotate_keys_
    return {
        "layer dtype (size_t index, ScalarType)": (
            lambda: rot(L + [torch.randn(10, 2, 32, dtype=torch.float64, device=dev)], ix(1), one, f, 32, False),
            TypeError, "ragattn.rerotate_keys_: k_layers[1] must be float16, bfloat16, float32 or float8_e4m3fn, got Double"),
        "layer shapes (IntArrayRef)": (
            lambda: rot(L + [torch.randn(11, 2, 32, device=dev)], ix(1), one, f, 32, False), ValueError,
            "ragattn.rerotate_keys_: every layer of k_layers must have one shape; k_layers[0] is [10, 2, 32], "
            "k_layers[1] is [11, 2, 32]"),
        "index length (int64)": (
            lambda: rot(L, ix(1, 2), torch.ones(3, dtype=torch.int32, device=dev), f, 32, False), ValueError,
            "ragattn.rerotate_keys_: delta must have shape [2] (one per row), got [3]"),
        "rope (int64)": (
            lambda: rot(L, ix(1, 2), torch.ones(2, dtype=torch.int32, device=dev), f, 31, False), ValueError,
            "ragattn.rerotate_keys_: rotary_dim must be even and in [2, head_dim=32], got 31"),
        "layers overlap (size_t indices)": (
            lambda: rot(L + [L[0]], ix(1), one, f, 32, False), ValueError,
            "ragattn.rerotate_keys_: k_layers[1] shares memory with k_layers[0]; every written layer must be its "
            "own memory (a row written or rotated twice would depend on the order)"),
    }


def _kv_row_cases(dev):
    L = [torch.randn(10, 2, 32, device=dev)]
    f = _rope().to(dev)
    two = torch.ones(2, dtype=torch.int32, device=dev)
    rot = torch.ops.ragattn.rerotate_keys_
    return {
        "row range (int64 values)": (
            lambda: rot(L, torch.tensor([1, 10], device=dev), two, f, 32, False), ValueError,
            "ragattn.rerotate_keys_: rows[1] = 10 is out of range for caches of 10 rows"),
        "row repeat (int64 values)": (
            lambda: rot(L, torch.tensor([6, 6], device=dev), two, f, 32, False), ValueError,
            "ragattn.rerotate_keys_: rows may not repeat a row, but row 6 appears twice (again at index 1)"),
        # few rows in a large cache: checked by sorting, not a bitmap of the cache; the same first repeat
        "row repeat in a large cache (int64 values)": (
            lambda: rot([torch.randn(1000, 2, 32, device=dev)], torch.tensor([5, 900, 7, 900, 5], device=dev),
                        torch.ones(5, dtype=torch.int32, device=dev), f, 32, False), ValueError,
            "ragattn.rerotate_keys_: rows may not repeat a row, but row 900 appears twice (again at index 3)"),
    }


def _verify_cases():
    B, g, V = 2, 3, 11
    gen = torch.Generator().manual_seed(0)
    dt, lg, u = torch.randint(0, V, (B, g), generator=gen), torch.randn(B, g + 1, V, generator=gen), torch.rand(B, g + 1)
    bad_tok, bad_u = dt.clone(), u.clone()
    bad_tok[1, 2], bad_u[0, 1] = V, 1.5
    vd = torch.ops.ragattn.verify_draft
    return {
        "shape (int64, IntArrayRef)": (
            lambda: vd(dt, None, lg[:, :2], u), ValueError,
            "ragattn.verify_draft: target_logits must have shape (2, 4, V) with V >= 1, got [2, 2, 11]"),
        "token range (int64, element index)": (
            lambda: vd(bad_tok, None, lg, u), ValueError,
            "ragattn.verify_draft: draft_tokens must be in [0, V = 11), got 11 at [1, 2]"),
        "uniform range (float)": (
            lambda: vd(dt, None, lg, bad_u), ValueError, "ragattn.verify_draft: uniforms must be in [0, 1), got 1.5 at [0, 1]"),
        "num_draft range (int64)": (
            lambda: vd(dt, None, lg, u, num_draft=torch.tensor([1, 4])), ValueError,
            "ragattn.verify_draft: num_draft must be in [0, 3], got 4 in row 1"),
        "dtype (ScalarType)": (
            lambda: vd(dt.int(), None, lg, u), TypeError, "ragattn.verify_draft: draft_tokens must be int64, got Int"),
    }


def _paged_cases():
    from tests.ops.paged_attention.test_paged_attention import make_case

    q, q_pos, cu, k, v, bt, kvl = make_case([[3, 4], [0]], [5, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                                            page_size=4, dtype=torch.float32, device="cpu")
    pa = torch.ops.ragattn.paged_attention
    long_kv = kvl.clone()
    long_kv[1] = 99
    bad_page = bt.clone()
    bad_page[0, 1] = 1000
    return {
        "dtype (Python spelling)": (
            lambda: pa(q, q_pos, cu, k.half(), v, bt, kvl), TypeError,
            "ragattn.paged_attention: k_cache must be float32, got float16"),
        "shape (tuple spelling)": (
            lambda: pa(q, q_pos, cu, k, v[..., :8], bt, kvl), ValueError,
            f"ragattn.paged_attention: v_cache must have shape {tuple(k.shape)}, got {tuple(v[..., :8].shape)}"),
        "kv_lens range (int64)": (
            lambda: pa(q, q_pos, cu, k, v, bt, long_kv), ValueError,
            f"ragattn.paged_attention: kv_lens must lie in [0, max_pages * page_size = {bt.shape[1] * 4}], got 99 "
            "for sequence 1"),
        "page range (int64 indices)": (
            lambda: pa(q, q_pos, cu, k, v, bad_page, kvl), ValueError,
            f"ragattn.paged_attention: block_table entries used by kv_lens must lie in [0, num_pages = {k.shape[0]}), "
            "got 1000 at [0, 1]"),
        "scale (double)": (
            lambda: pa(q, q_pos, cu, k, v, bt, kvl, float("nan")), ValueError,
            "ragattn.paged_attention: scale must be finite, got nan"),
    }


def _varlen_cases():
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    va = torch.ops.ragattn._varlen_attention_cpu
    return {
        # the call that crashed on the GPU image (the backtrace: check_int32, name="q_pos")
        "int32 range (int64 values past 2^31)": (
            lambda: va(q, k, k, cu, cu, torch.arange(5) + 2**31, None, None, None, True, None, -1), ValueError,
            "ragattn.varlen_attention: q_pos values must fit in int32, got 2147483648 .. 2147483652"),
        "offsets (int64)": (
            lambda: va(q, k, k, torch.tensor([0, 4], dtype=torch.int32), cu, None, None, None, None, True, None, -1),
            ValueError, "ragattn.varlen_attention: cu_seqlens_q must start at 0 and end at 5 (the packed length), got 0 .. 4"),
        "layout invariant (TORCH_CHECK family: RuntimeError)": (
            lambda: va(q, k, k, cu, cu, None, None, None, None, True, None, -2), RuntimeError,
            "ragattn.varlen_attention: window_left must be -1 (no window) or >= 0"),
    }


def _merge_cases():
    o, lse = torch.randn(3, 2, 8), torch.randn(3, 2)
    bad_out = torch.empty(3, 8, 2).transpose(1, 2)
    return {
        "unit stride (RuntimeError)": (
            lambda: torch.ops.ragattn._merge_attention_states_cpu(o, lse, o, lse, out=bad_out, lse_out=torch.empty(3, 2)),
            RuntimeError, "ragattn._merge_attention_states_cpu: out_a, out_b and out need a unit last-dim stride"),
    }


def _check(call, exc, message):
    with pytest.raises(exc) as info:
        call()
    first = str(info.value).splitlines()[0]
    assert first == message, first


_FAMILIES = {"verify_draft": _verify_cases, "paged": _paged_cases, "varlen": _varlen_cases, "merge": _merge_cases}
_CPU_IDS = [("kv_cache", k) for k in _kv_row_cases("cpu")] + [
    (fam, k) for fam, make in _FAMILIES.items() for k in make()]


@pytest.mark.parametrize("family, case", _CPU_IDS, ids=[f"{f}: {c}" for f, c in _CPU_IDS])
def test_cpu_check_raises_its_error(family, case):
    """The CPU checks (contents read on the host: row ranges, token ranges, offsets...)."""
    cases = _kv_row_cases("cpu") if family == "kv_cache" else _FAMILIES[family]()
    _check(*cases[case])


@pytest.mark.parametrize("case", list(_kv_cases("cpu")))
def test_kv_cache_check_raises_its_error(device, case):
    """kv_cache_checks.cpp, shared by the CPU twin and the CUDA launcher: on the test device."""
    _check(*_kv_cases(device)[case])


def test_kv_cache_row_checks_on_cuda_in_debug_mode(device, monkeypatch):
    """The row checks of the CUDA launcher (RAGATTN_DEBUG=1: a host copy of the rows)."""
    if device.type != "cuda":
        pytest.skip("CUDA-only debug mode (the CPU always checks: test_cpu_check_raises_its_error)")
    monkeypatch.setenv("RAGATTN_DEBUG", "1")
    for call, exc, message in _kv_row_cases(device).values():
        _check(call, exc, message)
