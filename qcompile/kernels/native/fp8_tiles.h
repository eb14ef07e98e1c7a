// Register tiles over an FP8 panel (64 columns stored k-major, 64 bytes a row, block scales along k), shared by the
// grouped matmul's expert panels (grouped_matmul_f32.cc) and the linear panel kernel (linear_panels_f32.cc): each
// panel row is dequantized in registers (fp8.h dequant64) just before the row tile multiplies it, so no dequantized
// weight goes through memory.
//   * tile_fp8: f32 rows; the weights as f32 (rounded to bf16 first for a bf16 graph), FMAs in k order — the f32
//     panel tiles' result on the dequantized panel, bit for bit.
//   * tile_fp8_pairs (AVX512_BF16): bf16 rows; rows k and k+1 dequantized, rounded and packed by VCVTNE2PS2BF16
//     (words [row k | row k+1]) and one word permute into (row k, row k+1) per column — lane j is column j, so the
//     accumulators stay in column order — then VDPBF16PS: the bf16 pair tiles' result (bf16_pairs.h) on the bf16
//     dequantize, bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "fp8.h"
#include "vec16.h"

namespace qcompile_native {

constexpr int64_t kFp8Panel = 64;          // columns (and bytes) per FP8 panel row
constexpr int64_t kFp8PrefetchRows = 64;   // panel rows prefetched ahead: 4 KiB (32-256 measured the same)

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
// As tile_fp8 with bf16 rows x (kb and ke even): the weights rounded to bf16 and multiplied in pairs on VDPBF16PS.
template <int MR>
void tile_fp8_pairs(const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scale, int64_t bk, int64_t kb,
                    int64_t ke, float* out, int64_t ldo, bool add) {
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
