// qcompile's native CPU MoE dispatch and combine, XLA FFI custom calls. Built and registered by
// qcompile/kernels/native.py; the CPU lowerings of moe_dispatch and moe_combine (ir/ops/moe.py) call them through
// jax.ffi.ffi_call (kernels/moe_routes.py).
//
// Dispatch: x[T,H], ids i32[T,k] -> rows[T*k,H], group_sizes i32[E], order i32[T*k]. Route i = t*k + j goes to
// bucket ids[i] (any id outside [0, E) to one bucket past the last expert); order lists the routes bucket by bucket,
// each bucket in route order — exactly a stable argsort of the ids when they lie in [0, E] —, rows[r] =
// x[order[r] / k] (a copy: any element type, moved as bytes), and group_sizes[e] the routes of expert e (ids outside
// [0, E) are not counted: the grouped matmul then returns 0 for their rows past the groups).
// Combine: rows[T*k,H] (sorted as dispatch left them), order i32[T*k], weights[T,k] -> out[T,H] =
// sum_j weights[t,j] * rows[r(t,j)], with r(t,j) the sorted row that route t*k+j became (order inverted once): f32
// products and sum, rounded once to bf16 for bf16 rows — as XLA CPU runs the reference rule, whose bf16 rounding of
// each product its excess-precision simplification removes (the graph is checked against that).
//
// Why: XLA CPU runs these as a sort, a bincount scatter, a row gather with a bounds select, and for combine a zero
// fill plus a scatter of every row back to route order: ~24 ms per MoE layer at 1024 tokens x top-8 (8192 rows of
// 4 KiB) on the bench preset, an eighth of a prefill step. Here dispatch is a counting sort (O(T*k), one pass to
// count, one to place) and one memcpy per row; combine reads each routed row once where it lies and writes each
// token once. Work is split into items of consecutive rows or tokens (parallel_items.h): results do not depend on
// the thread split.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "parallel_items.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using qcompile_native::load;
using qcompile_native::store;
using qcompile_native::v16;

constexpr int64_t kCopyRows = 128;    // rows copied per dispatch item
constexpr int64_t kCombineTokens = 16;  // tokens per combine item

ffi::Error Dispatch(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> rows,
                    ffi::ResultBuffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::S32> order) {
  const auto xd = x.dimensions();
  const auto id = ids.dimensions();
  const auto rd = rows->dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0] || rd.size() != 2 || rd[0] != id[0] * id[1] ||
      rd[1] != xd[1] || rows->element_type() != x.element_type() || order->dimensions().size() != 1 ||
      order->dimensions()[0] != rd[0] || group_sizes->dimensions().size() != 1)
    return ffi::Error::InvalidArgument("qcompile moe dispatch: expected x[T,H], ids[T,k] -> rows[T*k,H], "
                                       "group_sizes[E], order[T*k]");
  const int64_t n = rd[0], k = id[1], experts = group_sizes->dimensions()[0];
  const int32_t* route = ids.typed_data();
  int32_t* ord = order->typed_data();
  // Counting sort, stable: bucket e < E for expert e, bucket E for every id outside [0, E).
  std::vector<int64_t> start(experts + 2, 0);
  auto bucket = [experts](int32_t e) { return (e >= 0 && e < experts) ? static_cast<int64_t>(e) : experts; };
  for (int64_t i = 0; i < n; ++i) ++start[bucket(route[i]) + 1];
  int32_t* sizes = group_sizes->typed_data();
  for (int64_t e = 0; e < experts; ++e) sizes[e] = static_cast<int32_t>(start[e + 1]);
  for (int64_t e = 0; e <= experts; ++e) start[e + 1] += start[e];
  for (int64_t i = 0; i < n; ++i) ord[start[bucket(route[i])]++] = static_cast<int32_t>(i);
  const int64_t row_bytes = xd[1] * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  if (n == 0 || row_bytes == 0) return ffi::Error::Success();
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(rows->untyped_data());
  qcompile_native::parallel_items(pool, (n + kCopyRows - 1) / kCopyRows, [=](int64_t item) {
    for (int64_t r = item * kCopyRows, end = std::min(n, r + kCopyRows); r < end; ++r)
      std::memcpy(dst + r * row_bytes, src + (ord[r] / k) * row_bytes, row_bytes);
  });
  return ffi::Error::Success();
}

// where[i]: the sorted row route i became (order is a permutation of the routes; an index outside it reads 0).
std::shared_ptr<std::vector<int64_t>> routes_of(const int32_t* ord, int64_t n) {
  auto where = std::make_shared<std::vector<int64_t>>(n, -1);
  for (int64_t r = 0; r < n; ++r)
    if (ord[r] >= 0 && ord[r] < n) (*where)[ord[r]] = r;
  return where;
}

bool combine_shapes(const ffi::AnyBuffer& rows, const ffi::Buffer<ffi::S32>& order, const ffi::AnyBuffer& weights) {
  const auto rd = rows.dimensions();
  const auto wd = weights.dimensions();
  return rd.size() == 2 && wd.size() == 2 && order.dimensions().size() == 1 && order.dimensions()[0] == rd[0] &&
         rd[0] == wd[0] * wd[1];
}

// The f32 accumulator of a token's output: the output row itself for f32, a scratch row rounded once for bf16.
inline float* accumulator(float* dst, float*) { return dst; }
inline float* accumulator(uint16_t*, float* scratch) { return scratch; }
inline void finish(const float*, float*, int64_t) {}
inline void finish(const float* acc, uint16_t* dst, int64_t n) { qcompile_native::narrow(acc, dst, n); }

// f32 or bf16 (T = uint16_t) rows and weights, accumulated in f32 (a product of two bf16 values is exact in f32, so
// the bf16 result does not depend on whether the compiler fuses the multiply and add).
template <class T>
ffi::Error Combine(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> order, ffi::AnyBuffer weights,
                   ffi::Result<ffi::AnyBuffer> out, ffi::DataType dtype) {
  if (!combine_shapes(rows, order, weights) || rows.element_type() != dtype || weights.element_type() != dtype ||
      out->element_type() != dtype)
    return ffi::Error::InvalidArgument("qcompile moe combine: expected rows[T*k,H], order[T*k], weights[T,k], all "
                                       "f32 or all bf16");
  const int64_t tokens = weights.dimensions()[0], k = weights.dimensions()[1], h = rows.dimensions()[1];
  if (tokens == 0 || h == 0) return ffi::Error::Success();
  auto where = routes_of(order.typed_data(), rows.dimensions()[0]);
  const T* src = static_cast<const T*>(rows.untyped_data());
  const T* w = static_cast<const T*>(weights.untyped_data());
  T* dst = static_cast<T*>(out->untyped_data());
  qcompile_native::parallel_items(pool, (tokens + kCombineTokens - 1) / kCombineTokens, [=](int64_t item) {
    std::vector<float> scratch(std::is_same<T, float>::value ? 0 : h);
    for (int64_t t = item * kCombineTokens, end = std::min(tokens, t + kCombineTokens); t < end; ++t) {
      float* acc = accumulator(dst + t * h, scratch.data());
      std::fill(acc, acc + h, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = (*where)[t * k + j];
        if (r < 0) continue;
        const float wt = qcompile_native::value_as_f32(w + t * k + j);
        const T* s = src + r * h;
        int64_t c = 0;
        for (; c + 16 <= h; c += 16) store(acc + c, load(acc + c) + wt * qcompile_native::load_as_f32(s + c));
        for (; c < h; ++c) acc[c] += wt * qcompile_native::value_as_f32(s + c);
      }
      finish(acc, dst + t * h, h);
    }
  });
  return ffi::Error::Success();
}

ffi::Error CombineF32(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> order, ffi::AnyBuffer weights,
                      ffi::Result<ffi::AnyBuffer> out) {
  return Combine<float>(pool, rows, order, weights, out, ffi::DataType::F32);
}

ffi::Error CombineBf16(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> order, ffi::AnyBuffer weights,
                       ffi::Result<ffi::AnyBuffer> out) {
  return Combine<uint16_t>(pool, rows, order, weights, out, ffi::DataType::BF16);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileMoeDispatch, Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileMoeCombineBf16, CombineBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileMoeCombineF32, CombineF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
