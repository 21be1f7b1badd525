"""Logit soft-capping (Gemma 2's ``attn_logit_softcapping``; FlashInfer's ``logits_soft_cap``) for the
attention kernels, in the base-2 domain they form scores in: a score ``s`` (already scaled)
becomes ``cap * tanh(s / cap)``; with ``x = s * log2(e)`` and ``c = cap * log2(e)`` that is
``c * tanh(x / c)``, so the kernels pass ``c`` and keep their log2-domain scores."""
import triton
import triton.language as tl


@triton.jit
def soft_cap_log2(x, cap_log2):
    """``cap_log2 * tanh(x / cap_log2)`` elementwise (``x`` fp32 log2-domain scores). tanh from
    exp2 (the interpreter has no libdevice): ``(1 - e) / (1 + e)`` with ``e = exp(-2|y|)`` in
    (0, 1], so +-inf map to +-cap and NaN stays NaN."""
    y = x / cap_log2
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(y))  # exp(-2|y|) = 2^(-2 log2(e) |y|)
    t = (1.0 - e) / (1.0 + e)
    return cap_log2 * tl.where(y < 0, -t, t)


@triton.jit
def soft_cap_grad(capped_log2, cap_log2):
    """d(cap tanh(s / cap)) / ds = 1 - tanh^2, from the capped log2-domain score."""
    t = capped_log2 / cap_log2
    return 1.0 - t * t
