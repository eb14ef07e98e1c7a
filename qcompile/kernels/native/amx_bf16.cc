// qcompile's native CPU bf16 products on AMX tiles (Intel Advanced Matrix Extensions), XLA FFI custom calls. Built
// and registered by qcompile/kernels/native.py on CPUs whose flags include amx_bf16; the CPU rules of linear_panels
// (kernels/linear.py) and of the grouped matmuls (kernels/grouped_matmul.py) call them for bf16 activations and
// weights at prefill-sized row counts.
//
// Linear: out[T, P*64] f32 = x[T, K] bf16 · w, with w[P, K, 64] bf16 the [N, K] weight in column panels (the layout
// of linear_panels_f32.cc). Grouped matmul: out[N, Nout] f32 = rows[N, K] bf16 · w[e(r)] with w[E, K, Nout] bf16,
// or w[E, Nout/64, K, 64] in expert panels (the cpu target's layout, ir/target_layout.py), rows sorted by expert in groups of group_sizes[E] (grouped_matmul_f32.cc's contract: rows past the groups come back
// 0). (No SwiGLU epilogue: on bf16 the rule rounds the product and takes the halves as the reference does —
// kernels/grouped_matmul.py says why.)
// TDPBF16PS multiplies bf16 pairs exactly and accumulates in f32 (the reassociating class of a dot; like every AMX
// bf16 product, denormal inputs count as zero).
//
// Why: a bf16 checkpoint's prefill is compute-bound, and the f32 FMA kernels (bf16 widened first) run at ~120
// GFLOP/s per core; one AMX tile multiply does 16x16x32 multiply-adds, measured 350-510 GFLOP/s per core here on
// the bench preset's shapes. transformers' bf16 prefill on this CPU goes through oneDNN's AMX kernels.
//   * a work item is a run of consecutive panels against a chunk of up to kRowChunk rows (parallel_items.h); it
//     takes one panel at a time, repacking it into the pair-interleaved ("VNNI") layout TDPBF16PS reads —
//     [K/2, 64, 2]: the two weights of k = 2i and 2i+1 side by side — in a per-thread buffer *while its first row
//     block multiplies it*, 32 k at a time (the panel streams in from memory as the tiles work, the repacked piece
//     is read from L1; repacking whole panels first and multiplying after ran the two one after the other: 16-32
//     rows at 12 GB/s, now 14-17 GB/s, docs/cpu_rules.md "AMX thresholds"), with software prefetch ahead (a grouped
//     matmul's strips are 128-byte runs one weight row apart, which the hardware prefetchers do not follow);
//   * row blocks: 32 rows (two halves of 32 columns, four f32 accumulator tiles 32 x 32 over the whole K, fed per
//     32 k by two row tiles of x, read where they lie, and two weight tiles) or 16 rows (four accumulator tiles
//     16 x 64, one x tile); the first block is 32 rows when there are 32, then 32s, one 16, and the last rows
//     (fewer than 16) through a zero-padded copy made once per item and a scratch output — so from 6 rows on
//     (the rules' threshold) a product reads its weights once, at little more than the cost of reading them;
//   * K must be a multiple of 32 (every projection of these models; the rule checks it).
//   * grouped matmul: items are (expert, chunk of up to kRowChunk rows); an item takes its expert's [K, Nout] a
//     64-column strip at a time (Nout a multiple of 64) and runs the same blocks.

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
constexpr int64_t kPrefetchPairs = 16;  // repack: rows prefetched this many pairs (2x rows) ahead
constexpr int64_t kStreamAhead = 4;     // panels in pair order: 32-k steps (4 KB each) prefetched this far ahead

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

// Pairs [i0, i1) of panel[K, 64] (rows ld apart) -> vnni[K/2, 64, 2]: the weights of k = 2i and 2i + 1 for column
// n at [i, n, 0..1].
void repack(const uint16_t* panel, int64_t k, int64_t i0, int64_t i1, uint16_t* vnni, int64_t ld) {
  static const __m512i first = [] {  // interleaves columns 0-15 (second: 16-31) of two rows of 32
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 16; ++i) idx[2 * i] = i, idx[2 * i + 1] = 32 + i;
    return _mm512_load_si512(idx);
  }();
  static const __m512i second = [] {
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 16; ++i) idx[2 * i] = 16 + i, idx[2 * i + 1] = 48 + i;
    return _mm512_load_si512(idx);
  }();
  for (int64_t i = i0; i < i1; ++i) {
    const uint16_t* even = panel + 2 * i * ld;
    if (2 * (i + kPrefetchPairs) < k) {  // the rows kPrefetchPairs pairs ahead (strips: one 128-byte run per row)
      const char* ahead = reinterpret_cast<const char*>(even + 2 * kPrefetchPairs * ld);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + ld * 2, _MM_HINT_T0);
      _mm_prefetch(ahead + ld * 2 + 64, _MM_HINT_T0);
    }
    const uint16_t* odd = even + ld;
    uint16_t* out = vnni + i * 2 * kPanel;
    for (int half = 0; half < 2; ++half) {
      const __m512i a = _mm512_loadu_si512(even + 32 * half), b = _mm512_loadu_si512(odd + 32 * half);
      _mm512_storeu_si512(out + 64 * half, _mm512_permutex2var_epi16(a, first, b));
      _mm512_storeu_si512(out + 64 * half + 32, _mm512_permutex2var_epi16(a, second, b));
    }
  }
}

// out[16 rows, 64 cols] = x[16, K] · the panel in vnni; x rows ldx apart, out rows ldo apart. Given `raw` (the panel
// as stored, rows ld apart), each 32-k step is repacked into vnni just before its tiles read it (a panel's first
// row block).
void block16(const uint16_t* x, int64_t ldx, uint16_t* vnni, int64_t k, float* out, int64_t ldo,
             const uint16_t* raw = nullptr, int64_t ld = kPanel, bool stream = false) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kk = 0; kk < k; kk += 32) {
    if (raw != nullptr) repack(raw, k, kk / 2, kk / 2 + 16, vnni, ld);
    const uint16_t* w = vnni + kk / 2 * kPanel * 2;
    if (stream && kk + kStreamAhead * 32 < k) {  // the panel in place, from memory: its 4 KB k step kStreamAhead on
      const char* ahead = reinterpret_cast<const char*>(w + kStreamAhead * 32 * kPanel);
      for (int line = 0; line < 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(4, x + kk, ldx * 2);
    _tile_loadd(5, w, kPanel * 4);
    _tile_loadd(6, w + 32, kPanel * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, w + 64, kPanel * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, w + 96, kPanel * 4);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, ldo * 4);
  _tile_stored(1, out + 16, ldo * 4);
  _tile_stored(2, out + 32, ldo * 4);
  _tile_stored(3, out + 48, ldo * 4);
}

// out[32 rows, 64 cols] = x[32, K] · the panel in vnni; x rows ldx apart, out rows ldo apart; given `raw`, the
// first half's k steps repack the panel as they go (as block16).
void block(const uint16_t* x, int64_t ldx, uint16_t* vnni, int64_t k, float* out, int64_t ldo,
           const uint16_t* raw = nullptr, int64_t ld = kPanel) {
  for (int64_t c = 0; c < kPanel; c += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < k; kk += 32) {
      if (raw != nullptr && c == 0) repack(raw, k, kk / 2, kk / 2 + 16, vnni, ld);
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
  bool pairs;  // the panels already in pair order ([K/2, 64, 2] each): the tiles read them where they lie
  qcompile_native::PanelItems split;
};

// The rows [r0, r1) of x (k wide) times one panel or strip (`raw`, rows ld apart) into y (ldy floats per row): the
// first block (32 rows, or 16 when there are fewer) repacks the panel into vnni as it goes; the rest read vnni in
// blocks of 32, then one of 16; the last rows (fewer than 16) go through `tail`, their zero-padded copy made once per
// item, and a scratch block. Without `raw`, `vnni` is the panel itself, already in pair order: blocks of 16 rows.
struct Rows {
  const uint16_t* x;
  int64_t k, r0, tail_start, r1;
  const uint16_t* tail;
};

void rows_times_panel(const Rows& rows, const uint16_t* raw, int64_t ld, uint16_t* vnni, float* y, int64_t ldy) {
  thread_local std::vector<float> scratch;
  const int64_t k = rows.k;
  const auto through_scratch = [&](const uint16_t* from, int64_t row, bool stream = false) {  // the tail's rows,
    scratch.resize(16 * kPanel);                                                                // from row `row` of y
    block16(rows.tail, k, vnni, k, scratch.data(), kPanel, from, ld, stream);
    for (int64_t m = 0; m < rows.r1 - rows.tail_start; ++m)
      std::memcpy(y + (row + m) * ldy, scratch.data() + m * kPanel, sizeof(float) * kPanel);
  };
  if (rows.r1 - rows.r0 < 16) return through_scratch(raw, 0, raw == nullptr);
  int64_t r = rows.r0;
  if (raw == nullptr) {  // the panel in pair order where it lies: blocks of 16 rows, each over all 64 columns, so the
    // first streams every line of the panel in from memory and the rest find it in L2 (a 32-row block reads half of
    // each line per pass: its second pass would wait on memory again)
    for (; r + 16 <= rows.tail_start; r += 16)
      block16(rows.x + r * k, k, vnni, k, y + (r - rows.r0) * ldy, ldy, nullptr, kPanel, r == rows.r0);
    if (rows.tail_start < rows.r1) through_scratch(nullptr, rows.tail_start - rows.r0, rows.tail_start == rows.r0);
    return;
  }
  if (rows.r1 - rows.r0 >= 32) {
    block(rows.x + r * k, k, vnni, k, y, ldy, raw, ld);
    r += 32;
  } else {
    block16(rows.x + r * k, k, vnni, k, y, ldy, raw, ld);
    r += 16;
  }
  for (; r + 32 <= rows.tail_start; r += 32) block(rows.x + r * k, k, vnni, k, y + (r - rows.r0) * ldy, ldy);
  if (r < rows.tail_start) block16(rows.x + r * k, k, vnni, k, y + (r - rows.r0) * ldy, ldy);
  if (rows.tail_start < rows.r1) through_scratch(nullptr, rows.tail_start - rows.r0);
}

// `Rows` over x[r0:r1]: where the blocks of rows_times_panel end, and the zero-padded copy of the rows after them.
Rows rows_of(const uint16_t* x, int64_t k, int64_t r0, int64_t r1, std::vector<uint16_t>& padded) {
  int64_t tail_start = r0;
  if (r1 - r0 >= 16) {
    const int64_t first = r1 - r0 >= 32 ? 32 : 16, rest = r1 - r0 - first;
    tail_start = r0 + first + rest / 32 * 32 + (rest % 32 >= 16 ? 16 : 0);
  }
  if (tail_start < r1) {
    padded.assign(static_cast<size_t>(16 * k), 0);
    std::memcpy(padded.data(), x + tail_start * k, sizeof(uint16_t) * (r1 - tail_start) * k);
  }
  return Rows{x, k, r0, tail_start, r1, padded.data()};
}

void run_item(const Job& j, int64_t i) {
  int64_t p0, p1, r0, r1;
  j.split.bounds(i, p0, p1, r0, r1);
  const int64_t n = j.panels * kPanel, panel_size = j.k * kPanel;
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  thread_local std::vector<uint16_t> vnni, padded;
  vnni.resize(static_cast<size_t>(panel_size));
  const Rows rows = rows_of(j.x, j.k, r0, r1, padded);
  for (int64_t p = p0; p < p1; ++p) {
    if (j.pairs)  // nothing to repack: the tiles read the panel as stored
      rows_times_panel(rows, nullptr, kPanel, const_cast<uint16_t*>(j.w + p * panel_size), j.out + r0 * n + p * kPanel,
                       n);
    else
      rows_times_panel(rows, j.w + p * panel_size, kPanel, vnni.data(), j.out + r0 * n + p * kPanel, n);
  }
  _tile_release();
}

// The linear over w[P, K, 64] panels as stored (`pairs`: each panel in pair order, [K/2, 64, 2]), shapes checked.
ffi::Error linear_amx(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> out,
                      bool pairs) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 || xd.size() != 2 ||
      wd.size() != 3 || wd[1] != xd[1] || wd[2] != kPanel || xd[1] % 32 != 0)
    return ffi::Error::InvalidArgument("qcompile linear_panels amx: expected x[T,K] bf16, w[P,K,64] bf16, K % 32 == 0");
  if (!tiles_permitted())
    return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile linear_panels amx: the OS refused the AMX tile state");
  Job job{static_cast<const uint16_t*>(x.untyped_data()), static_cast<const uint16_t*>(w.untyped_data()),
          out->typed_data(), xd[0], xd[1], wd[0], pairs,
          qcompile_native::PanelItems(xd[0], wd[0], kRowChunk, pool.num_threads(), kItemsPerThread)};
  if (job.t == 0 || job.panels == 0) return ffi::Error::Success();
  if (job.k == 0) {
    std::memset(job.out, 0, sizeof(float) * job.t * job.panels * kPanel);
    return ffi::Error::Success();
  }
  qcompile_native::parallel_items(pool, job.split.count, [job](int64_t i) { run_item(job, i); });
  return ffi::Error::Success();
}

ffi::Error LinearPanelsAmx(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> out) {
  return linear_amx(pool, x, w, out, false);
}

ffi::Error LinearPairPanelsAmx(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::ResultBuffer<ffi::F32> out) {
  return linear_amx(pool, x, w, out, true);
}

using GroupItem = qcompile_native::GroupChunk;

struct GroupJob {
  const uint16_t* x;
  const uint16_t* w;
  float* out;
  int64_t k, nout;
  bool panels;  // w[E, Nout/64, K, 64] (each strip one contiguous panel), else w[E, K, Nout]
  bool pairs;   // panels already in pair order ([K/2, 64, 2] each): the tiles read them where they lie
  std::vector<GroupItem> items;
};

// rows[item] · w[e] into y ([rows, nout], ldy floats per row), one 64-column strip at a time (as run_item's panels):
// a panel of the panel layout, or 128-byte runs one weight row apart in [E, K, Nout].
void group_product(const GroupJob& j, const GroupItem& it, float* y, int64_t ldy) {
  thread_local std::vector<uint16_t> vnni, padded;
  const int64_t strip = j.k * kPanel, strips = j.nout / kPanel;
  vnni.resize(static_cast<size_t>(strip));
  const uint16_t* we = j.w + it.expert * j.k * j.nout;
  const Rows rows = rows_of(j.x, j.k, it.row0, it.row0 + it.rows, padded);
  for (int64_t s = 0; s < strips; ++s) {
    if (j.pairs)
      rows_times_panel(rows, nullptr, kPanel, const_cast<uint16_t*>(we + s * strip), y + s * kPanel, ldy);
    else if (j.panels)
      rows_times_panel(rows, we + s * strip, kPanel, vnni.data(), y + s * kPanel, ldy);
    else
      rows_times_panel(rows, we + s * kPanel, j.nout, vnni.data(), y + s * kPanel, ldy);
  }
}

void run_group_item(const GroupJob& j, const GroupItem& it) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  group_product(j, it, j.out + it.row0 * j.nout, j.nout);
  _tile_release();
}

// The grouped product over w in either layout (`panels`: w[E, P, K, 64], else w[E, K, Nout]), shapes checked.
ffi::Error grouped_amx(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> group_sizes,
                       ffi::ResultBuffer<ffi::F32> out, bool panels, bool pairs = false) {
  const auto rd = rows.dimensions();
  const auto wd = w.dimensions();
  const auto gd = group_sizes.dimensions();
  const bool shaped = panels ? wd.size() == 4 && wd[2] == rd[1] && wd[3] == kPanel
                             : wd.size() == 3 && wd[1] == rd[1] && wd[2] % kPanel == 0;
  if (rows.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 || rd.size() != 2 ||
      !shaped || gd.size() != 1 || gd[0] != wd[0] || rd[1] % 32 != 0)
    return ffi::Error::InvalidArgument(panels ? "qcompile grouped matmul panels amx: expected rows[N,K] bf16, "
                                                "w[E,P,K,64] bf16, group_sizes[E], K % 32 == 0"
                                              : "qcompile grouped matmul amx: expected rows[N,K] bf16, w[E,K,Nout] "
                                                "bf16, group_sizes[E], K % 32 == 0, Nout % 64 == 0");
  if (!tiles_permitted())
    return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile grouped matmul amx: the OS refused the AMX tile state");
  auto job = std::make_shared<GroupJob>();
  job->x = static_cast<const uint16_t*>(rows.untyped_data());
  job->w = static_cast<const uint16_t*>(w.untyped_data());
  job->out = out->typed_data();
  job->k = rd[1];
  job->nout = panels ? wd[1] * kPanel : wd[2];
  job->panels = panels;
  job->pairs = pairs;
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

ffi::Error GroupedMatmulAmx(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  return grouped_amx(pool, rows, w, group_sizes, out, false);
}

ffi::Error GroupedMatmulPanelsAmx(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                                  ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  return grouped_amx(pool, rows, w, group_sizes, out, true);
}

ffi::Error GroupedMatmulPairPanelsAmx(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer w,
                                      ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  return grouped_amx(pool, rows, w, group_sizes, out, true, true);
}

#else  // built for a CPU without AMX: the rules never call these (kernels/native.py checks the CPU's flags)

ffi::Error LinearPanelsAmx(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile linear_panels amx: built for a CPU without AMX");
}

ffi::Error GroupedMatmulAmx(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::S32>,
                            ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile grouped matmul amx: built for a CPU without AMX");
}

ffi::Error GroupedMatmulPanelsAmx(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::S32>,
                                  ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile grouped matmul panels amx: built for a CPU without AMX");
}

ffi::Error GroupedMatmulPairPanelsAmx(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::S32>,
                                      ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile grouped matmul pair panels amx: built for a CPU without AMX");
}

ffi::Error LinearPairPanelsAmx(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnavailable, "qcompile linear pair panels amx: built for a CPU without AMX");
}

#endif

}  // namespace

// The grouped entry points: rows[N,K] bf16, w (below) bf16, group_sizes[E] -> out[N,Nout] f32.
#define QCOMPILE_AMX_GROUPED_BINDING \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>() \
      .Ret<ffi::Buffer<ffi::F32>>()
// The linear entry points: x[T,K] bf16, w[P,K,64] bf16 (column panels) -> out[T,64P] f32.
#define QCOMPILE_AMX_LINEAR_BINDING \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>()

// w[E,K,Nout]
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulAmx, GroupedMatmulAmx, QCOMPILE_AMX_GROUPED_BINDING);
// w[E,Nout/64,K,64] (expert panels)
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulPanelsAmx, GroupedMatmulPanelsAmx, QCOMPILE_AMX_GROUPED_BINDING);
// w[E,Nout/64,K,64], each panel in pair order
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGroupedMatmulPairPanelsAmx, GroupedMatmulPairPanelsAmx,
                              QCOMPILE_AMX_GROUPED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearPanelsAmx, LinearPanelsAmx, QCOMPILE_AMX_LINEAR_BINDING);
// each panel in pair order
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileLinearPairPanelsAmx, LinearPairPanelsAmx, QCOMPILE_AMX_LINEAR_BINDING);
