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
constexpr int64_t kTiledRows = 8;  // items of this many rows or more (prefill tiles) take the register-tiled path

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

// Many rows (a prefill tile of queries, the GQA group of each): per key block, the block's keys transposed once
// ([hd][kBlock], zero past the block's end) and its values widened; then per group of kRowTile rows the scores are a
// register-tiled product (kRowTile x 32 accumulators over hd), the online softmax runs on 16-key vectors (exp16),
// and P·V accumulates 64 output columns at a time for the group's rows, every value vector loaded once per group.
// The same blocks, the same per-block maximum and rescale as the row-at-a-time path.
constexpr int64_t kRowTile = 4;

template <class T>
void run_item_tiled(const Job<T>& j, int64_t item, int64_t keys) {
  const int64_t w = item / j.kv_heads, h = item % j.kv_heads;
  const int64_t rows = j.rows, hd = j.hd;
  const float* q = j.q + (w * j.kv_heads + h) * rows * hd;
  const int32_t* pos = j.pos + w * rows;
  float* out = j.out + (w * j.kv_heads + h) * rows * hd;
  thread_local std::vector<float> m, l, kt, vw;
  m.assign(rows, -1e30f);
  l.assign(rows, 0.0f);
  kt.resize(hd * kBlock);
  vw.resize(kBlock * hd);
  std::fill(out, out + rows * hd, 0.0f);
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t j0 = 0; j0 < keys; j0 += kBlock) {
    const int64_t n = std::min(kBlock, keys - j0);
    for (int64_t t = 0; t < kBlock; ++t) {
      if (t >= n) {
        for (int64_t d = 0; d < hd; ++d) kt[d * kBlock + t] = vw[t * hd + d] = 0.0f;
        continue;
      }
      const int64_t at = key_offset(j, w, h, j0 + t);
      for (int64_t d = 0; d < hd; ++d) {
        kt[d * kBlock + t] = value_as_f32(j.k + at + d);
        vw[t * hd + d] = value_as_f32(j.v + at + d);
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t nr = std::min(kRowTile, rows - r0);
      int64_t reach = -1;  // the furthest key any row of the group sees
      for (int64_t i = 0; i < nr; ++i) reach = std::max<int64_t>(reach, pos[r0 + i]);
      if (reach < j0) continue;  // no row of the group sees a key of this block
      v16 acc[kRowTile][2] = {};
      for (int64_t d = 0; d < hd; ++d) {
        const v16 k0 = load(kt.data() + d * kBlock), k1 = load(kt.data() + d * kBlock + 16);
        for (int64_t i = 0; i < nr; ++i) {
          const v16 a = qcompile_native::splat(q[(r0 + i) * hd + d]);
          acc[i][0] += a * k0;
          acc[i][1] += a * k1;
        }
      }
      float alpha[kRowTile];
      for (int64_t i = 0; i < kRowTile; ++i) {
        const int64_t r = r0 + i;
        const float seen = i < nr ? static_cast<float>(std::min<int64_t>(n, pos[r] - j0 + 1)) : 0.0f;
        if (seen <= 0) {  // nothing of this block: p = 0, the row unchanged
          acc[i][0] = acc[i][1] = v16{};
          alpha[i] = 1.0f;
          continue;
        }
        const v16 neg = qcompile_native::splat(-INFINITY);
        const v16 s0 = lane < seen ? acc[i][0] : neg, s1 = lane + 16.0f < seen ? acc[i][1] : neg;
        float top = m[r];
        for (int c = 0; c < 16; ++c) top = std::max(top, std::max(s0[c], s1[c]));
        alpha[i] = std::exp(m[r] - top);
        const v16 tv = qcompile_native::splat(top);
        const v16 p0 = lane < seen ? qcompile_native::exp16(s0 - tv) : v16{};
        const v16 p1 = lane + 16.0f < seen ? qcompile_native::exp16(s1 - tv) : v16{};
        float sum = 0.0f;
        for (int c = 0; c < 16; ++c) sum += p0[c] + p1[c];
        l[r] = l[r] * alpha[i] + sum;
        m[r] = top;
        acc[i][0] = p0;
        acc[i][1] = p1;
      }
      // P·V: 64 output columns (4 vectors) for the group's rows at a time, then a scalar tail
      int64_t c = 0;
      for (; c + 64 <= hd; c += 64) {
        v16 o[kRowTile][4];
        for (int64_t i = 0; i < nr; ++i)
          for (int v = 0; v < 4; ++v) o[i][v] = load(out + (r0 + i) * hd + c + 16 * v) * alpha[i];
        for (int64_t t = 0; t < n; ++t) {
          v16 vv[4];
          for (int v = 0; v < 4; ++v) vv[v] = load(vw.data() + t * hd + c + 16 * v);
          for (int64_t i = 0; i < nr; ++i) {
            const v16 p = qcompile_native::splat(acc[i][t / 16][t % 16]);
            for (int v = 0; v < 4; ++v) o[i][v] += p * vv[v];
          }
        }
        for (int64_t i = 0; i < nr; ++i)
          for (int v = 0; v < 4; ++v) store(out + (r0 + i) * hd + c + 16 * v, o[i][v]);
      }
      for (; c < hd; ++c)
        for (int64_t i = 0; i < nr; ++i) {
          float o = out[(r0 + i) * hd + c] * alpha[i];
          for (int64_t t = 0; t < n; ++t) o += acc[i][t / 16][t % 16] * vw[t * hd + c];
          out[(r0 + i) * hd + c] = o;
        }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 1.0f;
    for (int64_t c = 0; c < hd; ++c) out[r * hd + c] *= inv;
  }
}

template <class T>
void run_item(const Job<T>& j, int64_t item) {
  const int64_t w = item / j.kv_heads, h = item % j.kv_heads;
  const int64_t rows = j.rows, hd = j.hd;
  const float* q = j.q + (w * j.kv_heads + h) * rows * hd;
  const int32_t* pos = j.pos + w * rows;
  float* out = j.out + (w * j.kv_heads + h) * rows * hd;
  int64_t last = -1;  // the largest position any row of the item sees
  for (int64_t r = 0; r < rows; ++r) last = std::max<int64_t>(last, pos[r]);
  const int64_t keys = std::min<int64_t>(last + 1, j.per_seq * j.page_size);
  if (rows >= kTiledRows) {
    run_item_tiled(j, item, keys);
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
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 1.0f;
    for (int64_t c = 0; c < hd; ++c) out[r * hd + c] *= inv;
  }
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
