"""paged_attention's CPU kernel in C++ (csrc/attention/paged_attention_cpu.cpp): the op's checks on
the CPU against the fake impl's, the backend switch, and the kernel across its chunk and tile
boundaries."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference.paged_attention import paged_attention as ref_paged
from tests.ops.paged_attention.test_paged_attention import _good, _slot, check_against_reference, make_case

I32 = torch.int32
CHUNK = 128  # the kernel's kChunk: slots per online-softmax step, aligned to absolute slot multiples


def test_cpu_kernel_is_cpp():
    """The op's CPU and CUDA impls are its one dispatch point in Python (ragattn/ops/paged_attention.py:
    checks, then the backend); its default CPU kernel is the private C++ op, registered unboxed in
    torch_bindings.cpp, which calls nothing in Python."""
    for name in ("ragattn::paged_attention", "ragattn::paged_attention.out"):
        cpu = [ln for ln in torch._C._dispatch_dump(name).splitlines() if ln.startswith("CPU:")]
        assert len(cpu) == 1 and "torch/library.py" in cpu[0], cpu
    cpu = [ln for ln in torch._C._dispatch_dump("ragattn::_paged_attention_cpu").splitlines() if ln.startswith("CPU:")]
    assert len(cpu) == 1 and "torch_bindings.cpp" in cpu[0] and "unboxed" in cpu[0], cpu


def _error(fn):
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return None


def _swap(i, make):
    def build(dev):
        a = _good(dev)
        a[i] = make(a[i])
        return a, None
    return build


def _caches(make):
    def build(dev):
        a = _good(dev)
        a[3], a[4] = make(a[3]), make(a[4])
        return a, None
    return build


def _outs(make):
    """make(args, out, lse) -> (out, lse_out) for the .out overload."""
    def build(dev):
        a = _good(dev)
        out, lse = torch.empty_like(a[0]), torch.empty(a[0].shape[:2], device=dev)
        o, l = make(a, out, lse)
        return a, dict(out=o, lse_out=l)
    return build


# inputs every path refuses by shape, dtype or aliasing (the checks that read no values)
BAD_INPUTS = {
    "q dtype": _swap(0, lambda t: t.long()),
    "q ndim": _swap(0, lambda t: t[0]),
    "q head_dim 0": _swap(0, lambda t: t[..., :0]),
    "heads": _swap(0, lambda t: t[:, :3]),
    "k dtype": _swap(3, lambda t: t.float()),
    "k ndim": _swap(3, lambda t: t[0]),
    "k head_dim": _swap(3, lambda t: t[..., :32]),
    "v dtype": _swap(4, lambda t: t.float()),
    "v shape": _swap(4, lambda t: t[..., :32]),
    "kv heads 0": _caches(lambda t: t[:, :, :0]),
    "page size 0": _caches(lambda t: t[:, :0]),
    "q_pos dtype": _swap(1, lambda t: t.float()),
    "q_pos shape": _swap(1, lambda t: t[:1]),
    "cu dtype": _swap(2, lambda t: t.to(torch.int16)),
    "cu ndim": _swap(2, lambda t: t[None]),
    "cu empty": _swap(2, lambda t: t[:0]),
    "bt dtype": _swap(5, lambda t: t.to(torch.int16)),
    "bt ndim": _swap(5, lambda t: t[0]),
    "bt batch": _swap(5, lambda t: torch.cat([t, t])),
    "kv_lens dtype": _swap(6, lambda t: t.float()),
    "kv_lens shape": _swap(6, lambda t: t.repeat(2)),
    "scale inf": lambda dev: (_good(dev) + [float("inf")], None),
    "scale nan": lambda dev: (_good(dev) + [float("nan")], None),
    "out dtype": _outs(lambda a, o, l: (o.float(), l)),
    "out shape": _outs(lambda a, o, l: (o[:1], l)),
    "lse dtype": _outs(lambda a, o, l: (o, l.half())),
    "lse shape": _outs(lambda a, o, l: (o, l[:, :2])),
    "out is q": _outs(lambda a, o, l: (a[0], l)),
    "out in k_cache": _outs(lambda a, o, l: (a[3].view(-1)[: o.numel()].view(o.shape), l)),
    "lse in out": _outs(lambda a, o, l: (o, o.view(torch.float32).view(-1)[: l.numel()].view(l.shape))),
    "lse in block_table": _outs(lambda a, o, l: (o, a[5].view(torch.float32).view(-1)[:2].view(2, 1).expand(l.shape))),
}


@pytest.mark.parametrize("label", list(BAD_INPUTS))
def test_checks_match_the_fake_impl(label):
    """The C++ checks and the fake impl's (Python _validate) refuse the same inputs with the same
    exception type and message (meta tensors run the fake impl)."""
    errors = []
    for dev in ("cpu", "meta"):
        args, kwargs = BAD_INPUTS[label](dev)
        if kwargs is None:
            errors.append(_error(lambda: torch.ops.ragattn.paged_attention(*args)))
        else:
            errors.append(_error(lambda: torch.ops.ragattn.paged_attention.out(*args, **kwargs)))
    assert errors[0] is not None, f"{label}: the CPU impl accepted it"
    assert errors[0] == errors[1], f"{label}: CPU {errors[0]} vs fake {errors[1]}"
    assert errors[0][1].startswith("ragattn.paged_attention: ")


def test_value_checks_name_the_argument():
    """Values (read by the CPU impl only; a GPU precondition): cu_seqlens_q, kv_lens, q_pos, block_table."""
    g = _good()
    for i, bad, match in [
        (2, torch.tensor([1, 2], dtype=I32), "cu_seqlens_q must start at 0 and end at 2"),
        (6, g[6] - 100, "kv_lens must lie in"),
        (1, g[1] - 10, "q_pos must be >= 0"),
        (5, g[5] - 100, "block_table entries used by kv_lens"),
    ]:
        a = list(g)
        a[i] = bad
        with pytest.raises(ValueError, match=f"ragattn.paged_attention: {match}"):
            torch.ops.ragattn.paged_attention(*a)
    a = list(g)
    a[2] = torch.tensor([0, 2, 1, 2], dtype=I32)
    a[5], a[6] = g[5].repeat(3, 1), g[6].repeat(3)
    with pytest.raises(ValueError, match="ragattn.paged_attention: cu_seqlens_q must be non-decreasing"):
        torch.ops.ragattn.paged_attention(*a)


def test_backend_switch(monkeypatch, seed):
    """RAGATTN_CPU_BACKEND (read on every call): reference -> the plain-torch reference (both
    overloads); default/twin with any case and spaces -> the kernel; anything else -> ValueError."""
    args = make_case([[36], [3, 9, 10]], [37, 11], num_heads=6, num_kv_heads=2, head_dim=64, page_size=8,
                     dtype=torch.float32, device="cpu")
    kernel = ragattn.paged_attention(*args, None, 5)
    want = ref_paged(*args, None, 5)
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "reference")
    got = ragattn.paged_attention(*args, None, 5)
    out = torch.full_like(args[0], float("nan"))
    got_out = ragattn.paged_attention(*args, None, 5, out=out)
    assert got_out[0] is out
    for g in (got, got_out):
        torch.testing.assert_close(g[0], want[0], atol=0, rtol=0)
        torch.testing.assert_close(g[1], want[1], atol=0, rtol=0)
    assert not torch.equal(kernel[0], want[0])  # the two paths differ in rounding: the switch is real
    for value in (" Default ", "twin", ""):
        monkeypatch.setenv("RAGATTN_CPU_BACKEND", value)
        got = ragattn.paged_attention(*args, None, 5)
        torch.testing.assert_close(got[0], kernel[0], atol=0, rtol=0)
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "bogus")
    with pytest.raises(ValueError, match="RAGATTN_CPU_BACKEND must be one of"):
        ragattn.paged_attention(*args)
    with pytest.raises(TypeError, match="k_cache must be float32"):  # the checks come first, on every backend
        ragattn.paged_attention(*args[:3], args[3].half(), *args[4:])


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,dtype",
    [(6, 2, 72, torch.float32), (3, 1, 20, torch.bfloat16), (8, 1, 64, torch.float16), (2, 2, 136, torch.float32)],
)
def test_long_contexts_across_chunks(seed, num_heads, num_kv_heads, head_dim, dtype):
    """Contexts and windows that start, end and cross the kernel's 128-slot chunks mid-way, GQA
    groups with a head left over from the pairs (3), one head (MHA, the 8-slot dot path), head dims
    past the 32-lane blocks (72, 136) and not a multiple of 8 (20)."""
    kv_lens = [300, CHUNK + 1, CHUNK, 2 * CHUNK + 1, 1, 200]
    q_positions = [[0, 127, 128, 129, 299], [CHUNK], [CHUNK - 1, 5], [2 * CHUNK, 255, 256 - 9], [0], [199, 400]]
    args = make_case(q_positions, kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=7, dtype=dtype, device="cpu")
    for window_left in (-1, 0, 7, CHUNK - 1, CHUNK, 150):
        out = torch.full_like(args[0], float("nan"))
        lse = torch.full(args[0].shape[:2], float("nan"))
        ragattn.paged_attention(*args, None, window_left, out=out, lse_out=lse)
        check_against_reference(args, out, lse, window_left)


def test_a_row_does_not_depend_on_its_batch(seed):
    """Each row's result is a function of its own visible slots only: bit-identical alone or among
    other rows and sequences (the kernel's chunks are aligned to absolute slots)."""
    q_positions = [[3, 130, 131, 250], [17], [200, 201]]
    args = make_case(q_positions, [260, 18, 202], num_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                     dtype=torch.float32, device="cpu")
    q, q_pos, cu, k, v, bt, kvl = args
    for window_left in (-1, 40):
        out, lse = ragattn.paged_attention(*args, None, window_left)
        row = 0
        for b, ps in enumerate(q_positions):
            for _ in ps:
                one = ragattn.paged_attention(q[row:row + 1], q_pos[row:row + 1], torch.tensor([0, 1], dtype=I32),
                                              k, v, bt[b:b + 1], kvl[b:b + 1], None, window_left)
                assert torch.equal(one[0][0], out[row]) and torch.equal(one[1][0], lse[row]), (b, row)
                row += 1


def test_invisible_slots_across_chunks_are_never_read(seed):
    """NaN in every slot no row sees (between and around windows that cross chunk boundaries, and
    right of a row inside the last 8-slot block of dot products): the output stays finite."""
    ps = 8
    q_positions = [[129, 250, 253]]
    args = list(make_case(q_positions, [300], num_heads=3, num_kv_heads=1, head_dim=64, page_size=ps,
                          dtype=torch.float32, device="cpu"))
    window_left = 100
    clean = ragattn.paged_attention(*args, None, window_left)
    seen = set()
    for p in q_positions[0]:
        seen.update(range(p - window_left, p + 1))
    k, v = args[3].clone(), args[4].clone()
    for j in range(300):
        if j not in seen:
            page, off = _slot(args[5][0], j, ps)
            k[page, off] = float("nan")
            v[page, off] = float("inf")
    out, lse = ragattn.paged_attention(*args[:3], k, v, *args[5:], None, window_left)
    assert torch.equal(out, clean[0]) and torch.equal(lse, clean[1])


def test_nonfinite_score_in_a_later_chunk(seed):
    """A NaN/+inf visible score in the second chunk (after the first was accumulated) poisons the
    (row, head)s that see it, and nothing else: the other kv head's heads and the row that does
    not reach the slot keep their exact results."""
    args = list(make_case([[200, 100]], [201], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                          dtype=torch.float32, device="cpu"))
    args[0][..., 5] = args[0][..., 5].abs() + 0.5  # q . k = +inf below (a -inf score has weight 0)
    clean = ragattn.paged_attention(*args)
    k = args[3].clone()
    page, off = _slot(args[5][0], 150, 16)
    k[page, off, 0, 5] = float("inf")  # kv head 0: query heads 0 and 1
    args[3] = k
    out, lse = ragattn.paged_attention(*args)
    assert torch.isnan(out[0, :2]).all() and torch.isnan(lse[0, :2]).all()
    assert torch.equal(out[0, 2:], clean[0][0, 2:]) and torch.equal(lse[0, 2:], clean[1][0, 2:])
    assert torch.equal(out[1], clean[0][1]) and torch.equal(lse[1], clean[1][1])


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_agree(seed, threads):
    """The result does not depend on the thread count (tasks are whole rows)."""
    args = make_case([list(range(0, 300, 7))], [300], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                     dtype=torch.float32, device="cpu")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ragattn.paged_attention(*args)
        torch.set_num_threads(threads)
        got = ragattn.paged_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bf16_and_fp16_inputs_are_read_exactly(seed):
    """bf16/fp16 K, V and q widen exactly to float: the kernel's result equals the float32 kernel
    on the same (widened) values, bit for bit, before the output's rounding."""
    for dtype in (torch.bfloat16, torch.float16):
        args = make_case([[40, 90]], [91], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                         dtype=dtype, device="cpu")
        low = ragattn.paged_attention(*args)
        wide = ragattn.paged_attention(*[a.float() if a.is_floating_point() else a for a in args])
        assert torch.equal(low[0], wide[0].to(dtype)) and torch.equal(low[1], wide[1])
