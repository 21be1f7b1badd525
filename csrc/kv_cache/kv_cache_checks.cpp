#include "kv_cache/kv_cache_checks.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <set>

namespace ragattn {
namespace kv_cache {

LayerGeom check_layers(const char* op, const char* name, at::TensorList layers) {
  LayerGeom g;
  if (layers.empty()) return g;
  const at::Tensor& t0 = layers[0];
  std::set<const void*> seen;
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor& t = layers[l];
    const auto dt = t.scalar_type();
    TORCH_CHECK_TYPE(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat, "ragattn.", op, ": ", name, "[", l,
                     "] must be float16, bfloat16 or float32, got ", dt);
    TORCH_CHECK_TYPE(dt == t0.scalar_type(), "ragattn.", op, ": every layer of ", name, " must have one dtype; ",
                     name, "[0] is ", t0.scalar_type(), ", ", name, "[", l, "] is ", dt);
    TORCH_CHECK_VALUE(t.dim() >= 3, "ragattn.", op, ": ", name, "[", l,
                      "] must have at least 3 dims [..., num_kv_heads, head_dim], got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.device() == t0.device(), "ragattn.", op, ": every layer of ", name,
                      " must be on one device; ", name, "[0] is on ", t0.device(), ", ", name, "[", l, "] is on ",
                      t.device());
    TORCH_CHECK_VALUE(t.sizes() == t0.sizes(), "ragattn.", op, ": every layer of ", name, " must have one shape; ",
                      name, "[0] is ", t0.sizes(), ", ", name, "[", l, "] is ", t.sizes());
    TORCH_CHECK_VALUE(t.is_contiguous(), "ragattn.", op, ": ", name, "[", l, "] must be contiguous (shape ",
                      t.sizes(), ", strides ", t.strides(), ")");
    if (t.numel() > 0) {
      TORCH_CHECK_VALUE(seen.insert(t.data_ptr()).second, "ragattn.", op, ": ", name, "[", l,
                        "] is the same memory as an earlier layer; layers must be distinct");
    }
  }
  g.heads = t0.size(-2);
  g.head_dim = t0.size(-1);
  g.num_rows = (g.heads * g.head_dim) == 0 ? 0 : t0.numel() / (g.heads * g.head_dim);
  return g;
}

void check_index(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t n,
                 c10::Device device) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "ragattn.", op, ": ", name, " must be ", dtype, ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, "ragattn.", op, ": ", name, " must be 1-D, got shape ", t.sizes());
  if (n >= 0) {
    TORCH_CHECK_VALUE(t.size(0) == n, "ragattn.", op, ": ", name, " must have shape [", n, "] (one per row), got ",
                      t.sizes());
  }
  TORCH_CHECK_VALUE(t.device() == device, "ragattn.", op, ": ", name, " must be on ", device, " (the caches' device), got ",
                    t.device());
}

void check_rope(const char* op, const at::Tensor& inv_freq, int64_t rotary_dim, int64_t head_dim, c10::Device device) {
  TORCH_CHECK_VALUE(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, "ragattn.", op,
                    ": rotary_dim must be even and in [2, head_dim=", head_dim, "], got ", rotary_dim);
  TORCH_CHECK_TYPE(inv_freq.scalar_type() == at::kFloat, "ragattn.", op, ": inv_freq must be float32, got ",
                   inv_freq.scalar_type());
  TORCH_CHECK_VALUE(inv_freq.dim() == 1 && inv_freq.size(0) == rotary_dim / 2, "ragattn.", op,
                    ": inv_freq must have shape [rotary_dim // 2] = [", rotary_dim / 2, "], got ", inv_freq.sizes());
  TORCH_CHECK_VALUE(inv_freq.device() == device, "ragattn.", op, ": inv_freq must be on ", device,
                    " (the caches' device), got ", inv_freq.device());
}

void check_rows_host(const char* op, const char* name, const at::Tensor& rows_cpu, int64_t num_rows, bool distinct) {
  const at::Tensor r = rows_cpu.contiguous();
  const int64_t* p = r.data_ptr<int64_t>();
  const int64_t n = r.numel();
  std::vector<uint8_t> hit(distinct ? static_cast<size_t>(num_rows) : 0, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < num_rows, "ragattn.", op, ": ", name, "[", i, "] = ", p[i],
                      " is out of range for caches of ", num_rows, " rows");
    if (distinct) {
      TORCH_CHECK_VALUE(!hit[p[i]], "ragattn.", op, ": ", name, " may not repeat a row, but row ", p[i],
                        " appears twice (again at index ", i, ")");
      hit[p[i]] = 1;
    }
  }
}

bool debug_mode() {
  const char* v = std::getenv("RAGATTN_DEBUG");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace kv_cache
}  // namespace ragattn

namespace ragattn {
namespace kv_cache {

static bool host_checks(const at::Tensor& t) { return t.device().is_cpu() || debug_mode(); }

LayerGeom validate_rerotate(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                            const at::Tensor& inv_freq, int64_t rotary_dim) {
  const char* op = "rerotate_keys_";
  const LayerGeom g = check_layers(op, "k_layers", k_layers);
  const c10::Device dev = k_layers.empty() ? rows.device() : k_layers[0].device();
  check_index(op, "rows", rows, at::kLong, -1, dev);
  check_index(op, "delta", delta, at::kInt, rows.size(0), dev);
  check_rope(op, inv_freq, rotary_dim, k_layers.empty() ? rotary_dim : g.head_dim, dev);
  if (!k_layers.empty() && host_checks(rows)) check_rows_host(op, "rows", rows.cpu(), g.num_rows, /*distinct=*/true);
  return g;
}

CopyGeom validate_copy(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                       const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                       const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim) {
  const char* op = "copy_kv_";
  const size_t L = dst_k.size();
  TORCH_CHECK_VALUE(src_k.size() == L, "ragattn.copy_kv_: src_k must have one tensor per layer of dst_k (", L,
                    "), got ", src_k.size());
  TORCH_CHECK_VALUE(dst_v.size() == src_v.size(), "ragattn.copy_kv_: dst_v and src_v must have the same number of layers, got ",
                    dst_v.size(), " and ", src_v.size());
  TORCH_CHECK_VALUE(dst_v.empty() || dst_v.size() == L, "ragattn.copy_kv_: dst_v must be empty (K only) or have one tensor per layer of dst_k (",
                    L, "), got ", dst_v.size());
  CopyGeom cg;
  cg.k = check_layers(op, "dst_k", dst_k);
  const LayerGeom sk = check_layers(op, "src_k", src_k);
  cg.has_v = !dst_v.empty() && L > 0;
  const c10::Device dev = L == 0 ? dst_rows.device() : dst_k[0].device();
  if (L > 0) {
    const at::ScalarType dt = dst_k[0].scalar_type();
    TORCH_CHECK_TYPE(src_k[0].scalar_type() == dt, "ragattn.copy_kv_: src_k must have dst_k's dtype ", dt, ", got ",
                     src_k[0].scalar_type());
    TORCH_CHECK_VALUE(src_k[0].device() == dev, "ragattn.copy_kv_: src_k must be on ", dev, " (dst_k's device), got ",
                      src_k[0].device());
    TORCH_CHECK_VALUE(sk.heads == cg.k.heads && sk.head_dim == cg.k.head_dim, "ragattn.copy_kv_: src_k rows must be [",
                      cg.k.heads, ", ", cg.k.head_dim, "] like dst_k's, got shape ", src_k[0].sizes());
    cg.src_rows_total = sk.num_rows;
    if (cg.has_v) {
      cg.v = check_layers(op, "dst_v", dst_v);
      const LayerGeom sv = check_layers(op, "src_v", src_v);
      for (const auto* pair : {&dst_v, &src_v}) {
        const at::Tensor& t = (*pair)[0];
        const char* nm = pair == &dst_v ? "dst_v" : "src_v";
        TORCH_CHECK_TYPE(t.scalar_type() == dt, "ragattn.copy_kv_: ", nm, " must have dst_k's dtype ", dt, ", got ",
                         t.scalar_type());
        TORCH_CHECK_VALUE(t.device() == dev, "ragattn.copy_kv_: ", nm, " must be on ", dev, " (dst_k's device), got ",
                          t.device());
      }
      TORCH_CHECK_VALUE(sv.heads == cg.v.heads && sv.head_dim == cg.v.head_dim, "ragattn.copy_kv_: src_v rows must be [",
                        cg.v.heads, ", ", cg.v.head_dim, "] like dst_v's, got shape ", src_v[0].sizes());
      TORCH_CHECK_VALUE(cg.v.num_rows == cg.k.num_rows, "ragattn.copy_kv_: dst_v must have as many rows as dst_k (",
                        cg.k.num_rows, "), got ", cg.v.num_rows);
      TORCH_CHECK_VALUE(sv.num_rows == sk.num_rows, "ragattn.copy_kv_: src_v must have as many rows as src_k (",
                        sk.num_rows, "), got ", sv.num_rows);
    }
  }
  check_index(op, "src_rows", src_rows, at::kLong, -1, dev);
  check_index(op, "dst_rows", dst_rows, at::kLong, src_rows.size(0), dev);
  if (delta.has_value()) {
    check_index(op, "delta", *delta, at::kInt, src_rows.size(0), dev);
    TORCH_CHECK_VALUE(inv_freq.has_value(), "ragattn.copy_kv_: inv_freq is required when delta is given");
    check_rope(op, *inv_freq, rotary_dim, L == 0 ? rotary_dim : cg.k.head_dim, dev);
  }
  if (L > 0 && host_checks(dst_rows)) {
    const at::Tensor s = src_rows.cpu(), d = dst_rows.cpu();
    check_rows_host(op, "src_rows", s, cg.src_rows_total, /*distinct=*/false);
    check_rows_host(op, "dst_rows", d, cg.k.num_rows, /*distinct=*/true);
    // In-place moves within one cache: a row may not be both read and written (no ordering).
    bool alias = false;
    for (size_t l = 0; l < L; ++l) {
      alias = alias || dst_k[l].data_ptr() == src_k[l].data_ptr() ||
              (cg.has_v && dst_v[l].data_ptr() == src_v[l].data_ptr());
    }
    if (alias) {
      std::vector<uint8_t> written(static_cast<size_t>(cg.k.num_rows), 0);
      const int64_t* dp = d.data_ptr<int64_t>();
      const int64_t* sp = s.data_ptr<int64_t>();
      for (int64_t i = 0; i < d.numel(); ++i) written[dp[i]] = 1;
      for (int64_t i = 0; i < s.numel(); ++i) {
        TORCH_CHECK_VALUE(!written[sp[i]], "ragattn.copy_kv_: src and dst are the same cache and src_rows[", i, "] = ",
                          sp[i], " is also in dst_rows; a row may not be both read and written");
      }
    }
  }
  return cg;
}

}  // namespace kv_cache
}  // namespace ragattn
