// CPU impl of ragattn::_varlen_attention_cpu, the default CPU forward of ragattn.varlen_attention
// (ragattn/ops/varlen_attention.py runs its metadata checks, then calls this op; it is private:
// the public op keeps its Python registration, autograd and fake impls). Here: the checks that
// read index values (the Python _check_index_values' order and messages), the defaults of the
// optional index tensors, the sequence tiles, and the kernel of varlen_attention_cpu_kernel.h
// over them, blocks of tiles handed to threads largest first (each tile computed by one thread in
// a fixed order: results do not depend on the thread count).
// GCC notes that 32-byte vector arguments change the ABI: the v8f helpers are always inlined
#pragma GCC diagnostic ignored "-Wpsabi"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention/cpu_attention_blocks_c10.h"
#include "attention/varlen_attention_cpu_kernel.h"
#include "common/check_message.h"
#include "common/parallel_largest_first.h"
#include "ops.h"

namespace ragattn {
namespace varlen_cpu {

namespace {

constexpr const char* kOp = "ragattn.varlen_attention";

// One int32/int64 index tensor (1-D, any stride) as int64 values.
std::vector<int64_t> read_index(const at::Tensor& t) {
  const int64_t n = t.numel(), st = t.dim() ? t.stride(0) : 0;
  std::vector<int64_t> out(n);
  if (t.scalar_type() == at::kLong) {
    const int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = p[i * st];
  } else {
    const int32_t* p = t.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = p[i * st];
  }
  return out;
}

// check_cu_seqlens' value checks (ragattn/ops/_validate.py), same messages
void check_offsets(const char* name, const std::vector<int64_t>& cu, int64_t total) {
  RAGATTN_CHECK_VALUE(cu.front() == 0 && cu.back() == total, kOp, ": ", name, " must start at 0 and end at ", total,
                      " (the packed length), got ", cu.front(), " .. ", cu.back());
  for (size_t b = 1; b < cu.size(); ++b) RAGATTN_CHECK_VALUE(cu[b] >= cu[b - 1], kOp, ": ", name, " must be non-decreasing");
}

// _check_index_values' int32 range check of an int64 index tensor, same message
void check_int32(const char* name, const std::optional<at::Tensor>& t, const std::vector<int64_t>& vals) {
  if (!t || t->scalar_type() != at::kLong || vals.empty()) return;
  const auto mm = std::minmax_element(vals.begin(), vals.end());
  RAGATTN_CHECK_VALUE(*mm.first >= -(int64_t{1} << 31) && *mm.second <= (int64_t{1} << 31) - 1, kOp, ": ", name,
                      " values must fit in int32, got ", *mm.first, " .. ", *mm.second);
}

// The invariants the kernel relies on (the Python caller has checked them, with named errors).
void check_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                  const at::Tensor& cu_k, std::initializer_list<std::pair<const std::optional<at::Tensor>*, int64_t>> idx) {
  RAGATTN_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(2) == q.size(2) && q.size(2) > 0 &&
                    k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                kOp, ": _varlen_attention_cpu needs q [T, H, D], k and v [S, H_kv, D] with H % H_kv == 0");
  RAGATTN_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                    (q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16),
                kOp, ": _varlen_attention_cpu needs q, k, v of one dtype, float32, float16 or bfloat16");
  auto index_ok = [](const at::Tensor& t) {
    return t.is_cpu() && t.dim() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong);
  };
  RAGATTN_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu() && index_ok(cu_q) && index_ok(cu_k) && cu_q.numel() >= 1 &&
                    cu_q.numel() == cu_k.numel(),
                kOp, ": _varlen_attention_cpu needs CPU tensors and int32/int64 offsets of one batch");
  for (const auto& [t, n] : idx)
    RAGATTN_CHECK(!*t || (index_ok(**t) && (*t)->numel() == n), kOp,
                  ": _varlen_attention_cpu needs int32/int64 CPU index tensors of the packed lengths");
}

at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

template <typename T>
RAGATTN_CPU_CLONES void run_tiles_isa(const Args& a, int64_t begin, int64_t end) {
  run_tiles<T>(a, begin, end);
}

// One call's inputs: the layout invariants checked, q/k/v with a unit last stride, the index
// tensors read, checked (_check_index_values' order and messages) and completed with their
// defaults, and the tiles of kTileRows rows within each sequence.
struct Prepared {
  at::Tensor q, k, v;
  std::vector<int64_t> cq, ck, qp, kp, qb, kb, run_end, seq_tiles;
  std::vector<Tile> tiles;
  bool blocks = false;
  int64_t work = 0;  // (row, key) pairs of the dense per-sequence problem (grain estimate)

  Prepared(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
           const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& q_pos,
           const std::optional<at::Tensor>& kv_pos, const std::optional<at::Tensor>& q_block,
           const std::optional<at::Tensor>& kv_block, int64_t window_left) {
    const int64_t total_q = q_in.size(0), total_k = k_in.size(0);
    check_layout(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k,
                 {{&q_pos, total_q}, {&kv_pos, total_k}, {&q_block, total_q}, {&kv_block, total_k}});
    RAGATTN_CHECK(window_left >= -1, kOp, ": window_left must be -1 (no window) or >= 0");
    cq = read_index(cu_seqlens_q);
    ck = read_index(cu_seqlens_k);
    check_offsets("cu_seqlens_q", cq, total_q);
    check_offsets("cu_seqlens_k", ck, total_k);
    if (q_pos) qp = read_index(*q_pos);
    check_int32("q_pos", q_pos, qp);
    if (kv_pos) kp = read_index(*kv_pos);
    check_int32("kv_pos", kv_pos, kp);
    if (q_block) qb = read_index(*q_block);
    check_int32("q_block", q_block, qb);
    if (kv_block) kb = read_index(*kv_block);
    check_int32("kv_block", kv_block, kb);
    const int64_t batch = static_cast<int64_t>(cq.size()) - 1;
    // defaults: arange per sequence; block ids -1 (no block test when neither is given)
    if (!q_pos) {
      qp.resize(total_q);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t r = cq[b]; r < cq[b + 1]; ++r) qp[r] = r - cq[b];
    }
    if (!kv_pos) {
      kp.resize(total_k);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t j = ck[b]; j < ck[b + 1]; ++j) kp[j] = j - ck[b];
    }
    blocks = q_block || kv_block;
    if (blocks) {
      if (!q_block) qb.assign(total_q, -1);
      if (!kv_block) kb.assign(total_k, -1);
      run_end.resize(total_k);
      for (int64_t j = total_k - 1; j >= 0; --j)
        run_end[j] = j + 1 < total_k && kb[j + 1] == kb[j] ? run_end[j + 1] : j + 1;
    }
    tiles.reserve(total_q / kTileRows + batch);
    seq_tiles.assign(1, 0);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t k0 = ck[b], k1 = ck[b + 1];
      bool sorted = true;
      for (int64_t j = k0 + 1; j < k1 && sorted; ++j) sorted = kp[j] >= kp[j - 1];
      for (int64_t r = cq[b]; r < cq[b + 1]; r += kTileRows)
        tiles.push_back(Tile{r, std::min(r + kTileRows, cq[b + 1]), k0, k1, sorted});
      seq_tiles.push_back(static_cast<int64_t>(tiles.size()));
      work += (cq[b + 1] - cq[b]) * (k1 - k0);
    }
    q = unit_last_stride(q_in);
    k = unit_last_stride(k_in);
    v = unit_last_stride(v_in);
  }

  Args args(std::optional<double> scale, bool causal, int64_t window_left, double softcap) const {
    const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
    return Args{q.data_ptr(), k.data_ptr(), v.data_ptr(), nullptr, nullptr,
                qp.data(), kp.data(), blocks ? qb.data() : nullptr, blocks ? kb.data() : nullptr,
                blocks ? run_end.data() : nullptr, tiles.data(),
                q.size(1), k.size(1), q.size(2), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                v.stride(1), q.size(1) * q.size(2), q.size(2), static_cast<float>(s), causal, window_left,
                static_cast<float>(softcap)};
  }
};

// fn(begin, end) over [0, n) items of about `per_item` multiply-adds on average, item i costing
// about cost(i): blocks of about GRAIN_SIZE multiply-adds, largest first (a causal tile's cost
// grows with its rows' positions; contiguous halves left one thread most of the work).
template <typename Cost, typename F>
void run_items(int64_t n, int64_t per_item, const Cost& cost, const F& fn) {
  parallel_blocks_largest_first(n, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, per_item)),
                                cost, fn);
}

// A forward tile's cost: its rows x the keys its last row may see (under a causal mask over
// sorted key positions: those at or before the tile's largest query position).
inline int64_t tile_cost(const Prepared& prep, const Tile& t, bool causal) {
  int64_t keys = t.k1 - t.k0;
  if (causal && t.kv_sorted && t.r1 > t.r0) {
    const int64_t last = *std::max_element(prep.qp.begin() + t.r0, prep.qp.begin() + t.r1);
    keys = std::upper_bound(prep.kp.begin() + t.k0, prep.kp.begin() + t.k1, last) - (prep.kp.begin() + t.k0);
  }
  return (t.r1 - t.r0) * std::max<int64_t>(keys, 1);
}

template <typename T>
RAGATTN_CPU_CLONES void run_bwd_items_isa(const BwdArgs& a, int64_t begin, int64_t end) {
  run_bwd_items<T>(a, begin, end);
}

}  // namespace
}  // namespace varlen_cpu

std::tuple<at::Tensor, at::Tensor> varlen_attention_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& q_pos, const std::optional<at::Tensor>& kv_pos,
    const std::optional<at::Tensor>& q_block, const std::optional<at::Tensor>& kv_block, bool causal,
    std::optional<double> scale, int64_t window_left, double logits_soft_cap) {
  using namespace varlen_cpu;
  const Prepared prep(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, window_left);
  const at::Tensor& q = prep.q;
  const int64_t total_q = q.size(0);
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, like the fake impl
  at::Tensor lse = at::empty({total_q, q.size(1)}, q.options().dtype(at::kFloat));
  if (total_q == 0) return {out, lse};
  Args a = prep.args(scale, causal, window_left, logits_soft_cap);
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  const int64_t n_tiles = static_cast<int64_t>(prep.tiles.size());
  void (*run)(const Args&, int64_t, int64_t) =
      q.scalar_type() == at::kFloat  ? &run_tiles_isa<float>
      : q.scalar_type() == at::kHalf ? &run_tiles_isa<c10::Half>
                                     : &run_tiles_isa<c10::BFloat16>;
  run_items(n_tiles, prep.work / std::max<int64_t>(1, n_tiles) * q.size(1) * q.size(2),
            [&](int64_t i) { return tile_cost(prep, prep.tiles[i], causal); },
            [&](int64_t begin, int64_t end) { run(a, begin, end); });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& q_pos, const std::optional<at::Tensor>& kv_pos,
    const std::optional<at::Tensor>& q_block, const std::optional<at::Tensor>& kv_block, bool causal,
    std::optional<double> scale, int64_t window_left, double logits_soft_cap) {
  using namespace varlen_cpu;
  const Prepared prep(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, window_left);
  const at::Tensor &q = prep.q, &k = prep.k, &v = prep.v;
  const int64_t total_q = q_in.size(0);
  RAGATTN_CHECK(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes() &&
                    dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type() &&
                    lse_in.dim() == 2 && lse_in.size(0) == total_q && lse_in.size(1) == q_in.size(1) &&
                    lse_in.scalar_type() == at::kFloat && dout_in.is_cpu() && out_in.is_cpu() && lse_in.is_cpu(),
                kOp, ": _varlen_attention_backward_cpu needs dout and out like q and lse float32 [total_q, H]");
  const at::Tensor dout = dout_in.contiguous(), out = out_in.contiguous(), lse = lse_in.contiguous();
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  BwdArgs a{prep.args(scale, causal, window_left, logits_soft_cap), dout.data_ptr(), out.data_ptr(), lse.data_ptr<float>(),
            dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), prep.seq_tiles.data(), prep.ck.data()};
  const int64_t items = (static_cast<int64_t>(prep.ck.size()) - 1) * k.size(1);
  void (*run)(const BwdArgs&, int64_t, int64_t) =
      q.scalar_type() == at::kFloat  ? &run_bwd_items_isa<float>
      : q.scalar_type() == at::kHalf ? &run_bwd_items_isa<c10::Half>
                                     : &run_bwd_items_isa<c10::BFloat16>;
  const int64_t kv_heads = k.size(1);
  const auto seq_cost = [&](int64_t item) {  // item = sequence * kv heads + kv head
    const int64_t b = item / kv_heads;
    return std::max<int64_t>(1, (prep.cq[b + 1] - prep.cq[b]) * (prep.ck[b + 1] - prep.ck[b]));
  };
  run_items(items, 3 * prep.work / std::max<int64_t>(1, items) * q.size(1) * q.size(2), seq_cost,
            [&](int64_t begin, int64_t end) { run(a, begin, end); });
  return {dq, dk, dv};
}

}  // namespace ragattn
