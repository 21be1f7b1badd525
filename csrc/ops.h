// Declarations of every C++ op implementation registered in torch_bindings.cpp.
// CPU twins are always built; CUDA launchers only when RAGATTN_WITH_CUDA is defined.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <optional>
#include <tuple>
#include <vector>

namespace ragattn {

// ---- KV cache ops (csrc/kv_cache/) ----
void rerotate_keys_cpu(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                       const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved,
                       c10::optional<int64_t> num_kv_heads, const c10::optional<at::Tensor>& k_scale);
void copy_kv_cpu(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                 const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                 const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim, bool interleaved,
                 c10::optional<int64_t> num_kv_heads, const c10::optional<at::Tensor>& src_k_scale,
                 const c10::optional<at::Tensor>& src_v_scale, const c10::optional<at::Tensor>& dst_k_scale,
                 const c10::optional<at::Tensor>& dst_v_scale);
#ifdef RAGATTN_WITH_CUDA
void rerotate_keys_cuda(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                        const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved,
                        c10::optional<int64_t> num_kv_heads, const c10::optional<at::Tensor>& k_scale);
void copy_kv_cuda(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                  const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                  const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim, bool interleaved,
                  c10::optional<int64_t> num_kv_heads, const c10::optional<at::Tensor>& src_k_scale,
                  const c10::optional<at::Tensor>& src_v_scale, const c10::optional<at::Tensor>& dst_k_scale,
                  const c10::optional<at::Tensor>& dst_v_scale);
#endif

// ---- attention CPU paths (csrc/attention/): called by the Python ops after their validation ----
// paged_attention's CPU kernel over a padded block table (private: called by
// ragattn/ops/paged_attention.py after its checks; writes out and lse_out)
void paged_attention_cpu(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                         const at::Tensor& kv_lens, double scale, int64_t window_left, double logits_soft_cap,
                         const at::Tensor& out, const at::Tensor& lse_out);
// paged_attention_run's CPU kernel for position-tagged page lists and page-local keys (private:
// called by ragattn/ops/paged_attention_run.py after its checks)
std::tuple<at::Tensor, at::Tensor> paged_attention_tagged_cpu(const at::Tensor& q, const at::Tensor& q_pos,
    const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& pages,
    const at::Tensor& row_start, const at::Tensor& kv_lens, const std::optional<at::Tensor>& entry_pos,
    const std::optional<at::Tensor>& entry_len, const std::optional<at::Tensor>& entry_start,
    const std::optional<at::Tensor>& rope_cos,
    const std::optional<at::Tensor>& rope_sin, int64_t rotary_dim, bool interleaved, double scale,
    int64_t window_left, double logits_soft_cap);
// varlen_attention's default CPU forward and backward (index-value checks in C++; metadata by Python)
std::tuple<at::Tensor, at::Tensor> varlen_attention_cpu(const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const std::optional<at::Tensor>& q_pos, const std::optional<at::Tensor>& kv_pos,
    const std::optional<at::Tensor>& q_block, const std::optional<at::Tensor>& kv_block, bool causal,
    std::optional<double> scale, int64_t window_left, double logits_soft_cap);
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cpu(const at::Tensor& dout,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& q_pos,
    const std::optional<at::Tensor>& kv_pos, const std::optional<at::Tensor>& q_block,
    const std::optional<at::Tensor>& kv_block, bool causal, std::optional<double> scale, int64_t window_left,
    double logits_soft_cap);
void merge_attention_states_cpu(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                                const at::Tensor& lse_b, bool log2, const at::Tensor& out, const at::Tensor& lse_out);
void merge_attention_states_n_cpu(const at::Tensor& outs, const at::Tensor& lses, bool log2, const at::Tensor& out,
                                  const at::Tensor& lse_out);

// ---- speculative verification (csrc/speculative/) ----
// Shape/dtype/device/scalar checks of verify_draft (ValueError/TypeError naming the argument);
// check_values adds the index and range checks that need host data (CPU only).
void check_verify_draft_args(const at::Tensor& draft_tokens, const std::optional<at::Tensor>& draft_probs,
                             const at::Tensor& target_logits, const at::Tensor& uniforms, double temperature,
                             double eta, double alpha, const std::optional<at::Tensor>& num_draft,
                             const std::optional<at::Tensor>& cu_num_draft, bool check_values);
// verify_draft's CPU kernels (private: ragattn/ops/verify_draft.py chooses; twin: the CUDA kernel's
// bit-faithful twin, else the fast path)
std::tuple<at::Tensor, at::Tensor> verify_draft_cpu(const at::Tensor& draft_tokens,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& target_logits, const at::Tensor& uniforms,
    double temperature, double eta, double alpha, bool greedy, const std::optional<at::Tensor>& num_draft,
    const std::optional<at::Tensor>& cu_num_draft, bool twin);
#ifdef RAGATTN_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> verify_draft_cuda(const at::Tensor& draft_tokens,
    const std::optional<at::Tensor>& draft_probs, const at::Tensor& target_logits, const at::Tensor& uniforms,
    double temperature, double eta, double alpha, bool greedy, const std::optional<at::Tensor>& num_draft,
    const std::optional<at::Tensor>& cu_num_draft);
#endif

}  // namespace ragattn
