// qcompile's native token log-probabilities (kernels/logprobs.py): for n chosen rows of logits[R, V] (f32 or bf16),
// the log-softmax of a target token and the K most likely tokens — what a server's `logprobs` option returns.
//
// Why: XLA CPU's lax.top_k sorts each row (11.6 ms at [32, 248320]) and its exp-sum takes 5 more; here each row is
// read twice: once for its maximum and its top K — a sorted list of K whose last value is a threshold that a block of
// 64 logits is compared against in one vector compare, so almost every logit costs a max and a compare — and once for
// the sum of e^(x - max) (exp16, vec16.h). Rows are the work items (parallel_items.h).
//
// Matches the jnp rule: the top K most likely first, the lower id first among equal logits; log-probabilities are
// x - (max + log Σ e^(x - max)) in f32. A row or target outside its range is clamped into it, as jnp's gather does.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "parallel_items.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using qcompile_native::load_as_f32;
using qcompile_native::splat;
using qcompile_native::v16;
using qcompile_native::value_as_f32;

constexpr int64_t kBlock = 64;  // logits compared against the threshold together

// The K largest (value, id) pairs seen so far, largest first; equal values keep the earlier (lower) id first.
struct TopList {
  std::vector<float> value;
  std::vector<int32_t> id;
  int64_t k;
  explicit TopList(int64_t k_) : value(k_), id(k_), k(k_) {}
  // Insert x (id j) into the first `filled` entries, which are sorted; returns the new count (at most k).
  int64_t insert(float x, int32_t j, int64_t filled) {
    int64_t at = filled < k ? filled : k - 1;
    while (at > 0 && value[at - 1] < x) {
      if (at < k) value[at] = value[at - 1], id[at] = id[at - 1];
      --at;
    }
    value[at] = x, id[at] = j;
    return filled < k ? filled + 1 : k;
  }
};

inline bool any_greater(v16 x, float threshold) {
  const auto mask = x > splat(threshold);
  uint64_t words[8];
  std::memcpy(words, &mask, sizeof(words));
  return (words[0] | words[1] | words[2] | words[3] | words[4] | words[5] | words[6] | words[7]) != 0;
}

inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

inline float hmax(v16 v) {
  float lanes[16];
  std::memcpy(lanes, &v, sizeof(lanes));
  return *std::max_element(lanes, lanes + 16);
}

template <class T>
void score_row(const T* x, int64_t v, int64_t target, int64_t k, float* logprob, float* top_logprob,
               int32_t* top_id) {
  TopList top(k);
  int64_t filled = 0, j = 0;
  float row_max = -INFINITY;
  for (; j < k; ++j) {
    const float value = value_as_f32(x + j);
    filled = top.insert(value, static_cast<int32_t>(j), filled);
    row_max = std::max(row_max, value);
  }
  // Pass 1: the maximum and the top K. Scalar up to a block boundary, then whole blocks, then the tail.
  auto scalar = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      const float value = value_as_f32(x + i);
      row_max = std::max(row_max, value);
      if (value > top.value[k - 1]) filled = top.insert(value, static_cast<int32_t>(i), filled);
    }
  };
  const int64_t aligned = std::min(v, (j + kBlock - 1) / kBlock * kBlock);
  scalar(j, aligned);
  j = aligned;
  v16 running = splat(row_max);
  for (; j + kBlock <= v; j += kBlock) {
    const v16 a = load_as_f32(x + j), b = load_as_f32(x + j + 16), c = load_as_f32(x + j + 32),
              d = load_as_f32(x + j + 48);
    const v16 m = vmax(vmax(a, b), vmax(c, d));
    running = vmax(running, m);
    if (any_greater(m, top.value[k - 1])) {
      for (int64_t i = j; i < j + kBlock; ++i) {
        const float value = value_as_f32(x + i);
        if (value > top.value[k - 1]) filled = top.insert(value, static_cast<int32_t>(i), filled);
      }
    }
  }
  row_max = std::max(row_max, hmax(running));
  scalar(j, v);
  // Pass 2: Σ e^(x - max).
  const v16 shift = splat(row_max);
  v16 s0{}, s1{}, s2{}, s3{};
  int64_t i = 0;
  for (; i + kBlock <= v; i += kBlock) {
    s0 += qcompile_native::exp16(load_as_f32(x + i) - shift);
    s1 += qcompile_native::exp16(load_as_f32(x + i + 16) - shift);
    s2 += qcompile_native::exp16(load_as_f32(x + i + 32) - shift);
    s3 += qcompile_native::exp16(load_as_f32(x + i + 48) - shift);
  }
  float lanes[16];
  const v16 sum = (s0 + s1) + (s2 + s3);
  std::memcpy(lanes, &sum, sizeof(lanes));
  double total = 0;
  for (float lane : lanes) total += lane;
  for (; i < v; ++i) total += std::exp(value_as_f32(x + i) - row_max);
  const float normaliser = row_max + static_cast<float>(std::log(total));
  *logprob = value_as_f32(x + target) - normaliser;
  for (int64_t t = 0; t < k; ++t) top_logprob[t] = top.value[t] - normaliser, top_id[t] = top.id[t];
}

template <class T>
ffi::Error TokenLogprobs(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> rows,
                         ffi::Buffer<ffi::S32> targets, ffi::Result<ffi::Buffer<ffi::F32>> logprob,
                         ffi::Result<ffi::Buffer<ffi::F32>> top_logprob, ffi::Result<ffi::Buffer<ffi::S32>> top_id,
                         ffi::DataType dtype) {
  const auto dims = logits.dimensions();
  const int64_t n = rows.element_count();
  if (dims.size() != 2 || logits.element_type() != dtype || targets.element_count() != n ||
      logprob->element_count() != n || top_logprob->dimensions().size() != 2 || top_logprob->dimensions()[0] != n ||
      top_id->element_count() != top_logprob->element_count())
    return ffi::Error::InvalidArgument("qcompile token logprobs: expected logits[R,V], rows[n], targets[n] -> "
                                       "f32[n], f32[n,K], s32[n,K]");
  const int64_t r = dims[0], v = dims[1], k = top_logprob->dimensions()[1];
  if (n == 0) return ffi::Error::Success();
  if (r == 0 || k < 1 || k > v)
    return ffi::Error::InvalidArgument("qcompile token logprobs: needs at least one row and 1 <= K <= V");
  const T* x = static_cast<const T*>(logits.untyped_data());
  const int32_t* row = rows.typed_data();
  const int32_t* target = targets.typed_data();
  float* lp = logprob->typed_data();
  float* top_lp = top_logprob->typed_data();
  int32_t* ids = top_id->typed_data();
  qcompile_native::parallel_items(pool, n, [=](int64_t item) {
    const int64_t at = std::clamp<int64_t>(row[item], 0, r - 1);
    const int64_t token = std::clamp<int64_t>(target[item], 0, v - 1);
    score_row(x + at * v, v, token, k, lp + item, top_lp + item * k, ids + item * k);
  });
  return ffi::Error::Success();
}

ffi::Error TokenLogprobsF32(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> rows,
                            ffi::Buffer<ffi::S32> targets, ffi::Result<ffi::Buffer<ffi::F32>> logprob,
                            ffi::Result<ffi::Buffer<ffi::F32>> top_logprob, ffi::Result<ffi::Buffer<ffi::S32>> top_id) {
  return TokenLogprobs<float>(pool, logits, rows, targets, logprob, top_logprob, top_id, ffi::DataType::F32);
}

ffi::Error TokenLogprobsBf16(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> rows,
                             ffi::Buffer<ffi::S32> targets, ffi::Result<ffi::Buffer<ffi::F32>> logprob,
                             ffi::Result<ffi::Buffer<ffi::F32>> top_logprob,
                             ffi::Result<ffi::Buffer<ffi::S32>> top_id) {
  return TokenLogprobs<uint16_t>(pool, logits, rows, targets, logprob, top_logprob, top_id, ffi::DataType::BF16);
}

}  // namespace

#define QCOMPILE_TOKEN_LOGPROBS_BINDING                                                                              \
  ffi::Ffi::Bind()                                                                                                   \
      .Ctx<ffi::ThreadPool>()                                                                                        \
      .Arg<ffi::AnyBuffer>()                                                                                         \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                                  \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                                  \
      .Ret<ffi::Buffer<ffi::F32>>()                                                                                  \
      .Ret<ffi::Buffer<ffi::F32>>()                                                                                  \
      .Ret<ffi::Buffer<ffi::S32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileTokenLogprobsF32, TokenLogprobsF32, QCOMPILE_TOKEN_LOGPROBS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileTokenLogprobsBf16, TokenLogprobsBf16, QCOMPILE_TOKEN_LOGPROBS_BINDING);
