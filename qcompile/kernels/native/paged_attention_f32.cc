// qcompile's native CPU paged attention (flash decoding over the live pages), an XLA FFI custom call. Built and
// registered by qcompile/kernels/native.py; paged_attention_cpu (kernels/paged_attention.py) calls it for the
// one-token rows of a step (decode batches and the decode rows of mixed ones, a GQA group of rows an item) and for
// the query tiles of its multi-token sequences (a tile's tokens times the group: the register-tiled path).
//
// Contract (_flash_blocks' in kernels/paged_attention.py): q f32[W, Hkv, R, hd] (already scaled; the R query rows
// of an item and KV head: a GQA group), k_pages and v_pages [P, ps, Hkv, hd] f32 or bf16, item_pages i32[W, M] (the
// page table row of each item), row_pos i32[W, R] -> out f32[W, Hkv, R, hd]: row r of item w attends to the keys at
// positions 0..row_pos[w, r] (and < M·ps) of its pages, key position j in page item_pages[w, j / ps] (jnp's gather
// rule: a negative page counts from the end, then clamped into [0, P)) at row j mod ps. Softmax in f32, online over
// blocks of kBlock keys (a block's maximum, one rescale per block), as the jnp rule's blocks do; a row that sees no
// key gets 0.
//
// Why: the jnp rule runs a while loop over 32-key blocks whose every iteration gathers the block, transposes it and
// runs two small einsums; at 32 decode sequences of the bench preset that is ~6-7 ms of a step for ~1 MB of keys.
// Here a work item (sequence, KV head) streams its keys and values once, widened from bf16 in registers, and its
// group's rows share every key it reads. Work items run on XLA's intra-op threads (parallel_items.h).
//
// Decode rows (run_item_rows, head sizes a multiple of 64): scores summed 16 keys at a time in a tree (lane_sums16)
// instead of one dependent chain per key, the next block's keys and values prefetched while this one is scored, one
// page-table lookup per page — 2-3x the row-at-a-time path at 1000-4000-token contexts (docs/cpu_rules_attention.md,
// "Decode rows at long contexts"). Head sizes that are not a multiple of 64 keep the row-at-a-time path (run_item).

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

using qcompile_native::load;
using qcompile_native::load_as_f32;
using qcompile_native::store;
using qcompile_native::v16;
using qcompile_native::value_as_f32;

constexpr int64_t kBlock = 32;  // keys per online-softmax block
// Items of this many rows or more (prefill tiles: a 32-token tile times the GQA group) take the register-tiled path;
// fewer (decode: one token's group, up to 16 rows in Qwen3.5) the row-group path, 1.7-1.9x faster there at group 8-16.
constexpr int64_t kTiledRows = 32;

inline float dot(const float* q, const float* k, int64_t n) {
  v16 acc = {};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) acc += load(q + c) * load(k + c);
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += acc[i];
  for (; c < n; ++c) s += q[c] * k[c];
  return s;
}

template <class T>
struct Job {
  const float* q;
  const T* k;
  const T* v;
  const int32_t* pages;
  const int32_t* pos;
  float* out;
  int64_t items, kv_heads, rows, hd, num_pages, page_size, per_seq;
};

// Key `key` of item w's pages, head h: its offset in the page pool (jnp's gather rule for the page id).
template <class T>
inline int64_t key_offset(const Job<T>& j, int64_t w, int64_t h, int64_t key) {
  int64_t page = j.pages[w * j.per_seq + key / j.page_size];
  if (page < 0) page += j.num_pages;
  page = std::min<int64_t>(std::max<int64_t>(page, 0), j.num_pages - 1);
  return ((page * j.page_size + key % j.page_size) * j.kv_heads + h) * j.hd;
}

// The largest lane and the sum of the lanes, as trees (4 dependent steps instead of 16).
inline v16 larger(v16 a, v16 b) { return a > b ? a : b; }

inline float lane_max(v16 x) {
  x = larger(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = larger(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = larger(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  return std::max(x[0], x[1]);
}

inline float lane_sum(v16 x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return x[0] + x[1];
}

// One row's online-softmax step over a block of kBlock = 32 scores (s0: keys 0-15, s1: keys 16-31), of which the
// first `seen` count: their weights e^(s - max) into prob[0:32] (0 past seen), the row's running maximum m and sum l
// updated; returns alpha = e^(m_before - m), the factor that rescales what the row accumulated before. A row that
// sees no key of the block gets zero weights and alpha 1.
static_assert(kBlock == 32, "block_softmax takes a block as two 16-lane vectors");
inline float block_softmax(v16 s0, v16 s1, float seen, float& m, float& l, float* prob) {
  if (seen <= 0) {
    store(prob, v16{});
    store(prob + 16, v16{});
    return 1.0f;
  }
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 neg = qcompile_native::splat(-INFINITY);
  s0 = lane < seen ? s0 : neg;
  s1 = lane + 16.0f < seen ? s1 : neg;
  const float top = std::max(m, lane_max(larger(s0, s1)));
  const float alpha = std::exp(m - top);
  const v16 tv = qcompile_native::splat(top);
  const v16 p0 = lane < seen ? qcompile_native::exp16(s0 - tv) : v16{};
  const v16 p1 = lane + 16.0f < seen ? qcompile_native::exp16(s1 - tv) : v16{};
  l = l * alpha + lane_sum(p0 + p1);
  m = top;
  store(prob, p0);
  store(prob + 16, p1);
  return alpha;
}

// Item `item` of a job: its sequence w and KV head h, its R query rows, their positions and its R output rows.
template <class T>
struct ItemRows {
  int64_t w, h;
  const float* q;
  const int32_t* pos;
  float* out;
};

template <class T>
inline ItemRows<T> item_rows(const Job<T>& j, int64_t item) {
  const int64_t w = item / j.kv_heads;
  return {w, item % j.kv_heads, j.q + item * j.rows * j.hd, j.pos + w * j.rows, j.out + item * j.rows * j.hd};
}

// The online softmax's last step: each row divided by its sum of weights (a row that saw no key stays 0).
inline void normalize_rows(float* out, const float* l, int64_t rows, int64_t hd) {
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 1.0f;
    for (int64_t c = 0; c < hd; ++c) out[r * hd + c] *= inv;
  }
}

// Many rows (a prefill tile of queries, the GQA group of each): per key block, the block's keys transposed once
// ([hd][kBlock], zero past the block's end) and its values widened; then per group of kRowTile rows the scores are a
// register-tiled product (kRowTile x 32 accumulators over hd), the online softmax runs on 16-key vectors (exp16),
// and P·V accumulates 64 output columns at a time for the group's rows, every value vector loaded once per group.
// The same blocks, the same per-block maximum and rescale as the row-at-a-time path.
constexpr int64_t kRowTile = 4;

// One group of NR rows (at q, pos, m, l, out) against a block of n keys (kt: transposed [hd][kBlock], zero past n;
// vw: values [kBlock][hd] in f32): the scores as an NR x 32 register tile over hd, the online softmax on 16-key
// vectors, then P·V 64 output columns at a time (a scalar tail for hd not a multiple of 64). NR is a template
// parameter so the accumulators stay in registers (with a run-time row count they went through the stack).
template <int NR>
void tiled_group(const float* q, int64_t hd, const float* kt, const float* vw, int64_t n, int64_t j0,
                 const int32_t* pos, float* m, float* l, float* out) {
  v16 acc[NR][2];
  for (int i = 0; i < NR; ++i) acc[i][0] = acc[i][1] = v16{};
  for (int64_t d = 0; d < hd; ++d) {
    v16 k0 = load(kt + d * kBlock), k1 = load(kt + d * kBlock + 16);
    asm("" : "+v"(k0), "+v"(k1));  // in registers: GCC would fold each use into an FMA's memory operand
    for (int i = 0; i < NR; ++i) {
      const v16 a = qcompile_native::splat(q[i * hd + d]);
      acc[i][0] += a * k0;
      acc[i][1] += a * k1;
    }
  }
  alignas(64) float prob[NR][kBlock];
  float alpha[NR];
  for (int i = 0; i < NR; ++i)
    alpha[i] = block_softmax(acc[i][0], acc[i][1], static_cast<float>(std::min<int64_t>(n, pos[i] - j0 + 1)), m[i],
                             l[i], prob[i]);
  int64_t c = 0;
  for (; c + 64 <= hd; c += 64) {
    v16 o[NR][4];
    for (int i = 0; i < NR; ++i)
      for (int u = 0; u < 4; ++u) o[i][u] = load(out + i * hd + c + 16 * u) * alpha[i];
    for (int64_t t = 0; t < n; ++t) {
      v16 vv[4];
      for (int u = 0; u < 4; ++u) vv[u] = load(vw + t * hd + c + 16 * u);
      asm("" : "+v"(vv[0]), "+v"(vv[1]), "+v"(vv[2]), "+v"(vv[3]));
      for (int i = 0; i < NR; ++i) {
        const v16 p = qcompile_native::splat(prob[i][t]);
        for (int u = 0; u < 4; ++u) o[i][u] += p * vv[u];
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int u = 0; u < 4; ++u) store(out + i * hd + c + 16 * u, o[i][u]);
  }
  for (; c < hd; ++c)
    for (int i = 0; i < NR; ++i) {
      float acc_c = out[i * hd + c] * alpha[i];
      for (int64_t t = 0; t < n; ++t) acc_c += prob[i][t] * vw[t * hd + c];
      out[i * hd + c] = acc_c;
    }
}

template <class T>
void run_item_tiled(const Job<T>& j, int64_t item, int64_t keys) {
  const auto [w, h, q, pos, out] = item_rows(j, item);
  const int64_t rows = j.rows, hd = j.hd;
  thread_local std::vector<float> m, l, kt, vw;
  m.assign(rows, -1e30f);
  l.assign(rows, 0.0f);
  kt.resize(hd * kBlock);
  vw.resize(kBlock * hd);
  std::fill(out, out + rows * hd, 0.0f);
  for (int64_t j0 = 0; j0 < keys; j0 += kBlock) {
    const int64_t n = std::min(kBlock, keys - j0);
    for (int64_t t = 0; t < kBlock; ++t) {
      if (t >= n) {
        for (int64_t d = 0; d < hd; ++d) kt[d * kBlock + t] = vw[t * hd + d] = 0.0f;
        continue;
      }
      const int64_t at = key_offset(j, w, h, j0 + t);
      for (int64_t d = 0; d < hd; ++d) kt[d * kBlock + t] = value_as_f32(j.k + at + d);
      int64_t d = 0;
      for (; d + 16 <= hd; d += 16) store(vw.data() + t * hd + d, qcompile_native::load_as_f32(j.v + at + d));
      for (; d < hd; ++d) vw[t * hd + d] = value_as_f32(j.v + at + d);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      int64_t reach = -1;  // the furthest key any row of the group sees
      for (int64_t i = r0; i < std::min(rows, r0 + kRowTile); ++i) reach = std::max<int64_t>(reach, pos[i]);
      if (reach < j0) continue;  // no row of the group sees a key of this block
      float* o = out + r0 * hd;
      const float* qr = q + r0 * hd;
      switch (std::min(kRowTile, rows - r0)) {
        case 1: tiled_group<1>(qr, hd, kt.data(), vw.data(), n, j0, pos + r0, m.data() + r0, l.data() + r0, o); break;
        case 2: tiled_group<2>(qr, hd, kt.data(), vw.data(), n, j0, pos + r0, m.data() + r0, l.data() + r0, o); break;
        case 3: tiled_group<3>(qr, hd, kt.data(), vw.data(), n, j0, pos + r0, m.data() + r0, l.data() + r0, o); break;
        default: tiled_group<4>(qr, hd, kt.data(), vw.data(), n, j0, pos + r0, m.data() + r0, l.data() + r0, o); break;
      }
    }
  }
  normalize_rows(out, l.data(), rows, hd);
}

// The lane sums of 16 vectors as one vector: lane i holds the sum of a[kRev4[i]]'s lanes (kRev4 reverses 4 bits and
// is its own inverse, so a caller that stores key t's partial sums at a[kRev4[t]] gets key t's score in lane t). Four
// levels fold pairs of vectors in half — 15 adds for 16 sums, where summing one vector's lanes in order is a chain of
// 16 dependent adds per score (what made the row-at-a-time path latency-bound at long contexts).
constexpr int kRev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline v16 lane_sums16(const float* a) {  // a: 16 vectors of 16 floats, one after another
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    const v16 x = load(a + 32 * i), y = load(a + 32 * i + 16);
    b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// Partial scores of rows r0..r0+RG-1 against keys t and t + 1 (two keys at a time: 2·RG independent FMA chains):
// part[r][kRev4-slot of t] = the 16 lane partial sums of q[r]·k[t] over hd (a multiple of 16).
template <int RG, class T>
inline void partial_scores(const float* q, int64_t hd, const T* k0, const T* k1, float* part, int64_t slot0,
                           int64_t slot1) {
  v16 a0[RG] = {}, a1[RG] = {};
  for (int64_t c = 0; c < hd; c += 16) {
    const v16 x0 = qcompile_native::load_as_f32(k0 + c), x1 = qcompile_native::load_as_f32(k1 + c);
    for (int r = 0; r < RG; ++r) {
      const v16 qr = load(q + r * hd + c);
      a0[r] += qr * x0;
      a1[r] += qr * x1;
    }
  }
  for (int r = 0; r < RG; ++r) {
    store(part + (r * kBlock + slot0) * 16, a0[r]);
    store(part + (r * kBlock + slot1) * 16, a1[r]);
  }
}

// out[r0..r0+NR) (columns c..c+64) = alpha·out + Σ_t prob[r][t]·v[t] over keys t < n.
template <int NR, class T>
inline void weighted_values(const T* v, const int64_t* off, int64_t n, const float* prob, const float* alpha,
                            float* out, int64_t hd, int64_t c) {
  v16 o[NR][4];
  for (int i = 0; i < NR; ++i)
    for (int u = 0; u < 4; ++u) o[i][u] = load(out + i * hd + c + 16 * u) * alpha[i];
  for (int64_t t = 0; t < n; ++t) {
    v16 vv[4];
    for (int u = 0; u < 4; ++u) vv[u] = qcompile_native::load_as_f32(v + off[t] + c + 16 * u);
    for (int i = 0; i < NR; ++i) {
      const v16 p = qcompile_native::splat(prob[i * kBlock + t]);
      for (int u = 0; u < 4; ++u) o[i][u] += p * vv[u];
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int u = 0; u < 4; ++u) store(out + i * hd + c + 16 * u, o[i][u]);
}

// Few rows (decode: a token's GQA group; hd a multiple of 64): per block of kBlock keys, each key read once for all
// rows straight from its page (widened in registers), partial scores for two keys at a time, summed 16 keys at a time
// by lane_sums16; the online softmax on 16-key vectors (exp16); P·V 64 output columns at a time for up to 4 rows,
// each value vector read once per column chunk. The same blocks, per-block maximum and rescale as run_item.
template <class T>
void run_item_rows(const Job<T>& j, int64_t item, int64_t keys) {
  const auto [item_w, item_h, q, pos, out] = item_rows(j, item);
  const int64_t w = item_w, h = item_h;  // the lambdas below capture them (C++17 cannot capture a binding)
  const int64_t rows = j.rows, hd = j.hd;
  thread_local std::vector<float> m, l, part, prob, alpha;
  m.assign(rows, -1e30f);
  l.assign(rows, 0.0f);
  part.resize(rows * kBlock * 16);
  prob.resize(rows * kBlock);
  alpha.resize(rows);
  std::fill(out, out + rows * hd, 0.0f);
  int64_t off[kBlock];
  const int64_t row_bytes = hd * static_cast<int64_t>(sizeof(T));
  int64_t next[kBlock];  // offsets of the next block's keys: prefetched two at a time while this block's are scored
  auto offsets = [&](int64_t start, int64_t* into) {  // one page-table lookup per page, not per key
    int64_t t = 0;
    while (t < kBlock && start + t < keys) {
      const int64_t first = key_offset(j, w, h, start + t);
      const int64_t run = std::min(std::min(kBlock - t, keys - start - t), j.page_size - (start + t) % j.page_size);
      const int64_t stride = j.kv_heads * hd;  // consecutive keys of one page
      for (int64_t i = 0; i < run; ++i) into[t + i] = first + i * stride;
      t += run;
    }
    for (; t < kBlock; ++t) into[t] = -1;
  };
  auto fetch = [&](int64_t at) {  // the key and value rows at `at`, every cache line
    if (at < 0) return;
    const char* kr = reinterpret_cast<const char*>(j.k + at);
    const char* vr = reinterpret_cast<const char*>(j.v + at);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(kr + b);
      __builtin_prefetch(vr + b);
    }
  };
  offsets(0, next);
  for (int64_t t = 0; t < kBlock; ++t) fetch(next[t]);
  for (int64_t j0 = 0; j0 < keys; j0 += kBlock) {
    const int64_t n = std::min(kBlock, keys - j0);
    std::memcpy(off, next, sizeof(off));
    offsets(j0 + kBlock, next);
    const int64_t groups = (n + 15) / 16;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int rg = static_cast<int>(std::min<int64_t>(4, rows - r0));
      float* pr = part.data() + r0 * kBlock * 16;
      const float* qr = q + r0 * hd;
      for (int64_t t = 0; t < 16 * groups; t += 2) {
        // keys past the block's end: key 0 again (their lanes are masked below), so every slot holds finite sums
        const T* k0 = j.k + off[t < n ? t : 0];
        const T* k1 = j.k + off[t + 1 < n ? t + 1 : 0];
        const int64_t s0 = (t / 16) * 16 + kRev4[t % 16], s1 = (t / 16) * 16 + kRev4[(t + 1) % 16];
        if (r0 == 0) {
          fetch(next[t]);
          fetch(next[t + 1]);
        }
        switch (rg) {
          case 1: partial_scores<1>(qr, hd, k0, k1, pr, s0, s1); break;
          case 2: partial_scores<2>(qr, hd, k0, k1, pr, s0, s1); break;
          case 3: partial_scores<3>(qr, hd, k0, k1, pr, s0, s1); break;
          default: partial_scores<4>(qr, hd, k0, k1, pr, s0, s1); break;
        }
      }
    }
    int64_t reach = 0;  // keys of the block that some row sees
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min<int64_t>(n, pos[r] - j0 + 1);
      reach = std::max(reach, seen);
      const float* pr = part.data() + r * kBlock * 16;
      const v16 s0 = lane_sums16(pr), s1 = groups > 1 ? lane_sums16(pr + 16 * 16) : v16{};  // (s1 masked when n <= 16)
      alpha[r] = block_softmax(s0, s1, static_cast<float>(seen), m[r], l[r], prob.data() + r * kBlock);
    }
    if (reach == 0) continue;
    for (int64_t c = 0; c < hd; c += 64)
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const float* pb = prob.data() + r0 * kBlock;
        float* o = out + r0 * hd;
        switch (std::min<int64_t>(4, rows - r0)) {
          case 1: weighted_values<1>(j.v, off, reach, pb, alpha.data() + r0, o, hd, c); break;
          case 2: weighted_values<2>(j.v, off, reach, pb, alpha.data() + r0, o, hd, c); break;
          case 3: weighted_values<3>(j.v, off, reach, pb, alpha.data() + r0, o, hd, c); break;
          default: weighted_values<4>(j.v, off, reach, pb, alpha.data() + r0, o, hd, c); break;
        }
      }
  }
  normalize_rows(out, l.data(), rows, hd);
}

template <class T>
void run_item(const Job<T>& j, int64_t item) {
  const auto [w, h, q, pos, out] = item_rows(j, item);
  const int64_t rows = j.rows, hd = j.hd;
  int64_t last = -1;  // the largest position any row of the item sees
  for (int64_t r = 0; r < rows; ++r) last = std::max<int64_t>(last, pos[r]);
  const int64_t keys = std::min<int64_t>(last + 1, j.per_seq * j.page_size);
  if (rows >= kTiledRows) {
    run_item_tiled(j, item, keys);
    return;
  }
  if (hd % 64 == 0) {
    run_item_rows(j, item, keys);
    return;
  }
  thread_local std::vector<float> m, l, s, kw, vw;
  m.assign(rows, -1e30f);
  l.assign(rows, 0.0f);
  s.resize(rows * kBlock);
  kw.resize(kBlock * hd);
  vw.resize(kBlock * hd);
  std::fill(out, out + rows * hd, 0.0f);
  for (int64_t j0 = 0; j0 < keys; j0 += kBlock) {
    const int64_t n = std::min(kBlock, keys - j0);
    // The block's keys and values for head h, in f32.
    for (int64_t t = 0; t < n; ++t) {
      const int64_t at = key_offset(j, w, h, j0 + t);
      int64_t c = 0;
      for (; c + 16 <= hd; c += 16) {
        store(kw.data() + t * hd + c, load_as_f32(j.k + at + c));
        store(vw.data() + t * hd + c, load_as_f32(j.v + at + c));
      }
      for (; c < hd; ++c) {
        kw[t * hd + c] = value_as_f32(j.k + at + c);
        vw[t * hd + c] = value_as_f32(j.v + at + c);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min<int64_t>(n, pos[r] - j0 + 1);  // keys of this block the row attends to
      if (seen <= 0) continue;
      float* sr = s.data() + r * kBlock;
      float top = m[r];
      for (int64_t t = 0; t < seen; ++t) top = std::max(top, sr[t] = dot(q + r * hd, kw.data() + t * hd, hd));
      const float alpha = std::exp(m[r] - top);
      float sum = 0.0f;
      for (int64_t t = 0; t < seen; ++t) sum += (sr[t] = std::exp(sr[t] - top));
      l[r] = l[r] * alpha + sum;
      m[r] = top;
      float* o = out + r * hd;
      int64_t c = 0;
      for (; c + 16 <= hd; c += 16) {
        v16 acc = load(o + c) * alpha;
        for (int64_t t = 0; t < seen; ++t) acc += sr[t] * load(vw.data() + t * hd + c);
        store(o + c, acc);
      }
      for (; c < hd; ++c) {
        float acc = o[c] * alpha;
        for (int64_t t = 0; t < seen; ++t) acc += sr[t] * vw[t * hd + c];
        o[c] = acc;
      }
    }
  }
  normalize_rows(out, l.data(), rows, hd);
}

template <class T>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
               ffi::Buffer<ffi::S32> item_pages, ffi::Buffer<ffi::S32> row_pos, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto td = item_pages.dimensions();
  const auto rd = row_pos.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()) ||
      td.size() != 2 || rd.size() != 2 || td[0] != qd[0] || rd[0] != qd[0] || rd[1] != qd[2] || kd[2] != qd[1] ||
      kd[3] != qd[3] || kd[0] < 1 || td[1] < 1)
    return ffi::Error::InvalidArgument("qcompile paged decode attention: expected q[W,Hkv,R,hd], pages[P,ps,Hkv,hd], "
                                       "item_pages[W,M], row_pos[W,R]");
  Job<T> job{q.typed_data(), static_cast<const T*>(k.untyped_data()), static_cast<const T*>(v.untyped_data()),
             item_pages.typed_data(), row_pos.typed_data(), out->typed_data(), qd[0] * qd[1], qd[1], qd[2], qd[3],
             kd[0], kd[1], td[1]};
  qcompile_native::parallel_items(pool, job.items, [job](int64_t i) { run_item(job, i); });
  return ffi::Error::Success();
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> item_pages, ffi::Buffer<ffi::S32> row_pos,
                                ffi::ResultBuffer<ffi::F32> out) {
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("qcompile paged decode attention: k and v pages differ in dtype");
  if (k.element_type() == ffi::DataType::F32) return Run<float>(pool, q, k, v, item_pages, row_pos, out);
  if (k.element_type() == ffi::DataType::BF16) return Run<uint16_t>(pool, q, k, v, item_pages, row_pos, out);
  return ffi::Error::InvalidArgument("qcompile paged decode attention: pages must be f32 or bf16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompilePagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
