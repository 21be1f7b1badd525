// Work items of unequal cost on torch's intra-op threads, largest first.
//
// at::parallel_for splits a range into one contiguous block per thread. Attention items ordered
// by position (causal rows, tiles of them) grow in cost along the range, so the thread holding the
// last block does most of the work and a second thread gains little. Here the items are handed out
// one at a time from a shared counter, costliest first (the LPT rule: no thread is left with a
// large item at the end), so the threads finish together. Which thread runs an item never changes
// what the item computes. (ATen's parallel API has no dynamic schedule to ask for instead.)
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

namespace ragattn {

// The items [0, cost.size()) in descending cost (ties in index order: the order depends on the
// costs alone).
inline std::vector<int64_t> largest_first(const std::vector<int64_t>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

// Runs worker(next) on up to at::get_num_threads() threads; next() returns the next item of
// `order` not yet taken by any worker, or -1 when none is left. A worker sets up its thread's
// buffers once, then loops on next(). Inside another parallel region (or on one thread) a single
// worker takes every item.
template <typename Worker>
void parallel_largest_first(const std::vector<int64_t>& order, Worker&& worker) {
  const int64_t n = static_cast<int64_t>(order.size());
  std::atomic<int64_t> taken{0};
  auto next = [&]() -> int64_t {
    const int64_t i = taken.fetch_add(1, std::memory_order_relaxed);
    return i < n ? order[i] : -1;
  };
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  if (workers <= 1 || at::in_parallel_region()) {
    worker(next);
    return;
  }
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { worker(next); });
}

// Items [0, n) in blocks of `grain` consecutive items (a block: one call run(begin, end), its
// cost the sum of item_cost(i) over its items), the blocks run largest first; one block (n <=
// grain) runs inline, without a parallel region or costs. For many small items (attention rows x
// kv heads) whose cost grows along the range.
template <typename Cost, typename Run>
void parallel_blocks_largest_first(int64_t n, int64_t grain, Cost&& item_cost, Run&& run) {
  if (n <= grain) {
    run(0, n);
    return;
  }
  const int64_t nb = (n + grain - 1) / grain;
  std::vector<int64_t> cost(nb, 0);
  for (int64_t i = 0; i < n; ++i) cost[i / grain] += item_cost(i);
  parallel_largest_first(largest_first(cost), [&](auto next) {
    for (int64_t b = next(); b >= 0; b = next()) run(b * grain, std::min(n, (b + 1) * grain));
  });
}

}  // namespace ragattn
