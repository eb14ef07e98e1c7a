// Shared by qcompile's native CPU kernels: run items 0..total-1 on the caller and XLA's intra-op threads.
//
// Items are claimed from an atomic counter, so a slow or late thread never holds up the others; each item must write
// only its own outputs, so results do not depend on how items fall to threads. The caller works too and returns when
// every item is done. The state is shared with the pool tasks: one may start after the caller has finished every item
// and returned, and must then find the counter exhausted, not a dead stack frame.

#ifndef QCOMPILE_NATIVE_PARALLEL_ITEMS_H_
#define QCOMPILE_NATIVE_PARALLEL_ITEMS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace qcompile_native {

template <class Fn>
void parallel_items(xla::ffi::ThreadPool& pool, int64_t total, Fn fn) {
  struct State {
    explicit State(Fn f, int64_t n) : fn(std::move(f)), total(n) {}
    Fn fn;
    const int64_t total;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void drain() {
      for (int64_t i; (i = next.fetch_add(1)) < total;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (total <= 0) return;
  auto state = std::make_shared<State>(std::move(fn), total);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->drain(); });
  state->drain();
  while (state->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

// Work of a product over column panels: runs of consecutive panels (about `runs_per_thread` runs per thread) times
// chunks of `chunk` rows. Item i is run i / row_chunks against chunk i % row_chunks.
struct PanelItems {
  int64_t rows, panels, chunk, row_chunks, panels_per_run, count;
  PanelItems(int64_t rows_, int64_t panels_, int64_t chunk_, int64_t threads, int64_t runs_per_thread)
      : rows(rows_), panels(panels_), chunk(chunk_), row_chunks((rows_ + chunk_ - 1) / chunk_) {
    const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(panels, runs_per_thread * threads));
    panels_per_run = (panels + runs - 1) / runs;
    count = ((panels + panels_per_run - 1) / panels_per_run) * row_chunks;
  }
  // Item i's panels [p0, p1) and rows [r0, r1).
  void bounds(int64_t i, int64_t& p0, int64_t& p1, int64_t& r0, int64_t& r1) const {
    p0 = (i / row_chunks) * panels_per_run, p1 = std::min(panels, p0 + panels_per_run);
    r0 = (i % row_chunks) * chunk, r1 = std::min(rows, r0 + chunk);
  }
};

// Work of a grouped matmul: rows sorted by expert in groups of sizes[E] (each clipped to [0, the rows left]), cut
// into (expert, first row, rows) chunks of at most `chunk` rows. Returns the first row past the groups.
struct GroupChunk {
  int64_t expert, row0, rows;
};

inline int64_t group_chunks(const int32_t* sizes, int64_t experts, int64_t n, int64_t chunk,
                            std::vector<GroupChunk>& items) {
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t g = std::min<int64_t>(std::max<int64_t>(sizes[e], 0), n - row);
    for (int64_t r = 0; r < g; r += chunk) items.push_back({e, row + r, std::min(chunk, g - r)});
    row += g;
  }
  return row;
}

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_PARALLEL_ITEMS_H_
