"""refrag_assemble (REFRAG's mixed token / chunk decoder input) vs its reference: forward bit for
bit (rows are copies), backward (gradcheck in float64, index_add semantics), opcheck, the fake
impl, validation, inference mode, on every backend (default torch gather, Triton interpreter)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragattn
from ragattn.reference.refrag_assemble import refrag_assemble as ref_assemble
from tests.helpers import randn_nonzero, use_kernel_backend


@pytest.fixture(params=["default", "triton"])
def backend(request, monkeypatch, device):
    use_kernel_backend(monkeypatch, device, request.param)
    return request.param


def _random_layout(n_tok, n_chunks, gen, p_chunk=0.4):
    """slot_src over a random mix: token slots read random token indices (repeats allowed),
    chunk slots random chunk rows (some chunks read twice, some never)."""
    n_out = max(1, n_tok + n_chunks - 3)
    tok = torch.randint(0, max(n_tok, 1), (n_out,), generator=gen)
    chk = -torch.randint(1, max(n_chunks, 1) + 1, (n_out,), generator=gen)
    use_chunk = torch.rand(n_out, generator=gen) < p_chunk
    if n_tok == 0:
        use_chunk[:] = True
    if n_chunks == 0:
        use_chunk[:] = False
    return torch.where(use_chunk, chk, tok)


@pytest.mark.parametrize("dtype,idx_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32),
                                             (torch.float16, torch.int64)])
@pytest.mark.parametrize("n_tok,n_chunks,d", [(37, 5, 77), (1, 1, 1), (0, 3, 64), (29, 0, 130), (200, 17, 576)])
def test_forward_matches_reference(backend, device, seed, dtype, n_tok, n_chunks, d, idx_dtype):
    gen = torch.Generator().manual_seed(seed)
    vocab = 101
    w = randn_nonzero(vocab, d, dtype=dtype, device=device, generator=gen)
    chunks = randn_nonzero(n_chunks, d, dtype=dtype, device=device, generator=gen)
    ids = torch.randint(0, vocab, (n_tok,), generator=gen).to(device=device, dtype=idx_dtype)
    src = _random_layout(n_tok, n_chunks, gen).to(device=device, dtype=idx_dtype)
    out = ragattn.refrag_assemble(w, ids, chunks, src)
    ref = ref_assemble(w.cpu(), ids.cpu(), chunks.cpu(), src.cpu())
    assert out.shape == (src.numel(), d) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out.cpu(), ref)  # pure copies: bit for bit


def test_nothing_compressed_is_embedding_lookup(backend, device):
    gen = torch.Generator().manual_seed(1)
    w = randn_nonzero(1000, 96, dtype=torch.bfloat16, device=device, generator=gen)
    ids = torch.randint(0, 1000, (333,), generator=gen).to(device)
    out = ragattn.refrag_assemble(w, ids, w.new_empty(0, 96), torch.arange(333, device=device))
    assert torch.equal(out, F.embedding(ids, w))


def test_strided_inputs(backend, device, seed):
    gen = torch.Generator().manual_seed(seed)
    w = randn_nonzero(50, 2 * 33, device=device, generator=gen)[:, ::2]     # non-unit last stride
    chunks = randn_nonzero(33, 9, device=device, generator=gen).t()           # [9, 33], transposed
    ids = torch.randint(0, 50, (40,), generator=gen).to(device)[::2]
    src = _random_layout(20, 9, gen).to(device)
    out = ragattn.refrag_assemble(w, ids, chunks, src)
    assert torch.equal(out.cpu(), ref_assemble(w.cpu(), ids.cpu(), chunks.cpu(), src.cpu()))


def test_gradcheck_float64(device, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(11, 5, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    chunks = torch.randn(4, 5, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    ids = torch.randint(0, 11, (9,), generator=gen).to(device)
    src = _random_layout(9, 4, gen).to(device)
    assert torch.autograd.gradcheck(lambda a, b: ragattn.refrag_assemble(a, ids, b, src), (w, chunks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_reference(backend, device, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = randn_nonzero(31, 24, dtype=dtype, device=device, generator=gen)
    chunks = randn_nonzero(6, 24, dtype=dtype, device=device, generator=gen)
    ids = torch.randint(0, 31, (45,), generator=gen).to(device)
    src = _random_layout(45, 6, gen).to(device)
    g = randn_nonzero(src.numel(), 24, dtype=dtype, device=device, generator=gen)
    a, b = w.clone().requires_grad_(), chunks.clone().requires_grad_()
    ragattn.refrag_assemble(a, ids, b, src).backward(g)
    # float64 reference gradient, then the op's (sums of a few rows) within the dtype's rounding
    a64, b64 = w.double().cpu().requires_grad_(), chunks.double().cpu().requires_grad_()
    ref_assemble(a64, ids.cpu(), b64, src.cpu()).backward(g.double().cpu())
    tol = dict(atol=4 * torch.finfo(dtype).eps * 8, rtol=4 * torch.finfo(dtype).eps)
    torch.testing.assert_close(a.grad.cpu().double(), a64.grad, **tol)
    torch.testing.assert_close(b.grad.cpu().double(), b64.grad, **tol)
    assert a.grad.dtype == dtype and b.grad.dtype == dtype


def test_backward_nan_in_other_kind_does_not_leak(device):
    """A NaN gradient at a chunk slot must not reach embed_weight (and vice versa): the backward
    selects with where, never 0 * grad."""
    w = torch.randn(5, 3, device=device, requires_grad=True)
    c = torch.randn(2, 3, device=device, requires_grad=True)
    ids = torch.tensor([0, 1, 2], device=device)
    src = torch.tensor([0, -1, 1, -2, 2], device=device)
    g = torch.ones(5, 3, device=device)
    g[1] = float("nan")   # chunk 0's slot
    g[2] = float("inf")   # token 1's slot
    ragattn.refrag_assemble(w, ids, c, src).backward(g)
    assert torch.isnan(c.grad[0]).all() and torch.isfinite(c.grad[1]).all()
    assert torch.isfinite(w.grad[[0, 2, 3, 4]]).all() and torch.isinf(w.grad[1]).all()


def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(13, 8, generator=gen).to(device).requires_grad_()
    c = torch.randn(3, 8, generator=gen).to(device).requires_grad_()
    ids = torch.randint(0, 13, (10,), generator=gen).to(device)
    src = _random_layout(10, 3, gen).to(device)
    torch.library.opcheck(torch.ops.ragattn.refrag_assemble, (w, ids, c, src))
    torch.library.opcheck(torch.ops.ragattn.refrag_assemble, (w.detach(), ids.int(), c.detach()[:0], torch.arange(10, device=device)))


def test_fake_impl_validates_like_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w, c = torch.empty(13, 8), torch.empty(3, 8)
        out = torch.ops.ragattn.refrag_assemble(w, torch.empty(10, dtype=torch.int64), c, torch.empty(7, dtype=torch.int64))
        assert out.shape == (7, 8)
        with pytest.raises(ValueError, match="d = 8"):
            torch.ops.ragattn.refrag_assemble(w, torch.empty(10, dtype=torch.int64), torch.empty(3, 9),
                                              torch.empty(7, dtype=torch.int64))


def test_inference_mode(device):
    w, c = torch.randn(13, 8, device=device), torch.randn(3, 8, device=device)
    src = torch.tensor([0, -3, 2], device=device)
    ids = torch.tensor([4, 5, 6], device=device)
    with torch.inference_mode():
        out = ragattn.refrag_assemble(w, ids, c, src)
    assert torch.equal(out.cpu(), torch.stack([w[4], c[2], w[6]]).cpu())


@pytest.mark.parametrize("args,err,match", [
    (dict(src=[0, 3]), ValueError, r"slot_src values must lie in \[-2, 2\]"),
    (dict(src=[0, -3]), ValueError, r"slot_src values must lie"),
    (dict(ids=[0, 1, 13]), ValueError, r"token_ids must lie in \[0, 12\]"),
    (dict(ids=[0, -1, 2]), ValueError, r"token_ids must lie"),
    (dict(src=[]), ValueError, "slot_src is empty"),
    (dict(d_chunk=9), ValueError, r"chunk_embeds must have the decoder's embedding size d = 8"),
    (dict(chunk_dtype=torch.float16), TypeError, "chunk_embeds must have embed_weight's dtype"),
    (dict(ids_dtype=torch.float32), TypeError, "token_ids must be int32 or int64"),
    (dict(w_shape=(0, 8)), ValueError, "non-empty"),
])
def test_validation(args, err, match):
    w = torch.randn(*args.get("w_shape", (13, 8)))
    c = torch.randn(2, args.get("d_chunk", 8)).to(args.get("chunk_dtype", torch.float32))
    ids = torch.tensor(args.get("ids", [0, 1, 2])).to(args.get("ids_dtype", torch.int64))
    src = torch.tensor(args.get("src", [0, -1, 2]), dtype=torch.int64)
    with pytest.raises(err, match=f"ragattn.refrag_assemble: .*{match}"):
        ragattn.refrag_assemble(w, ids, c, src)


_COMPILE_CHECK = r"""
import ragattn.triton_kernels.refrag_assemble as ra
from tests.helpers import compile_many_sm90

jobs = []
for elt, idx in (("bf16", "i64"), ("fp32", "i32")):   # a pure copy: fp16 compiles like bf16
    jobs.append((ra._assemble_kernel, dict(BLOCK_D=1024),
                 {"weight": "*" + elt, "chunks": "*" + elt, "out": "*" + elt,
                  "token_ids": "*" + idx, "slot_src": "*" + idx}, {}))
compile_many_sm90(jobs)
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """The assembly kernel compiles for an H100 (sm_90) in bf16 and fp32, int64 and int32 indices; needs no
    GPU (a subprocess: this process's kernels are interpreter objects)."""
    from tests.helpers import run_compile_check

    run_compile_check(_COMPILE_CHECK)
