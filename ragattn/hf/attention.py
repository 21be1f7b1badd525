"""ragattn as a transformers attention implementation ("ragattn").

    import ragattn.hf
    ragattn.hf.enable()                                  # registers "ragattn" (idempotent)
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="ragattn")
    # or: model.set_attn_implementation("ragattn")
    model.generate(**tok(texts, return_tensors="pt", padding=True), do_sample=False)

Registered in both ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface``
(the mask builder: transformers' boolean SDPA mask, so padded batches get their mask, or ``None``
where SDPA would use ``is_causal``). Every transformers cache works (dynamic, static, offloaded,
and ragattn's paged :class:`ragattn.hf.cache.PagedCache`). Per layer call, with
``query [B, Hq, q, D]`` and the cache's ``key/value [B, Hkv, kv, D]``:

* The mask decides what each query sees, exactly as it does for SDPA. ``None`` means SDPA's
  ``is_causal``: for ``q > 1`` query ``i`` sees keys ``0..i`` (top-left aligned: a fresh cache,
  dynamic or static), for ``q == 1`` every key. A boolean or additive ``[B, 1|H, q, kv]`` mask
  is read once per forward (at layer 0, one host sync) into a *plan*: each query row's slot
  (its last visible key) and each key's validity (padding). When the mask is exactly
  "causal by slot and padding" (what transformers builds for any cache, padded or not), the
  plan runs ragattn's kernels (a sliding layer's mask: "causal + padding + window W");
  **any other mask (block-diagonal, a custom bias) falls back to SDPA with that mask**, so a
  custom mask is always honoured, never approximated.
* ``q > 1`` (prefill, chunked prefill): ``ragattn.varlen_attention`` over the batch with no
  packing: keys of padding get a position no query reaches, padded query rows a position below
  every key; keys past the last query's slot (a static cache's empty tail) are never read.
* ``q == 1`` (decode): ``ragattn.paged_attention`` reading the cache in place (its strides, no
  copy): unpadded, one page per row; with a mask, pages of one slot listing the visible slots.
* Sliding windows (Mistral, Qwen2's sliding layers): decode reads only the window's slots (the
  mask says which); a prefill whose mask is "causal + padding + window W by slot" runs
  ``varlen_attention`` with ``window_left = W - 1`` (the window is checked against the mask, and
  any other mask falls back to SDPA); the paged paths pass ``window_left = W - 1`` to
  ``ragattn.paged_attention``.
* With no mask (an unpadded batch) the path has no host sync and builds its index tensors once
  per shape, so ``torch.compile(fullgraph=True)`` traces it without a graph break.

``output_attentions=True`` runs that call through the model's own eager attention (the weights
are formed there only). Attention-logit soft-capping (Gemma 2) runs in the kernels
(``logits_soft_cap``). Refused with a named error (rather than computed wrong): attention sinks,
dropout in training and non-causal attention modules; model families whose attention this path
has not been checked against (:data:`ragattn.hf.rope.SUPPORTED_FAMILIES`) are refused when the
model is created or switched to "ragattn" (``refuse_unsupported_family``). A transformers version outside :data:`TESTED_TRANSFORMERS`
gets a warning (``RAGATTN_ALLOW_UNTESTED_TRANSFORMERS=1`` silences it).

Keyword arguments used by ``ragattn.methods`` (all optional, passed through ``model(...)``):

* ``ragattn_block_ids`` int ``[B, kv]``: block id of every cache slot incl. the current tokens,
  ``-1`` = global; the prefill then uses the Block-Attention mask (same block or either global).
* ``ragattn_cu_seqlens`` int32 ``[n + 1]``: the batch-1 input packs ``n`` independent sequences
  (e.g. chunks; their ``position_ids`` restart at 0): one ``varlen_attention`` call, no cross-talk.
  With ``ragattn_block_ids`` ``[1, T]`` as well, each packed sequence gets the Block-Attention mask
  (block fine-tuning: ``ragattn.finetune``); differentiable through ``varlen_attention``'s autograd.
* ``ragattn_capture`` list: each layer appends its ``(key, value)`` ``[B, Hkv, T, D]`` (keys after RoPE).
* ``ragattn_capture_query`` list: each layer appends its ``query`` ``[B, Hq, T, D]`` (after RoPE).
* ``ragattn_paged`` a :class:`PagedKV`: the current tokens' K/V are written into the paged request
  cache at slots ``lengths[b] + i`` and attention runs through ``ragattn.paged_attention`` (causal by
  slot; RoPE positions come from ``position_ids`` and may differ from slots). The caller advances
  ``lengths`` after the forward (:class:`ragattn.hf.cache.PagedCache` does it for ``generate()``).
  ``ragattn_paged`` may also be a zero-copy request (:class:`ragattn.hf.tagged.TaggedPagedKV`,
  ``ChunkStore.request``): keys are stored un-rotated on shared and private pages, positions come
  from its page table and RoPE is applied in the kernel; it needs ``position_ids`` (batch 1) and
  masks by position (the same rule as by slot for the methods' position schemes).
* ``ragattn_slots`` int ``[q]`` with ``ragattn_paged`` (batch 1): selective recompute. The current
  tokens' K/V overwrite these slots (distinct, each ``< lengths[0]``; the caller sets ``lengths`` to
  cover them first and does not advance it after) instead of being appended, and row ``i`` attends
  causally to the slots ``<= ragattn_slots[i]``: never to a later slot, whatever the row order.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ragattn import _extension
from ragattn import ops as _ops
from ragattn.hf.rope import SUPPORTED_FAMILIES  # the families whose attention modules are checked
from ragattn.hf.tagged import TaggedPagedKV

NAME = "ragattn"
# transformers versions this path is tested with (inclusive, major.minor)
TESTED_TRANSFORMERS = ((5, 17), (5, 23))
ALLOW_UNTESTED_ENV = "RAGATTN_ALLOW_UNTESTED_TRANSFORMERS"
_FAR = 1 << 30  # a key position no query reaches (padding keys) is _FAR; padded queries sit at -1


class PagedKV:
    """A paged request KV cache (design.md layout) for one model.

    ``k[l]``, ``v[l]``: ``[num_pages, page_size, Hkv, D]`` per layer; ``block_table`` int32
    ``[B, max_pages]``; ``lengths`` int32 ``[B]`` (slots filled per row); ``capacity`` slots per
    row. :class:`ragattn.hf.cache.PagedCache` wraps one as a transformers ``Cache``.

    ``buffer``: optional flat tensor (``dtype``, ``device``) of at least :meth:`buffer_numel`
    elements whose leading part holds every layer's K then V (views, no copy; e.g. a recycled
    request cache: :class:`ragattn.methods.chunk_store.ChunkStore`); by default one tensor per
    layer is allocated.
    """

    def __init__(self, num_layers, batch, capacity, num_kv_heads, head_dim, page_size=16,
                 dtype=torch.float32, device="cpu", buffer: torch.Tensor | None = None):
        pages_per_row = max(1, -(-capacity // page_size))
        n_pages = batch * pages_per_row
        self.page_size, self.capacity = page_size, pages_per_row * page_size
        shape = (n_pages, page_size, num_kv_heads, head_dim)
        if buffer is None:
            self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.empty_like(t) for t in self.k]
        else:
            per = n_pages * page_size * num_kv_heads * head_dim
            if (buffer.dim() != 1 or buffer.numel() < 2 * num_layers * per or buffer.dtype != dtype
                    or buffer.device != torch.device(device)):
                raise ValueError(f"ragattn PagedKV: buffer must be a flat {dtype} tensor on {device} of at "
                                 f"least {2 * num_layers * per} elements, got {tuple(buffer.shape)} "
                                 f"{buffer.dtype} on {buffer.device}")
            layers = buffer[: 2 * num_layers * per].view(2 * num_layers, *shape).unbind(0)
            self.k, self.v = list(layers[:num_layers]), list(layers[num_layers:])
        self.block_table = torch.arange(n_pages, dtype=torch.int32, device=device).view(batch, pages_per_row)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self._plan_key = self._scatter_key = None
        self._head_views = {}
        self.launch_plans = {}   # the paged launch plans of the current forward (Triton route)
        self.cpu_sdpa = None     # the current forward's CPU route (cpu_sdpa_enabled), set at its first layer

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer ``layer``'s K, V at row 0's ``slots``: ``[n, Hkv, D]`` each (keys as
        stored: rotated). :class:`ragattn.hf.tagged.TaggedPagedKV` has the same method."""
        rows = self.slot_rows(0, slots)
        return (self.k[layer].view(-1, *self.k[layer].shape[2:])[rows],
                self.v[layer].view(-1, *self.v[layer].shape[2:])[rows])

    @staticmethod
    def buffer_numel(num_layers, batch, capacity, num_kv_heads, head_dim, page_size=16) -> int:
        """Elements of the ``buffer`` a cache of these sizes needs (K and V of every layer)."""
        pages = batch * max(1, -(-capacity // page_size))
        return 2 * num_layers * pages * page_size * num_kv_heads * head_dim

    def slot_rows(self, b: int, slots: torch.Tensor) -> torch.Tensor:
        """Flat row indices (into a layer viewed as ``[num_pages * page_size, Hkv, D]``) of ``slots``."""
        pages = self.block_table[b].long()[slots.long() // self.page_size]
        return pages * self.page_size + slots.long() % self.page_size

    def all_slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Like :meth:`slot_rows` for every row at once: ``slots`` int ``[B, n]`` -> int64 ``[B, n]``."""
        s = slots.long()
        pages = self.block_table.long().gather(1, s // self.page_size)
        return pages * self.page_size + s % self.page_size

    def scatter_plan(self, slots: torch.Tensor, first_layer: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [q] int64, slots [q] int32)`` for writing ``q`` tokens of row 0 at ``slots``
        (selective recompute); checked once per forward (at its first layer): slots distinct and
        ``< lengths[0]``."""
        key = (id(slots), tuple(slots.shape))
        if first_layer or self._scatter_key != key:
            if self.lengths.shape[0] != 1:
                raise ValueError("ragattn attention: ragattn_slots needs a batch-1 paged cache")
            if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= int(self.lengths[0])):
                raise ValueError(f"ragattn attention: ragattn_slots must lie in [0, lengths[0] = "
                                 f"{int(self.lengths[0])}), got {int(slots.min())} .. {int(slots.max())}")
            if torch.unique(slots).numel() != slots.numel():
                raise ValueError("ragattn attention: ragattn_slots may not repeat a slot")
            self._scatter_key = key
            self._scatter = (self.slot_rows(0, slots), slots.to(torch.int32))
        return self._scatter

    def append_plan(self, q: int, device, first_layer: bool = True):
        """``(rows [B * q] int64, slots [B * q] int32, cu_seqlens_q [B + 1] int32, kv_lens [B]
        int32)``: where ``q`` new tokens per row go, and ``paged_attention``'s metadata for them.

        The same for every layer of one forward: computed at the forward's first layer (one host
        sync for the capacity check) and reused by the others (the caller advances ``lengths``
        after the forward). Keyed by the layer, not by ``lengths``' version counter, so that it
        works on inference tensors (``torch.inference_mode()``), which have none."""
        b = self.lengths.shape[0]
        key = (q, b)
        if first_layer or self._plan_key != key:
            if int(self.lengths.max()) + q > self.capacity:
                raise ValueError(f"ragattn attention: paged request cache full ({self.capacity} slots), "
                                 f"cannot append {q} tokens")
            slots = self.lengths[:, None] + torch.arange(q, device=device, dtype=torch.int32)   # [B, q]
            cu = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=device)
            self._plan_key = key
            self._plan = (self.all_slot_rows(slots).reshape(-1), slots.reshape(-1), cu, self.lengths + q)
        return self._plan

    def head_views(self, layer: int):
        """``(k, v)`` of ``layer`` as ``[1, Hkv, num_pages * page_size, D]`` views (flat slot rows,
        no copy), or ``(None, None)`` when the pages do not merge into rows. Cached per layer (a
        decode step builds none) and rebuilt when ``k[layer]`` or ``v[layer]`` is replaced."""
        k, v = self.k[layer], self.v[layer]
        hv = self._head_views.get(layer)
        if hv is None or hv[0] is not k or hv[1] is not v:
            hv = (k, v, _head_rows(k), _head_rows(v))
            if hv[2] is None or hv[3] is None:
                hv = (k, v, None, None)
            self._head_views[layer] = hv
        return hv[2], hv[3]

    def cpu_rows(self, q_pos, kv_lens, q: int, first_layer: bool = True, window_left: int = -1,
                 dtype: torch.dtype = torch.float32):
        """For the CPU SDPA path: per row ``(first flat slot row, kv length, additive mask [q, L]
        in ``dtype`` (0 visible, -inf not) or None)`` when every row's pages are consecutive, else
        None; computed at the first layer (per window: layers of a mixed model may differ). Every
        query sees at least its own slot, so no mask row is all -inf. ``kv_lens`` None:
        ``lengths + q`` (an append). The mask is additive because SDPA turns a boolean one into
        exactly that on every call."""
        key = (q, self.lengths.shape[0], window_left, dtype)
        if first_layer or getattr(self, "_cpu_rows_key", None) != key:
            if kv_lens is None:
                kv_lens = self.lengths + q
            bt = self.block_table
            plan = None
            if bt.device.type == "cpu" and bool((bt[:, 1:] - bt[:, :-1] == 1).all()):
                plan = []
                for i, (page0, length) in enumerate(zip(bt[:, 0].tolist(), kv_lens.tolist())):
                    qp = q_pos[i * q:(i + 1) * q]
                    mask = None
                    windowed = 0 <= window_left < length - 1
                    if windowed or not (q == 1 and int(qp[0]) >= length - 1):
                        j = torch.arange(length)[None, :]
                        mask = j <= qp[:, None].long()
                        if windowed:
                            mask &= j >= qp[:, None].long() - window_left
                        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
                    plan.append((page0 * self.page_size, length, mask))
            self._cpu_rows_key, self._cpu_rows = key, plan
        return self._cpu_rows

    def masked_append_plan(self, valid: torch.Tensor, first_layer: bool = True):
        """Appending ``q`` new tokens per row of which only ``valid`` (bool ``[B, q]``) are real
        (the rest padding, never written): ``(rows [n] int64, src [n] int64, q_pos [B * q] int32,
        kv_lens [B] int32, counts [B] int32)`` with ``src`` the flat indices of the real tokens,
        written at their row's next slots in order. Padding query rows get a position that sees
        only written slots (their output is never used). Computed at the first layer."""
        b, q = valid.shape
        key = ("masked", b, q)
        if first_layer or self._plan_key != key:
            counts = valid.sum(1, dtype=torch.int32)
            if int((self.lengths + counts).max()) > self.capacity:
                raise ValueError(f"ragattn attention: paged request cache full ({self.capacity} slots), "
                                 f"cannot append {q} tokens")
            rank = valid.to(torch.int32).cumsum(1) - 1                          # [B, q]
            slots = self.lengths[:, None] + rank
            src = valid.reshape(-1).nonzero().squeeze(1)
            rows = self.all_slot_rows(slots.clamp_min(0)).reshape(-1)[src]
            self._plan_key = key
            self._plan = (rows, src, slots.clamp_min(0).reshape(-1).to(torch.int32),
                          self.lengths + counts, counts)
        return self._plan


def _head_rows(pages: torch.Tensor):
    """``pages`` ``[num_pages, page_size, Hkv, D]`` as ``[1, Hkv, num_pages * page_size, D]`` (no
    copy), or None when its slots do not merge into one row stride. One ``as_strided`` for
    contiguous pages (a request cache is built per request, and its 2 x layers views are made in
    its first forward, where every Python op costs several microseconds)."""
    n, p, h, d = pages.shape
    if pages.is_contiguous():
        return pages.as_strided((1, h, n * p, d), (h * d, d, h * d, 1))
    try:
        return pages.view(-1, h, d).permute(1, 0, 2)[None]
    except RuntimeError:
        return None


def _window_left(module, kwargs) -> int:
    """transformers' sliding window W (key visible iff ``q_pos - W < kv_pos <= q_pos``) as
    FlashAttention's ``window_left = W - 1``; -1 when the layer has none."""
    # the module's own attribute via its __dict__: nn.Module.__getattr__ on a missing name (every
    # layer of a model without windows, every decode step) raises and catches an AttributeError
    w = kwargs.get("sliding_window") or vars(module).get("sliding_window")
    return int(w) - 1 if w else -1


def _paged_forward(module, query, key, value, scaling, cache: PagedKV, slots=None, valid=None,
                   window_left: int = -1, logits_soft_cap: float = 0.0, positions=None):
    """Write the new K/V into ``cache`` and attend through it; ``valid`` bool ``[B, q]`` marks
    the real (non-padding) new tokens; ``window_left`` >= 0: sliding window. Returns
    ``((out, None), counts or None)``. A zero-copy request (:class:`TaggedPagedKV`) needs the
    forward's ``positions`` (its ``position_ids``)."""
    if isinstance(cache, TaggedPagedKV):
        return _tagged_forward(module, query, key, value, scaling, cache, slots, valid, window_left,
                               logits_soft_cap, positions)
    b, hq, q, d = query.shape
    layer = module.layer_idx
    first = layer == 0
    if first:
        cache.launch_plans = {}   # a new forward: its paged launches are planned afresh
        cache.cpu_sdpa = cpu_sdpa_enabled(q)   # and its CPU route read once
    cpu_sdpa = (slots is None and query.device.type == "cpu" and not logits_soft_cap   # (SDPA cannot soft-cap)
                and (cache.cpu_sdpa if cache.cpu_sdpa is not None else cpu_sdpa_enabled(q)))
    if slots is None and valid is None and query.device.type == "cpu":
        # the CPU decode (and unpadded prefill) step: the new K/V go to consecutive slot rows of
        # [1, Hkv, rows, D] views (no index tensors, no reshapes), then ragattn.paged_attention
        # (C++) reads the pages, or SDPA reads the row's slots in place (see cpu_sdpa_enabled)
        _, q_pos, cu, kv_lens = cache.append_plan(q, query.device, first_layer=first)
        rows_plan = cache.cpu_rows(q_pos, kv_lens, q, first, window_left, query.dtype)
        k4, v4 = cache.head_views(layer)
        if rows_plan is not None and k4 is not None:
            for i, (start, length, _) in enumerate(rows_plan):
                # narrow, not [:, :, a:b]: one op where Python indexing applies three (each costs
                # microseconds in a forward whose matmuls have just flushed the CPU's caches)
                k4.narrow(2, start + length - q, q).copy_(key if b == 1 else key[i:i + 1])
                v4.narrow(2, start + length - q, q).copy_(value if b == 1 else value[i:i + 1])
            if cpu_sdpa:
                return (_cpu_rows_sdpa(query, k4, v4, rows_plan, scaling), None), None
            qr = query[:, :, 0] if q == 1 else query.transpose(1, 2).reshape(b * q, hq, d)
            o = _paged_attention(cache.launch_plans, qr, q_pos, cu, cache.k[layer], cache.v[layer],
                                 cache.block_table, kv_lens, scaling, window_left, logits_soft_cap)
            return (o.view(b, q, hq, d), None), None
    kf = cache.k[layer].view(-1, *cache.k[layer].shape[2:])
    vf = cache.v[layer].view(-1, *cache.v[layer].shape[2:])
    k_new = key.transpose(1, 2).reshape(b * q, *kf.shape[1:]).to(kf.dtype)    # [B * q, Hkv, D]
    v_new = value.transpose(1, 2).reshape(b * q, *vf.shape[1:]).to(vf.dtype)
    counts = None
    if valid is not None:
        rows, src, q_pos, kv_lens, counts = cache.masked_append_plan(valid, first)
        k_new, v_new = k_new.index_select(0, src), v_new.index_select(0, src)
    elif slots is None:
        rows, q_pos, _, kv_lens = cache.append_plan(q, query.device, first_layer=first)
    else:
        if b != 1 or slots.shape != (q,):
            raise ValueError(f"ragattn attention: ragattn_slots must be [q] = [{q}] with batch 1, "
                             f"got {tuple(slots.shape)} with batch {b}")
        rows, q_pos = cache.scatter_plan(slots, first_layer=first)
        kv_lens = cache.lengths
    kf.index_copy_(0, rows, k_new)
    vf.index_copy_(0, rows, v_new)
    if cpu_sdpa:
        rows_plan = cache.cpu_rows(q_pos, kv_lens, q, first, window_left, query.dtype)
        k4, v4 = cache.head_views(layer)
        if rows_plan is not None and k4 is not None:
            return (_cpu_rows_sdpa(query, k4, v4, rows_plan, scaling), None), counts
    cu = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=query.device)
    o = _paged_attention(cache.launch_plans, query.transpose(1, 2).reshape(b * q, hq, d),
                         q_pos, cu, cache.k[layer], cache.v[layer], cache.block_table, kv_lens, scaling,
                         window_left, logits_soft_cap)
    return (o.view(b, q, hq, d), None), counts


def _tagged_forward(module, query, key, value, scaling, cache: TaggedPagedKV, slots, valid, window_left,
                    logits_soft_cap, positions):
    """The zero-copy request path: the new keys go un-rotated into the request's private pages
    (a shared page a recompute writes is copied first), then attention over the request's
    position-tagged page table with RoPE in the kernel (:mod:`ragattn.hf.tagged`)."""
    b, hq, q, d = query.shape
    if b != 1:
        raise ValueError(f"ragattn attention: a zero-copy request cache (TaggedPagedKV) holds one sequence, "
                         f"got a batch of {b}")
    if positions is None:
        raise ValueError("ragattn attention: a zero-copy request cache (TaggedPagedKV) needs the forward's "
                         "position_ids (its keys are rotated in the kernel by position)")
    layer = module.layer_idx
    f = cache.forward_plan(layer == 0, q, positions.reshape(-1), slots, valid)
    cache.write(f, layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
    o = cache.attend(f, layer, query[0].transpose(0, 1).contiguous(), scaling, window_left, logits_soft_cap)
    counts = None if valid is None else valid.sum(1, dtype=torch.int32)
    return (o.view(1, q, hq, d), None), counts


def _paged_attention(launch_plans: dict, q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens,
                     scale, window_left, logits_soft_cap=0.0):
    """``ragattn.paged_attention`` for one layer of a forward whose layers share their index
    tensors' values (``launch_plans``: a dict owned by that forward, empty at its first layer).

    On the Triton route (CUDA, or the CPU under ``RAGATTN_CPU_BACKEND=triton``) the launch is
    planned once per forward and window (``plan_paged_attention``: the step's one host sync) and
    every layer only launches (``run_paged_attention``: no sync, CUDA-graph capturable); the one-
    call op would plan, i.e. sync, in every layer. Elsewhere (the CPU's C++ kernel, which has no
    plan; under ``torch.compile``, which sees the op as one node) the op itself. Returns
    ``out [total_q, Hq, D]``."""
    dev = q.device.type
    triton_route = dev == "cuda" or (dev == "cpu" and _extension.cpu_backend() == "triton")
    if not triton_route or torch.compiler.is_compiling():
        return _ops.paged_attention(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale,
                                    window_left, logits_soft_cap)[0]
    from ragattn.triton_kernels.paged_attention import plan_paged_attention, run_paged_attention

    plan = launch_plans.get(window_left)
    if plan is None:
        plan = launch_plans[window_left] = plan_paged_attention(
            cu_seqlens_q, kv_lens, num_heads=q.shape[1], num_kv_heads=k_cache.shape[2], head_dim=q.shape[2],
            dtype=q.dtype, window_left=window_left)
    with torch.cuda.device(q.device) if dev == "cuda" else contextlib.nullcontext():
        return run_paged_attention(plan, q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale,
                                   window_left, logits_soft_cap=logits_soft_cap)[0]


def cpu_sdpa_enabled(q_rows: int) -> bool:
    """Whether a CPU paged step of ``q_rows`` new tokens per row attends with torch's SDPA over
    the row's slots in place (rows owning consecutive pages, as every :class:`PagedKV` is
    allocated; same rule: slot ``j`` visible to a query at slot ``s`` iff ``j <= s``,
    ``j < kv_lens``) rather than ``ragattn.paged_attention``'s C++ kernel. By default a decode
    step (one row) takes the kernel (it reads each row of the paged layout once for the whole GQA
    group; SDPA over the strided ``[page, slot, Hkv, D]`` rows is ~2x slower per layer) and a
    longer step (a final block's prefill, masked) takes SDPA. ``RAGATTN_HF_CPU_SDPA=1`` forces
    SDPA, ``=0`` the kernel, for every step."""
    flag = os.environ.get("RAGATTN_HF_CPU_SDPA")
    if flag is None or flag == "auto":
        return q_rows > 1
    return flag != "0"


def _cpu_rows_sdpa(query, k4, v4, rows_plan, scaling):
    """Per row ``(start, length, mask | None)``: SDPA of the row's queries over its slots
    ``k4[:, :, start:start + length]`` (``k4``, ``v4``: ``[1, Hkv, rows, D]`` views of the pages),
    GQA without repeating K/V. Returns ``[B, q, Hq, D]`` (for one row, a transposed view of SDPA's
    result: the caller's reshape makes it contiguous, as transformers' own SDPA path does)."""
    b, hq, q, d = query.shape
    gqa = hq != k4.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if b == 1 and q == 1 and rows_plan[0][2] is None and rows_plan[0][1] > 0:
        # decode, every slot visible (the common case): no mask, no output buffer to fill, SDPA's
        # [1, Hq, 1, D] viewed as the [1, 1, Hq, D] result
        start, length, _ = rows_plan[0]
        o = sdpa(query, k4.narrow(2, start, length), v4.narrow(2, start, length), scale=scaling,
                 enable_gqa=gqa)
        return o.view(1, 1, hq, d)
    if b == 1 and rows_plan[0][1] > 0:   # one row (a final block's prefill): SDPA's result as a view
        start, length, mask = rows_plan[0]
        return sdpa(query, k4.narrow(2, start, length), v4.narrow(2, start, length), attn_mask=mask,
                    scale=scaling, enable_gqa=gqa).transpose(1, 2)
    out = query.new_zeros(b, q, hq, d)
    for i, (start, length, mask) in enumerate(rows_plan):
        if length == 0:
            continue
        o = sdpa(query[i:i + 1], k4.narrow(2, start, length), v4.narrow(2, start, length),
                 attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[i] = o[0].transpose(0, 1)
    return out


def _paged_cache_forward(module, query, key, value, attention_mask, scaling, owner, window_left=-1,
                         logits_soft_cap=0.0, positions=None):
    """The :class:`ragattn.hf.cache.PagedCache` path: the mask covers only the new tokens
    (``[B, 1, q, q]``: causal + their padding); its diagonal says which tokens are real."""
    b, q = query.shape[0], query.shape[2]
    valid = None
    if attention_mask is not None:
        vis = _visible_from_mask(attention_mask, b, q, q)
        if vis is None:
            raise NotImplementedError("ragattn attention: a custom attention mask with a PagedCache")
        valid = torch.diagonal(vis, dim1=1, dim2=2)                     # [B, q]
    out, counts = _paged_forward(module, query, key, value, scaling, owner.paged, valid=valid,
                                 window_left=window_left, logits_soft_cap=logits_soft_cap,
                                 positions=positions)
    if module.layer_idx == owner.num_layers - 1:
        owner._advance(q, counts)
    return out


# ----- checks ----------------------------------------------------------------------------------
def check_transformers_version(version: str | None = None) -> bool:
    """Warn (RuntimeWarning) if transformers ``version`` (default: the installed one) is outside
    :data:`TESTED_TRANSFORMERS`; returns whether it is inside. ``RAGATTN_ALLOW_UNTESTED_TRANSFORMERS=1``
    silences the warning."""
    version = version or transformers.__version__
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    lo, hi = TESTED_TRANSFORMERS
    if lo <= major_minor <= hi:
        return True
    if os.environ.get(ALLOW_UNTESTED_ENV, "0") != "1":
        warnings.warn(f"ragattn.hf: transformers {version} is outside the tested range {lo[0]}.{lo[1]} to "
                      f"{hi[0]}.{hi[1]} (the attention and cache interfaces change between releases); the "
                      f"ragattn attention may fail or differ from sdpa (set {ALLOW_UNTESTED_ENV}=1 to "
                      "silence this warning)", RuntimeWarning, stacklevel=3)
    return False


def _soft_cap(module, kwargs) -> float:
    """The layer's attention-logit soft cap (Gemma 2's ``attn_logit_softcapping``, passed by its
    attention module as ``softcap``), 0.0 for none: ``logits_soft_cap`` of the ops."""
    cap = kwargs.get("softcap")
    if cap is None:
        cap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    return float(cap) if cap else 0.0


def _refuse_unsupported(module, dropout, kwargs) -> None:
    """Named errors for every attention feature this path does not implement."""
    config = getattr(module, "config", None)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise NotImplementedError(
            f"ragattn attention: model family {family!r} is not supported (supported: "
            f"{sorted(SUPPORTED_FAMILIES)}); use attn_implementation='sdpa' for it")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("ragattn attention: attention sinks (s_aux) are not supported")
    if dropout and module.training:
        raise NotImplementedError("ragattn attention: dropout is not supported")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("ragattn attention: non-causal attention is not supported")


# ----- the per-forward plan --------------------------------------------------------------------
class _Plan:
    """Index tensors shared by every layer of one forward (see the module docstring)."""
    __slots__ = ("key", "mask", "fallback", "kv_end", "cu_q", "cu_k", "q_pos", "kv_pos",
                 "table", "kv_lens", "dec_pos", "cu_dec", "page_view", "window_left", "launch_plans")


_local = threading.local()


def _cached_plan(layer_idx, key, mask):
    """The plan of this forward if layer ``layer_idx`` may reuse it (any layer but the first, same
    shapes, the very same mask object)."""
    plan = getattr(_local, "plan", None)
    if plan is None or layer_idx == 0 or plan.key != key or plan.mask is not mask:
        return None
    return plan


def _store_plan(plan):
    if not torch.compiler.is_compiling():
        _local.plan = plan
    return plan


def _visible_from_mask(mask, b, q, kv):
    """bool ``[B, q, kv]`` from a boolean or additive ``[B, 1|H, q, kv]`` mask, or None when the
    mask is not one pattern for all heads of 0 / -inf entries (the caller falls back to SDPA)."""
    if mask.dim() != 4 or mask.shape[-2:] != (q, kv) or mask.shape[0] not in (1, b):
        return None
    if mask.dtype == torch.bool:
        vis = mask
    else:
        vis = mask == 0
        blocked = mask[~vis]
        if blocked.numel() and not bool((blocked <= torch.finfo(mask.dtype).min / 2).all()):
            return None   # a bias, not a mask
    if vis.shape[1] > 1 and not bool((vis == vis[:, :1]).all()):
        return None       # per-head masks
    return vis[:, 0].expand(b, q, kv)


def _plan(module, query, key, attention_mask, kwargs):
    b, hq, q, d = query.shape
    kv = key.shape[2]
    dev = query.device
    window_left = _window_left(module, kwargs)
    shape_key = (b, q, kv, dev, window_left)
    plan = _cached_plan(getattr(module, "layer_idx", 0), shape_key, attention_mask)
    if plan is not None:
        return plan
    plan = _Plan()
    plan.key, plan.mask, plan.fallback, plan.page_view = shape_key, attention_mask, False, None
    plan.window_left, plan.launch_plans = window_left, {}
    if attention_mask is None:
        if q > 1:   # SDPA's is_causal: top-left aligned, keys past the last query never seen
            plan.kv_end = min(q, kv)
            plan.cu_q, plan.cu_k, plan.q_pos, plan.kv_pos = _versioned(
                torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=dev),
                torch.arange(0, (b + 1) * plan.kv_end, plan.kv_end, dtype=torch.int32, device=dev),
                torch.arange(q, dtype=torch.int32, device=dev).repeat(b),
                torch.arange(plan.kv_end, dtype=torch.int32, device=dev).repeat(b))
        else:       # decode: every key, one page per row, read in place
            plan.page_view = "row"
            plan.table = torch.arange(b, dtype=torch.int32, device=dev)[:, None]
            plan.kv_lens = torch.full((b,), kv, dtype=torch.int32, device=dev)
            plan.dec_pos = torch.full((b,), kv - 1, dtype=torch.int32, device=dev)
            plan.cu_dec = torch.arange(b + 1, dtype=torch.int32, device=dev)
        return _store_plan(plan)
    vis = _visible_from_mask(attention_mask, b, q, kv)
    if vis is None:
        plan.fallback = True
        return _store_plan(plan)
    slot = torch.arange(kv, device=dev)
    if q == 1:      # decode: the visible slots (any set) as pages of one slot, in slot order
        v = vis[:, 0]                                                   # [B, kv]
        plan.page_view = "slot"
        order = torch.sort((~v).to(torch.int8), dim=1, stable=True).indices   # visible first
        hkv = key.shape[1]
        plan.table = (torch.arange(b, device=dev)[:, None] * (hkv * kv) + order).to(torch.int32)
        plan.kv_lens = v.sum(1, dtype=torch.int32)
        plan.dec_pos = (plan.kv_lens - 1).clamp_min(0)
        plan.cu_dec = torch.arange(b + 1, dtype=torch.int32, device=dev)
        return _store_plan(plan)
    # prefill: row slot = last visible key; key valid = seen by some row; must be causal + padding
    last = torch.where(vis, slot, -1).amax(-1)                          # [B, q]
    kv_ok = vis.any(1)                                                  # [B, kv]
    allowed = kv_ok[:, None, :] & (slot <= last[..., None])
    if window_left >= 0:    # transformers' sliding window, by slot: last - W < slot
        allowed &= slot >= last[..., None] - window_left
    structured = (vis == allowed).all()
    if torch.compiler.is_compiling():
        # no host sync in a graph: a mask that is not causal + padding is refused, not approximated
        torch._assert_async(structured, "ragattn attention: under torch.compile the attention mask "
                            "must be causal + padding (transformers' own); use sdpa for custom masks")
        kv_end = kv
    else:
        if not bool(structured):                                        # host sync, once per forward
            plan.fallback = True
            return _store_plan(plan)
        kv_end = max(int(last.max()) + 1, 1)                            # never read the empty tail
    plan.kv_end = kv_end
    plan.cu_q, plan.cu_k, plan.q_pos, plan.kv_pos = _versioned(
        torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=dev),
        torch.arange(0, (b + 1) * kv_end, kv_end, dtype=torch.int32, device=dev),
        last.to(torch.int32).reshape(-1),
        torch.where(kv_ok[:, :kv_end], slot[:kv_end], _FAR).to(torch.int32).reshape(-1))
    return _store_plan(plan)


def _versioned(*index):
    """The forward's varlen index tensors as tensors with a version counter. Every layer passes
    the same objects, and the op's tile-plan cache (``ragattn.triton_kernels.plan_cache``) hits on the same
    objects at unchanged versions without reading them; but tensors made under
    ``torch.inference_mode()`` (serving) have no version counter, so the cache would compare their
    contents in every layer (a host sync per tensor and layer on CUDA). Made once per forward, so
    only its first layer compares."""
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return index
    with torch.inference_mode(False):
        return tuple(t.clone() for t in index)


def _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    if _soft_cap(module, kwargs):   # SDPA cannot soft-cap: the model's eager attention (its mask as given)
        return _eager_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("ragattn_")}
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def _eager_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """``output_attentions=True``: the call runs the model's own eager attention (its modeling
    file's ``eager_attention_forward``: soft-capping and all), which forms the weights ragattn's
    kernels never materialise; what SDPA code gets from ``attn_implementation="eager"``. The mask
    comes from ragattn's (SDPA's) mask builder: boolean, or None for SDPA's ``is_causal``, made
    additive here as eager expects."""
    import sys

    if kwargs.get("output_attentions") and (getattr(key, "_ragattn_cache", None) is not None or any(
            kwargs.get(k) is not None for k in ("ragattn_paged", "ragattn_cu_seqlens", "ragattn_block_ids"))):
        raise NotImplementedError("ragattn attention: output_attentions=True with ragattn's paged, packed or "
                                  "block-attention inputs (the weights are never formed there)")
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    q, kv = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is None and q > 1:      # SDPA's is_causal: top-left aligned
        mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril()[None, None]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("ragattn_")}
    out, weights = eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return out, weights if kwargs.get("output_attentions") else None


def _rows_view(t):
    """``[B, H, S, D]`` -> ``[B * S, H, D]`` contiguous (one copy: varlen's packed layout)."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)


def _page_view(t, kind):
    """The cache ``[B, H, S, D]`` (last dim contiguous) as pages, without a copy: ``"row"`` one
    page per row ``[B, S, H, D]``; ``"slot"`` pages of one slot ``[n, 1, H, D]``, page ``p`` at
    ``p * stride(S)`` (page ``b * H * S + j`` is row ``b``'s slot ``j`` when the rows are packed)."""
    if kind == "row":
        return t.transpose(1, 2)
    b, h, s, d = t.shape
    sb, sh, ss, _ = t.stride()
    if sb != h * s * ss:
        raise ValueError("ragattn attention: the K/V cache rows are not packed (unexpected strides "
                         f"{t.stride()} for shape {tuple(t.shape)})")
    n = (b - 1) * h * s + s
    return t.as_strided((n, 1, h, d), (ss, ss, sh, 1))


def ragattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              is_causal=None, **kwargs):
    """HF attention function: returns ``(out [B, q, Hq, D], None)`` (with ``output_attentions=True``:
    the model's eager attention, ``(out, weights [B, Hq, q, kv])``)."""
    if kwargs.get("output_attentions"):
        return _eager_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    _refuse_unsupported(module, dropout, dict(kwargs, is_causal=is_causal))
    cap = _soft_cap(module, kwargs)
    b, hq, q, d = query.shape
    dev = query.device
    capture = kwargs.get("ragattn_capture")
    if capture is not None:
        capture.append((key, value))
    if kwargs.get("ragattn_capture_query") is not None:
        kwargs["ragattn_capture_query"].append(query)
    owner = getattr(key, "_ragattn_cache", None)       # set by PagedCache.update
    if owner is not None:
        return _paged_cache_forward(module, query, key, value, attention_mask, scaling, owner,
                                    _window_left(module, kwargs), cap, kwargs.get("position_ids"))
    paged = kwargs.get("ragattn_paged")
    if paged is not None:
        return _paged_forward(module, query, key, value, scaling, paged, kwargs.get("ragattn_slots"),
                              window_left=_window_left(module, kwargs), logits_soft_cap=cap,
                              positions=kwargs.get("position_ids"))[0]
    kv = key.shape[2]
    cu_packed = kwargs.get("ragattn_cu_seqlens")
    if cu_packed is not None:
        if b != 1 or kv != q:
            raise ValueError("ragattn attention: ragattn_cu_seqlens needs a batch of 1 with no cache")
        cu_packed = cu_packed.to(device=dev, dtype=torch.int32)
        blocks = kwargs.get("ragattn_block_ids")  # [1, T]: Block-Attention inside each packed sequence
        if blocks is not None:
            blocks = blocks.to(device=dev, dtype=torch.int32).reshape(-1).contiguous()
        o, _ = _ops.varlen_attention(query[0].transpose(0, 1).contiguous(),
                                     key[0].transpose(0, 1).contiguous(),
                                     value[0].transpose(0, 1).contiguous(), cu_packed, cu_packed,
                                     None, None, blocks, blocks, True, scaling, -1, cap)
        return o[None], None
    block_ids = kwargs.get("ragattn_block_ids")
    if block_ids is not None:
        return _block_forward(query, key, value, attention_mask, scaling, block_ids, cap)
    plan = _plan(module, query, key, attention_mask, kwargs)
    if plan.fallback:
        return _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if q == 1:
        o = _paged_attention(plan.launch_plans, query[:, :, 0], plan.dec_pos, plan.cu_dec,
                             _page_view(key, plan.page_view), _page_view(value, plan.page_view),
                             plan.table, plan.kv_lens, scaling, -1, cap)
        return o[:, None], None
    e = plan.kv_end
    o, _ = _ops.varlen_attention(_rows_view(query), _rows_view(key[:, :, :e]), _rows_view(value[:, :, :e]),
                                 plan.cu_q, plan.cu_k, plan.q_pos, plan.kv_pos, None, None, True, scaling,
                                 plan.window_left, cap)
    return o.view(b, q, hq, d), None


def _block_forward(query, key, value, attention_mask, scaling, block_ids, logits_soft_cap=0.0):
    """Block-Attention prefill (``ragattn_block_ids``): causal by slot, same block or global."""
    b, hq, q, d = query.shape
    kv, dev = key.shape[2], query.device
    kv_ok = torch.ones(b, kv, dtype=torch.bool, device=dev)
    if attention_mask is not None:   # padding: keys no row sees
        vis = _visible_from_mask(attention_mask, b, q, kv)
        if vis is None:
            raise NotImplementedError("ragattn attention: ragattn_block_ids with a custom attention mask")
        kv_ok = vis.any(1)
    slot = torch.arange(kv, dtype=torch.int32, device=dev)
    kv_pos = torch.where(kv_ok, slot, _FAR).to(torch.int32).reshape(-1)
    q_pos = torch.where(kv_ok[:, kv - q:], slot[kv - q:], -1).to(torch.int32).reshape(-1)
    blocks = block_ids.to(device=dev, dtype=torch.int32)
    cu_q = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=dev)
    cu_k = torch.arange(0, (b + 1) * kv, kv, dtype=torch.int32, device=dev)
    o, _ = _ops.varlen_attention(_rows_view(query), _rows_view(key), _rows_view(value), cu_q, cu_k,
                                 q_pos, kv_pos, blocks[:, kv - q:].reshape(-1).contiguous(),
                                 blocks.reshape(-1).contiguous(), True, scaling, -1, logits_soft_cap)
    return o.view(b, q, hq, d), None


@contextlib.contextmanager
def use_ragattn(model):
    """Context manager: run ``model`` with the "ragattn" attention implementation, then restore.
    Safe for several threads using one model (:mod:`ragattn.hf.attn_switch`)."""
    from ragattn.hf.attn_switch import attention_implementation

    with attention_implementation(model, NAME, _switch_attn_implementation):
        yield model


# model -> {(from, to): [(config, value before, value after)]}: what set_attn_implementation changed
_SWITCHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _attn_configs(model) -> list:
    """Every config whose ``_attn_implementation`` ``model.set_attn_implementation`` may set: the
    model's, the nested sub-configs, and those of PreTrainedModel submodules (by identity)."""
    from transformers import PreTrainedModel

    found, todo = {}, [model.config] + [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        c = todo.pop()
        if id(c) not in found:
            found[id(c)] = c
            todo += [sub for key in getattr(c, "sub_configs", {}) if (sub := getattr(c, key, None)) is not None]
    return list(found.values())


def _switch_attn_implementation(model, old, new) -> None:
    """``model.set_attn_implementation(new)``, replayed after the first time: transformers walks
    every submodule and re-validates the name on each call (~0.4 ms per switch on SmolLM2, twice
    per cached prefill); the replay writes the same values into the configs it changed, when each
    still holds the value it had then (otherwise, e.g. the user switched in between, the real
    call runs and is recorded afresh)."""
    per_model = _SWITCHES.setdefault(model, {})
    changes = per_model.get((old, new))
    if changes is not None and all(c._attn_implementation_internal == before for c, before, _ in changes):
        for c, _, after in changes:
            c._attn_implementation_internal = after
        return
    configs = _attn_configs(model)
    before = [c._attn_implementation_internal for c in configs]
    model.set_attn_implementation(new)
    per_model[(old, new)] = [(c, b, c._attn_implementation_internal) for c, b in zip(configs, before)
                             if c._attn_implementation_internal != b]


def refuse_unsupported_family(model) -> None:
    """ValueError naming the family and a working ``attn_implementation`` when ``model`` (a
    ``PreTrainedModel``) is not of :data:`SUPPORTED_FAMILIES`: raised where transformers checks the
    requested implementation (``from_pretrained`` / model init, before any weight is loaded, and
    ``set_attn_implementation``), not at the first forward."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family in SUPPORTED_FAMILIES:
        return
    hint = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    raise ValueError(f"ragattn attention: model family {family!r} ({type(model).__name__}) is not supported "
                     f"(supported: {', '.join(sorted(SUPPORTED_FAMILIES))}); load it with "
                     f"attn_implementation={hint!r}")


def _install_family_check() -> None:
    """Wrap ``PreTrainedModel.get_correct_attn_implementation`` (every path that sets an attention
    implementation goes through it) so that "ragattn" on an unsupported family is refused there."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_ragattn_family_check", False):
        return

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        if requested_attention == NAME:
            refuse_unsupported_family(self)
        return original(self, requested_attention, is_init_check)

    get_correct_attn_implementation._ragattn_family_check = True
    get_correct_attn_implementation.__wrapped__ = original
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def register() -> None:
    """Register "ragattn" with transformers (idempotent); warns if transformers is untested."""
    check_transformers_version()
    AttentionInterface.register(NAME, ragattn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _install_family_check()


register()
