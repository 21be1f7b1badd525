"""paged_attention's opcheck, fake impl and named errors."""
from __future__ import annotations
import pytest
import torch
import ragattn
from tests.helpers import run_compile_check

from tests.ops.paged_attention.test_paged_attention import I32, _good, backend, make_case  # noqa: F401 (fixtures)


# ------------------------------------------------------------------------- opcheck, fakes, errors

def test_opcheck(backend, device):
    args = make_case([[3, 7], [0]], [8, 4], num_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=4, dtype=torch.float32, device=device)
    torch.library.opcheck(torch.ops.ragattn.paged_attention.default, args)
    torch.library.opcheck(torch.ops.ragattn.paged_attention.default, (*args, 0.5))
    torch.library.opcheck(torch.ops.ragattn.paged_attention.default, (*args, None, 2))
    q = args[0]
    torch.library.opcheck(torch.ops.ragattn.paged_attention.out, (*args, None, 2),
                          dict(out=torch.empty_like(q), lse_out=torch.empty(q.shape[:2], device=device)))


@pytest.mark.parametrize(
    "index,bad,exc,match",
    [
        (0, lambda a: a.float(), TypeError, "k_cache"),
        (0, lambda a: a[:, :3], ValueError, "num_heads"),
        (0, lambda a: a.long(), TypeError, "q must be"),
        (1, lambda a: a.float(), TypeError, "q_pos"),
        (1, lambda a: a[:1], ValueError, "q_pos"),
        (1, lambda a: a - 10, ValueError, "q_pos"),
        (2, lambda a: torch.tensor([0, 1], dtype=I32), ValueError, "cu_seqlens_q"),
        (4, lambda a: a[..., :32], ValueError, "v_cache"),
        (5, lambda a: a.to(torch.int16), TypeError, "block_table"),
        (5, lambda a: a + 100, ValueError, "block_table"),
        (5, lambda a: a[0], ValueError, "block_table"),
        (6, lambda a: a + 100, ValueError, "kv_lens"),
        (6, lambda a: a.float(), TypeError, "kv_lens"),
    ],
)
def test_bad_inputs(index, bad, exc, match):
    args = _good()
    args[index] = bad(args[index])
    with pytest.raises(exc, match=f"ragattn.paged_attention.*{match}"):
        ragattn.paged_attention(*args)


_COMPILE_CHECK = r"""
import torch
import triton
import ragattn.triton_kernels.paged_attention as pa
import ragattn.triton_kernels.paged_plan as pp
from tests.helpers import SM90_CASES, compile_many_sm90

ints = ("Q_POS", "CU_SEQLENS_Q", "PAGES", "ROW_START", "KV_LENS", "TILE_SEQ", "TILE_ROW0", "ENTRY_POS", "ENTRY_LEN")
jobs = []
for elt, head_dim in SM90_CASES:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[elt]
    # (query rows of the longest sequence, GQA group, split-KV): prefill, decode, verify
    for max_rows, group, split in [(1000, 4, False), (1, 8, True), (5, 1, True)][: 3 if head_dim == 128 else 2]:
        group_pad = triton.next_power_of_2(group)
        m_tile = min(128, max(16, triton.next_power_of_2(max_rows * group_pad)))
        block_d = max(16, triton.next_power_of_2(head_dim))
        cfg = pp.kernel_config(m_tile, block_d, dtype.itemsize)  # the table's default entry
        m_tile, block_n, stages, warps = cfg["m_tile"], cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"]
        consts = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_M=max(1, m_tile // group_pad),
                      BLOCK_N=block_n, BLOCK_D=block_d, HAS_WINDOW=split, SOFTCAP=False, UPCAST=False,
                      IEEE_FP32=dtype == torch.float32,  # windows: decode/verify configs
                      ROW_STARTS=split,  # flat (CSR) page lists: decode/verify configs
                      POS_TABLE=False, HAS_ENTRY_LEN=False, ROPE=False, ROPE_INTERLEAVED=False, KV_FP8=False,
                      # page ids once per page (16-slot pages) for decode/verify, once per tile (128) for prefill
                      EVEN_D=block_d == head_dim, PAGE_MODE=1 if split else 2, PAGE_SIZE=16 if split else 128,
                      SPLIT_WHOLE_TILES=pa.split_whole_tiles(m_tile),  # as the launcher
                      PIPELINE_V=bool(cfg.get("pipeline_v", False)))
        types = {n: "*i32" for n in ints}
        types.update(Q="*" + elt, K_CACHE="*" + elt, V_CACHE="*" + elt, OUT="*fp32" if split else "*" + elt,
                     LSE="*fp32", qk_scale="fp32", INV_FREQ="*fp32", softcap_log2="fp32")
        jobs.append((pa._paged_attention_kernel, consts, types, dict(num_warps=warps, num_stages=stages)))
        if split and elt != "fp32":  # zero-copy pages: positions from the entries, keys rotated in the kernel
            tagged = dict(consts, POS_TABLE=True, HAS_ENTRY_LEN=True, ROPE=True, ROPE_INTERLEAVED=max_rows == 5)
            jobs.append((pa._paged_attention_kernel, tagged, types, dict(num_warps=warps, num_stages=stages)))
            # vLLM's fp8 caches, dequantised in the kernel, with and without the tagged pages
            fp8_types = dict(types, K_CACHE="*fp8e4nv", V_CACHE="*fp8e4nv", K_SCALE="*fp32", V_SCALE="*fp32")
            for flags in (dict(consts, KV_FP8=True), dict(tagged, KV_FP8=True)):
                jobs.append((pa._paged_attention_kernel, flags, fp8_types, dict(num_warps=warps, num_stages=stages)))
compile_many_sm90(jobs)
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """The kernel compiles for an H100 (sm_90) at the launcher's tile configs (prefill, decode,
    split-KV) in every dtype and head dim, within its shared memory; needs no GPU."""
    run_compile_check(_COMPILE_CHECK)


def test_docs_examples_run():
    """The runnable examples of docs/ops.md's paged_attention and merge_attention_states sections."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "ops.md").read_text()
    section = text[text.index("## paged_attention"): text.index("## rerotate_keys_")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    for code in blocks:
        exec(compile(code, "docs/ops.md", "exec"), {})
