"""``ragattn.verify_draft``: chain speculative verification, standard and RAPID's modified target."""
from __future__ import annotations

import math
import numbers
import os
from typing import Optional, Tuple

import torch

from ragattn.ops import backend
from ragattn.ops._direct_call import plain_cpu_call
from ragattn.ops._validate import FLOAT_DTYPES, check_same_device, check_tensor
from ragattn.reference.speculative import verify_draft as _reference

_OP = "verify_draft"


def _check_scalar_types(temperature, eta, alpha) -> None:
    for name, val in (("temperature", temperature), ("eta", eta), ("alpha", alpha)):
        if not isinstance(val, (int, float)) or isinstance(val, bool):
            raise TypeError(f"ragattn.{_OP}: {name} must be a float, got {type(val).__name__}")


def _validate(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, num_draft,
              cu_num_draft=None) -> None:
    """The Python twin of check_verify_draft_args (csrc/speculative/verify_draft_cpu.cpp), for the
    paths that do not reach it: the reference, the fake impl, and the CUDA debug-mode value checks."""
    check_tensor(_OP, "draft_tokens", draft_tokens, dtypes=(torch.int64,))
    if cu_num_draft is not None:
        check_tensor(_OP, "cu_num_draft", cu_num_draft, dtypes=(torch.int32, torch.int64), ndim=1)
        if cu_num_draft.shape[0] < 1:
            raise ValueError(f"ragattn.{_OP}: cu_num_draft must have shape (B + 1,), got {tuple(cu_num_draft.shape)}")
        if num_draft is not None:
            raise ValueError(f"ragattn.{_OP}: num_draft (padded layout) and cu_num_draft (flat layout) cannot both be given")
        if draft_tokens.dim() != 1:
            raise ValueError(f"ragattn.{_OP}: with cu_num_draft, draft_tokens must be flat with shape (T,), got {tuple(draft_tokens.shape)}")
        bsz, total = cu_num_draft.shape[0] - 1, draft_tokens.shape[0]
        check_tensor(_OP, "target_logits", target_logits, dtypes=FLOAT_DTYPES)
        if target_logits.dim() != 2 or target_logits.shape[0] != total + bsz or target_logits.shape[1] < 1:
            raise ValueError(f"ragattn.{_OP}: with cu_num_draft, target_logits must have shape (T + B, V) = ({total + bsz}, V) with V >= 1, got {tuple(target_logits.shape)}")
        vocab = target_logits.shape[1]
        q_shape, u_shape = (total, vocab), (total + bsz,)
    else:
        check_tensor(_OP, "draft_tokens", draft_tokens, ndim=2)
        bsz, g = draft_tokens.shape
        check_tensor(_OP, "target_logits", target_logits, dtypes=FLOAT_DTYPES, ndim=3)
        check_tensor(_OP, "target_logits", target_logits, shape=(bsz, g + 1, None))
        vocab = target_logits.shape[2]
        if vocab < 1:
            raise ValueError(f"ragattn.{_OP}: target_logits must have a vocabulary of at least 1, got shape {tuple(target_logits.shape)}")
        q_shape, u_shape = (bsz, g, vocab), (bsz, g + 1)
    if draft_probs is not None:
        check_tensor(_OP, "draft_probs", draft_probs, dtypes=(torch.float32,), shape=q_shape)
    check_tensor(_OP, "uniforms", uniforms, dtypes=(torch.float32,), shape=u_shape)
    if num_draft is not None:
        check_tensor(_OP, "num_draft", num_draft, dtypes=(torch.int32, torch.int64), shape=(bsz,))
    check_same_device(_OP, target_logits=target_logits, draft_tokens=draft_tokens, draft_probs=draft_probs,
                      uniforms=uniforms, num_draft=num_draft, cu_num_draft=cu_num_draft)
    _check_scalar_types(temperature, eta, alpha)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"ragattn.{_OP}: temperature must be finite and > 0, got {temperature}")
    if not (math.isfinite(eta) and eta >= 0):
        raise ValueError(f"ragattn.{_OP}: eta must be finite and >= 0, got {eta}")
    if not (math.isfinite(alpha) and 0 <= alpha <= 1):
        raise ValueError(f"ragattn.{_OP}: alpha must be in [0, 1], got {alpha}")


def _check_values(draft_tokens, target_logits, uniforms, num_draft, cu_num_draft=None) -> None:
    """Index and range checks (they read the data: a sync on CUDA, so only on CPU or in debug mode)."""
    vocab = target_logits.shape[-1]
    if cu_num_draft is not None:
        cu = cu_num_draft.long()
        total = draft_tokens.shape[0]
        if int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(f"ragattn.{_OP}: cu_num_draft must start at 0 and end at T = {total} (the number of draft tokens), got {int(cu[0])} .. {int(cu[-1])}")
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"ragattn.{_OP}: cu_num_draft must be non-decreasing")
        used = torch.ones_like(draft_tokens, dtype=torch.bool)
    else:
        bsz, g = draft_tokens.shape
        nd = torch.full((bsz,), g, device=draft_tokens.device) if num_draft is None else num_draft.long()
        bad = (nd < 0) | (nd > g)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"ragattn.{_OP}: num_draft must be in [0, {g}], got {int(nd[b])} in row {b}")
        used = torch.arange(g, device=draft_tokens.device)[None, :] < nd[:, None]
    bad = used & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"ragattn.{_OP}: draft_tokens must be in [0, V = {vocab}), got {int(draft_tokens[at])} at {list(at)}")
    bad = ~((uniforms >= 0) & (uniforms < 1))
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"ragattn.{_OP}: uniforms must be in [0, 1), got {float(uniforms[at])} at {list(at)}")


def verify_draft(
    draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float = 1.0,
    eta: float = 0.0,
    alpha: float = 0.1,
    greedy: bool = False,
    num_draft: Optional[torch.Tensor] = None,
    cu_num_draft: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of draft chains against the target model in one call (no host sync).

    Args:
        draft_tokens: int64 ``[B, g]``, the drafted tokens ``x_j`` of each chain.
        draft_probs: float32 ``[B, g, V]``, the draft distribution ``q_j`` each ``x_j`` was sampled
            from (already at the sampling temperature; rows need not be exactly normalised), or
            None for drafters without a distribution (n-gram / prompt lookup): ``q_j`` is then
            one-hot on ``x_j``, so a draft is accepted iff ``u_j < p_hat(x_j)``, the residual is
            ``max(p - min(onehot, p_hat), 0)`` (for ``eta = 0``: ``p`` with ``x_j`` removed), and
            ``eta > 0`` is defined by the same formula (the mask ``q >= alpha * max q`` is ``{x_j}``
            for ``alpha > 0``: RAPID's shift then raises the draft token only).
        target_logits: fp16/bf16/fp32 ``[B, g + 1, V]``, raw target logits ``z`` at the ``g + 1``
            verified positions (position ``g`` scores the bonus token). ``-inf`` marks a token the
            target forbids (probability 0). Math is fp32 whatever the dtype.
        uniforms: float32 ``[B, g + 1]`` in ``[0, 1)``: ``uniforms[:, j]`` is draft ``j``'s acceptance
            draw, ``uniforms[:, g]`` the draw of the final token (by inverse CDF). Ignored if greedy.
        temperature: ``T > 0``; ``p = softmax(z / T)``, computed as ``softmax((z - max z) * (1 / T))`` so
            any small ``T`` is safe: as ``T -> 0`` (and for ``T`` below ``1 / FLT_MAX``, where ``1 / T``
            saturates) ``p`` becomes the uniform distribution over the argmax ties of ``z``, and sampling
            becomes greedy decoding.
        eta: RAPID's transfer strength, ``>= 0`` (0 = standard speculative sampling).
        alpha: RAPID's mask threshold in ``[0, 1]``: the shift applies where ``q >= alpha * max q``.
        greedy: deterministic mode (below).
        num_draft: optional int32/int64 ``[B]`` in ``[0, g]``: row ``b`` verifies only its first
            ``num_draft[b]`` drafts (chains of different lengths padded to ``g``; padded tokens, probs
            and acceptance uniforms are ignored, the final draw still uses ``uniforms[:, g]``).
        cu_num_draft: optional int32/int64 ``[B + 1]``, vLLM's flat layout instead of the padded
            one (cumulative draft counts from 0, non-decreasing, ending at T): ``draft_tokens [T]``,
            ``draft_probs [T, V]`` or None, ``target_logits [T + B, V]`` and ``uniforms [T + B]``,
            where request ``b`` owns draft rows ``cu[b] .. cu[b + 1]`` and logits / uniform rows
            ``cu[b] + b .. cu[b + 1] + b`` (its ``g_b`` drafted positions, then its bonus
            position: the rows a verification forward over ``last token + drafts`` produces);
            uniform row ``cu[b + 1] + b`` is the final draw. ``out_tokens`` is then ``[T + B]``
            in the same rows (accepted drafts, the emitted token, then -1). Not with ``num_draft``.

    Returns:
        ``out_tokens`` int64 ``[B, g + 1]``: the accepted drafts, then the one token drawn at the first
        rejection (or the bonus token), then ``-1``; ``num_accepted`` int32 ``[B]``: the number ``n`` of
        accepted drafts, so row ``b`` emits ``n + 1`` tokens.

    The rule, per position ``j < num_draft``, with ``p = softmax(z_j / T)``,
    ``p_hat = softmax(z_j / T + eta * mask * (q_j - p))``, ``mask = q_j >= alpha * max(q_j)``
    (``p_hat = p`` when ``eta = 0``): accept ``x_j`` iff ``q_j(x_j) > 0`` and
    ``u_j * q_j(x_j) < p_hat(x_j)`` (i.e. with probability ``min(1, p_hat / q)``); at the first
    rejection draw the final token from ``norm(max(p - min(q_j, p_hat), 0))`` (from ``p`` when that
    is all zero); if every draft is accepted draw the bonus token from ``p`` at position ``num_draft``.

    Output distribution, for drafts sampled from ``q``:

    * ``eta = 0``: every emitted token follows the target ``p`` exactly (standard speculative
      sampling, Leviathan et al. / Chen et al.).
    * ``eta > 0``: deliberately NOT ``p``. A token emitted at a drafted position follows RAPID's
      modified distribution ``min(q, p_hat) + (1 - beta) * norm(max(p - min(q, p_hat), 0))`` with
      ``beta = sum(min(q, p_hat))`` (notes-rapid.md §2.6: the method biases the target towards
      the retrieval-augmented drafter); the bonus token follows ``p``.
    * ``greedy``: deterministic. Accept while ``x_j == argmax p_hat_j`` (first index on ties),
      emit ``argmax p_hat_j`` at the first mismatch and ``argmax p`` as the bonus: greedy decoding
      of ``p_hat``, independent of ``g`` apart from the bonus.

    Deterministic given ``uniforms``; the CUDA kernel and the CPU twin (``RAGATTN_CPU_BACKEND=twin``)
    return the same tokens. The fast default CPU path rounds differently: it returns the float64
    reference's tokens wherever the reference's decisions are not within float32 rounding of a
    threshold (acceptance ``u q(x) < p_hat(x)``, the inverse-CDF crossing, a greedy near-tie of
    ``p_hat``); exact ties of ``z`` are decided alike by every backend.
    CPU: draft tokens outside ``[0, V)``, uniforms outside ``[0, 1)`` and ``num_draft`` outside
    ``[0, g]`` (or a ``cu_num_draft`` that does not start at 0, decreases or does not end at T)
    raise ValueError. CUDA: those are preconditions (not checked unless ``RAGATTN_DEBUG=1``,
    which syncs); an out-of-range draft token is rejected, never read.

    Non-finite target logits, one rule on every backend: NaN and ``-inf`` have probability 0;
    where a position has ``+inf`` logits they share all the mass equally (probability
    ``1 / count`` each, every other token 0: the limit of a logit growing without bound, e.g.
    an fp16 overflow); a position whose logits are all ``-inf``/NaN has no mass: its draft is
    rejected and it emits token 0.

    Backends: CUDA C++ kernel; on CPU a fast C++ path (default), the kernel's bit-faithful C++ twin
    with ``RAGATTN_CPU_BACKEND=twin``, or the float64 reference with ``RAGATTN_CPU_BACKEND=reference``.
    """
    _check_scalar_types(temperature, eta, alpha)  # (the schema would coerce or reject them unnamed)
    on_cpu = isinstance(target_logits, torch.Tensor) and target_logits.device.type == "cpu"
    # The C++ kernels validate shapes, dtypes and devices, and on CPU the values too; the CUDA
    # kernel does not read values (a sync): checked here in debug mode.
    if not on_cpu and os.environ.get("RAGATTN_DEBUG", "0") == "1":
        _validate(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, num_draft, cu_num_draft)
        _check_values(draft_tokens, target_logits, uniforms, num_draft, cu_num_draft)
    args = (draft_tokens, draft_probs, target_logits, uniforms, float(temperature), float(eta), float(alpha),
            bool(greedy), num_draft, cu_num_draft)
    if on_cpu and plain_cpu_call(target_logits, draft_tokens, draft_probs, uniforms, num_draft, cu_num_draft):
        return _verify_draft_cpu(*args)   # what torch.ops would run, without its dispatch
    return torch.ops.ragattn.verify_draft(*args)


def _verify_draft_cpu(draft_tokens, draft_probs, target_logits, uniforms, temperature=1.0, eta=0.0, alpha=0.1,
                      greedy=False, num_draft=None, cu_num_draft=None):
    """``torch.ops.ragattn.verify_draft`` on the CPU, the op's one choice of CPU backend
    (``RAGATTN_CPU_BACKEND``, read on every call): the float64 reference after the op's checks
    (``reference``), else the C++ kernel ``ragattn::_verify_draft_cpu`` (every check in C++): the
    CUDA kernel's bit-faithful twin (``twin``) or the fast path."""
    chosen = backend.choose("verify_draft", "cpu")
    if chosen == backend.REFERENCE:
        _validate(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, num_draft, cu_num_draft)
        _check_values(draft_tokens, target_logits, uniforms, num_draft, cu_num_draft)
        return _reference(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, greedy, num_draft,
                          cu_num_draft=cu_num_draft)
    return torch.ops.ragattn._verify_draft_cpu(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta,
                                               alpha, greedy, num_draft, cu_num_draft, chosen == backend.TWIN)


torch.library.impl("ragattn::verify_draft", "CPU", _verify_draft_cpu)


@torch.library.register_fake("ragattn::verify_draft")
def _verify_draft_fake(draft_tokens, draft_probs, target_logits, uniforms, temperature=1.0, eta=0.0, alpha=0.1,
                       greedy=False, num_draft=None, cu_num_draft=None):
    _validate(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, num_draft, cu_num_draft)
    if cu_num_draft is not None:
        bsz = cu_num_draft.shape[0] - 1
        out = draft_tokens.new_empty((target_logits.shape[0],))
    else:
        bsz, g = draft_tokens.shape
        out = draft_tokens.new_empty((bsz, g + 1))
    return out, draft_tokens.new_empty((bsz,), dtype=torch.int32)


@torch.library.register_fake("ragattn::_verify_draft_cpu")
def _verify_draft_cpu_fake(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, greedy,
                           num_draft, cu_num_draft, twin):
    return _verify_draft_fake(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, greedy,
                              num_draft, cu_num_draft)


def verify_draft_vllm(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    *,
    bonus_logits: Optional[torch.Tensor] = None,
    bonus_token_ids: Optional[torch.Tensor] = None,
    temperature=1.0,
    generators: Optional[dict] = None,
    max_spec_len: Optional[int] = None,
    eta: float = 0.0,
    alpha: float = 0.1,
) -> torch.Tensor:
    """:func:`verify_draft` on vLLM's rejection-sampler layout (``vllm/v1/sample/rejection_sampler.py``).

    Args:
        draft_token_ids: int64 ``[T]``, every request's drafts back to back.
        cu_num_draft_tokens: int32/int64 ``[B]``, vLLM's cumulative *ends* (request ``b`` owns
            drafts ``cu[b - 1] .. cu[b]``, ``cu[-1] = 0``; no leading 0).
        target_logits: fp16/bf16/fp32 ``[T, V]``, the target's logits at the drafted positions only.
        draft_probs: float32 ``[T, V]`` or None (n-gram / prompt-lookup drafts: one-hot).
        bonus_logits: ``[B, V]`` (target_logits' dtype), the target's logits after each request's
            last draft; the bonus token is drawn from them when every draft is accepted. Or
        bonus_token_ids: int64 ``[B]`` or ``[B, 1]``, the bonus tokens vLLM already sampled (then
            emitted as they are). Exactly one of the two.
        temperature: a float for the batch, or float32 ``[B]`` (vLLM's per-request
            ``sampling_metadata.temperature``); a request at temperature ``<= 1e-5`` (vLLM's
            greedy threshold; vLLM writes 0.0) is verified greedily, the others are sampled. Either
            form must be finite and ``>= 0`` (ValueError naming the request); the division by the
            temperature is done in float32 whatever the logits' dtype, as :func:`verify_draft` does.
        generators: vLLM's ``sampling_metadata.generators``, ``{request index: torch.Generator}``:
            the uniforms of request ``b`` (its ``g_b`` acceptance draws, then the final draw) come from
            its generator when it has one, else from torch's default generator on the device.
        max_spec_len: the output's width minus one (default: the largest ``g_b``).
        eta, alpha: RAPID's modified target, as in :func:`verify_draft`.

    Returns:
        int64 ``[B, max_spec_len + 1]`` in vLLM's convention: the accepted drafts, the emitted
        token, then ``-1`` (vLLM's ``PLACEHOLDER_TOKEN_ID``); ``num_accepted = (out != -1).sum(1) - 1``.

    Runs :func:`verify_draft`'s flat layout (``cu_num_draft``): the logits are interleaved into
    ``[T + B, V]`` (one copy of the logits), the per-request temperatures folded into them
    (``z / T_b``, then ``temperature=1``), greedy and sampled requests verified in one call each.
    Tested against the padded native layout on random ragged batches (tests/ops/test_verify_draft_vllm.py).
    """
    op = "verify_draft_vllm"
    check_tensor(op, "draft_token_ids", draft_token_ids, dtypes=(torch.int64,), ndim=1)
    check_tensor(op, "cu_num_draft_tokens", cu_num_draft_tokens, dtypes=(torch.int32, torch.int64), ndim=1)
    check_tensor(op, "target_logits", target_logits, dtypes=FLOAT_DTYPES, ndim=2)
    dev, bsz, total = target_logits.device, cu_num_draft_tokens.shape[0], draft_token_ids.shape[0]
    vocab = target_logits.shape[1]
    if target_logits.shape[0] != total:
        raise ValueError(f"ragattn.{op}: target_logits must have shape (T, V) = ({total}, V), got {tuple(target_logits.shape)}")
    if (bonus_logits is None) == (bonus_token_ids is None):
        raise ValueError(f"ragattn.{op}: give exactly one of bonus_logits ([B, V]) and bonus_token_ids ([B])")
    ends = cu_num_draft_tokens.to(device=dev, dtype=torch.int64)
    cu = torch.cat((ends.new_zeros(1), ends))  # [B + 1], verify_draft's flat layout
    counts = (cu[1:] - cu[:-1]).tolist()  # host copy: the uniforms below are drawn per request anyway
    if any(c < 0 for c in counts) or (bsz and int(ends[-1]) != total):
        raise ValueError(f"ragattn.{op}: cu_num_draft_tokens must be non-decreasing cumulative ends reaching T = {total}")
    width = max(counts, default=0) if max_spec_len is None else int(max_spec_len)
    if counts and max(counts) > width:
        raise ValueError(f"ragattn.{op}: max_spec_len = {width} is below a request's {max(counts)} drafts")
    if bonus_logits is not None:
        check_tensor(op, "bonus_logits", bonus_logits, dtypes=(target_logits.dtype,), shape=(bsz, vocab), device=dev)
        bonus = bonus_logits
    else:
        ids = bonus_token_ids.reshape(-1)
        check_tensor(op, "bonus_token_ids", ids, dtypes=(torch.int64,), shape=(bsz,), device=dev)
        if bsz:  # (a host read, as counts above; on CUDA scatter_ would hit a device-side assert)
            lo, hi = (int(x) for x in ids.aminmax())
            if lo < 0 or hi >= vocab:
                raise ValueError(f"ragattn.{op}: bonus_token_ids must be token ids in [0, V = {vocab}), got {lo} .. {hi}")
        # one-hot logits: p puts all its mass on the given token, which the final draw then emits
        bonus = torch.full((bsz, vocab), float("-inf"), dtype=target_logits.dtype, device=dev)
        bonus.scatter_(1, ids[:, None], 0.0)
    # native rows: request b's drafts at cu[b] + b .., its bonus at cu[b + 1] + b
    arange_b = torch.arange(bsz, device=dev)
    req = torch.repeat_interleave(arange_b, torch.as_tensor(counts, dtype=torch.int64, device=dev), output_size=total)
    row_req = torch.repeat_interleave(arange_b, torch.as_tensor(counts, dtype=torch.int64, device=dev) + 1,
                                      output_size=total + bsz)  # the request of each native row
    logits = target_logits.new_empty((total + bsz, vocab))
    logits.index_copy_(0, torch.arange(total, device=dev) + req, target_logits)
    logits.index_copy_(0, cu[1:] + arange_b, bonus)
    uniforms = torch.empty(total + bsz, dtype=torch.float32, device=dev)
    gens = generators or {}
    for b in range(bsz):
        lo, n = int(cu[b]) + b, counts[b] + 1
        gen = gens.get(b)
        uniforms[lo:lo + n] = torch.rand(n, generator=gen, device=dev) if gen is not None else torch.rand(n, device=dev)
    # One rule for a float and a per-request tensor: finite and >= 0 (NaN, inf, negative refused),
    # <= 1e-5 greedy (vLLM's 0.0), and the division by T done in float32 whatever the logits' dtype
    # (z / T in fp16 overflows to inf for a small T and would accept any draft).
    if isinstance(temperature, torch.Tensor):
        check_tensor(op, "temperature", temperature, dtypes=(torch.float32,), shape=(bsz,))
        t = temperature.to(dev)
        bad = ~torch.isfinite(t) | (t < 0)
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            raise ValueError(f"ragattn.{op}: temperature must be finite and >= 0 (<= 1e-5: greedy), got {float(t[b])} "
                             f"for request {b}")
        greedy_req = t <= 1e-5
        t_row = torch.where(greedy_req, torch.ones_like(t), t)[row_req]
        args = (draft_token_ids, draft_probs, logits.float() / t_row[:, None], uniforms, 1.0, eta, alpha)
        flat, _ = verify_draft(*args, greedy=False, cu_num_draft=cu)
        if bool(greedy_req.any()):
            greedy_flat, _ = verify_draft(*args, greedy=True, cu_num_draft=cu)
            flat = torch.where(greedy_req[row_req], greedy_flat, flat)
    else:
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise TypeError(f"ragattn.{op}: temperature must be a float or a float32 [B] tensor, "
                            f"got {type(temperature).__name__}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"ragattn.{op}: temperature must be finite and >= 0 (<= 1e-5: greedy), got {temperature}")
        greedy = float(temperature) <= 1e-5
        flat, _ = verify_draft(draft_token_ids, draft_probs, logits, uniforms, 1.0 if greedy else float(temperature),
                               eta, alpha, greedy=greedy, cu_num_draft=cu)
    out = torch.full((bsz, width + 1), -1, dtype=torch.int64, device=dev)
    j = torch.arange(width + 1, device=dev)[None, :]
    keep = j <= torch.as_tensor(counts, device=dev)[:, None]
    src = (cu[:-1] + torch.arange(bsz, device=dev))[:, None] + j
    out[keep] = flat[src[keep]]
    return out
