// Register tiles over an FP8 panel (64 columns stored k-major, 64 bytes a row, block scales along k), shared by the
// grouped matmul's expert panels (grouped_matmul_f32.cc) and the linear panel kernel (linear_panels_f32.cc): each
// panel row is dequantized in registers (fp8.h dequant64) just before the row tile multiplies it, so no dequantized
// weight goes through memory.
//   * tile_fp8: f32 rows; the weights as f32 (rounded to bf16 first for a bf16 graph), FMAs in k order — the f32
//     panel tiles' result on the dequantized panel, bit for bit.
//   * tile_fp8_pairs (AVX512_BF16): bf16 rows; the weights as bf16, multiplied in pairs of rows k, k+1 by
//     VDPBF16PS: the bf16 pair tiles' result (bf16_pairs.h) on the bf16 dequantize, bit for bit. Where a block scale
//     covers at least kFp8TableRows rows (Qwen's 128) the bf16 weights come from a 128-entry table of the block's
//     values (Fp8Bf16Table: two word permutes per 32 weights), else each is dequantized, rounded and packed by
//     VCVTNE2PS2BF16 and one word permute. The table also serves dequant_rows' bf16 panels (the prefill path).
//     At 32 decode sequences of the FP8 bench checkpoint the experts took 15.5 ms a step by dequantizing, 11.0 by
//     table (docs/cpu_rules.md, "FP8 by table").
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "fp8.h"
#include "vec16.h"

namespace qcompile_native {

constexpr int64_t kFp8Panel = 64;          // columns (and bytes) per FP8 panel row
constexpr int64_t kFp8PrefetchRows = 64;   // panel rows prefetched ahead: 4 KiB (32-256 measured the same)

#if defined(__AVX512BW__)
// A block scale's FP8 -> bf16 dequantization as a table of 128 words in four registers: entry e = dequant64_bf16's
// value of code e under scale s (value(e) · s rounded once in f32, then to the nearest bf16). value(e | 0x80) =
// -value(e) and both roundings are symmetric, so a code's sign bit is ORed in after the lookup. Built once per block
// scale (128 k rows of a panel in Qwen's layout), it replaces ~40 instructions per 64 weights by ~15.
struct Fp8Bf16Table {
  __m512i words[4];
  explicit Fp8Bf16Table(float s) {
    alignas(64) uint8_t codes[128];
    alignas(64) uint16_t bits[128];
    for (int i = 0; i < 128; ++i) codes[i] = static_cast<uint8_t>(i);
    dequant64_bf16(codes, Fp8RowScale(s, true), bits);
    dequant64_bf16(codes + 64, Fp8RowScale(s, true), bits + 64);
    for (int v = 0; v < 4; ++v) words[v] = _mm512_load_si512(bits + 32 * v);
  }
  // 32 FP8 codes (zero-extended to words) -> their bf16 bits: two two-register word permutes (entries 0-63 and
  // 64-127, by the low six bits), bit 6 choosing between them, then the sign.
  __m512i lookup(__m512i code) const {
    const __m512i low = _mm512_permutex2var_epi16(words[0], code, words[1]);
    const __m512i high = _mm512_permutex2var_epi16(words[2], code, words[3]);
    const __m512i magnitude =
        _mm512_mask_blend_epi16(_mm512_test_epi16_mask(code, _mm512_set1_epi16(0x40)), low, high);
    // magnitude | ((code << 8) & 0x8000)
    return _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(code, 8), _mm512_set1_epi16(int16_t(0x8000)), 0xF8);
  }
};

constexpr int64_t kFp8TableRows = 16;  // blocks of at least this many k rows dequantize by table (its cost: 128 codes)
#endif

// Rows kb..ke-1 of an FP8 panel (row k at w + 64 k, block scale scale[k / bk]) dequantized into dst ([ke - kb, 64]):
// f32 values (rounded to bf16 first when bf16), or the bf16 bits for the pair tiles.
inline void dequant_rows(const uint8_t* w, const float* scale, int64_t bk, int64_t kb, int64_t ke, bool bf16,
                         float* dst) {
  for (int64_t k = kb; k < ke; ++k) {
    v16 row[4];
    dequant64(w + k * kFp8Panel, Fp8RowScale(scale[k / bk], bf16), row);
    for (int v = 0; v < 4; ++v) store(dst + (k - kb) * kFp8Panel + 16 * v, row[v]);
  }
}

inline void dequant_rows(const uint8_t* w, const float* scale, int64_t bk, int64_t kb, int64_t ke, uint16_t* dst) {
#if defined(__AVX512BW__)
  if (bk >= kFp8TableRows) {
    for (int64_t k0 = kb; k0 < ke; k0 = (k0 / bk + 1) * bk) {
      const Fp8Bf16Table table(scale[k0 / bk]);
      for (int64_t k = k0; k < std::min(ke, (k0 / bk + 1) * bk); ++k) {
        const __m512i codes = _mm512_loadu_si512(w + k * kFp8Panel);
        uint16_t* row = dst + (k - kb) * kFp8Panel;
        _mm512_storeu_si512(row, table.lookup(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(codes))));
        _mm512_storeu_si512(row + 32, table.lookup(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(codes, 1))));
      }
    }
    return;
  }
#endif
  for (int64_t k = kb; k < ke; ++k)
    dequant64_bf16(w + k * kFp8Panel, Fp8RowScale(scale[k / bk], true), dst + (k - kb) * kFp8Panel);
}

// out[m, 0:64] (+)= x[m, kb:ke] · w[kb:ke, 0:64] for m < MR, w the panel from row 0 (row k at w + 64 k) whose row k
// uses the block scale scale[k / bk]; x indexed by absolute k; add: on top of what out holds.
template <int MR>
void tile_fp8(const float* x, int64_t ldx, const uint8_t* w, const float* scale, int64_t bk, int64_t kb, int64_t ke,
              bool bf16, float* out, int64_t ldo, bool add) {
  v16 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = add ? load(out + m * ldo + 16 * v) : v16{};
  for (int64_t k0 = kb; k0 < ke; k0 = (k0 / bk + 1) * bk) {
    const Fp8RowScale s(scale[k0 / bk], bf16);
    const int64_t k1 = std::min(ke, (k0 / bk + 1) * bk);
    for (int64_t kk = k0; kk < k1; ++kk) {
      const uint8_t* wr = w + kk * kFp8Panel;
      __builtin_prefetch(wr + kFp8PrefetchRows * kFp8Panel);
      v16 b[4];
      dequant64(wr, s, b);
      for (int m = 0; m < MR; ++m) {
        const v16 a = splat(x[m * ldx + kk]);
        for (int v = 0; v < 4; ++v) acc[m][v] += a * b[v];
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) store(out + m * ldo + 16 * v, acc[m][v]);
}

inline void tile_fp8_rows(int rows, const float* x, int64_t ldx, const uint8_t* w, const float* scale, int64_t bk,
                          int64_t kb, int64_t ke, bool bf16, float* out, int64_t ldo, bool add) {
  switch (rows) {
    case 1: tile_fp8<1>(x, ldx, w, scale, bk, kb, ke, bf16, out, ldo, add); break;
    case 2: tile_fp8<2>(x, ldx, w, scale, bk, kb, ke, bf16, out, ldo, add); break;
    case 3: tile_fp8<3>(x, ldx, w, scale, bk, kb, ke, bf16, out, ldo, add); break;
    case 4: tile_fp8<4>(x, ldx, w, scale, bk, kb, ke, bf16, out, ldo, add); break;
    case 5: tile_fp8<5>(x, ldx, w, scale, bk, kb, ke, bf16, out, ldo, add); break;
    default: tile_fp8<6>(x, ldx, w, scale, bk, kb, ke, bf16, out, ldo, add); break;
  }
}

#ifdef __AVX512BF16__
// tile_fp8_pairs where the block size along k is even (each pair of rows shares a scale): the weights looked up in
// the block's Fp8Bf16Table — the same bf16 values as dequantizing and rounding each one, in a third of the
// instructions. Rows k and k+1 are interleaved as bytes (unpack low/high within 128-bit lanes) and widened to words,
// which leaves the accumulators' columns as {0-7, 16-23}, {32-39, 48-55}, {8-15, 24-31}, {40-47, 56-63}; 128-bit
// lane shuffles put them in order when the tile loads or stores. Same products, same order: bit-identical results.
template <int MR>
void tile_fp8_pairs_table(const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scale, int64_t bk,
                          int64_t kb, int64_t ke, float* out, int64_t ldo, bool add) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m) {
    if (add) {
      __m512 c[4];
      for (int v = 0; v < 4; ++v) c[v] = _mm512_loadu_ps(out + m * ldo + 16 * v);
      acc[m][0] = _mm512_shuffle_f32x4(c[0], c[1], 0x44);
      acc[m][2] = _mm512_shuffle_f32x4(c[0], c[1], 0xEE);
      acc[m][1] = _mm512_shuffle_f32x4(c[2], c[3], 0x44);
      acc[m][3] = _mm512_shuffle_f32x4(c[2], c[3], 0xEE);
    } else {
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t k0 = kb; k0 < ke; k0 = (k0 / bk + 1) * bk) {
    const Fp8Bf16Table table(scale[k0 / bk]);
    const int64_t k1 = std::min(ke, (k0 / bk + 1) * bk);
    for (int64_t kk = k0; kk < k1; kk += 2) {
      const uint8_t* wr = w + kk * kFp8Panel;
      __builtin_prefetch(wr + kFp8PrefetchRows * kFp8Panel);
      __builtin_prefetch(wr + (kFp8PrefetchRows + 1) * kFp8Panel);
      const __m512i r0 = _mm512_loadu_si512(wr), r1 = _mm512_loadu_si512(wr + kFp8Panel);
      const __m512i lo = _mm512_unpacklo_epi8(r0, r1), hi = _mm512_unpackhi_epi8(r0, r1);
      __m512bh b[4];
      b[0] = (__m512bh)table.lookup(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)));
      b[1] = (__m512bh)table.lookup(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1)));
      b[2] = (__m512bh)table.lookup(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)));
      b[3] = (__m512bh)table.lookup(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1)));
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + kk, sizeof(pair));  // x[m, k] in the low half, x[m, k + 1] in the high
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(out + m * ldo, _mm512_shuffle_f32x4(acc[m][0], acc[m][2], 0x44));
    _mm512_storeu_ps(out + m * ldo + 16, _mm512_shuffle_f32x4(acc[m][0], acc[m][2], 0xEE));
    _mm512_storeu_ps(out + m * ldo + 32, _mm512_shuffle_f32x4(acc[m][1], acc[m][3], 0x44));
    _mm512_storeu_ps(out + m * ldo + 48, _mm512_shuffle_f32x4(acc[m][1], acc[m][3], 0xEE));
  }
}

// As tile_fp8 with bf16 rows x (kb and ke even): the weights rounded to bf16 and multiplied in pairs on VDPBF16PS
// (by table where the k blocks are even, dequantized weight by weight otherwise).
template <int MR>
void tile_fp8_pairs(const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scale, int64_t bk, int64_t kb,
                    int64_t ke, float* out, int64_t ldo, bool add) {
  if (bk % 2 == 0 && bk >= kFp8TableRows) {
    tile_fp8_pairs_table<MR>(x, ldx, w, scale, bk, kb, ke, out, ldo, add);
    return;
  }
  alignas(64) static const int16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(order);  // word 2j <- row k's column j, 2j + 1 <- row k+1's
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = add ? _mm512_loadu_ps(out + m * ldo + 16 * v) : _mm512_setzero_ps();
  for (int64_t kk = kb; kk < ke; kk += 2) {
    const uint8_t* wr = w + kk * kFp8Panel;
    __builtin_prefetch(wr + kFp8PrefetchRows * kFp8Panel);
    __builtin_prefetch(wr + (kFp8PrefetchRows + 1) * kFp8Panel);
    v16 r0[4], r1[4];
    dequant64(wr, Fp8RowScale(scale[kk / bk]), r0);
    dequant64(wr + kFp8Panel, Fp8RowScale(scale[(kk + 1) / bk]), r1);
    __m512bh b[4];
    for (int v = 0; v < 4; ++v)  // words [row k: 16 columns | row k+1: 16 columns] -> (row k, row k+1) per column
      b[v] = (__m512bh)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh((__m512)r1[v], (__m512)r0[v]));
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + kk, sizeof(pair));  // x[m, k] in the low half, x[m, k + 1] in the high
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + m * ldo + 16 * v, acc[m][v]);
}

inline void tile_fp8_pairs_rows(int rows, const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scale,
                                int64_t bk, int64_t kb, int64_t ke, float* out, int64_t ldo, bool add) {
  switch (rows) {
    case 1: tile_fp8_pairs<1>(x, ldx, w, scale, bk, kb, ke, out, ldo, add); break;
    case 2: tile_fp8_pairs<2>(x, ldx, w, scale, bk, kb, ke, out, ldo, add); break;
    case 3: tile_fp8_pairs<3>(x, ldx, w, scale, bk, kb, ke, out, ldo, add); break;
    case 4: tile_fp8_pairs<4>(x, ldx, w, scale, bk, kb, ke, out, ldo, add); break;
    case 5: tile_fp8_pairs<5>(x, ldx, w, scale, bk, kb, ke, out, ldo, add); break;
    default: tile_fp8_pairs<6>(x, ldx, w, scale, bk, kb, ke, out, ldo, add); break;
  }
}
#endif

}  // namespace qcompile_native
