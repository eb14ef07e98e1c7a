// qcompile's native CPU linear (f32) for few rows, an XLA FFI custom call. Built and registered by
// qcompile/kernels/native.py; the CPU lowering of linear calls it through jax.ffi.ffi_call when the step has few rows.
//
// out[T, N] = x[T, K] · w[N, K]ᵀ — the weight in Hugging Face's [out, in] layout, read where it lies. Accumulation is
// f32 (sixteen partial sums per output, added in a fixed order: the reassociating class of a dot).
//
// Why a custom call: at decode a step has few rows (one per sequence), and XLA's CPU dot then runs at about half the
// matmul rate (it packs a transposed copy of [N, K] weights per call and blocks for large row counts; measured in
// docs/cpu_rules.md). With the weight in [N, K] each output is a dot product of two contiguous rows, so this kernel
// needs no packing:
//   * a register tile is kMr input rows x kNr weight rows; its kMr*kNr accumulators are 16-lane vectors over k
//     (kNr + kMr loads feed kMr*kNr multiply-adds per 16 k), reduced to scalars once at the end of k;
//   * a work item is a block of kNb weight rows against a chunk of up to kRowChunk input rows, run on the caller and
//     XLA's intra-op threads (parallel_items.h); inside it, groups of kNr weight rows (in L1 while every row tile of
//     the chunk reads them, so each comes from memory once), whose first row tile prefetches the next group.
// Vectors are GCC vector extensions (16 floats; GCC >= 12 or clang for __builtin_shufflevector); -march=native maps
// them to AVX-512, AVX2, SSE or NEON.
// FP8 weights (QcompileLinearFp8: w is e4m3fn bytes [N, K] with f32 block scales [ceil(N/bn), ceil(K/bk)]): a work
// item's kNb weight rows are dequantized into a per-thread buffer (fp8.h, kNb x K floats, L2-resident) that its row
// tiles then read: memory moves one byte per weight.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fp8.h"
#include "parallel_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

constexpr int kMr = 6;                 // input rows per register tile
constexpr int kNr = 4;                 // weight rows per register tile
constexpr int64_t kNb = 16;            // weight rows per work item
constexpr int64_t kRowChunk = 8 * kMr; // input rows per work item

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }

inline float hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// out[m, n] = x[m, 0:k] · w[n, 0:k] for m < MR, n < NR; with prefetch >= 0, each weight row is also prefetched
// `prefetch` floats ahead of what it reads.
template <int MR, int NR>
void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* out, int64_t ldo,
          int64_t prefetch) {
  v16 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = v16{};
  const int64_t kv = k - k % 16;
  for (int64_t kk = 0; kk < kv; kk += 16) {
    v16 b[NR];
    if (prefetch >= 0)
      for (int n = 0; n < NR; ++n) __builtin_prefetch(w + n * ldw + kk + prefetch);
    for (int n = 0; n < NR; ++n) b[n] = load(w + n * ldw + kk);
    for (int m = 0; m < MR; ++m) {
      v16 a = load(x + m * ldx + kk);
#if defined(__x86_64__)
      asm("" : "+v"(a));  // one load per input vector: GCC would otherwise fold it into each of the NR multiply-adds
#endif
      for (int n = 0; n < NR; ++n) acc[m][n] += a * b[n];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t kk = kv; kk < k; ++kk) s += x[m * ldx + kk] * w[n * ldw + kk];
      out[m * ldo + n] = s;
    }
}

template <int NR>
void tile_rows(const float* x, int64_t ldx, int rows, const float* w, int64_t ldw, int64_t k, float* out,
               int64_t ldo, int64_t prefetch) {
  switch (rows) {
    case 1: tile<1, NR>(x, ldx, w, ldw, k, out, ldo, prefetch); break;
    case 2: tile<2, NR>(x, ldx, w, ldw, k, out, ldo, prefetch); break;
    case 3: tile<3, NR>(x, ldx, w, ldw, k, out, ldo, prefetch); break;
    case 4: tile<4, NR>(x, ldx, w, ldw, k, out, ldo, prefetch); break;
    case 5: tile<5, NR>(x, ldx, w, ldw, k, out, ldo, prefetch); break;
    default: tile<kMr, NR>(x, ldx, w, ldw, k, out, ldo, prefetch); break;
  }
}

void block(const float* x, int64_t ldx, int rows, const float* w, int64_t ldw, int64_t k, int cols, float* out,
           int64_t ldo, int64_t prefetch) {
  switch (cols) {
    case 1: tile_rows<1>(x, ldx, rows, w, ldw, k, out, ldo, prefetch); break;
    case 2: tile_rows<2>(x, ldx, rows, w, ldw, k, out, ldo, prefetch); break;
    case 3: tile_rows<3>(x, ldx, rows, w, ldw, k, out, ldo, prefetch); break;
    default: tile_rows<kNr>(x, ldx, rows, w, ldw, k, out, ldo, prefetch); break;
  }
}

struct Job {
  const float* x;
  const float* w;
  float* out;
  int64_t t, k, n, row_chunks;
  // FP8 weights (w8 set, w null): values [N, K], scales [ceil(N/bn), kblocks] in blocks of bn x bk
  const uint8_t* w8 = nullptr;
  const float* scale = nullptr;
  int64_t bn = 1, bk = 1, kblocks = 1;
};

// Item i: weight rows [nb*kNb, +kNb) against input rows [rc*kRowChunk, +kRowChunk); consecutive items share the
// weight block, so one thread tends to keep it cached across row chunks.
void run_item(const Job& j, int64_t i) {
  const int64_t nb = i / j.row_chunks, rc = i % j.row_chunks;
  const int64_t n0 = nb * kNb, n1 = std::min(j.n, n0 + kNb);
  const int64_t r0 = rc * kRowChunk, r1 = std::min(j.t, r0 + kRowChunk);
  // Row tiles of near-equal size (32 rows: 6,6,5,5,5,5, not 6,6,6,6,6,2): a short tile reads the weights as often as
  // a full one for fewer multiply-adds.
  const float* w = j.w;  // weight row n at w + n * k (FP8: the item's rows, dequantized, at w + (n - n0) * k)
  thread_local std::vector<float> rows;
  int64_t base = 0;
  if (j.w8 != nullptr) {
    rows.resize(static_cast<size_t>(kNb * j.k));
    for (int64_t n = n0; n < n1; ++n)
      qcompile_native::dequant_row(j.w8 + n * j.k, j.scale + (n / j.bn) * j.kblocks, j.bk, j.k,
                                   rows.data() + (n - n0) * j.k);
    w = rows.data();
    base = n0;
  }
  // Weight rows outer, row tiles inner: a group of kNr weight rows (kNr x K floats) stays in L1 while every row tile
  // reads it, so each weight byte comes from memory once; the group's first row tile prefetches the next group's
  // rows (the next item's first rows after the last group), so memory streams while the other tiles compute.
  const int64_t tiles = (r1 - r0 + kMr - 1) / kMr;
  const int64_t ahead = j.w8 == nullptr ? kNr * j.k : -1;  // FP8: the dequantized rows are already in cache
  for (int64_t n = n0; n < n1; n += kNr) {
    const int cols = static_cast<int>(std::min<int64_t>(kNr, n1 - n));
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t r = r0 + (r1 - r0) * i / tiles, r_end = r0 + (r1 - r0) * (i + 1) / tiles;
      block(j.x + r * j.k, j.k, static_cast<int>(r_end - r), w + (n - base) * j.k, j.k, j.k, cols,
            j.out + r * j.n + n, j.n, i == 0 ? ahead : -1);
    }
  }
}

ffi::Error Launch(ffi::ThreadPool pool, Job job) {
  if (job.t == 0 || job.n == 0) return ffi::Error::Success();
  if (job.k == 0) {
    std::memset(job.out, 0, sizeof(float) * job.t * job.n);
    return ffi::Error::Success();
  }
  job.row_chunks = (job.t + kRowChunk - 1) / kRowChunk;
  const int64_t col_blocks = (job.n + kNb - 1) / kNb;
  qcompile_native::parallel_items(pool, job.row_chunks * col_blocks, [job](int64_t i) { run_item(job, i); });
  return ffi::Error::Success();
}

ffi::Error LinearF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("qcompile linear: expected x[T,K], w[N,K]");
  return Launch(pool, Job{x.typed_data(), w.typed_data(), out->typed_data(), xd[0], xd[1], wd[0], 0});
}

ffi::Error LinearFp8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out, int64_t bn, int64_t bk) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto sd = scale.dimensions();
  if (w.element_type() != ffi::DataType::F8E4M3FN || xd.size() != 2 || wd.size() != 2 || sd.size() != 2 ||
      wd[1] != xd[1] || bn < 1 || bk < 1 ||
      sd[0] != (wd[0] + bn - 1) / bn || sd[1] != (wd[1] + bk - 1) / bk)
    return ffi::Error::InvalidArgument("qcompile linear fp8: expected x[T,K], w[N,K] e4m3fn bytes, "
                                       "scale[ceil(N/block_n),ceil(K/block_k)]");
  Job job{x.typed_data(), nullptr, out->typed_data(), xd[0], xd[1], wd[0], 0};
  job.w8 = static_cast<const uint8_t*>(w.untyped_data());
  job.scale = scale.typed_data();
  job.bn = bn;
  job.bk = bk;
  job.kblocks = sd[1];
  return Launch(pool, job);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearF32, LinearF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearFp8, LinearFp8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_n")
                                  .Attr<int64_t>("block_k"));
