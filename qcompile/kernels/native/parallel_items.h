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

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_PARALLEL_ITEMS_H_
