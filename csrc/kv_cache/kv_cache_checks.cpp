#include "kv_cache/kv_cache_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "common/check_message.h"

namespace ragattn {
namespace kv_cache {
namespace {

// Collapse the leading dims of `t` ([..., H, D]) into at most two (size, stride) levels, inner
// first; size-1 dims are dropped and a dim whose stride spans the next one merges into it.
std::vector<std::pair<int64_t, int64_t>> leading_levels(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> levels;  // inner to outer
  for (int64_t i = t.dim() - 3; i >= 0; --i) {
    const int64_t size = t.size(i), stride = t.stride(i);
    if (size == 1) continue;
    if (!levels.empty() && stride == levels.back().first * levels.back().second) {
      levels.back().first *= size;
    } else {
      levels.emplace_back(size, stride);
    }
  }
  return levels;
}

}  // namespace

LayerGeom check_layers(const char* op, const char* name, at::TensorList layers) {
  LayerGeom g;
  if (layers.empty()) return g;
  const at::Tensor& t0 = layers[0];
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor& t = layers[l];
    const auto dt = t.scalar_type();
    RAGATTN_CHECK_TYPE(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat || dt == at::kFloat8_e4m3fn,
                     "ragattn.", op, ": ", name, "[", l, "] must be float16, bfloat16, float32 or float8_e4m3fn, got ",
                     dt);
    RAGATTN_CHECK_TYPE(dt == t0.scalar_type(), "ragattn.", op, ": every layer of ", name, " must have one dtype; ",
                     name, "[0] is ", t0.scalar_type(), ", ", name, "[", l, "] is ", dt);
    RAGATTN_CHECK_VALUE(t.dim() >= 3, "ragattn.", op, ": ", name, "[", l,
                      "] must have at least 3 dims [..., num_kv_heads, head_dim], got shape ", t.sizes());
    RAGATTN_CHECK_VALUE(t.device() == t0.device(), "ragattn.", op, ": every layer of ", name,
                      " must be on one device; ", name, "[0] is on ", t0.device(), ", ", name, "[", l, "] is on ",
                      t.device());
    RAGATTN_CHECK_VALUE(t.sizes() == t0.sizes(), "ragattn.", op, ": every layer of ", name, " must have one shape; ",
                      name, "[0] is ", t0.sizes(), ", ", name, "[", l, "] is ", t.sizes());
    RAGATTN_CHECK_VALUE(t.strides() == t0.strides(), "ragattn.", op, ": every layer of ", name,
                      " must have one layout (strides); ", name, "[0] has ", t0.strides(), ", ", name, "[", l,
                      "] has ", t.strides());
  }
  g.heads = t0.size(-2);
  g.head_dim = t0.size(-1);
  const int64_t w = g.heads * g.head_dim;
  const bool inner_ok = (g.head_dim <= 1 || t0.stride(-1) == 1) && (g.heads <= 1 || t0.stride(-2) == g.head_dim);
  RAGATTN_CHECK_VALUE(inner_ok, "ragattn.", op, ": ", name, "[0] must have contiguous [num_kv_heads, head_dim] rows ",
                    "(strides [..., head_dim, 1]), got shape ", t0.sizes(), " with strides ", t0.strides());
  g.layout = RowLayout{1, w, w};
  if (t0.numel() == 0) return g;  // no rows
  const auto levels = leading_levels(t0);
  RAGATTN_CHECK_VALUE(levels.size() <= 2, "ragattn.", op, ": ", name, "[0] (shape ", t0.sizes(), ", strides ",
                    t0.strides(), ") must be addressable as [rows, num_kv_heads, head_dim] with at most two row ",
                    "strides (e.g. [pages, page_size, H, D] viewed out of [pages, 2, page_size, H, D]); its leading ",
                    "dims need ", levels.size());
  if (levels.size() >= 1) g.layout = RowLayout{levels[0].first, levels[0].second, levels[0].first * levels[0].second};
  if (levels.size() == 2) {
    g.outer_rows = levels[1].first;
    g.layout.outer_stride = levels[1].second;
  }
  g.num_rows = g.outer_rows * g.layout.inner_rows;
  const bool inner_apart = g.layout.inner_rows == 1 || g.layout.inner_stride >= w;
  const int64_t inner_span = g.layout.inner_rows == 1 ? w : g.layout.inner_rows * g.layout.inner_stride;
  const bool outer_apart = g.outer_rows == 1 || g.layout.outer_stride >= inner_span;
  RAGATTN_CHECK_VALUE(inner_apart && outer_apart, "ragattn.", op, ": ", name, "[0] (shape ", t0.sizes(), ", strides ",
                    t0.strides(), ") has rows that overlap in memory; every row must be its own memory");
  return g;
}

namespace {

// 1-D, `n` entries (n < 0: any), on `device`.
void check_index_shape(const char* op, const char* name, const at::Tensor& t, int64_t n, c10::Device device) {
  RAGATTN_CHECK_VALUE(t.dim() == 1, "ragattn.", op, ": ", name, " must be 1-D, got shape ", t.sizes());
  if (n >= 0) {
    RAGATTN_CHECK_VALUE(t.size(0) == n, "ragattn.", op, ": ", name, " must have shape [", n, "] (one per row), got ",
                      t.sizes());
  }
  RAGATTN_CHECK_VALUE(t.device() == device, "ragattn.", op, ": ", name, " must be on ", device, " (the caches' device), got ",
                    t.device());
}

}  // namespace

void check_rows_index(const char* op, const char* name, const at::Tensor& t, int64_t n, c10::Device device) {
  RAGATTN_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, "ragattn.", op, ": ", name,
                   " must be int32 or int64, got ", t.scalar_type());
  check_index_shape(op, name, t, n, device);
}

void check_index(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t n,
                 c10::Device device) {
  RAGATTN_CHECK_TYPE(t.scalar_type() == dtype, "ragattn.", op, ": ", name, " must be ", dtype, ", got ",
                   t.scalar_type());
  check_index_shape(op, name, t, n, device);
}

void check_rope(const char* op, const at::Tensor& inv_freq, int64_t rotary_dim, int64_t head_dim, c10::Device device) {
  RAGATTN_CHECK_VALUE(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, "ragattn.", op,
                    ": rotary_dim must be even and in [2, head_dim=", head_dim, "], got ", rotary_dim);
  RAGATTN_CHECK_TYPE(inv_freq.scalar_type() == at::kFloat, "ragattn.", op, ": inv_freq must be float32, got ",
                   inv_freq.scalar_type());
  RAGATTN_CHECK_VALUE(inv_freq.dim() == 1 && inv_freq.size(0) == rotary_dim / 2, "ragattn.", op,
                    ": inv_freq must have shape [rotary_dim // 2] = [", rotary_dim / 2, "], got ", inv_freq.sizes());
  RAGATTN_CHECK_VALUE(inv_freq.device() == device, "ragattn.", op, ": inv_freq must be on ", device,
                    " (the caches' device), got ", inv_freq.device());
}

int64_t check_scale(const char* op, const char* name, const c10::optional<at::Tensor>& scale, const char* cache_name,
                    at::ScalarType cache_dtype, int64_t num_layers, c10::Device device) {
  if (cache_dtype != at::kFloat8_e4m3fn) {
    RAGATTN_CHECK_VALUE(!scale.has_value(), "ragattn.", op, ": ", name, " is given but ", cache_name, " is ",
                      cache_dtype, "; scales belong to float8_e4m3fn caches only");
    return -1;
  }
  RAGATTN_CHECK_VALUE(scale.has_value(), "ragattn.", op, ": ", name, " is required: ", cache_name,
                    " is float8_e4m3fn (stored value x means x * scale; pass torch.ones(1) for unscaled)");
  const at::Tensor& s = *scale;
  RAGATTN_CHECK_TYPE(s.scalar_type() == at::kFloat, "ragattn.", op, ": ", name, " must be float32, got ",
                   s.scalar_type());
  const bool one = s.numel() == 1 && s.dim() <= 1;
  RAGATTN_CHECK_VALUE(one || (s.dim() == 1 && s.size(0) == num_layers), "ragattn.", op, ": ", name,
                    " must have shape [], [1] or [num_layers] = [", num_layers, "], got ", s.sizes());
  RAGATTN_CHECK_VALUE(s.device() == device, "ragattn.", op, ": ", name, " must be on ", device,
                    " (the caches' device), got ", s.device());
  // the values: finite and > 0 (0 would store +-inf or NaN). Read where that costs no device sync
  // (CPU; CUDA under RAGATTN_DEBUG=1); elsewhere a precondition, and the kernels write NaN
  // (fp8_math.h) rather than a finite value
  if (s.device().is_cpu() || debug_mode()) {
    const at::Tensor v = s.detach().to(at::kCPU).reshape({-1});
    const at::Tensor bad = v.isfinite().logical_not().logical_or(v.le(0));
    if (bad.any().item<bool>()) {
      const int64_t i = bad.nonzero()[0][0].item<int64_t>();
      RAGATTN_CHECK_VALUE(false, "ragattn.", op, ": ", name, " must be finite and > 0 (a stored x means x * scale), got ",
                        v[i].item<float>(), " at index ", i);
    }
  }
  return one ? 0 : s.stride(0);
}

void check_num_kv_heads(const char* op, const c10::optional<int64_t>& num_kv_heads, const char* name,
                        const LayerGeom& g, at::TensorList layers) {
  if (!num_kv_heads.has_value() || layers.empty()) return;
  RAGATTN_CHECK_VALUE(g.heads == *num_kv_heads, "ragattn.", op, ": ", name, "[0] of shape ", layers[0].sizes(),
                    " has ", g.heads, " heads in its [..., num_kv_heads, head_dim] rows, but num_kv_heads=",
                    *num_kv_heads, " (a head-major (HND) cache [pages, H, page_size, D] is not token-major: pass ",
                    "one [pages, page_size, 1, D] view per head, cache[:, h:h+1].transpose(1, 2))");
}

void check_rows_host(const char* op, const char* name, const at::Tensor& rows, int64_t num_rows, bool distinct) {
  const at::Tensor r = rows.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = r.data_ptr<int64_t>();
  const int64_t n = r.numel();
  for (int64_t i = 0; i < n; ++i)
    RAGATTN_CHECK_VALUE(p[i] >= 0 && p[i] < num_rows, "ragattn.", op, ": ", name, "[", i, "] = ", p[i],
                      " is out of range for caches of ", num_rows, " rows");
  if (!distinct || n < 2) return;
  // the first index whose row appeared before it, and that row (-1: none)
  int64_t again = -1, row = -1;
  if (n * 16 >= num_rows) {  // a bitmap of the cache's rows
    std::vector<uint8_t> hit(static_cast<size_t>(num_rows), 0);
    for (int64_t i = 0; i < n && again < 0; ++i) {
      if (hit[p[i]]) again = i, row = p[i];
      hit[p[i]] = 1;
    }
  } else {  // few rows in a large cache (a decode step's write): sorted (row, index) pairs, not a
            // bitmap of every row of the cache zeroed on every call
    std::vector<std::pair<int64_t, int64_t>> sorted(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) sorted[i] = {p[i], i};
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 1; i < n; ++i)  // within a run of one row, the second index is its first repeat
      if (sorted[i].first == sorted[i - 1].first && (i < 2 || sorted[i - 2].first != sorted[i].first) &&
          (again < 0 || sorted[i].second < again))
        again = sorted[i].second, row = sorted[i].first;
  }
  RAGATTN_CHECK_VALUE(again < 0, "ragattn.", op, ": ", name, " may not repeat a row, but row ", row,
                      " appears twice (again at index ", again, ")");
}

namespace {

// Elements [first, last] of `t` inside its storage.
std::pair<int64_t, int64_t> element_span(const at::Tensor& t, const LayerGeom& g) {
  const int64_t first = t.storage_offset();
  return {first, first + row_offset(g.layout, g.num_rows - 1) + g.heads * g.head_dim - 1};
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// Whether a row of a layer at element offset 0 and a row of the same layout at offset d >= 0
// share an element: d = i * outer + j * inner + t with |i| < outer_rows, |j| < inner_rows,
// |t| < row width. The layout rule (rows apart, levels apart) leaves two candidates per level.
bool same_layout_rows_meet(int64_t d, const LayerGeom& g) {
  const int64_t w = g.heads * g.head_dim;
  const int64_t nI = g.layout.inner_rows, s = nI > 1 ? g.layout.inner_stride : w;
  const int64_t nO = g.outer_rows, o = g.layout.outer_stride;
  const int64_t i0 = nO > 1 ? floor_div(d, o) : 0;
  for (int64_t i = i0; i <= i0 + (nO > 1 ? 1 : 0); ++i) {
    if (i <= -nO || i >= nO) continue;
    const int64_t rem = d - i * o;
    const int64_t j0 = nI > 1 ? floor_div(rem, s) : 0;
    for (int64_t j = j0; j <= j0 + (nI > 1 ? 1 : 0); ++j) {
      if (j <= -nI || j >= nI) continue;
      const int64_t t = rem - j * s;
      if (t > -w && t < w) return true;
    }
  }
  return false;
}

// Whether two layers address their rows alike: row i of one lies where row i of the other would at
// the same offset.
bool same_layout(const LayerGeom& ga, const LayerGeom& gb) {
  return ga.heads * ga.head_dim == gb.heads * gb.head_dim && ga.num_rows == gb.num_rows &&
         ga.outer_rows == gb.outer_rows && ga.layout.inner_rows == gb.layout.inner_rows &&
         ga.layout.inner_stride == gb.layout.inner_stride && ga.layout.outer_stride == gb.layout.outer_stride;
}

}  // namespace

bool layers_overlap(const at::Tensor& a, const LayerGeom& ga, const at::Tensor& b, const LayerGeom& gb) {
  if (ga.num_rows == 0 || gb.num_rows == 0 || a.numel() == 0 || b.numel() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  if (a.element_size() != b.element_size()) return true;  // (never: one dtype per op) conservative
  const auto sa = element_span(a, ga), sb = element_span(b, gb);
  if (sa.second < sb.first || sb.second < sa.first) return false;
  if (!same_layout(ga, gb)) return true;  // conservative: intersecting spans of different layouts
  const int64_t d = sb.first - sa.first;
  return same_layout_rows_meet(d < 0 ? -d : d, ga);
}

void check_writes_disjoint(const char* op, std::initializer_list<NamedLayers> written) {
  std::vector<const NamedLayers*> lists;
  for (const auto& w : written) lists.push_back(&w);
  for (size_t a = 0; a < lists.size(); ++a) {
    for (size_t la = 0; la < lists[a]->layers.size(); ++la) {
      for (size_t b = a; b < lists.size(); ++b) {
        for (size_t lb = (b == a ? la + 1 : 0); lb < lists[b]->layers.size(); ++lb) {
          RAGATTN_CHECK_VALUE(!layers_overlap(lists[a]->layers[la], *lists[a]->geom, lists[b]->layers[lb], *lists[b]->geom),
                            "ragattn.", op, ": ", lists[b]->name, "[", lb, "] shares memory with ", lists[a]->name, "[",
                            la, "]; every written layer must be its own memory (a row written or rotated twice "
                            "would depend on the order)");
        }
      }
    }
  }
}

ReadWriteOverlap read_write_overlap(std::initializer_list<NamedLayers> read, std::initializer_list<NamedLayers> written) {
  ReadWriteOverlap found = ReadWriteOverlap::kNone;
  for (const auto& r : read)
    for (const auto& w : written)
      for (const auto& tr : r.layers)
        for (const auto& tw : w.layers) {
          if (!layers_overlap(tr, *r.geom, tw, *w.geom)) continue;
          if (tr.storage_offset() != tw.storage_offset() || !same_layout(*r.geom, *w.geom))
            return ReadWriteOverlap::kOther;
          found = ReadWriteOverlap::kSameRows;
        }
  return found;
}

bool rows_meet(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor ra = a.to(at::kLong).contiguous(), rb = b.to(at::kLong).contiguous();
  std::vector<int64_t> sorted(rb.data_ptr<int64_t>(), rb.data_ptr<int64_t>() + rb.numel());
  std::sort(sorted.begin(), sorted.end());
  const int64_t* p = ra.data_ptr<int64_t>();
  for (int64_t i = 0; i < ra.numel(); ++i)
    if (std::binary_search(sorted.begin(), sorted.end(), p[i])) return true;
  return false;
}

bool debug_mode() {
  const char* v = std::getenv("RAGATTN_DEBUG");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

static bool host_checks(const at::Tensor& t) { return t.device().is_cpu() || debug_mode(); }

RerotateGeom validate_rerotate(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                               const at::Tensor& inv_freq, int64_t rotary_dim,
                               const c10::optional<int64_t>& num_kv_heads, const c10::optional<at::Tensor>& k_scale) {
  const char* op = "rerotate_keys_";
  RerotateGeom rg;
  rg.g = check_layers(op, "k_layers", k_layers);
  const LayerGeom& g = rg.g;
  const c10::Device dev = k_layers.empty() ? rows.device() : k_layers[0].device();
  check_rows_index(op, "rows", rows, -1, dev);
  check_rows_index(op, "delta", delta, rows.size(0), dev);
  check_rope(op, inv_freq, rotary_dim, k_layers.empty() ? rotary_dim : g.head_dim, dev);
  check_num_kv_heads(op, num_kv_heads, "k_layers", g, k_layers);
  if (!k_layers.empty()) {
    rg.scale_stride = check_scale(op, "k_scale", k_scale, "k_layers", k_layers[0].scalar_type(),
                                  static_cast<int64_t>(k_layers.size()), dev);
  } else {
    RAGATTN_CHECK_VALUE(!k_scale.has_value() || k_scale->scalar_type() == at::kFloat, "ragattn.", op,
                      ": k_scale must be float32, got ", k_scale->scalar_type());
  }
  check_writes_disjoint(op, {{"k_layers", k_layers, &g}});
  if (!k_layers.empty() && host_checks(rows)) check_rows_host(op, "rows", rows, g.num_rows, /*distinct=*/true);
  return rg;
}

CopyGeom validate_copy(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                       const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                       const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim,
                       const c10::optional<int64_t>& num_kv_heads, const c10::optional<at::Tensor>& src_k_scale,
                       const c10::optional<at::Tensor>& src_v_scale, const c10::optional<at::Tensor>& dst_k_scale,
                       const c10::optional<at::Tensor>& dst_v_scale) {
  const char* op = "copy_kv_";
  const size_t L = dst_k.size();
  RAGATTN_CHECK_VALUE(src_k.size() == L, "ragattn.copy_kv_: src_k must have one tensor per layer of dst_k (", L,
                    "), got ", src_k.size());
  RAGATTN_CHECK_VALUE(dst_v.size() == src_v.size(), "ragattn.copy_kv_: dst_v and src_v must have the same number of layers, got ",
                    dst_v.size(), " and ", src_v.size());
  RAGATTN_CHECK_VALUE(dst_v.empty() || dst_v.size() == L, "ragattn.copy_kv_: dst_v must be empty (K only) or have one tensor per layer of dst_k (",
                    L, "), got ", dst_v.size());
  CopyGeom cg;
  cg.k = check_layers(op, "dst_k", dst_k);
  cg.sk = check_layers(op, "src_k", src_k);
  cg.has_v = !dst_v.empty() && L > 0;
  const c10::Device dev = L == 0 ? dst_rows.device() : dst_k[0].device();
  if (L > 0) {
    const at::ScalarType dt = dst_k[0].scalar_type(), st = src_k[0].scalar_type();
    RAGATTN_CHECK_TYPE(st == dt || st == at::kFloat8_e4m3fn || dt == at::kFloat8_e4m3fn,
                     "ragattn.copy_kv_: src_k must have dst_k's dtype ", dt,
                     " (or one side float8_e4m3fn), got ", st);
    RAGATTN_CHECK_VALUE(src_k[0].device() == dev, "ragattn.copy_kv_: src_k must be on ", dev, " (dst_k's device), got ",
                      src_k[0].device());
    RAGATTN_CHECK_VALUE(cg.sk.heads == cg.k.heads && cg.sk.head_dim == cg.k.head_dim, "ragattn.copy_kv_: src_k rows must be [",
                      cg.k.heads, ", ", cg.k.head_dim, "] like dst_k's, got shape ", src_k[0].sizes());
    if (cg.has_v) {
      cg.v = check_layers(op, "dst_v", dst_v);
      cg.sv = check_layers(op, "src_v", src_v);
      for (const auto* pair : {&dst_v, &src_v}) {
        const at::Tensor& t = (*pair)[0];
        const bool is_dst = pair == &dst_v;
        const char* nm = is_dst ? "dst_v" : "src_v";
        const at::ScalarType want = is_dst ? dt : st;
        RAGATTN_CHECK_TYPE(t.scalar_type() == want, "ragattn.copy_kv_: ", nm, " must have ", is_dst ? "dst_k" : "src_k",
                         "'s dtype ", want, ", got ", t.scalar_type());
        RAGATTN_CHECK_VALUE(t.device() == dev, "ragattn.copy_kv_: ", nm, " must be on ", dev, " (dst_k's device), got ",
                          t.device());
      }
      RAGATTN_CHECK_VALUE(cg.sv.heads == cg.v.heads && cg.sv.head_dim == cg.v.head_dim, "ragattn.copy_kv_: src_v rows must be [",
                        cg.v.heads, ", ", cg.v.head_dim, "] like dst_v's, got shape ", src_v[0].sizes());
      RAGATTN_CHECK_VALUE(cg.v.num_rows == cg.k.num_rows, "ragattn.copy_kv_: dst_v must have as many rows as dst_k (",
                        cg.k.num_rows, "), got ", cg.v.num_rows);
      RAGATTN_CHECK_VALUE(cg.sv.num_rows == cg.sk.num_rows, "ragattn.copy_kv_: src_v must have as many rows as src_k (",
                        cg.sk.num_rows, "), got ", cg.sv.num_rows);
    }
  }
  check_rows_index(op, "src_rows", src_rows, -1, dev);
  check_rows_index(op, "dst_rows", dst_rows, src_rows.size(0), dev);
  if (delta.has_value()) {
    check_rows_index(op, "delta", *delta, src_rows.size(0), dev);
    RAGATTN_CHECK_VALUE(inv_freq.has_value(), "ragattn.copy_kv_: inv_freq is required when delta is given");
    check_rope(op, *inv_freq, rotary_dim, L == 0 ? rotary_dim : cg.k.head_dim, dev);
  }
  if (L == 0) return cg;
  check_num_kv_heads(op, num_kv_heads, "dst_k", cg.k, dst_k);
  check_num_kv_heads(op, num_kv_heads, "src_k", cg.sk, src_k);
  if (cg.has_v) {
    check_num_kv_heads(op, num_kv_heads, "dst_v", cg.v, dst_v);
    check_num_kv_heads(op, num_kv_heads, "src_v", cg.sv, src_v);
  }
  const int64_t nl = static_cast<int64_t>(L);
  cg.dk_scale = check_scale(op, "dst_k_scale", dst_k_scale, "dst_k", dst_k[0].scalar_type(), nl, dev);
  cg.sk_scale = check_scale(op, "src_k_scale", src_k_scale, "src_k", src_k[0].scalar_type(), nl, dev);
  if (cg.has_v) {
    cg.dv_scale = check_scale(op, "dst_v_scale", dst_v_scale, "dst_v", dst_v[0].scalar_type(), nl, dev);
    cg.sv_scale = check_scale(op, "src_v_scale", src_v_scale, "src_v", src_v[0].scalar_type(), nl, dev);
  } else {
    RAGATTN_CHECK_VALUE(!dst_v_scale.has_value() && !src_v_scale.has_value(),
                      "ragattn.copy_kv_: dst_v_scale/src_v_scale are given but no V layers are copied");
  }
  const at::TensorList no_layers;
  const NamedLayers w_k{"dst_k", dst_k, &cg.k}, w_v{"dst_v", cg.has_v ? dst_v : no_layers, &cg.v};
  const NamedLayers r_k{"src_k", src_k, &cg.sk}, r_v{"src_v", cg.has_v ? src_v : no_layers, &cg.sv};
  check_writes_disjoint(op, {w_k, w_v});
  cg.overlap = read_write_overlap({r_k, r_v}, {w_k, w_v});
  if (host_checks(dst_rows)) {
    check_rows_host(op, "src_rows", src_rows, cg.sk.num_rows, /*distinct=*/false);
    check_rows_host(op, "dst_rows", dst_rows, cg.k.num_rows, /*distinct=*/true);
  }
  return cg;
}

}  // namespace kv_cache
}  // namespace ragattn
