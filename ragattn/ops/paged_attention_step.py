"""``ragattn.ops.PagedAttentionStep``: one forward's ``paged_attention`` over a ``ragattn.PageTable``,
run by every layer (what request caches and the vLLM backend hold per step).

What belongs to the step (its query offsets, page table and bounds) is checked once, when the
step is made; a layer's run checks only what a layer brings (q, the caches, the outputs), in O(1)
on the CPU's C++ path: no tensor reduction and no host read per layer.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ragattn.ops._direct_call import plain_cpu_call
from ragattn.ops._validate import INDEX_DTYPES, check_no_overlap, check_tensor
from ragattn.ops.page_table import PageTable
from ragattn.ops import backend
from ragattn.ops.paged_attention import paged_attention
from ragattn.ops.paged_attention_run import plan_paged_attention, run_paged_attention
from ragattn.ops.paged_checks import check_rows_within, cpu_well_formed, is_int, rotary_dim_of, validate_run
from ragattn.ops.paged_kernels import (
    ROPE_TABLE_MAX_POSITIONS,
    cpu_kernel,
    default_scale,
    rope_table,
    run_on_backend,
)

_OP = "PagedAttentionStep"


def _version(t: torch.Tensor) -> Optional[int]:
    """``t``'s version counter (bumped by every in-place write), None for an inference tensor."""
    return None if t.is_inference() else t._version


class PagedAttentionStep:
    """One step (forward) of ``paged_attention`` over a ``PageTable`` for every layer: what a
    request cache holds per forward. ``run`` per layer; the step chooses the call for the
    backend (:func:`ragattn.ops.backend.choose`, read at the step's first run), so
    callers never do:

    * the Triton kernel (CUDA, ``RAGATTN_CPU_BACKEND=triton``): ``plan_paged_attention`` once per
      step and window (at the first run that needs it; no host read when ``max_q_len`` and
      ``max_kv_len`` are given), ``run_paged_attention`` per layer (no host sync);
    * the CPU's C++ kernels and the reference, which read no plan: a padded table through
      the C++ kernel directly (O(1) checks per layer; a profiler sees that kernel's op;
      ``paged_attention``, the public op, under ``torch.compile``, fake and other dispatch modes),
      a position-tagged one through the run op's checks and its CPU kernel (index values checked
      by the kernel as it reads them; the RoPE table of ``inv_freq`` kept across calls), or for
      plain CPU tensors through that kernel directly (the table's entries checked when the step is
      made, ``inv_freq`` and the rows' highest position once per step: O(1) checks per layer).

    Checked when the step is made (once, not per layer): the table's type, ``cu_seqlens_q``'s
    dtype, shape and device, the bounds, and where values may be read (CPU, ``RAGATTN_DEBUG=1``)
    that no sequence has more query rows than ``max_q_len`` ("plan again"). The C++ kernels check
    the index values they follow (offsets, lengths, positions, used pages) in one pass per call.

    Args:
        cu_seqlens_q: int32/int64 ``[B + 1]``, the step's query row offsets (on the table's device).
        table: the step's ``PageTable``.
        max_q_len, max_kv_len: optional non-negative bounds for the plan (both given: planning
            reads nothing).
    """

    def __init__(self, cu_seqlens_q: torch.Tensor, table: PageTable, *, max_q_len: Optional[int] = None,
                 max_kv_len: Optional[int] = None):
        if not isinstance(table, PageTable):
            raise TypeError(f"ragattn.{_OP}: table must be a ragattn.PageTable, got {type(table).__name__}")
        check_tensor(_OP, "cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, shape=(table.batch + 1,),
                     device=table.kv_lens.device)
        for name, value in (("max_q_len", max_q_len), ("max_kv_len", max_kv_len)):
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"ragattn.{_OP}: {name} must be None or a non-negative int, got {value!r}")
        check_rows_within(cu_seqlens_q, max_q_len, cu_seqlens_q.device)   # the rule the plan path follows
        self.cu_seqlens_q, self.table = cu_seqlens_q, table
        self.max_q_len, self.max_kv_len = max_q_len, max_kv_len
        self._rope_hit = None   # _tagged_rope's last answer, with what it was for
        self.plans: dict = {}   # (window_left, num_heads, num_kv_heads, head_dim, dtype) -> plan
        self._backend: Optional[Tuple[str, str]] = None   # (q's device type, its backend) of the first run
        T = torch.Tensor
        # a padded, untagged table of plain CPU tensors: the C++ kernel's direct call
        self._direct = (table.row_start is None and not table.is_tagged
                        and type(cu_seqlens_q) is T and type(table.pages) is T and type(table.kv_lens) is T
                        and cu_seqlens_q.is_cpu and table.pages.is_cpu and table.kv_lens.is_cpu)
        self._storages = ({x.untyped_storage()._cdata for x in (cu_seqlens_q, table.pages, table.kv_lens)}
                          if self._direct else set())
        # a flat, position-tagged page list of plain CPU tensors whose entries are well formed (the
        # run op's checks on them, made here once): the tagged C++ kernel's direct call
        entries = [x for x in (table.entry_pos, table.entry_len, table.entry_start) if x is not None]
        self._tagged_direct = (table.row_start is not None and type(cu_seqlens_q) is T and cu_seqlens_q.is_cpu
                               and all(type(x) is T and x.is_cpu for x in (table.pages, table.row_start,
                                                                          table.kv_lens, *entries))
                               and all(x.dtype in INDEX_DTYPES and x.shape == table.pages.shape for x in entries))

    def run(self, q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: Optional[float] = None, *, window_left: int = -1, inv_freq: Optional[torch.Tensor] = None,
            rotary_dim: Optional[int] = None, interleaved: bool = False, logits_soft_cap: float = 0.0,
            k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
            out: Optional[torch.Tensor] = None,
            lse_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(out [total_q, Hq, D], lse float32 [total_q, Hq])`` of ``run_paged_attention`` over the
        step's table (same arguments; ``inv_freq``: keys stored page-local; ``k_scale``/``v_scale``:
        float8 caches' per-tensor scales). ``out``, ``lse_out``: optional outputs (``[total_q, Hq, D]``
        in q's dtype, float32 ``[total_q, Hq]``; any strides; no overlap with an input), written and
        returned; a missing one is allocated."""
        t = self.table
        chosen = self._backend_of(q)
        scaled = k_scale is not None or v_scale is not None
        if (self._direct and not scaled and chosen == backend.CPP and inv_freq is None and rotary_dim is None
                and plain_cpu_call(q, q_pos, k_cache, v_cache, out, lse_out, under_profiler=True)
                and cpu_well_formed(q, q_pos, self.cu_seqlens_q, k_cache, v_cache, t.pages, t.kv_lens, None, scale,
                                     window_left, logits_soft_cap, False)
                and _outputs_well_formed(q, out, lse_out)):
            if (out is not None or lse_out is not None) and not self._outputs_apart(q, q_pos, k_cache, v_cache, out,
                                                                                    lse_out):
                check_no_overlap("paged_attention", {"out": out, "lse_out": lse_out},
                                 dict(q=q, q_pos=q_pos, cu_seqlens_q=self.cu_seqlens_q, k_cache=k_cache,
                                      v_cache=v_cache, block_table=t.pages, kv_lens=t.kv_lens))
            out = q.new_empty(q.shape) if out is None else out
            lse_out = q.new_empty(q.shape[:2], dtype=torch.float32) if lse_out is None else lse_out
            # (every check of paged_attention's metadata passed; the kernel checks the index values)
            return cpu_kernel(q, q_pos, self.cu_seqlens_q, k_cache, v_cache, t.pages, t.kv_lens, scale, window_left,
                               logits_soft_cap, out, lse_out)
        tagged = inv_freq is not None or t.is_tagged
        if (tagged and self._tagged_direct and not scaled and out is None and lse_out is None and chosen == backend.CPP
                and plain_cpu_call(q, q_pos, k_cache, v_cache, inv_freq, under_profiler=True)
                and cpu_well_formed(q, q_pos, self.cu_seqlens_q, k_cache, v_cache, t.pages, t.kv_lens, t.row_start,
                                     scale, window_left, logits_soft_cap, False)
                and type(interleaved) is bool):
            rope = self._tagged_rope(q, q_pos, inv_freq, rotary_dim)
            if rope is not None:
                # (every check of the run op's metadata passed; the kernel checks the index values)
                return torch.ops.ragattn._paged_attention_tagged_cpu(
                    q, q_pos, self.cu_seqlens_q, k_cache, v_cache, t.pages, t.row_start, t.kv_lens, t.entry_pos,
                    t.entry_len, t.entry_start, rope[0], rope[1], rope[2], interleaved,
                    default_scale(scale, q.shape[-1]),
                    window_left, logits_soft_cap)
        if chosen == backend.TRITON and not (torch.compiler.is_compiling() and not tagged):
            key = (window_left, q.shape[1], k_cache.shape[2], q.shape[2], q.dtype)
            plan = self.plans.get(key)
            if plan is None:
                plan = self.plans[key] = plan_paged_attention(
                    self.cu_seqlens_q, t, num_heads=q.shape[1], num_kv_heads=k_cache.shape[2], head_dim=q.shape[2],
                    dtype=q.dtype, window_left=window_left, max_q_len=self.max_q_len, max_kv_len=self.max_kv_len)
            return run_paged_attention(plan, q, q_pos, k_cache, v_cache, scale, inv_freq=inv_freq,
                                       rotary_dim=rotary_dim, interleaved=interleaved, k_scale=k_scale,
                                       v_scale=v_scale, logits_soft_cap=logits_soft_cap, out=out, lse_out=lse_out)
        if not tagged and not scaled and t.row_start is None:
            return paged_attention(q, q_pos, self.cu_seqlens_q, k_cache, v_cache, t.pages, t.kv_lens, scale,
                                   window_left, logits_soft_cap, out=out, lse_out=lse_out)
        rotary_dim = rotary_dim_of(q, inv_freq, rotary_dim)
        args = (q, q_pos, self.cu_seqlens_q, k_cache, v_cache, t.pages, t.row_start, t.kv_lens, None, None, (),
                scale, window_left, t.entry_pos, t.entry_len, t.entry_start, inv_freq, rotary_dim or 0,
                bool(interleaved), k_scale, v_scale, float(logits_soft_cap))
        if out is not None or lse_out is not None:
            out = q.new_empty(q.shape) if out is None else out
            lse_out = q.new_empty(q.shape[:2], dtype=torch.float32) if lse_out is None else lse_out
        # (the C++ kernels check the index values they follow; the reference needs them checked here)
        validate_run(*args, out, lse_out, read_values=chosen != backend.CPP, planned=False)
        return run_on_backend(*args, out, lse_out)

    def _tagged_rope(self, q: torch.Tensor, q_pos: torch.Tensor, inv_freq, rotary_dim):
        """``(cos, sin, rotary_dim)`` for the tagged kernel's direct call (``(None, None, 0)``: keys
        stored rotated), or None where the checked path must run (arguments it refuses, rows past
        the kernel's RoPE table). The table is the run op's (``rope_table``: kept across calls
        while ``inv_freq``'s values are unchanged); the step keeps its answer for the next layer
        while ``inv_freq`` and ``q_pos`` are the same tensors, unchanged (their version counters:
        an in-place write is seen), which spares each layer a host read of ``q_pos``'s maximum and
        a comparison of ``inv_freq``'s values. An inference
        tensor has no version counter: an ``inv_freq`` made under ``torch.inference_mode()`` is
        looked up every time; ``q_pos`` only sizes the table, whose bounds the kernel checks
        against every row's position."""
        if inv_freq is None:
            return (None, None, 0) if rotary_dim is None else None
        key = (_version(inv_freq), _version(q_pos), rotary_dim, q.shape[-1])
        hit = self._rope_hit
        if key[0] is not None and hit is not None and hit[0] == key and hit[1] is inv_freq and hit[2] is q_pos:
            return hit[3]
        rope = self._tagged_rope_table(q, q_pos, inv_freq, rotary_dim)
        self._rope_hit = (key, inv_freq, q_pos, rope)   # (held: their ids stay theirs)
        return rope

    def _tagged_rope_table(self, q: torch.Tensor, q_pos: torch.Tensor, inv_freq, rotary_dim):
        D = q.shape[-1]
        rd = D if rotary_dim is None else rotary_dim
        if not (type(rd) is int and 2 <= rd <= D and rd % 2 == 0 and inv_freq.dtype == torch.float32
                and inv_freq.is_cpu and inv_freq.shape == (rd // 2,)):
            return None
        positions = int(q_pos.max()) + 1 if q_pos.numel() else 0
        if positions > ROPE_TABLE_MAX_POSITIONS:
            return None
        cos, sin = rope_table(inv_freq, positions)
        return cos, sin, rd

    def _outputs_apart(self, q, q_pos, k_cache, v_cache, out, lse_out) -> bool:
        """A fast sufficient condition for ``check_no_overlap``: each output contiguous (no element
        twice) and in a storage of its own, none of the inputs' (the step's own storages known
        since it was made). False only means "run the full check" (which names the argument)."""
        inputs = self._storages | {x.untyped_storage()._cdata for x in (q, q_pos, k_cache, v_cache)}
        seen = set()
        for o in (out, lse_out):
            if o is not None:
                s = o.untyped_storage()._cdata
                if not o.is_contiguous() or s in inputs or s in seen:
                    return False
                seen.add(s)
        return True

    def _backend_of(self, q: torch.Tensor) -> str:
        """``ragattn.ops.backend.choose("paged_attention", ...)`` for ``q``, asked once per step and
        device type (it reads the environment)."""
        device_type = q.device.type
        if self._backend is None or self._backend[0] != device_type:
            self._backend = (device_type, backend.choose("paged_attention", device_type))
        return self._backend[1]


def _outputs_well_formed(q: torch.Tensor, out, lse_out) -> bool:
    """A fast sufficient condition for the outputs' metadata checks (None, or plain CPU tensors
    like q and float32 ``[total_q, Hq]``); False only means "run the named checks"."""
    T = torch.Tensor
    return ((out is None or (type(out) is T and out.is_cpu and out.dtype == q.dtype and out.shape == q.shape))
            and (lse_out is None or (type(lse_out) is T and lse_out.is_cpu and lse_out.dtype == torch.float32
                                     and lse_out.shape == q.shape[:2])))
