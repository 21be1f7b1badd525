// Every schema of torch.ops.ragattn in one place (the op contract of design.md).
//
// C++ ops register their CPU twin and (when built with CUDA) their CUDA launcher here.
// Triton-backed ops (varlen_attention, paged_attention, merge_attention_states,
// key_attention_scores, refrag_assemble) register their CPU/CUDA kernels and fake impls from Python
// (ragattn/ops/), against the schemas declared below; their CPU kernels in C++ are the private
// _*_cpu ops below, called by the Python op after its checks (no C++ op calls into Python).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(ragattn, m) {
  // 1. Packed prefill with block/position masks (Triton).
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor? q_pos=None, Tensor? kv_pos=None, Tensor? q_block=None, Tensor? kv_block=None, "
      "bool causal=True, float? scale=None, int window_left=-1, float logits_soft_cap=0.0) -> (Tensor out, Tensor lse)");
  //    Into preallocated outputs (engines' out=/lse_out=): out like q, lse_out float32 [total_q, H].
  m.def(
      "varlen_attention.out(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor? q_pos=None, Tensor? kv_pos=None, Tensor? q_block=None, Tensor? kv_block=None, "
      "bool causal=True, float? scale=None, int window_left=-1, float logits_soft_cap=0.0, *, Tensor(a!) out, "
      "Tensor(b!) lse_out) -> ()");
  //    Its backward (Triton on CUDA, C++ on CPU, see below); dq/dk/dv in the inputs' dtypes.
  m.def(
      "varlen_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? q_pos, Tensor? kv_pos, Tensor? q_block, "
      "Tensor? kv_block, bool causal, float? scale, int window_left=-1, float logits_soft_cap=0.0) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");

  // 2. Q-indexed sparse prefill and decode over a paged KV cache (Triton; C++ on CPU).
  m.def(
      "paged_attention(Tensor q, Tensor q_pos, Tensor cu_seqlens_q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor kv_lens, float? scale=None, int window_left=-1, float logits_soft_cap=0.0) "
      "-> (Tensor out, Tensor lse)");
  //    Into preallocated outputs (engines: out=, lse_out=).
  m.def(
      "paged_attention.out(Tensor q, Tensor q_pos, Tensor cu_seqlens_q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor kv_lens, float? scale=None, int window_left=-1, float logits_soft_cap=0.0, *, "
      "Tensor(a!) out, "
      "Tensor(b!) lse_out) -> ()");
  //    The same with a ready plan (ragattn.plan_paged_attention, once per step; this per layer):
  //    no host sync on any device, CUDA-graph capturable. pages: a padded block_table [B, max_pages]
  //    (row_start None), or a flat page list [E] with row_start [B] (FlashInfer's CSR indices and
  //    indptr[:-1]); tile_seq/tile_row0/launch: the plan's tile map and launch integers.
  //    Zero-copy chunk pages: entry_pos/entry_len/entry_start [E] (flat lists) give each entry's
  //    slot-0 position and its valid slots [entry_start, entry_len); inv_freq [rotary_dim / 2]:
  //    keys stored page-local (slot o rotated by o), moved to their entry's position.
  //    fp8 caches (vLLM's kv_cache_dtype="fp8"): float8 k/v_cache with float32 k/v_scale [] or [1].
  m.def(
      "paged_attention_run(Tensor q, Tensor q_pos, Tensor cu_seqlens_q, Tensor k_cache, Tensor v_cache, "
      "Tensor pages, Tensor? row_start, Tensor kv_lens, Tensor tile_seq, Tensor tile_row0, int[] launch, "
      "float? scale=None, int window_left=-1, Tensor? entry_pos=None, Tensor? entry_len=None, "
      "Tensor? entry_start=None, Tensor? inv_freq=None, int rotary_dim=0, bool interleaved=False, "
      "Tensor? k_scale=None, Tensor? v_scale=None, float logits_soft_cap=0.0) -> (Tensor out, Tensor lse)");
  m.def(
      "paged_attention_run.out(Tensor q, Tensor q_pos, Tensor cu_seqlens_q, Tensor k_cache, Tensor v_cache, "
      "Tensor pages, Tensor? row_start, Tensor kv_lens, Tensor tile_seq, Tensor tile_row0, int[] launch, "
      "float? scale=None, int window_left=-1, Tensor? entry_pos=None, Tensor? entry_len=None, "
      "Tensor? entry_start=None, Tensor? inv_freq=None, int rotary_dim=0, bool interleaved=False, "
      "Tensor? k_scale=None, Tensor? v_scale=None, float logits_soft_cap=0.0, *, Tensor(a!) out, Tensor(b!) lse_out) -> ()");

  // 3. Exact merge of two partial attentions over disjoint key sets (Triton). LSEs are natural
  //    log; log2=True takes and returns base-2 LSEs (FlashInfer's convention).
  m.def(
      "merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, bool log2=False) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "merge_attention_states.out(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, bool log2=False, *, "
      "Tensor(a!) out, Tensor(b!) lse_out) -> ()");
  //    In place into (out_a, lse_a).
  m.def(
      "merge_attention_states_(Tensor(a!) out_a, Tensor(b!) lse_a, Tensor out_b, Tensor lse_b, "
      "bool log2=False) -> ()");
  //    N-way: S stacked states outs [S, N, H, D], lses [S, N, H] (cascades of more than two levels).
  m.def("merge_attention_states_n(Tensor outs, Tensor lses, bool log2=False) -> (Tensor out, Tensor lse)");

  // 4. In-place RoPE re-rotation of cached key rows, all layers in one launch (CUDA C++).
  //    delta int32/int64; num_kv_heads (optional) is checked against the layers' rows; k_scale:
  //    float8_e4m3fn layers' per-tensor scale(s), [] / [1] / [L].
  m.def(
      "rerotate_keys_(Tensor(a!)[] k_layers, Tensor rows, Tensor delta, Tensor inv_freq, "
      "int rotary_dim, bool interleaved, int? num_kv_heads=None, Tensor? k_scale=None) -> ()");

  // 5. Gather/scatter of K/V rows between caches, optionally re-rotating K (CUDA C++).
  //    Either side may be float8_e4m3fn with its per-tensor scales (dequantise, rotate, requantise).
  m.def(
      "copy_kv_(Tensor(a!)[] dst_k, Tensor(b!)[] dst_v, Tensor[] src_k, Tensor[] src_v, "
      "Tensor src_rows, Tensor dst_rows, Tensor? delta=None, Tensor? inv_freq=None, "
      "int rotary_dim=0, bool interleaved=False, int? num_kv_heads=None, Tensor? src_k_scale=None, "
      "Tensor? src_v_scale=None, Tensor? dst_k_scale=None, Tensor? dst_v_scale=None) -> ()");

  // 6. FusionRAG's query-guided key importance, two passes (Triton).
  m.def(
      "key_attention_scores(Tensor q, Tensor k, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "float? scale=None) -> Tensor scores");

  // CPU paths of the Triton-backed attention ops (csrc/attention/), private: the public ops'
  // CPU impls validate (ragattn/ops/) and call these with preallocated outputs (unit last-dim
  // stride); RAGATTN_CPU_BACKEND=reference/triton bypasses them.
  //    paged_attention's default CPU kernel over a padded block table (into out, lse_out).
  m.def(
      "_paged_attention_cpu(Tensor q, Tensor q_pos, Tensor cu_seqlens_q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor kv_lens, float scale, int window_left, float logits_soft_cap, *, "
      "Tensor(a!) out, Tensor(b!) lse_out) -> ()");
  //    paged_attention_run's CPU kernel for position-tagged page lists (C++): rope_cos/rope_sin
  //    float32 [positions, rotary_dim / 2] (None: keys stored rotated) rotate each key by its slot's position.
  m.def(
      "_paged_attention_tagged_cpu(Tensor q, Tensor q_pos, Tensor cu_seqlens_q, Tensor k_cache, Tensor v_cache, "
      "Tensor pages, Tensor row_start, Tensor kv_lens, Tensor? entry_pos, Tensor? entry_len, Tensor? entry_start, "
      "Tensor? rope_cos, Tensor? rope_sin, int rotary_dim, bool interleaved, float scale, int window_left, "
      "float logits_soft_cap) "
      "-> (Tensor out, Tensor lse)");
  //    varlen_attention's default CPU forward and backward (C++), called by its Python impls after
  //    the metadata checks; the backward takes the forward's out and lse.
  m.def(
      "_varlen_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor? q_pos, Tensor? kv_pos, Tensor? q_block, Tensor? kv_block, bool causal, float? scale, "
      "int window_left, float logits_soft_cap=0.0) -> (Tensor out, Tensor lse)");
  m.def(
      "_varlen_attention_backward_cpu(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? q_pos, Tensor? kv_pos, Tensor? q_block, "
      "Tensor? kv_block, bool causal, float? scale, int window_left, float logits_soft_cap=0.0) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "_merge_attention_states_cpu(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, bool log2=False, *, "
      "Tensor(a!) out, Tensor(b!) lse_out) -> ()");
  m.def(
      "_merge_attention_states_n_cpu(Tensor outs, Tensor lses, bool log2=False, *, "
      "Tensor(a!) out, Tensor(b!) lse_out) -> ()");

  // 7. Chain speculative verification, standard and RAPID's modified target (CUDA C++).
  //    num_draft [B] (optional) verifies chains of different lengths padded to g; cu_num_draft
  //    [B + 1] (optional) takes vLLM's flat layout instead; draft_probs=None: one-hot drafts (n-gram).
  m.def(
      "verify_draft(Tensor draft_tokens, Tensor? draft_probs, Tensor target_logits, Tensor uniforms, "
      "float temperature=1.0, float eta=0.0, float alpha=0.1, bool greedy=False, "
      "Tensor? num_draft=None, Tensor? cu_num_draft=None) -> (Tensor out_tokens, Tensor num_accepted)");
  //    Its CPU kernels (C++, with every check of the op): the fast path, or with twin=True the CUDA
  //    kernel's bit-faithful twin; the op's CPU impl (ragattn/ops/verify_draft.py) chooses.
  m.def(
      "_verify_draft_cpu(Tensor draft_tokens, Tensor? draft_probs, Tensor target_logits, Tensor uniforms, "
      "float temperature, float eta, float alpha, bool greedy, Tensor? num_draft, Tensor? cu_num_draft, "
      "bool twin) -> (Tensor out_tokens, Tensor num_accepted)");

  // 8. REFRAG's decoder input: token embeddings and projected chunk embeddings interleaved in one
  //    pass (Triton; plain torch on CPU), with autograd (registered from Python).
  //    slot_src[t] >= 0: embed_weight[token_ids[slot_src[t]]]; < 0: chunk_embeds[-slot_src[t] - 1].
  m.def("refrag_assemble(Tensor embed_weight, Tensor token_ids, Tensor chunk_embeds, Tensor slot_src) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragattn, CPU, m) {
  // kv_cache: rerotate_keys_, copy_kv_
  m.impl("rerotate_keys_", &ragattn::rerotate_keys_cpu);
  m.impl("copy_kv_", &ragattn::copy_kv_cpu);
  // speculative: verify_draft's CPU kernels
  m.impl("_verify_draft_cpu", &ragattn::verify_draft_cpu);
  // attention CPU paths
  m.impl("_paged_attention_cpu", &ragattn::paged_attention_cpu);
  m.impl("_paged_attention_tagged_cpu", &ragattn::paged_attention_tagged_cpu);
  m.impl("_merge_attention_states_cpu", &ragattn::merge_attention_states_cpu);
  m.impl("_merge_attention_states_n_cpu", &ragattn::merge_attention_states_n_cpu);
  m.impl("_varlen_attention_cpu", &ragattn::varlen_attention_cpu);
  m.impl("_varlen_attention_backward_cpu", &ragattn::varlen_attention_backward_cpu);
}

#ifdef RAGATTN_WITH_CUDA
TORCH_LIBRARY_IMPL(ragattn, CUDA, m) {
  // kv_cache: rerotate_keys_, copy_kv_
  m.impl("rerotate_keys_", &ragattn::rerotate_keys_cuda);
  m.impl("copy_kv_", &ragattn::copy_kv_cuda);
  // speculative: verify_draft
  m.impl("verify_draft", &ragattn::verify_draft_cuda);
}
#endif

// Makes `import ragattn._C` load the library (and run the registrations above);
// the ops themselves live in torch.ops.ragattn.
#include <Python.h>
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
