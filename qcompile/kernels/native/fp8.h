// Shared by qcompile's native CPU kernels that read FP8 weights (e4m3fn values with f32 block scales; the layout is
// described in qcompile/kernels/fp8.py): the FP8 → f32 table and a row of weights dequantized into a buffer.
//
// The kernels dequantize a slab of weight rows into a small buffer that stays in L1/L2 just before multiplying it,
// so memory moves one byte per weight and the multiply-adds run on f32 as in the f32 kernels. An FP8 byte's value is
// built as f32 bits, 16 at a time in vector registers (exact: every e4m3fn value is an f32): a normal number
// S.EEEE.MMM is S | (EEEE.MMM << 20) + (120 << 23) (the exponent rebiased from 7 to 127), a subnormal (EEEE = 0)
// MMM · 2^-9, S.1111.111 NaN; then it is multiplied by its block's scale in f32 — the same single rounding as the
// jnp reference's values.astype(f32) * scale. (A 256-entry table did the same one element at a time, 2.5 ns per
// weight: 50× slower than the f32 kernel's multiply-adds at decode.)

#ifndef QCOMPILE_NATIVE_FP8_H_
#define QCOMPILE_NATIVE_FP8_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace qcompile_native {

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      float v;
      if (exponent == 15 && mantissa == 7) {
        v = std::numeric_limits<float>::quiet_NaN();  // e4m3fn has no infinities; S.1111.111 is NaN
      } else if (exponent == 0) {
        v = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: mantissa/8 · 2^-6
      } else {
        v = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      }
      value[b] = (b & 128) ? -v : v;
    }
  }
};

inline const float* fp8_table() {
  static const Fp8Table table;
  return table.value;
}

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// dst[0:16] = value(src[0:16]) · s.
inline void dequant16(const uint8_t* src, float s, float* dst) {
  // 16 bytes widened to 16 lanes (GCC scalarizes __builtin_convertvector of bytes: 3x slower, so intrinsics here)
#if defined(__AVX512F__)
  const u32x16 b = (u32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#elif defined(__AVX2__)
  u32x16 b;
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8)));
  __builtin_memcpy(&b, &lo, 32);
  __builtin_memcpy(reinterpret_cast<char*>(&b) + 32, &hi, 32);
#else
  u32x16 b;
  for (int i = 0; i < 16; ++i) b[i] = src[i];
#endif
  const u32x16 em = b & 0x7fu;
  const u32x16 sign = (b & 0x80u) << 24;
  const u32x16 normal = ((em << 20) + (120u << 23)) | sign;
  const f32x16 sub = __builtin_convertvector((i32x16)(em & 7u), f32x16) * (1.0f / 512.0f);
  const u32x16 sub_bits = (u32x16)sub | sign;
  const u32x16 is_sub = (u32x16)(em < 8u);  // all ones where true
  const u32x16 is_nan = (u32x16)(em == 0x7fu);
  u32x16 bits = (sub_bits & is_sub) | (normal & ~is_sub);
  bits = ((sign | 0x7fc00000u) & is_nan) | (bits & ~is_nan);
  *reinterpret_cast<f32x16u*>(dst) = (f32x16)bits * s;
}

// dst[0:n] = value(src[0:n]) · scale[c / block] for columns c = 0..n-1 (scale: this row's block scales).
inline void dequant_row(const uint8_t* src, const float* scale, int64_t block, int64_t n, float* dst) {
  const float* table = fp8_table();
  for (int64_t c0 = 0, b = 0; c0 < n; c0 += block, ++b) {
    const float s = scale[b];
    const int64_t c1 = std::min(n, c0 + block);
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) dequant16(src + c, s, dst + c);
    for (; c < c1; ++c) dst[c] = table[src[c]] * s;
  }
}

// A row of 64 FP8 weights of one block scale, dequantized in registers (the panel kernels: a 64-column panel row is
// one cache line of FP8). Where the CPU has AVX-512 BW, e4m3 goes through fp16: the byte sign-extended to 16 bits and
// shifted left by 7 puts S at bit 15 and EEEE.MMM at bits 7..13 of an fp16 whose value is the FP8 value · 2^-8 (fp16's
// exponent bias is 15, e4m3's 7; FP8 subnormals land on fp16 subnormals, zero on zero), widened exactly to f32 by
// VCVTPH2PS, then multiplied by scale · 2^8: the product of two exact factors, rounded once — the reference's value.
// Five vector instructions per 16 weights instead of dequant16's fifteen. S.1111.111 (NaN) would come out finite
// this way, so a row holding one takes dequant16's route (one compare per row).
// With `bf16` each value is then rounded to bf16 (to nearest even, kept in f32 lanes): the dequantize of a bf16 graph,
// whose reference rounds W8 · S once to bf16.
struct Fp8RowScale {
  float scale, scaled;  // the block's scale, and scale · 2^8 (not finite: the row takes the portable route)
  bool bf16;
  explicit Fp8RowScale(float s, bool to_bf16 = false) : scale(s), scaled(s * 256.0f), bf16(to_bf16) {}
};

// f32 lanes rounded to the nearest bf16 (ties to even), as f32: the bit trick of an f32 -> bf16 conversion (NaN stays
// NaN, overflow goes to infinity) without leaving f32.
inline f32x16 round_bf16(f32x16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &bits, sizeof(bits));
  return v;
}

inline void dequant64_portable(const uint8_t* src, float s, float* dst) {
  for (int i = 0; i < 64; i += 16) dequant16(src + i, s, dst + i);
}

// dst[0:4] (16 lanes each) = value(src[0:64]) · s (rounded to bf16 when s.bf16).
inline void dequant64(const uint8_t* src, const Fp8RowScale& s, f32x16 dst[4]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i bytes = _mm512_loadu_si512(src);
  const __m512i seven = _mm512_set1_epi8(0x7f);
  const __mmask64 nan = _mm512_cmpeq_epi8_mask(_mm512_and_si512(bytes, seven), seven);
  if (__builtin_expect(nan == 0 && std::isfinite(s.scaled), 1)) {
    const __m512i keep = _mm512_set1_epi16(static_cast<int16_t>(0xbfff));  // bit 14 held the sign: cleared
    const __m512i lo = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm512_castsi512_si256(bytes)), 7), keep);
    const __m512i hi =
        _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(bytes, 1)), 7), keep);
    const __m512 sv = _mm512_set1_ps(s.scaled);
    dst[0] = (f32x16)_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(lo)), sv);
    dst[1] = (f32x16)_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1)), sv);
    dst[2] = (f32x16)_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(hi)), sv);
    dst[3] = (f32x16)_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1)), sv);
  } else
#endif
  {
    float buf[64];
    dequant64_portable(src, s.scale, buf);
    for (int v = 0; v < 4; ++v) std::memcpy(&dst[v], buf + 16 * v, 64);
  }
  if (s.bf16)
    for (int v = 0; v < 4; ++v) dst[v] = round_bf16(dst[v]);
}

// dst[0:64] = the bf16 bits of value(src[0:64]) · s rounded to bf16 (s.bf16 set): a panel row for the VDPBF16PS
// pair tiles (bf16_pairs.h).
inline void dequant64_bf16(const uint8_t* src, const Fp8RowScale& s, uint16_t* dst) {
  typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
  f32x16 row[4];
  dequant64(src, s, row);  // already bf16 values: the low halves are zero
  for (int v = 0; v < 4; ++v) {
    u32x16 bits;
    std::memcpy(&bits, &row[v], sizeof(bits));
    *reinterpret_cast<u16x16*>(dst + 16 * v) = __builtin_convertvector(bits >> 16, u16x16);
  }
}

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_FP8_H_
