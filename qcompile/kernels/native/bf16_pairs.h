// bf16 pairs on VDPBF16PS (AVX512_BF16): register tiles over a panel of 64 columns stored k-major ([K, 64] bf16),
// shared by the linear panel kernel (linear_panels_f32.cc) and the grouped matmul's expert panels
// (grouped_matmul_f32.cc). VDPBF16PS multiplies pairs of bf16 along k into f32 accumulators — x[k]·w[k] +
// x[k+1]·w[k+1] per column, exact products, the pair summed into the accumulator (a reassociation of the same
// products: the reassociating class) — with half the instructions of widening the weights for FMAs. The panel's rows
// k and k+1 are interleaved in registers (unpack low/high words), which scatters each vector's 16 columns over two
// accumulators in 128-bit lanes; a tile puts them back in column order when it stores. Compiled only where
// -march=native enables AVX512_BF16 (__AVX512BF16__); the rules ask native.avx512_bf16() first. A panel stored in
// pair order (the layout AMX tiles read, made at compile time on CPUs with AMX) needs no interleaving at all.
#pragma once

#ifdef __AVX512BF16__
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace qcompile_native {

// Column order <-> the pair-interleaved accumulators: unpacking words of rows k and k+1 (32 columns) puts columns
// {0-3, 8-11, 16-19, 24-27} in the low vector and {4-7, 12-15, 20-23, 28-31} in the high one.
inline void pairs_to_columns(__m512 lo, __m512 hi, __m512& c0, __m512& c1) {
  c0 = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi);
  c1 = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi);
}

inline void columns_to_pairs(__m512 c0, __m512 c1, __m512& lo, __m512& hi) {
  lo = _mm512_permutex2var_ps(c0, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), c1);
  hi = _mm512_permutex2var_ps(c0, _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31), c1);
}

// out[m, 0:64] (+)= x[m, kb:ke] · panel[kb:ke, 0:64] for m < MR, bf16 x (ldx per row) and panel rows kb..ke-1 at
// `block` (64 per row), (ke - kb) even; prefetch(i) is called before the i-th pair of rows. Paired: the panel is
// stored in pair order (kernels/grouped_matmul.py to_pair_order: the 128 values of rows k and k + 1 as 64 column
// pairs, at the same offset as the two rows in k order), so each 64-byte load is already VDPBF16PS's operand for 16
// columns and the accumulators are in column order.
template <int MR, bool Paired = false, class Prefetch>
void tile_pairs(const uint16_t* x, int64_t ldx, const uint16_t* block, int64_t kb, int64_t ke, float* out,
                int64_t ldo, bool add, Prefetch prefetch) {
  __m512 acc[MR][4];  // per row: columns 0-31 as (lo, hi), then columns 32-63 (Paired: columns 16v..16v+15)
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) {
      if (add && Paired) {
        acc[m][2 * h] = _mm512_loadu_ps(out + m * ldo + 32 * h);
        acc[m][2 * h + 1] = _mm512_loadu_ps(out + m * ldo + 32 * h + 16);
      } else if (add) {
        columns_to_pairs(_mm512_loadu_ps(out + m * ldo + 32 * h), _mm512_loadu_ps(out + m * ldo + 32 * h + 16),
                         acc[m][2 * h], acc[m][2 * h + 1]);
      } else {
        acc[m][2 * h] = acc[m][2 * h + 1] = _mm512_setzero_ps();
      }
    }
  for (int64_t k = kb; k < ke; k += 2) {
    prefetch((k - kb) / 2);
    const uint16_t* row = block + (k - kb) * 64;
    __m512bh b[4];
    if constexpr (Paired) {
      for (int v = 0; v < 4; ++v) b[v] = (__m512bh)_mm512_loadu_si512(row + 32 * v);
    } else {
      for (int h = 0; h < 2; ++h) {
        const __m512i r0 = _mm512_loadu_si512(row + 32 * h), r1 = _mm512_loadu_si512(row + 64 + 32 * h);
        b[2 * h] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
        b[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
      }
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + k, sizeof(pair));  // x[m, k] in the low half, x[m, k + 1] in the high
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) {
      __m512 c0 = acc[m][2 * h], c1 = acc[m][2 * h + 1];
      if constexpr (!Paired) pairs_to_columns(acc[m][2 * h], acc[m][2 * h + 1], c0, c1);
      _mm512_storeu_ps(out + m * ldo + 32 * h, c0);
      _mm512_storeu_ps(out + m * ldo + 32 * h + 16, c1);
    }
}

template <bool Paired, class Prefetch>
void tile_pairs_rows_of(int rows, const uint16_t* x, int64_t ldx, const uint16_t* block, int64_t kb, int64_t ke,
                        float* out, int64_t ldo, bool add, Prefetch prefetch) {
  switch (rows) {
    case 1: tile_pairs<1, Paired>(x, ldx, block, kb, ke, out, ldo, add, prefetch); break;
    case 2: tile_pairs<2, Paired>(x, ldx, block, kb, ke, out, ldo, add, prefetch); break;
    case 3: tile_pairs<3, Paired>(x, ldx, block, kb, ke, out, ldo, add, prefetch); break;
    case 4: tile_pairs<4, Paired>(x, ldx, block, kb, ke, out, ldo, add, prefetch); break;
    case 5: tile_pairs<5, Paired>(x, ldx, block, kb, ke, out, ldo, add, prefetch); break;
    default: tile_pairs<6, Paired>(x, ldx, block, kb, ke, out, ldo, add, prefetch); break;
  }
}

// tile_pairs for 1..6 rows (6 for more); `paired`: the panel in pair order.
template <class Prefetch>
void tile_pairs_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* block, int64_t kb, int64_t ke,
                     float* out, int64_t ldo, bool add, Prefetch prefetch, bool paired = false) {
  if (paired)
    tile_pairs_rows_of<true>(rows, x, ldx, block, kb, ke, out, ldo, add, prefetch);
  else
    tile_pairs_rows_of<false>(rows, x, ldx, block, kb, ke, out, ldo, add, prefetch);
}

}  // namespace qcompile_native
#endif
