// qcompile's native CPU grouped matmul (f32), an XLA FFI custom call. Built and registered by
// qcompile/kernels/native.py; the CPU lowering of grouped_matmul calls it through jax.ffi.ffi_call.
//
// out[N, Nout] = rows[N, K] · w[e(r)] with w[E, K, Nout]: rows are sorted by expert, group e owns the consecutive
// rows [start_e, start_e + g_e) (g clipped to >= 0 and to the rows that exist); rows past the groups come back 0.
// Accumulation is f32, one product at a time in k order (the reassociating class of a dot).
// A second entry point fuses SwiGLU (the swiglu-fusion pass): w = [gate | up] along Nout = 2I, and
// out[N, I] = silu(rows · w_gate) * (rows · w_up), applied per work item to its [rows, 2I] product, so the routed
// rows are read once, the experts' gate and up weights in one sweep, and no [N, 2I] intermediate reaches memory.
//
// Why a custom call: XLA's CPU emitter copies every dynamically indexed expert slice w[e] before its dot (one 1 MiB
// copy per block of rows at the bench preset), and its dots run far below the memory bandwidth at the 1-8 rows an
// expert gets per decode step. This kernel reads each routed expert's weights once, where they lie:
//   * work items are (expert, chunk of up to kRowChunk rows), run on the caller and XLA's intra-op threads
//     (parallel_items.h; each item writes only its own rows: results do not depend on the thread split);
//   * an item walks k in blocks whose [kc, Nout] weight slab stays in L2, column panels of 64 inside it, and row
//     tiles of up to kMr rows inside that; a tile's kMr x 64 accumulators stay in registers over the k block (an item
//     of few rows, at decode, walks the slab in sub-blocks of kFewRowsSub rows instead, every panel of one before the
//     next, so memory streams contiguous rows);
//   * weight rows are prefetched kPrefetchRows ahead (a panel reads 256 bytes per weight row, one row per page at
//     Nout = 1024, which the hardware prefetchers do not follow across pages).
// Vectors are GCC vector extensions (16 floats); -march=native maps them to AVX-512, AVX2 or SSE.
// Panels (the ...Panels entry points, the cpu target's layout of f32 and bf16 experts, ir/target_layout.py): w is
// [E, Nout/64, K, 64], each 64-column panel of an expert stored k-major, so an item reads each panel front to back —
// one sequential stream the hardware prefetchers follow — with its row tile's accumulators in registers over all of
// K (the [E, K, Nout] layout makes a few-row item read 256-byte pieces of rows one page apart: 43 vs 73 GB/s on a
// 2-core AMD EPYC, docs/cpu_rules.md "Experts in column panels").
// FP8 weights (the ...Fp8 entry points: w is e4m3fn bytes [E, K, Nout] with f32 block scales [E, ceil(K/bk),
// ceil(Nout/bn)]): each k block's [kc, Nout] slab is dequantized into a per-thread buffer (fp8.h) that the same
// panels then read, so memory moves one byte per weight and the slab is multiplied while it is in L2.
// bf16 weights (the ...Bf16 entry point, a bf16 checkpoint's experts: w is bf16 [E, K, Nout]): each slab is widened
// into the same per-thread buffer the same way (two bytes a weight from memory; items of few rows, at decode, read
// the bf16 weights where they lie and widen them in registers instead); rows and out stay f32.
// bf16 results (the bf16 pair entry points and the FP8 panels of a bf16 graph, a bf16 result buffer): each item's
// product goes through a per-thread f32 scratch and is rounded once into the result, or with SwiGLU (the
// ...SwigluPanelsBf16Pairs entry point, the FP8 one with bf16_weights) the halves are computed as a bf16 graph's ops
// round them (bf16.h swiglu_bf16) — no f32 product or XLA conversion through memory.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
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

using qcompile_native::exp16;
using qcompile_native::load;
using qcompile_native::store;
using qcompile_native::v16;

constexpr int kMr = 6;                  // rows per register tile
constexpr int kNv = 4;                  // 16-float vectors per tile row
constexpr int64_t kNr = 16 * kNv;       // columns per panel
constexpr int64_t kPrefetchRows = 16;   // weight rows prefetched ahead within a panel
constexpr int64_t kSlabFloats = 65536;  // k block: kc = kSlabFloats / Nout (>= 16) weight rows (256 KiB) per slab
constexpr int64_t kRowChunk = 8 * kMr;  // rows per work item
constexpr int64_t kRowChunkWidened = 4 * kRowChunk;  // bf16: rows per item (each item widens its expert's slabs once)
constexpr int64_t kFewRows = 2 * kMr;   // items of at most this many rows walk a slab in sub-blocks of
constexpr int64_t kFewRowsSub = kPrefetchRows;  // this many weight rows


// A weight's 16 consecutive values (or one) as f32: f32 as it is, bf16 widened in registers.
inline v16 load_w(const float* p) { return load(p); }
inline v16 load_w(const uint16_t* p) { return qcompile_native::widen16(p); }
inline float value_w(const float* p) { return *p; }
inline float value_w(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// out[m, 0:16*NV] (+)= x[m, 0:k] · w[0:k, 0:16*NV] for m < MR.
template <int MR, int NV, class W>
void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t k, float* out, int64_t ldo, bool add) {
  v16 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = add ? load(out + m * ldo + 16 * v) : v16{};
  for (int64_t kk = 0; kk < k; ++kk) {
    const W* wr = w + kk * ldw;
    for (int v = 0; v < NV; ++v) __builtin_prefetch(wr + kPrefetchRows * ldw + 16 * v);
    v16 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load_w(wr + 16 * v);
    for (int m = 0; m < MR; ++m) {
      const v16 a = qcompile_native::splat(x[m * ldx + kk]);
      for (int v = 0; v < NV; ++v) acc[m][v] += a * b[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) store(out + m * ldo + 16 * v, acc[m][v]);
}

template <int NV, class W>
void tile_rows(const float* x, int64_t ldx, int rows, const W* w, int64_t ldw, int64_t k, float* out, int64_t ldo,
               bool add) {
  switch (rows) {
    case 1: tile<1, NV, W>(x, ldx, w, ldw, k, out, ldo, add); break;
    case 2: tile<2, NV, W>(x, ldx, w, ldw, k, out, ldo, add); break;
    case 3: tile<3, NV, W>(x, ldx, w, ldw, k, out, ldo, add); break;
    case 4: tile<4, NV, W>(x, ldx, w, ldw, k, out, ldo, add); break;
    case 5: tile<5, NV, W>(x, ldx, w, ldw, k, out, ldo, add); break;
    default: tile<kMr, NV, W>(x, ldx, w, ldw, k, out, ldo, add); break;
  }
}

// Fewer than 16 columns left: scalar loops.
template <class W>
void narrow(const float* x, int64_t ldx, int rows, const W* w, int64_t ldw, int64_t k, int64_t ncols, float* out,
            int64_t ldo, bool add) {
  for (int m = 0; m < rows; ++m) {
    float* o = out + m * ldo;
    if (!add) std::memset(o, 0, sizeof(float) * ncols);
    for (int64_t kk = 0; kk < k; ++kk) {
      const float a = x[m * ldx + kk];
      const W* wr = w + kk * ldw;
      for (int64_t n = 0; n < ncols; ++n) o[n] += a * value_w(wr + n);
    }
  }
}

// x[rows, k] · w[k, ncols] into out (+= when add), any ncols: 64-column panels, then 16-column ones, then scalars.
template <class W>
void panel(const float* x, int64_t ldx, int rows, const W* w, int64_t ldw, int64_t k, int64_t ncols, float* out,
           int64_t ldo, bool add) {
  int64_t n = 0;
  for (; n + kNr <= ncols; n += kNr) tile_rows<kNv, W>(x, ldx, rows, w + n, ldw, k, out + n, ldo, add);
  for (; n + 16 <= ncols; n += 16) tile_rows<1, W>(x, ldx, rows, w + n, ldw, k, out + n, ldo, add);
  if (n < ncols) narrow(x, ldx, rows, w + n, ldw, k, ncols - n, out + n, ldo, add);
}

using Item = qcompile_native::GroupChunk;

struct Job {
  const float* x;
  const float* w;
  float* out;
  int64_t k, nout;
  bool swiglu;  // out[r, j] = silu(y[r, j]) * y[r, nout/2 + j] of the product y, out nout/2 wide
  std::vector<Item> items;
  // FP8 weights (w8 set, w null): values [E, K, Nout], scales [E, kblocks, nblocks] in blocks of bk x bn; in panels
  // (panels set) values [E, P, K, 64], scales [E, nblocks, kblocks] in blocks of bn panels x bk rows
  const uint8_t* w8 = nullptr;
  const float* scale = nullptr;
  const uint16_t* w16 = nullptr;  // bf16 weights [E, K, Nout] (w null)
  bool panels = false;            // w is [E, Nout/64, K, 64] (f32 or bf16)
  const uint16_t* x16 = nullptr;  // bf16 rows (x null), with bf16 panels: the VDPBF16PS tiles (bf16_pairs.h)
  bool paired = false;            // the bf16 panels stored in pair order (bf16_pairs.h), read as such
  int64_t bk = 1, bn = 1, kblocks = 1, nblocks = 1;
  bool bf16_weights = false;  // FP8 panels: each dequantized weight rounded to bf16 (a bf16 graph's dequantize)
  // A bf16 result (out null): each value of the product rounded once to bf16, or with swiglu the halves as a bf16
  // graph computes them (bf16.h swiglu_bf16) — so neither the f32 product nor a conversion goes through memory.
  uint16_t* out16 = nullptr;
};

// Rows [k0, k0 + kc) of expert e's FP8 weights, dequantized into buf ([kc, Nout]).
void dequant_slab(const Job& j, int64_t e, int64_t k0, int64_t kc, float* buf) {
  const uint8_t* we = j.w8 + e * j.k * j.nout;
  const float* se = j.scale + e * j.kblocks * j.nblocks;
  for (int64_t kk = 0; kk < kc; ++kk)
    qcompile_native::dequant_row(we + (k0 + kk) * j.nout, se + ((k0 + kk) / j.bk) * j.nblocks, j.bn, j.nout,
                                 buf + kk * j.nout);
}


// rows[it] · w[e] with w in panels ([E, Nout/64, K, 64]): per panel, each row tile's accumulators stay in registers
// over all of K while the panel streams by (re-read from L2 by the next row tile: 256 KiB at K = 1024). bf16 panels
// are widened in registers for an item of one row tile, into a per-thread f32 panel for more (widened once). FP8
// panels likewise (dequantized); against bf16 rows (VDPBF16PS) an item of one row tile makes the bf16 pairs in
// registers, one of several dequantizes each panel to bf16 once for the pair tiles (a bf16 panel through L2 for a
// single tile cost 1.4-1.8x at 8-32 tokens).
void panel_product(const Job& j, const Item& it, float* out, int64_t ldo) {
  const int64_t panel = j.k * kNr;
  thread_local std::vector<float> widened;
  for (int64_t p = 0; p < j.nout / kNr; ++p) {
    const int64_t at = (it.expert * (j.nout / kNr) + p) * panel;
    // FP8: this panel's block scales along K
    const float* sp = j.w8 != nullptr ? j.scale + (it.expert * j.nblocks + p / j.bn) * j.kblocks : nullptr;
#ifdef __AVX512BF16__
    if (j.x16 != nullptr && j.w16 != nullptr) {  // bf16 rows and panels: pairs, the panel read in place
      const uint16_t* wp16 = j.w16 + at;
      auto ahead = [wp16](int64_t pair) {  // the two panel rows kPrefetchRows ahead (256 bytes)
        const uint16_t* next = wp16 + (2 * pair + kPrefetchRows) * kNr;
        for (int l = 0; l < 4; ++l) __builtin_prefetch(next + 32 * l);
      };
      for (int64_t r = 0; r < it.rows; r += kMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kMr, it.rows - r));
        qcompile_native::tile_pairs_rows(rows, j.x16 + (it.row0 + r) * j.k, j.k, wp16, 0, j.k, out + r * ldo + p * kNr,
                                         ldo, false, ahead, j.paired);
      }
      continue;
    }
    if (j.w8 != nullptr && j.x16 != nullptr && it.rows <= kMr) {  // FP8, bf16 rows, one tile: pairs in registers
      qcompile_native::tile_fp8_pairs_rows(static_cast<int>(it.rows), j.x16 + it.row0 * j.k, j.k, j.w8 + at, sp,
                                           j.bk, 0, j.k, out + p * kNr, ldo, false);
      continue;
    }
    if (j.w8 != nullptr && j.x16 != nullptr) {  // FP8, bf16 rows, several tiles: the panel as bf16 once, pair tiles
      thread_local std::vector<uint16_t> panel16;
      panel16.resize(static_cast<size_t>(panel));
      qcompile_native::dequant_rows(j.w8 + at, sp, j.bk, 0, j.k, panel16.data());
      for (int64_t r = 0; r < it.rows; r += kMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kMr, it.rows - r));
        qcompile_native::tile_pairs_rows(rows, j.x16 + (it.row0 + r) * j.k, j.k, panel16.data(), 0, j.k,
                                         out + r * ldo + p * kNr, ldo, false, [](int64_t) {});
      }
      continue;
    }
#endif
    if (j.w8 != nullptr) {  // FP8 panels: one row tile dequantizes in registers; more share a dequantized panel
      if (it.rows > kMr) {
        widened.resize(static_cast<size_t>(panel));
        qcompile_native::dequant_rows(j.w8 + at, sp, j.bk, 0, j.k, j.bf16_weights, widened.data());
      }
      for (int64_t r = 0; r < it.rows; r += kMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kMr, it.rows - r));
        float* o = out + r * ldo + p * kNr;
        const float* x = j.x + (it.row0 + r) * j.k;
        if (it.rows > kMr)
          tile_rows<kNv, float>(x, j.k, rows, widened.data(), kNr, j.k, o, ldo, false);
        else
          qcompile_native::tile_fp8_rows(rows, x, j.k, j.w8 + at, sp, j.bk, 0, j.k, j.bf16_weights, o, ldo, false);
      }
      continue;
    }
    const float* wp = j.w != nullptr ? j.w + at : nullptr;
    if (wp == nullptr && it.rows > kMr) {
      widened.resize(static_cast<size_t>(panel));
      qcompile_native::widen(j.w16 + at, widened.data(), panel);
      wp = widened.data();
    }
    for (int64_t r = 0; r < it.rows; r += kMr) {
      const int rows = static_cast<int>(std::min<int64_t>(kMr, it.rows - r));
      const float* x = j.x + (it.row0 + r) * j.k;
      float* o = out + r * ldo + p * kNr;
      if (wp != nullptr)
        tile_rows<kNv, float>(x, j.k, rows, wp, kNr, j.k, o, ldo, false);
      else
        tile_rows<kNv, uint16_t>(x, j.k, rows, j.w16 + at, kNr, j.k, o, ldo, false);
    }
  }
}

// rows[it] · w[e] into out (ldo floats per row), k blocks outer, 64-column panels, row tiles inner.
void product(const Job& j, const Item& it, float* out, int64_t ldo) {
  if (j.panels) {
    panel_product(j, it, out, ldo);
    return;
  }
  const int64_t kblock = std::max<int64_t>(16, kSlabFloats / std::max<int64_t>(j.nout, 1));
  thread_local std::vector<float> slab;  // FP8 or bf16: the k block's weights, in f32
  if (j.w8 != nullptr || j.w16 != nullptr) slab.resize(static_cast<size_t>(std::min(kblock, j.k) * j.nout));
  for (int64_t k0 = 0; k0 < j.k; k0 += kblock) {
    const int64_t kc = std::min(kblock, j.k - k0);
    const float* wk = nullptr;  // the slab: weight rows k0..k0+kc of this expert, [kc, Nout]
    if (j.w8 != nullptr) {
      dequant_slab(j, it.expert, k0, kc, slab.data());
      wk = slab.data();
    } else if (j.w16 != nullptr && it.rows > kFewRows) {  // (few rows widen each weight once, in registers)
      qcompile_native::widen(j.w16 + (it.expert * j.k + k0) * j.nout, slab.data(), kc * j.nout);
      wk = slab.data();
    } else if (j.w16 == nullptr) {
      wk = j.w + (it.expert * j.k + k0) * j.nout;
    }
    // Few rows (decode): the slab in sub-blocks of kFewRowsSub weight rows, every panel of one before the next, so
    // memory streams each sub-block's contiguous rows once (the panels' prefetches fetch the next sub-block) instead
    // of reading the slab a 64-column strip at a time; the accumulators go through `out` once per sub-block.
    const int64_t sub = it.rows <= kFewRows ? kFewRowsSub : kc;
    for (int64_t ks = 0; ks < kc; ks += sub) {
      const int64_t kn = std::min(sub, kc - ks);
      for (int64_t n0 = 0; n0 < j.nout; n0 += kNr) {
        const int64_t ncols = std::min(kNr, j.nout - n0);
        for (int64_t r = 0; r < it.rows; r += kMr) {
          const int rows = static_cast<int>(std::min<int64_t>(kMr, it.rows - r));
          const int64_t row = it.row0 + r;
          if (wk == nullptr)  // bf16, few rows: straight from the checkpoint's weights
            panel(j.x + row * j.k + k0 + ks, j.k, rows, j.w16 + (it.expert * j.k + k0 + ks) * j.nout + n0, j.nout,
                  kn, ncols, out + r * ldo + n0, ldo, k0 + ks > 0);
          else
            panel(j.x + row * j.k + k0 + ks, j.k, rows, wk + ks * j.nout + n0, j.nout, kn, ncols, out + r * ldo + n0,
                  ldo, k0 + ks > 0);
        }
      }
    }
  }
}


void run_item(const Job& j, const Item& it) {
  if (!j.swiglu && j.out16 == nullptr) {
    product(j, it, j.out + it.row0 * j.nout, j.nout);
    return;
  }
  // The [rows, nout] product goes to a per-thread scratch (≤ kRowChunk rows, 4x for bf16: L2-resident), then the
  // epilogue.
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(it.rows * j.nout));
  float* y = scratch.data();
  product(j, it, y, j.nout);
  const int64_t half = j.nout / 2;
  if (j.out16 != nullptr) {
    for (int64_t r = 0; r < it.rows; ++r) {
      const float* yr = y + r * j.nout;
      if (j.swiglu)
        qcompile_native::swiglu_bf16(yr, yr + half, j.out16 + (it.row0 + r) * half, half);
      else
        qcompile_native::narrow(yr, j.out16 + (it.row0 + r) * j.nout, j.nout);
    }
    return;
  }
  for (int64_t r = 0; r < it.rows; ++r) {
    const float* yr = y + r * j.nout;
    float* o = j.out + (it.row0 + r) * half;
    int64_t c = 0;
    for (; c + 16 <= half; c += 16) {
      const v16 g = load(yr + c);
      store(o + c, g / (1.0f + exp16(-g)) * load(yr + half + c));
    }
    for (; c < half; ++c) {
      const float g = yr[c];
      o[c] = g / (1.0f + std::exp(-g)) * yr[half + c];
    }
  }
}

// Items (expert, row chunk) for the groups, rows past them zeroed; then every item, on the pool.
ffi::Error Launch(ffi::ThreadPool pool, std::shared_ptr<Job> job, int64_t n, int64_t experts, const int32_t* gs) {
  const int64_t width = job->swiglu ? job->nout / 2 : job->nout;
  const int64_t elem = job->out16 != nullptr ? 2 : 4;  // bytes per result value
  char* out = job->out16 != nullptr ? reinterpret_cast<char*>(job->out16) : reinterpret_cast<char*>(job->out);
  if (job->k == 0) {  // an empty product: y = 0, and silu(0)·0 = 0
    std::memset(out, 0, elem * n * width);
    return ffi::Error::Success();
  }
  const int64_t row = qcompile_native::group_chunks(gs, experts, n, job->w16 != nullptr || (job->w8 != nullptr && job->panels)
                                                        ? kRowChunkWidened : kRowChunk,
                                                    job->items);
  if (row < n) std::memset(out + elem * row * width, 0, elem * (n - row) * width);
  qcompile_native::parallel_items(pool, static_cast<int64_t>(job->items.size()),
                                  [job](int64_t i) { run_item(*job, job->items[i]); });
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> w,
               ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out, bool swiglu) {
  const auto rd = rows.dimensions();
  const auto wd = w.dimensions();
  const auto gd = group_sizes.dimensions();
  if (rd.size() != 2 || wd.size() != 3 || gd.size() != 1 || wd[1] != rd[1] || gd[0] != wd[0] ||
      (swiglu && wd[2] % 2))
    return ffi::Error::InvalidArgument(swiglu ? "qcompile grouped matmul swiglu: expected rows[N,K], w[E,K,2I], "
                                                "group_sizes[E]"
                                              : "qcompile grouped matmul: expected rows[N,K], w[E,K,Nout], "
                                                "group_sizes[E]");
  auto job = std::make_shared<Job>();  // shared with the items, which may run after this frame returns
  job->x = rows.typed_data();
  job->w = w.typed_data();
  job->out = out->typed_data();
  job->k = rd[1];
  job->nout = wd[2];
  job->swiglu = swiglu;
  return Launch(pool, job, rd[0], wd[0], group_sizes.typed_data());
}

// w in panels [E, P, K, 64] (Nout = 64 P), f32 or bf16, against f32 rows x or bf16 rows x16 (the pairs kernel).
ffi::Error LaunchPanels(ffi::ThreadPool pool, const float* x, const uint16_t* x16, const void* w, bool w_bf16,
                        ffi::Span<const int64_t> rd, ffi::Span<const int64_t> wd, ffi::Buffer<ffi::S32> group_sizes,
                        float* out, bool swiglu, uint16_t* out16 = nullptr, bool paired = false) {
  const auto gd = group_sizes.dimensions();
  if (rd.size() != 2 || wd.size() != 4 || gd.size() != 1 || wd[2] != rd[1] || wd[3] != kNr || gd[0] != wd[0] ||
      (swiglu && wd[1] % 2) || (x16 != nullptr && rd[1] % 2))
    return ffi::Error::InvalidArgument("qcompile grouped matmul panels: expected rows[N,K], w[E,P,K,64] (an even P "
                                       "for swiglu, an even K for bf16 rows), group_sizes[E]");
  auto job = std::make_shared<Job>();  // shared with the items, which may run after this frame returns
  job->x = x;
  job->x16 = x16;
  job->w = w_bf16 ? nullptr : static_cast<const float*>(w);
  job->w16 = w_bf16 ? static_cast<const uint16_t*>(w) : nullptr;
  job->out = out;
  job->out16 = out16;
  job->k = rd[1];
  job->nout = wd[1] * kNr;
  job->swiglu = swiglu;
  job->panels = true;
  job->paired = paired;
  return Launch(pool, job, rd[0], wd[0], group_sizes.typed_data());
}

ffi::Error RunFp8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                  ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out, int64_t bk, int64_t bn,
                  bool swiglu) {
  const auto rd = rows.dimensions();
  const auto wd = w.dimensions();
  const auto sd = scale.dimensions();
  const auto gd = group_sizes.dimensions();
  if (w.element_type() != ffi::DataType::F8E4M3FN || rd.size() != 2 || wd.size() != 3 || gd.size() != 1 ||
      sd.size() != 3 || wd[1] != rd[1] || gd[0] != wd[0] ||
      (swiglu && wd[2] % 2) || bk < 1 || bn < 1 || sd[0] != wd[0] || sd[1] != (wd[1] + bk - 1) / bk ||
      sd[2] != (wd[2] + bn - 1) / bn)
    return ffi::Error::InvalidArgument("qcompile grouped matmul fp8: expected rows[N,K], w[E,K,Nout] e4m3fn bytes, "
                                       "scale[E,ceil(K/block_k),ceil(Nout/block_n)], group_sizes[E]");
  auto job = std::make_shared<Job>();
  job->x = rows.typed_data();
  job->w = nullptr;
  job->w8 = static_cast<const uint8_t*>(w.untyped_data());
  job->scale = scale.typed_data();
  job->bk = bk;
  job->bn = bn;
  job->kblocks = sd[1];
  job->nblocks = sd[2];
  job->out = out->typed_data();
  job->k = rd[1];
  job->nout = wd[2];
  job->swiglu = swiglu;
  return Launch(pool, job, rd[0], wd[0], group_sizes.typed_data());
}

// rows[N,K] f32, w[E,P,K,64] e4m3fn panels, scale[E, ceil(P/bp), ceil(K/bk)] f32 -> out f32 (SwiGLU in the epilogue
// when asked, as the f32 panel kernel).
ffi::Error RunPanelsFp8(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out, int64_t bp, int64_t bk,
                        int64_t bf16_weights, bool swiglu) {
  const bool pairs = rows.element_type() == ffi::DataType::BF16;  // bf16 rows: the VDPBF16PS pair tiles
  const bool out16 = out->element_type() == ffi::DataType::BF16;  // a bf16 graph's result, SwiGLU as it rounds
  if ((!pairs && rows.element_type() != ffi::DataType::F32) || (pairs && rows.dimensions().back() % 2) ||
      (out16 ? bf16_weights == 0 : (out->element_type() != ffi::DataType::F32 || (pairs && swiglu))))
    return ffi::Error::InvalidArgument("qcompile grouped matmul panels fp8: rows f32, or bf16 with an even K; out "
                                       "f32 (no SwiGLU for bf16 rows), or bf16 with bf16_weights");
#ifndef __AVX512BF16__
  if (pairs)
    return ffi::Error::InvalidArgument("qcompile grouped matmul panels fp8 pairs: built for a CPU without "
                                       "AVX512_BF16");
#endif
  const auto rd = rows.dimensions();
  const auto wd = w.dimensions();
  const auto sd = scale.dimensions();
  const auto gd = group_sizes.dimensions();
  if (w.element_type() != ffi::DataType::F8E4M3FN || rd.size() != 2 || wd.size() != 4 || gd.size() != 1 ||
      sd.size() != 3 || wd[2] != rd[1] || wd[3] != kNr || gd[0] != wd[0] || (swiglu && wd[1] % 2) || bp < 1 ||
      bk < 1 || sd[0] != wd[0] || sd[1] != (wd[1] + bp - 1) / bp || sd[2] != (wd[2] + bk - 1) / bk)
    return ffi::Error::InvalidArgument("qcompile grouped matmul panels fp8: expected rows[N,K], w[E,P,K,64] e4m3fn "
                                       "panels (an even P for swiglu), scale[E,ceil(P/block_p),ceil(K/block_k)], "
                                       "group_sizes[E]");
  auto job = std::make_shared<Job>();  // shared with the items, which may run after this frame returns
  job->x = pairs ? nullptr : static_cast<const float*>(rows.untyped_data());
  job->x16 = pairs ? static_cast<const uint16_t*>(rows.untyped_data()) : nullptr;
  job->w = nullptr;
  job->w8 = static_cast<const uint8_t*>(w.untyped_data());
  job->scale = scale.typed_data();
  job->bn = bp;
  job->bk = bk;
  job->nblocks = sd[1];
  job->kblocks = sd[2];
  job->bf16_weights = bf16_weights != 0;
  job->out = out16 ? nullptr : static_cast<float*>(out->untyped_data());
  job->out16 = out16 ? static_cast<uint16_t*>(out->untyped_data()) : nullptr;
  job->k = rd[1];
  job->nout = wd[1] * kNr;
  job->swiglu = swiglu;
  job->panels = true;
  return Launch(pool, job, rd[0], wd[0], group_sizes.typed_data());
}

ffi::Error GroupedMatmulPanelsFp8(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                                  ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Result<ffi::AnyBuffer> out, int64_t bp, int64_t bk, int64_t bf16_weights) {
  return RunPanelsFp8(pool, rows, w, scale, group_sizes, out, bp, bk, bf16_weights, false);
}

ffi::Error GroupedMatmulSwigluPanelsFp8(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                                        ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> group_sizes,
                                        ffi::Result<ffi::AnyBuffer> out, int64_t bp, int64_t bk,
                                        int64_t bf16_weights) {
  return RunPanelsFp8(pool, rows, w, scale, group_sizes, out, bp, bk, bf16_weights, true);
}

ffi::Error GroupedMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto rd = rows.dimensions();
  const auto wd = w.dimensions();
  const auto gd = group_sizes.dimensions();
  if (w.element_type() != ffi::DataType::BF16 || rd.size() != 2 || wd.size() != 3 || gd.size() != 1 ||
      wd[1] != rd[1] || gd[0] != wd[0])
    return ffi::Error::InvalidArgument("qcompile grouped matmul bf16: expected rows[N,K] f32, w[E,K,Nout] bf16, "
                                       "group_sizes[E]");
  auto job = std::make_shared<Job>();
  job->x = rows.typed_data();
  job->w = nullptr;
  job->w16 = static_cast<const uint16_t*>(w.untyped_data());
  job->out = out->typed_data();
  job->k = rd[1];
  job->nout = wd[2];
  job->swiglu = false;  // bf16 SwiGLU rounds the product first, as the reference does (kernels/grouped_matmul.py)
  return Launch(pool, job, rd[0], wd[0], group_sizes.typed_data());
}

// rows[N,K] f32, w[E,P,K,64] bf16 panels -> out f32 (SwiGLU, if any, after rounding: as GroupedMatmulBf16).
ffi::Error GroupedMatmulPanelsBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::AnyBuffer w,
                                   ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  if (w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("qcompile grouped matmul panels bf16: expected bf16 panels");
  return LaunchPanels(pool, rows.typed_data(), nullptr, w.untyped_data(), true, rows.dimensions(), w.dimensions(),
                      group_sizes, out->typed_data(), false);
}

// rows[N,K] bf16, w[E,P,K,64] bf16 panels, K even -> out on VDPBF16PS: f32, or bf16 (each value rounded once; with
// swiglu, SwiGLU's halves as a bf16 graph computes them); an error on a CPU without AVX512_BF16 (the rule asks
// native.avx512_bf16() first).
ffi::Error RunPanelsBf16Pairs(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out, bool swiglu,
                              bool paired = false) {
#ifdef __AVX512BF16__
  const bool out16 = out->element_type() == ffi::DataType::BF16;
  if (rows.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 ||
      (out16 ? false : out->element_type() != ffi::DataType::F32 || swiglu))
    return ffi::Error::InvalidArgument("qcompile grouped matmul panels bf16 pairs: expected bf16 rows and panels, "
                                       "out f32 or bf16 (bf16 for swiglu)");
  return LaunchPanels(pool, nullptr, static_cast<const uint16_t*>(rows.untyped_data()), w.untyped_data(), true,
                      rows.dimensions(), w.dimensions(), group_sizes,
                      out16 ? nullptr : static_cast<float*>(out->untyped_data()), swiglu,
                      out16 ? static_cast<uint16_t*>(out->untyped_data()) : nullptr, paired);
#else
  return ffi::Error::InvalidArgument("qcompile grouped matmul panels bf16 pairs: built for a CPU without AVX512_BF16");
#endif
}

ffi::Error GroupedMatmulPanelsBf16Pairs(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                                        ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  return RunPanelsBf16Pairs(pool, rows, w, group_sizes, out, false);
}

ffi::Error GroupedMatmulSwigluPanelsBf16Pairs(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                                              ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  return RunPanelsBf16Pairs(pool, rows, w, group_sizes, out, true);
}

// The same two with the panels in pair order (the layout AMX tiles read, made on CPUs with AMX).
ffi::Error GroupedMatmulPairPanelsBf16(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                                       ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  return RunPanelsBf16Pairs(pool, rows, w, group_sizes, out, false, true);
}

ffi::Error GroupedMatmulSwigluPairPanelsBf16(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                                             ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  return RunPanelsBf16Pairs(pool, rows, w, group_sizes, out, true, true);
}

ffi::Error GroupedMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> w,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, rows, w, group_sizes, out, false);
}

ffi::Error GroupedMatmulSwigluF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> w,
                                  ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, rows, w, group_sizes, out, true);
}

ffi::Error GroupedMatmulPanelsF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> w,
                                  ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  return LaunchPanels(pool, rows.typed_data(), nullptr, w.typed_data(), false, rows.dimensions(), w.dimensions(),
                      group_sizes, out->typed_data(), false);
}

ffi::Error GroupedMatmulSwigluPanelsF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> w,
                                        ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  return LaunchPanels(pool, rows.typed_data(), nullptr, w.typed_data(), false, rows.dimensions(), w.dimensions(),
                      group_sizes, out->typed_data(), true);
}

ffi::Error GroupedMatmulFp8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> group_sizes,
                            ffi::ResultBuffer<ffi::F32> out, int64_t bk, int64_t bn) {
  return RunFp8(pool, rows, w, scale, group_sizes, out, bk, bn, false);
}

ffi::Error GroupedMatmulSwigluFp8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::AnyBuffer w,
                                  ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::ResultBuffer<ffi::F32> out, int64_t bk, int64_t bn) {
  return RunFp8(pool, rows, w, scale, group_sizes, out, bk, bn, true);
}

}  // namespace

// rows[N,K], w[E,K,Nout], group_sizes[E] -> out; both entry points take the same operands.
#define QCOMPILE_GROUPED_MATMUL_BINDING                \
  ffi::Ffi::Bind()                                    \
      .Ctx<ffi::ThreadPool>()                         \
      .Arg<ffi::Buffer<ffi::F32>>()                   \
      .Arg<ffi::Buffer<ffi::F32>>()                   \
      .Arg<ffi::Buffer<ffi::S32>>()                   \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulF32, GroupedMatmulF32, QCOMPILE_GROUPED_MATMUL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulSwigluF32, GroupedMatmulSwigluF32, QCOMPILE_GROUPED_MATMUL_BINDING);
// rows[N,K], w[E,P,K,64] (panels), group_sizes[E] -> out: the same binding, w of rank 4.
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulPanelsF32, GroupedMatmulPanelsF32, QCOMPILE_GROUPED_MATMUL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulSwigluPanelsF32, GroupedMatmulSwigluPanelsF32,
                              QCOMPILE_GROUPED_MATMUL_BINDING);

// rows[N,K] f32, w[E,K,Nout] bf16, group_sizes[E] -> out f32.
#define QCOMPILE_GROUPED_MATMUL_BF16_BINDING           \
  ffi::Ffi::Bind()                                    \
      .Ctx<ffi::ThreadPool>()                         \
      .Arg<ffi::Buffer<ffi::F32>>()                   \
      .Arg<ffi::AnyBuffer>()                          \
      .Arg<ffi::Buffer<ffi::S32>>()                   \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulBf16, GroupedMatmulBf16, QCOMPILE_GROUPED_MATMUL_BF16_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulPanelsBf16, GroupedMatmulPanelsBf16,
                              QCOMPILE_GROUPED_MATMUL_BF16_BINDING);
// rows[N,K] bf16, w[E,P,K,64] bf16, group_sizes[E] -> out f32 or bf16 (the swiglu entry point: bf16, [N, 32P]).
#define QCOMPILE_GROUPED_MATMUL_PAIRS_BINDING \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<ffi::AnyBuffer>()                 \
      .Arg<ffi::AnyBuffer>()                 \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Ret<ffi::AnyBuffer>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulPanelsBf16Pairs, GroupedMatmulPanelsBf16Pairs,
                              QCOMPILE_GROUPED_MATMUL_PAIRS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulSwigluPanelsBf16Pairs, GroupedMatmulSwigluPanelsBf16Pairs,
                              QCOMPILE_GROUPED_MATMUL_PAIRS_BINDING);
// ... with w's panels in pair order
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulPairPanelsBf16, GroupedMatmulPairPanelsBf16,
                              QCOMPILE_GROUPED_MATMUL_PAIRS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulSwigluPairPanelsBf16, GroupedMatmulSwigluPairPanelsBf16,
                              QCOMPILE_GROUPED_MATMUL_PAIRS_BINDING);

// rows[N,K] f32, w[E,K,Nout] e4m3fn (taken as bytes), scale[E,KB,NB] f32, group_sizes[E]; attrs block_k, block_n -> out.
#define QCOMPILE_GROUPED_MATMUL_FP8_BINDING            \
  ffi::Ffi::Bind()                                    \
      .Ctx<ffi::ThreadPool>()                         \
      .Arg<ffi::Buffer<ffi::F32>>()                   \
      .Arg<ffi::AnyBuffer>()                    \
      .Arg<ffi::Buffer<ffi::F32>>()                   \
      .Arg<ffi::Buffer<ffi::S32>>()                   \
      .Ret<ffi::Buffer<ffi::F32>>()                   \
      .Attr<int64_t>("block_k")                       \
      .Attr<int64_t>("block_n")

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulFp8, GroupedMatmulFp8, QCOMPILE_GROUPED_MATMUL_FP8_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulSwigluFp8, GroupedMatmulSwigluFp8,
                              QCOMPILE_GROUPED_MATMUL_FP8_BINDING);
// rows[N,K] f32 (or bf16: pair tiles), w[E,P,K,64] e4m3fn panels, scale[E,PB,KB] f32, group_sizes[E]; attrs block_p,
// block_k, bf16_weights (nonzero: each weight rounded to bf16 once dequantized) -> out f32 (no SwiGLU for bf16 rows),
// or bf16 with bf16_weights (SwiGLU as a bf16 graph rounds it).
#define QCOMPILE_GROUPED_MATMUL_PANELS_FP8_BINDING     \
  ffi::Ffi::Bind()                                    \
      .Ctx<ffi::ThreadPool>()                         \
      .Arg<ffi::AnyBuffer>()                          \
      .Arg<ffi::AnyBuffer>()                          \
      .Arg<ffi::Buffer<ffi::F32>>()                   \
      .Arg<ffi::Buffer<ffi::S32>>()                   \
      .Ret<ffi::AnyBuffer>()                          \
      .Attr<int64_t>("block_p")                       \
      .Attr<int64_t>("block_k")                       \
      .Attr<int64_t>("bf16_weights")

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulPanelsFp8, GroupedMatmulPanelsFp8,
                              QCOMPILE_GROUPED_MATMUL_PANELS_FP8_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulSwigluPanelsFp8, GroupedMatmulSwigluPanelsFp8,
                              QCOMPILE_GROUPED_MATMUL_PANELS_FP8_BINDING);
