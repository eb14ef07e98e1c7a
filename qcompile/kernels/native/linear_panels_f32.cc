// qcompile's native CPU linear over a weight in column panels (f32), an XLA FFI custom call. Built and registered by
// qcompile/kernels/native.py; the CPU lowering of linear_panels (ir/ops/core.py, made by ir/target_layout.py from a
// linear whose weight is known at compile time) calls it through jax.ffi.ffi_call.
//
// out[T, P*64] = x[T, K] · w, with w[P, K, 64] the [N, K] weight cut into panels of 64 output columns, each panel
// stored k-major: panel p holds w[64p + c, k] at [p, k, c]. Weight preparation makes this layout once at compile
// time (reshape + transpose on the param), so the step reads every panel as one contiguous run of memory.
// Accumulation is f32, one product at a time in k order (the reassociating class of a dot).
//
// Why: at decode a step multiplies few rows by every weight once, and the Hugging Face [N, K] layout leaves two bad
// choices. Dot products of rows (kernels/native/linear_f32.cc) need no packing, but at 32 rows every weight group
// re-reads the whole input from L2 and ran at ~70 GFLOP/s per core with cold weights; outer products over [K, N]
// stream 256-byte pieces of rows one page apart, which the hardware prefetchers do not follow (~4 GB/s per core).
// Panels are contiguous: measured 120-135 GFLOP/s per core at 32 rows with weights from memory (docs/cpu_rules.md).
//   * a register tile is up to kMr input rows x 64 columns (4 vectors), kMr*4 accumulators, fed per k by 4 vector
//     loads of the panel and kMr broadcasts of x;
//   * k runs in blocks of kKc panel rows (16 KiB, in L1 while every row tile of the chunk uses it); the partial sums
//     go through the output between blocks;
//   * each row tile prefetches part of the panel rows kPrefetchBlocks blocks ahead into L2 (into the next panel of
//     its item near a panel's end), spread one line per k step over all tiles of a block;
//   * a work item is a run of consecutive panels against a chunk of up to kRowChunk input rows, run on the caller
//     and XLA's intra-op threads (parallel_items.h); consecutive panels keep the prefetch stream going.
// bf16 weights (the ...Bf16 entry point, a bf16 checkpoint's panels): each k block of a panel is widened into a
// per-thread f32 block (8 KiB read, 16 KiB in L1) that the same tiles then read, so memory moves two bytes per weight
// and no f32 copy of the weight exists; an item of one row tile (decode) widens the panel in registers instead. x and
// out stay f32 (the rule widens and rounds the activations).
// FP8 panels (the ...Fp8 entry point, an FP8 checkpoint's weights computed in f32: e4m3 values [P, K, 64] with f32
// block scales [ceil(P/bp), ceil(K/bk)]): each k block of a panel is dequantized into the same per-thread f32 block
// (fp8.h dequant64: one cache line of FP8 a panel row, converted in registers), so memory moves one byte per weight
// and the tiles, reading the same values in the same order, give the f32 kernel's result on the dequantized panels.
// Against bf16 activations (a bf16 graph, an even K, AVX512_BF16) the block is dequantized to bf16 instead and the
// VDPBF16PS pair tiles read it, as they read a bf16 checkpoint's panels. An item of one row tile (decode) skips the
// block: its tile dequantizes each panel row in registers over all of K (fp8_tiles.h).
// bf16 activations and panels on a CPU with AVX512_BF16 (the ...Bf16Pairs entry point, an even K): VDPBF16PS tiles
// (bf16_pairs.h), the weights read in place at every row count. An item of kFullKRows rows or more (prefill) runs each
// pair tile over all of K, the panel in L2, instead of k blocks whose partial sums go through the output and are
// re-paired per block (1000-1100 GFLOP/s at 128-4096 rows instead of 710-770); FP8 panels on pairs likewise, each
// panel dequantized to bf16 once per item, and items of up to kFp8RowChunk rows share it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "bf16_pairs.h"
#include "fp8.h"
#include "fp8_tiles.h"
#include "parallel_items.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using qcompile_native::load;
using qcompile_native::store;
using qcompile_native::v16;

constexpr int kMr = 6;                   // input rows per register tile
constexpr int kNv = 4;                   // 16-float vectors per tile row
constexpr int64_t kPanel = 16 * kNv;     // columns per panel (the layout's last dimension)
constexpr int64_t kKc = 64;              // panel rows per k block
constexpr int64_t kPrefetchBlocks = 2;   // k blocks prefetched ahead
constexpr int64_t kRowChunk = 8 * kMr;   // input rows per work item
constexpr int64_t kItemsPerThread = 4;   // panel runs per thread and row chunk (balance against prefetch streams)
constexpr int64_t kFullKRows = 24;       // pair tiles of an item of at least this many rows run over all of K,
constexpr int64_t kPrefetchPairRows = 16;  // ... prefetching the panel this many rows ahead
constexpr int64_t kFp8RowChunk = 384;    // FP8 on pairs: input rows per work item up to this

// Panel lines (64 bytes) to prefetch while a tile computes: lines [first, first + count) of the run starting at
// base, `per_step` of them at each k step.
struct Prefetch {
  const char* base = nullptr;
  int64_t first = 0, count = 0, per_step = 1;
};

// out[m, 0:64] (+)= x[m, kb:ke] · panel[kb:ke, 0:64] for m < MR (add: on top of what out holds); `block` holds the
// panel's rows kb..ke-1.
inline v16 load_w(const float* p) { return load(p); }
inline v16 load_w(const uint16_t* p) { return qcompile_native::widen16(p); }

template <int MR, class W>
void tile(const float* x, int64_t ldx, const W* block, int64_t kb, int64_t ke, float* out, int64_t ldo,
          bool add, Prefetch ahead) {
  v16 acc[MR][kNv];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNv; ++v) acc[m][v] = add ? load(out + m * ldo + 16 * v) : v16{};
  for (int64_t k = kb; k < ke; ++k) {
    for (int64_t l = (k - kb) * ahead.per_step, e = std::min(ahead.count, l + ahead.per_step); l < e; ++l)
      __builtin_prefetch(ahead.base + (ahead.first + l) * 64, 0, 2);
    v16 b[kNv];
    for (int v = 0; v < kNv; ++v) b[v] = load_w(block + (k - kb) * kPanel + 16 * v);
    for (int m = 0; m < MR; ++m) {
      const float a = x[m * ldx + k];
      for (int v = 0; v < kNv; ++v) acc[m][v] += a * b[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNv; ++v) store(out + m * ldo + 16 * v, acc[m][v]);
}

template <class W>
void tile_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t kb, int64_t ke, float* out,
               int64_t ldo, bool add, Prefetch ahead) {
  switch (rows) {
    case 1: tile<1, W>(x, ldx, panel, kb, ke, out, ldo, add, ahead); break;
    case 2: tile<2, W>(x, ldx, panel, kb, ke, out, ldo, add, ahead); break;
    case 3: tile<3, W>(x, ldx, panel, kb, ke, out, ldo, add, ahead); break;
    case 4: tile<4, W>(x, ldx, panel, kb, ke, out, ldo, add, ahead); break;
    case 5: tile<5, W>(x, ldx, panel, kb, ke, out, ldo, add, ahead); break;
    default: tile<kMr, W>(x, ldx, panel, kb, ke, out, ldo, add, ahead); break;
  }
}


struct Job {
  const float* x;
  const float* w;
  float* out;
  int64_t t, k, panels;
  qcompile_native::PanelItems split;  // item i: a run of panels against a chunk of kRowChunk input rows
  const uint16_t* w16 = nullptr;  // bf16 panels instead of w
  const uint16_t* x16 = nullptr;  // bf16 activations (with bf16 panels: the VDPBF16PS tiles)
  const uint8_t* w8 = nullptr;    // FP8 panels instead of w, with scale[ceil(P/bp), kblocks] in blocks of bp x bk
  const float* scale = nullptr;
  int64_t bp = 1, bk = 1, kblocks = 1;
  bool bf16_weights = false;  // each dequantized weight rounded to bf16 (a bf16 graph's dequantize)
  // A bf16 result (out null): each value rounded once to bf16. swiglu: the panels are [gate ; up] (the first P/2
  // gate, the rest up), items run over the gate panels, and the result is silu(gate) · up, [T, 32P] — in f32, or for
  // a bf16 result as a bf16 graph's ops round it (bf16.h swiglu_bf16).
  uint16_t* out16 = nullptr;
  bool swiglu = false;
  bool paired = false;  // the bf16 panels (w16) stored in pair order (bf16_pairs.h), read by the pair tiles as such
};

void run_item(const Job& j, int64_t i) {
  int64_t p0, p1, r0, r1;
  j.split.bounds(i, p0, p1, r0, r1);
  // Row tiles of near-equal size (32 rows: 6,6,5,5,5,5): a short tile reads the panel as often as a full one.
  const int64_t tiles = (r1 - r0 + kMr - 1) / kMr;
  const int64_t elem = j.w8 != nullptr ? 1 : j.w16 != nullptr ? 2 : 4;  // bytes per weight
  const char* base = j.w8 != nullptr    ? reinterpret_cast<const char*>(j.w8)
                     : j.w16 != nullptr ? reinterpret_cast<const char*>(j.w16)
                                        : reinterpret_cast<const char*>(j.w);
  const int64_t n = j.panels * kPanel;  // columns of the product
  thread_local std::vector<float> widened;  // bf16 or FP8: the k block of the panel, in f32
  if (j.w16 != nullptr || j.w8 != nullptr) widened.resize(kKc * kPanel);
  thread_local std::vector<uint16_t> block16_fp8;  // FP8 against bf16 activations: the k block as bf16 pairs
  if (j.w8 != nullptr && j.x16 != nullptr) block16_fp8.resize(kKc * kPanel);
  // Rows [r0, r1) times panel p into dst (row r0 at dst, ldd floats a row); run_end: where (bytes) the run of panels
  // p belongs to ends, which bounds the prefetch ahead.
  auto panel_product = [&](int64_t p, float* dst, int64_t ldd, int64_t run_end) {
    const float* sp = j.w8 != nullptr ? j.scale + (p / j.bp) * j.kblocks : nullptr;  // FP8: the panel's scales
    if (j.w8 != nullptr && tiles == 1) {  // FP8, one row tile: each panel row dequantized in registers, all of K
      const uint8_t* wp = j.w8 + p * j.k * kPanel;
      const int rows = static_cast<int>(r1 - r0);
#ifdef __AVX512BF16__
      if (j.x16 != nullptr) {
        qcompile_native::tile_fp8_pairs_rows(rows, j.x16 + r0 * j.k, j.k, wp, sp, j.bk, 0, j.k, dst, ldd, false);
        return;
      }
#endif
      qcompile_native::tile_fp8_rows(rows, j.x + r0 * j.k, j.k, wp, sp, j.bk, 0, j.k, j.bf16_weights,
                                     dst, ldd, false);
      return;
    }
#ifdef __AVX512BF16__
    if (j.x16 != nullptr && (j.w16 != nullptr || j.w8 != nullptr) && r1 - r0 >= kFullKRows) {
      // Many rows (prefill) on pairs: each tile's accumulators stay in registers over all of K, the panel read in
      // place (from L2 after the first tile; FP8: dequantized to bf16 once into a per-thread panel): no partial sums
      // through the output and no re-pairing per k block (1.3-1.5x at 128-4096 rows, 1.1-1.2x at 24-48).
      thread_local std::vector<uint16_t> panel16;
      const uint16_t* wp16 = j.w16 != nullptr ? j.w16 + p * j.k * kPanel : nullptr;
      if (wp16 == nullptr) {
        panel16.resize(static_cast<size_t>(j.k * kPanel));
        qcompile_native::dequant_rows(j.w8 + p * j.k * kPanel, sp, j.bk, 0, j.k, panel16.data());
        wp16 = panel16.data();
      }
      auto ahead = [wp16, k = j.k, bf16 = j.w16 != nullptr](int64_t pair) {  // the panel rows kPrefetchPairRows ahead
        if (!bf16 || 2 * pair + kPrefetchPairRows >= k) return;
        const uint16_t* next = wp16 + (2 * pair + kPrefetchPairRows) * kPanel;
        for (int l = 0; l < 4; ++l) __builtin_prefetch(next + 32 * l);
      };
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t r = r0 + (r1 - r0) * i / tiles, r_end = r0 + (r1 - r0) * (i + 1) / tiles;
        qcompile_native::tile_pairs_rows(static_cast<int>(r_end - r), j.x16 + r * j.k, j.k, wp16, 0, j.k,
                                         dst + (r - r0) * ldd, ldd, false, ahead, j.paired && j.w16 != nullptr);
      }
      return;
    }
#endif
    for (int64_t kb = 0; kb < j.k; kb += kKc) {
      const int64_t ke = std::min(j.k, kb + kKc);
      const float* block = j.w != nullptr ? j.w + (p * j.k + kb) * kPanel : nullptr;
      const uint16_t* block16 = nullptr;  // bf16 read in place by a single row tile (or by the pair tiles)
      if (j.w8 != nullptr && j.x16 != nullptr) {
        qcompile_native::dequant_rows(j.w8 + p * j.k * kPanel, sp, j.bk, kb, ke, block16_fp8.data());
        block16 = block16_fp8.data();  // row kb of the panel
      } else if (j.w8 != nullptr) {
        qcompile_native::dequant_rows(j.w8 + p * j.k * kPanel, sp, j.bk, kb, ke, j.bf16_weights, widened.data());
        block = widened.data();
      } else if (j.w16 != nullptr && (r1 - r0 <= kMr || j.x16 != nullptr)) {
        block16 = j.w16 + (p * j.k + kb) * kPanel;
      } else if (j.w16 != nullptr) {
        qcompile_native::widen(j.w16 + (p * j.k + kb) * kPanel, widened.data(), (ke - kb) * kPanel);
        block = widened.data();
      }
      // The block kPrefetchBlocks ahead, in this item's panels only: its lines, split over the tiles.
      const int64_t ahead = (p * j.k * kPanel + (kb + kPrefetchBlocks * kKc) * kPanel) * elem;
      const int64_t lines = std::max<int64_t>(0, std::min(kKc * kPanel * elem, run_end - ahead)) / 64;
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t r = r0 + (r1 - r0) * i / tiles, r_end = r0 + (r1 - r0) * (i + 1) / tiles;
        const int64_t l0 = lines * i / tiles, l1 = lines * (i + 1) / tiles;
        const int64_t per_step = (l1 - l0 + (ke - kb) - 1) / (ke - kb);
        const Prefetch pf{base + ahead, l0, l1 - l0, per_step};
#ifdef __AVX512BF16__
        if (j.x16 != nullptr) {
          // The spread prefetch of this tile's share of the block ahead, two k steps per pair.
          auto ahead = [pf](int64_t pair) {
            for (int64_t l = 2 * pair * pf.per_step, e = std::min(pf.count, l + 2 * pf.per_step); l < e; ++l)
              __builtin_prefetch(pf.base + (pf.first + l) * 64, 0, 2);
          };
          qcompile_native::tile_pairs_rows(static_cast<int>(r_end - r), j.x16 + r * j.k, j.k, block16, kb, ke,
                                           dst + (r - r0) * ldd, ldd, kb > 0, ahead, j.paired && j.w8 == nullptr);
          continue;
        }
#endif
        if (block16 != nullptr)
          tile_rows(static_cast<int>(r_end - r), j.x + r * j.k, j.k, block16, kb, ke, dst + (r - r0) * ldd, ldd,
                    kb > 0, pf);
        else
          tile_rows(static_cast<int>(r_end - r), j.x + r * j.k, j.k, block, kb, ke, dst + (r - r0) * ldd, ldd,
                    kb > 0, pf);
      }
    }
  };
  const int64_t panel_bytes = j.k * kPanel * elem;
  if (j.out16 == nullptr && !j.swiglu) {  // f32 result: straight into the output
    for (int64_t p = p0; p < p1; ++p) panel_product(p, j.out + r0 * n + p * kPanel, n, p1 * panel_bytes);
    return;
  }
  // A bf16 result or SwiGLU: each panel's product through a per-thread scratch, then the epilogue.
  const int64_t rows = r1 - r0;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(2 * rows * kPanel));
  float* y = scratch.data();
  float* up = y + rows * kPanel;
  if (!j.swiglu) {
    for (int64_t p = p0; p < p1; ++p) {
      panel_product(p, y, kPanel, p1 * panel_bytes);
      for (int64_t r = 0; r < rows; ++r)
        qcompile_native::narrow(y + r * kPanel, j.out16 + (r0 + r) * n + p * kPanel, kPanel);
    }
    return;
  }
  // SwiGLU: the items run over the gate panels [0, P/2); gate panel p pairs with up panel p + P/2.
  const int64_t half = j.panels / 2, width = half * kPanel;
  for (int64_t p = p0; p < p1; ++p) {
    panel_product(p, y, kPanel, p1 * panel_bytes);
    panel_product(p + half, up, kPanel, (p1 + half) * panel_bytes);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = y + r * kPanel;
      const float* u = up + r * kPanel;
      if (j.out16 != nullptr) {
        qcompile_native::swiglu_bf16(g, u, j.out16 + (r0 + r) * width + p * kPanel, kPanel);
        continue;
      }
      float* o = j.out + (r0 + r) * width + p * kPanel;
      for (int v = 0; v < kNv; ++v) {
        const v16 gv = load(g + 16 * v);
        store(o + 16 * v, gv / (1.0f + qcompile_native::exp16(-gv)) * load(u + 16 * v));
      }
    }
  }
}

// Every item of `job` on the pool (an empty product writes zeros).
ffi::Error Execute(ffi::ThreadPool pool, Job job) {
  if (job.t == 0 || job.panels == 0) return ffi::Error::Success();
  const int64_t width = (job.swiglu ? job.panels / 2 : job.panels) * kPanel;
  if (job.k == 0) {  // an empty product: y = 0, and silu(0)·0 = 0
    if (job.out16 != nullptr)
      std::memset(job.out16, 0, sizeof(uint16_t) * job.t * width);
    else
      std::memset(job.out, 0, sizeof(float) * job.t * width);
    return ffi::Error::Success();
  }
  if (job.swiglu)  // items over the gate panels
    job.split = qcompile_native::PanelItems(job.t, job.panels / 2, job.split.chunk, pool.num_threads(), kItemsPerThread);
  qcompile_native::parallel_items(pool, job.split.count, [job](int64_t i) { run_item(job, i); });
  return ffi::Error::Success();
}

// SwiGLU's [gate ; up] panels come in pairs.
ffi::Error check_swiglu(const Job& job) {
  if (job.swiglu && job.panels % 2)
    return ffi::Error::InvalidArgument("qcompile linear_panels swiglu: expected an even number of panels [gate ; up]");
  return ffi::Error::Success();
}

// The result: f32, or bf16 (each value rounded once to bf16; SwiGLU as a bf16 graph's ops round it).
ffi::Error bind_result(Job& job, ffi::Result<ffi::AnyBuffer>& out, int64_t swiglu) {
  job.swiglu = swiglu != 0;
  if (out->element_type() == ffi::DataType::BF16) {
    job.out = nullptr;
    job.out16 = static_cast<uint16_t*>(out->untyped_data());
  } else if (out->element_type() == ffi::DataType::F32) {
    job.out = static_cast<float*>(out->untyped_data());
  } else {
    return ffi::Error::InvalidArgument("qcompile linear_panels: the result must be f32 or bf16");
  }
  return check_swiglu(job);
}

ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> out,
               int64_t swiglu) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] != kPanel ||
      (!bf16 && w.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("qcompile linear_panels: expected x[T,K] f32, w[P,K,64] f32 or bf16");
  Job job{x.typed_data(), bf16 ? nullptr : static_cast<const float*>(w.untyped_data()), out->typed_data(), xd[0],
          xd[1], wd[0], qcompile_native::PanelItems(xd[0], wd[0], kRowChunk, pool.num_threads(), kItemsPerThread)};
  if (bf16) job.w16 = static_cast<const uint16_t*>(w.untyped_data());
  job.swiglu = swiglu != 0;
  if (auto error = check_swiglu(job); error.failure()) return error;
  return Execute(pool, job);
}

ffi::Error LinearPanelsF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> out, int64_t swiglu) {
  if (w.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("qcompile linear_panels f32: expected f32 panels");
  return Run(pool, x, w, out, swiglu);
}

ffi::Error LinearPanelsBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::ResultBuffer<ffi::F32> out, int64_t swiglu) {
  if (w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("qcompile linear_panels bf16: expected bf16 panels");
  return Run(pool, x, w, out, swiglu);
}

// x[T,K] f32 (or bf16 with an even K: the pair tiles, each weight rounded to bf16), w[P,K,64] e4m3fn panels,
// scale[ceil(P/block_p), ceil(K/block_k)] f32 -> out f32 or bf16.
ffi::Error LinearPanelsFp8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                           ffi::Result<ffi::AnyBuffer> out, int64_t bp, int64_t bk, int64_t bf16_weights,
                           int64_t swiglu) {
  const bool pairs = x.element_type() == ffi::DataType::BF16;
  if ((!pairs && x.element_type() != ffi::DataType::F32) || (pairs && x.dimensions().back() % 2))
    return ffi::Error::InvalidArgument("qcompile linear_panels fp8: x f32, or bf16 with an even K");
#ifndef __AVX512BF16__
  if (pairs)
    return ffi::Error::InvalidArgument("qcompile linear_panels fp8 pairs: built for a CPU without AVX512_BF16");
#endif
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto sd = scale.dimensions();
  if (w.element_type() != ffi::DataType::F8E4M3FN || xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] ||
      wd[2] != kPanel || bp < 1 || bk < 1 || sd.size() != 2 || sd[0] != (wd[0] + bp - 1) / bp ||
      sd[1] != (wd[1] + bk - 1) / bk)
    return ffi::Error::InvalidArgument("qcompile linear_panels fp8: expected x[T,K] f32, w[P,K,64] e4m3fn, "
                                       "scale[ceil(P/block_p),ceil(K/block_k)] f32");
  // On pairs every item of many rows dequantizes each of its panels to bf16 once: items of up to kFp8RowChunk rows
  // share that over more tiles (1.4-1.6x at 64-1024 rows against 48-row items).
  const int64_t chunk =
      pairs ? std::clamp<int64_t>((xd[0] + kMr - 1) / kMr * kMr, kRowChunk, kFp8RowChunk) : kRowChunk;
  Job job{pairs ? nullptr : static_cast<const float*>(x.untyped_data()), nullptr, nullptr, xd[0], xd[1],
          wd[0], qcompile_native::PanelItems(xd[0], wd[0], chunk, pool.num_threads(), kItemsPerThread)};
  if (pairs) job.x16 = static_cast<const uint16_t*>(x.untyped_data());
  job.w8 = static_cast<const uint8_t*>(w.untyped_data());
  job.scale = scale.typed_data();
  job.bp = bp;
  job.bk = bk;
  job.kblocks = sd[1];
  job.bf16_weights = bf16_weights != 0;
  if (auto error = bind_result(job, out, swiglu); error.failure()) return error;
  return Execute(pool, job);
}

// x[T,K] bf16, w[P,K,64] bf16, K even -> out f32 or bf16 on VDPBF16PS; an error on a CPU without AVX512_BF16 (the
// rule asks native.avx512_bf16() first).
ffi::Error linear_bf16_pairs(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                             int64_t swiglu, bool paired) {
#ifdef __AVX512BF16__
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 || xd.size() != 2 ||
      wd.size() != 3 || wd[1] != xd[1] || wd[2] != kPanel || xd[1] % 2 != 0)
    return ffi::Error::InvalidArgument("qcompile linear_panels bf16 pairs: expected x[T,K] bf16, w[P,K,64] bf16, K "
                                       "even");
  Job job{nullptr, nullptr, nullptr, xd[0], xd[1], wd[0],
          qcompile_native::PanelItems(xd[0], wd[0], kRowChunk, pool.num_threads(), kItemsPerThread)};
  job.w16 = static_cast<const uint16_t*>(w.untyped_data());
  job.x16 = static_cast<const uint16_t*>(x.untyped_data());
  job.paired = paired;
  if (auto error = bind_result(job, out, swiglu); error.failure()) return error;
  return Execute(pool, job);
#else
  return ffi::Error::InvalidArgument("qcompile linear_panels bf16 pairs: built for a CPU without AVX512_BF16");
#endif
}

ffi::Error LinearPanelsBf16Pairs(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                 ffi::Result<ffi::AnyBuffer> out, int64_t swiglu) {
  return linear_bf16_pairs(pool, x, w, out, swiglu, false);
}

// The same with the panels in pair order (the layout AMX tiles read, made on CPUs with AMX).
ffi::Error LinearPairPanelsBf16(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::Result<ffi::AnyBuffer> out, int64_t swiglu) {
  return linear_bf16_pairs(pool, x, w, out, swiglu, true);
}

}  // namespace

// Every entry point takes attr swiglu (nonzero: the panels are [gate ; up] and the result silu(gate) · up, [T, 32P]).
// x[T,K] bf16, w[P,K,64] bf16 -> out[T,P*64] f32 or bf16
#define QCOMPILE_LINEAR_PAIRS_BINDING \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() \
      .Attr<int64_t>("swiglu")
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearPanelsBf16Pairs, LinearPanelsBf16Pairs, QCOMPILE_LINEAR_PAIRS_BINDING);
// ... with w's panels in pair order
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearPairPanelsBf16, LinearPairPanelsBf16, QCOMPILE_LINEAR_PAIRS_BINDING);

// x[T,K] f32, w[P,K,64] (f32, or bf16 for the second entry point) -> out[T,P*64] f32
#define QCOMPILE_LINEAR_PANELS_BINDING                                                                            \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>() \
      .Attr<int64_t>("swiglu")

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearPanelsF32, LinearPanelsF32, QCOMPILE_LINEAR_PANELS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearPanelsBf16, LinearPanelsBf16, QCOMPILE_LINEAR_PANELS_BINDING);
// x[T,K] f32 or bf16, w[P,K,64] e4m3fn, scale[PB,KB] f32; attrs block_p, block_k, bf16_weights -> out[T,P*64]
// f32 or bf16
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearPanelsFp8, LinearPanelsFp8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("block_p")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("bf16_weights")
                                  .Attr<int64_t>("swiglu"));
