// qcompile's native CPU bf16 products on AMX tiles (Intel Advanced Matrix Extensions), XLA FFI custom calls. Built
// and registered by qcompile/kernels/native.py on CPUs whose flags include amx_bf16; the CPU rules of linear_panels
// (kernels/linear.py) and of the grouped matmuls (kernels/grouped_matmul.py) call them for bf16 activations and
// weights at prefill-sized row counts.
//
// Linear: out[T, P*64] f32 = x[T, K] bf16 · w, with w[P, K, 64] bf16 the [N, K] weight in column panels (the layout
// of linear_panels_f32.cc). Grouped matmul: out[N, Nout] f32 = rows[N, K] bf16 · w[e(r)] with w[E, K, Nout] bf16,
// rows sorted by expert in groups of group_sizes[E] (grouped_matmul_f32.cc's contract: rows past the groups come back
// 0). (No SwiGLU epilogue: on bf16 the rule rounds the product and takes the halves as the reference does —
// kernels/grouped_matmul.py says why.)
// TDPBF16PS multiplies bf16 pairs exactly and accumulates in f32 (the reassociating class of a dot; like every AMX
// bf16 product, denormal inputs count as zero).
//
// Why: a bf16 checkpoint's prefill is compute-bound, and the f32 FMA kernels (bf16 widened first) run at ~120
// GFLOP/s per core; one AMX tile multiply does 16x16x32 multiply-adds, measured 350-510 GFLOP/s per core here on
// the bench preset's shapes. transformers' bf16 prefill on this CPU goes through oneDNN's AMX kernels.
//   * a work item is a run of consecutive panels against a chunk of up to kRowChunk rows (parallel_items.h); it
//     repacks its panels once into the pair-interleaved ("VNNI") layout TDPBF16PS reads — [K/2, 64, 2]: the two
//     weights of k = 2i and 2i+1 side by side — in a per-thread buffer, then walks row blocks of 32 and, for each
//     panel, two halves of 32 columns: four f32 accumulator tiles (32 x 32) over the whole K, fed per 32 k by two
//     row tiles of x (read where they lie) and two weight tiles;
//   * rows past the last full block of 32 go through a zero-padded copy and a scratch output;
//   * K must be a multiple of 32 (every projection of these models; the rule checks it).
//   * grouped matmul: items are (expert, chunk of up to kRowChunk rows); an item repacks its expert's [K, Nout] into
//     the pair-interleaved layout a 64-column strip at a time (Nout a multiple of 64) and runs the same blocks.

#include <algorithm>
#include <memory>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "parallel_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;          // columns per panel
constexpr int64_t kRows = 32;           // rows per block: two 16-row tiles
constexpr int64_t kRowChunk = 8 * kRows;  // rows per work item
constexpr int64_t kItemsPerThread = 4;  // panel runs per thread and row chunk

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The process's permission to use the AMX tile state (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool tiles_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// panel[K, 64] (rows ld apart) -> vnni[K/2, 64, 2]: the weights of k = 2i and 2i + 1 for column n at [i, n, 0..1].
void repack(const uint16_t* panel, int64_t k, uint16_t* vnni, int64_t ld = kPanel) {
  __m512i first = _mm512_setzero_si512(), second = first;  // index vectors for columns 0-15 and 16-31 of a half
  alignas(64) uint16_t idx0[32], idx1[32];
  for (int i = 0; i < 16; ++i) {
    idx0[2 * i] = i, idx0[2 * i + 1] = 32 + i;
    idx1[2 * i] = 16 + i, idx1[2 * i + 1] = 48 + i;
  }
  first = _mm512_load_si512(idx0);
  second = _mm512_load_si512(idx1);
  for (int64_t i = 0; i < k / 2; ++i) {
    const uint16_t* even = panel + 2 * i * ld;
    const uint16_t* odd = even + ld;
    uint16_t* out = vnni + i * 2 * kPanel;
    for (int half = 0; half < 2; ++half) {
      const __m512i a = _mm512_loadu_si512(even + 32 * half), b = _mm512_loadu_si512(odd + 32 * half);
      _mm512_storeu_si512(out + 64 * half, _mm512_permutex2var_epi16(a, first, b));
      _mm512_storeu_si512(out + 64 * half + 32, _mm512_permutex2var_epi16(a, second, b));
    }
  }
}

// out[32 rows, 64 cols] = x[32, K] · the repacked panel; x rows ldx apart, out rows ldo apart.
void block(const uint16_t* x, int64_t ldx, const uint16_t* vnni, int64_t k, float* out, int64_t ldo) {
  for (int64_t c = 0; c < kPanel; c += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < k; kk += 32) {
      _tile_loadd(4, x + kk, ldx * 2);
      _tile_loadd(5, x + 16 * ldx + kk, ldx * 2);
      _tile_loadd(6, vnni + (kk / 2 * kPanel + c) * 2, kPanel * 4);
      _tile_loadd(7, vnni + (kk / 2 * kPanel + c + 16) * 2, kPanel * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out + c, ldo * 4);
    _tile_stored(1, out + c + 16, ldo * 4);
    _tile_stored(2, out + 16 * ldo + c, ldo * 4);
    _tile_stored(3, out + 16 * ldo + c + 16, ldo * 4);
  }
}

struct Job {
  const uint16_t* x;
  const uint16_t* w;
  float* out;
  int64_t t, k, panels;
  qcompile_native::PanelItems split;
};

void run_item(const Job& j, int64_t i) {
  int64_t p0, p1, r0, r1;
  j.split.bounds(i, p0, p1, r0, r1);
  const int64_t n = j.panels * kPanel, panel_size = j.k * kPanel;
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  thread_local std::vector<uint16_t> vnni, padded;
  thread_local std::vector<float> scratch;
  vnni.resize(static_cast<size_t>((p1 - p0) * panel_size));
  for (int64_t p = p0; p < p1; ++p) repack(j.w + p * panel_size, j.k, vnni.data() + (p - p0) * panel_size);
  for (int64_t r = r0; r < r1; r += kRows) {
    const int64_t rows = std::min(kRows, r1 - r);
    const uint16_t* x = j.x + r * j.k;
    if (rows < kRows) {  // the last rows: a zero-padded copy, results through a scratch block
      padded.assign(static_cast<size_t>(kRows * j.k), 0);
      std::memcpy(padded.data(), x, sizeof(uint16_t) * rows * j.k);
      scratch.resize(kRows * kPanel);
      for (int64_t p = p0; p < p1; ++p) {
        block(padded.data(), j.k, vnni.data() + (p - p0) * panel_size, j.k, scratch.data(), kPanel);
        for (int64_t m = 0; m < rows; ++m)
          std::memcpy(j.out + (r + m) * n + p * kPanel, scratch.data() + m * kPanel, sizeof(float) * kPanel);
      }
      continue;
    }
    for (int64_t p = p0; p < p1; ++p)
      block(x, j.k, vnni.data() + (p - p0) * panel_size, j.k, j.out + r * n + p * kPanel, n);
  }
  _tile_release();
}

ffi::Error LinearPanelsAmx(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 || xd.size() != 2 ||
      wd.size() != 3 || wd[1] != xd[1] || wd[2] != kPanel || xd[1] % 32 != 0)
    return ffi::Error::InvalidArgument("qcompile linear_panels amx: expected x[T,K] bf16, w[P,K,64] bf16, K % 32 == 0");
  if (!tiles_permitted())
    return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile linear_panels amx: the OS refused the AMX tile state");
  Job job{static_cast<const uint16_t*>(x.untyped_data()), static_cast<const uint16_t*>(w.untyped_data()),
          out->typed_data(), xd[0], xd[1], wd[0],
          qcompile_native::PanelItems(xd[0], wd[0], kRowChunk, pool.num_threads(), kItemsPerThread)};
  if (job.t == 0 || job.panels == 0) return ffi::Error::Success();
  if (job.k == 0) {
    std::memset(job.out, 0, sizeof(float) * job.t * job.panels * kPanel);
    return ffi::Error::Success();
  }
  qcompile_native::parallel_items(pool, job.split.count, [job](int64_t i) { run_item(job, i); });
  return ffi::Error::Success();
}

using GroupItem = qcompile_native::GroupChunk;

struct GroupJob {
  const uint16_t* x;
  const uint16_t* w;
  float* out;
  int64_t k, nout;
  std::vector<GroupItem> items;
};

// rows[item] · w[e] into y ([rows, nout], ldy floats per row): 32-row blocks (the last zero-padded) x 64-col strips.
void group_product(const GroupJob& j, const GroupItem& it, float* y, int64_t ldy) {
  thread_local std::vector<uint16_t> vnni, padded;
  thread_local std::vector<float> scratch;
  const int64_t strip = j.k * kPanel, strips = j.nout / kPanel;
  vnni.resize(static_cast<size_t>(strips * strip));
  const uint16_t* we = j.w + it.expert * j.k * j.nout;
  for (int64_t s = 0; s < strips; ++s) repack(we + s * kPanel, j.k, vnni.data() + s * strip, j.nout);
  for (int64_t r = 0; r < it.rows; r += kRows) {
    const int64_t rows = std::min(kRows, it.rows - r);
    const uint16_t* x = j.x + (it.row0 + r) * j.k;
    if (rows < kRows) {
      padded.assign(static_cast<size_t>(kRows * j.k), 0);
      std::memcpy(padded.data(), x, sizeof(uint16_t) * rows * j.k);
      scratch.resize(kRows * kPanel);
      for (int64_t s = 0; s < strips; ++s) {
        block(padded.data(), j.k, vnni.data() + s * strip, j.k, scratch.data(), kPanel);
        for (int64_t m = 0; m < rows; ++m)
          std::memcpy(y + (r + m) * ldy + s * kPanel, scratch.data() + m * kPanel, sizeof(float) * kPanel);
      }
      continue;
    }
    for (int64_t s = 0; s < strips; ++s) block(x, j.k, vnni.data() + s * strip, j.k, y + r * ldy + s * kPanel, ldy);
  }
}

void run_group_item(const GroupJob& j, const GroupItem& it) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  group_product(j, it, j.out + it.row0 * j.nout, j.nout);
  _tile_release();
}

ffi::Error GroupedMatmulAmx(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto rd = rows.dimensions();
  const auto wd = w.dimensions();
  const auto gd = group_sizes.dimensions();
  if (rows.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 || rd.size() != 2 ||
      wd.size() != 3 || gd.size() != 1 || wd[1] != rd[1] || gd[0] != wd[0] || rd[1] % 32 != 0 || wd[2] % kPanel)
    return ffi::Error::InvalidArgument("qcompile grouped matmul amx: expected rows[N,K] bf16, w[E,K,Nout] bf16, "
                                       "group_sizes[E], K % 32 == 0, Nout % 64 == 0");
  if (!tiles_permitted())
    return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile grouped matmul amx: the OS refused the AMX tile state");
  auto job = std::make_shared<GroupJob>();
  job->x = static_cast<const uint16_t*>(rows.untyped_data());
  job->w = static_cast<const uint16_t*>(w.untyped_data());
  job->out = out->typed_data();
  job->k = rd[1];
  job->nout = wd[2];
  const int64_t n = rd[0], width = job->nout;
  if (job->k == 0) {
    std::memset(job->out, 0, sizeof(float) * n * width);
    return ffi::Error::Success();
  }
  const int64_t row = qcompile_native::group_chunks(group_sizes.typed_data(), wd[0], n, kRowChunk, job->items);
  if (row < n) std::memset(job->out + row * width, 0, sizeof(float) * (n - row) * width);
  qcompile_native::parallel_items(pool, static_cast<int64_t>(job->items.size()),
                                  [job](int64_t i) { run_group_item(*job, job->items[i]); });
  return ffi::Error::Success();
}

#else  // built for a CPU without AMX: the rules never call these (kernels/native.py checks the CPU's flags)

ffi::Error LinearPanelsAmx(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile linear_panels amx: built for a CPU without AMX");
}

ffi::Error GroupedMatmulAmx(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::S32>,
                            ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile grouped matmul amx: built for a CPU without AMX");
}

#endif

}  // namespace

// rows[N,K] bf16, w[E,K,Nout] bf16, group_sizes[E] -> out[N,Nout] f32
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulAmx, GroupedMatmulAmx,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearPanelsAmx, LinearPanelsAmx,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
