// Shared by qcompile's native kernels: bf16 <-> f32 over contiguous runs (vectorisable loops, no branches).
// f32 -> bf16 rounds to nearest even, as XLA and ml_dtypes do; a NaN stays a (quiet) NaN.

#ifndef QCOMPILE_NATIVE_BF16_H_
#define QCOMPILE_NATIVE_BF16_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec16.h"

namespace qcompile_native {

inline void widen(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

inline void narrow(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, 4);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    dst[i] = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

// The same conversions for 16 values at a time, in registers: no f32 copy of a bf16 row goes through memory.
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 widen16(const uint16_t* src) {
#if defined(__AVX512F__)
  // VPMOVZXWD from memory and a shift: GCC compiles the generic form below into two 256-bit widenings, an extract
  // and an insert (6 instructions for 16 values), which made bf16 keys and values cost more than their FMAs.
  const __m512i bits =
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16);
  return (v16)_mm512_castsi512_ps(bits);
#else
  const u32x16 bits = __builtin_convertvector(*reinterpret_cast<const u16x16*>(src), u32x16) << 16;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

// value rounded to the nearest bf16 (even on ties), kept as f32: what a bf16 graph stores after each op.
inline v16 round16(v16 value) {
  u32x16 bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const u32x16 quiet_nan = (bits | 0x400000u) & 0xffff0000u;
  const u32x16 out = (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  std::memcpy(&value, &out, sizeof(value));
  return value;
}

inline void narrow16(v16 value, uint16_t* dst) {
#if defined(__AVX512BF16__)
  // VCVTNEPS2BF16 is this rounding in one instruction (nearest even; a NaN keeps its top bits and is made quiet)
  // except that it flushes f32 denormal inputs to zero; a vector with a denormal lane (exponent 0, mantissa not 0:
  // rare) takes the generic path below. The generic form was 8 vector ops, as many as a state row's FMAs.
  const __m512i raw = (__m512i)value;
  const __mmask16 denormal = _mm512_testn_epi32_mask(raw, _mm512_set1_epi32(0x7f800000)) &
                             _mm512_test_epi32_mask(raw, _mm512_set1_epi32(0x007fffff));
  if (__builtin_expect(denormal == 0, 1)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh((__m512)value));
    return;
  }
#endif
  u32x16 bits;
  const v16 rounded = round16(value);
  std::memcpy(&bits, &rounded, sizeof(bits));
#if defined(__AVX512F__)
  // VPMOVDW (GCC compiles the generic form into word permutes)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16((__m512i)(bits >> 16)));
#else
  *reinterpret_cast<u16x16*>(dst) = __builtin_convertvector(bits >> 16, u16x16);
#endif
}

// e^x up to f32's overflow: exp16 clamps above 88.38, so the lanes past 88 take 2 e^(x - ln 2), and e^x = inf from
// ln(FLT_MAX) on, as the reference's exp gives.
inline v16 exp16_to_inf(v16 x) {
  const auto high = x > 88.0f;
  const v16 e = exp16(high ? x - 0.693147180559945f : x);
  return x > 88.72283935546875f ? splat(INFINITY) : high ? e * 2.0f : e;
}

// sigmoid(x) = 1 / (1 + e^-x) of bf16 values x as a bf16 graph computes it, each op rounded to bf16.
inline v16 sigmoid_bf16_values(v16 x) { return round16(1.0f / round16(round16(exp16_to_inf(-x)) + 1.0f)); }

inline v16 swiglu_bf16_values(v16 gate, v16 up) {
  const v16 g = round16(gate), u = round16(up);
  return round16(g * sigmoid_bf16_values(g)) * u;  // narrow16 rounds the last product
}

// y = silu(y rounded to bf16) over n floats, as a bf16 graph computes jax.nn.silu (every op rounded to bf16; the
// values stay f32 holding bf16 values).
inline void silu_bf16_inplace(float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 g = round16(load(y + i));
    store(y + i, round16(g * sigmoid_bf16_values(g)));
  }
  if (i < n) {
    float tail[16] = {};
    std::memcpy(tail, y + i, sizeof(float) * (n - i));
    const v16 g = round16(load(tail));
    store(tail, round16(g * sigmoid_bf16_values(g)));
    std::memcpy(y + i, tail, sizeof(float) * (n - i));
  }
}

// dst = the bf16 bits of silu(g) · u for the f32 products g (gate) and u (up), as a bf16 graph computes SwiGLU's
// halves (kernels/grouped_matmul.py swiglu_halves: jax.nn.silu on bf16, then the product): g and u rounded to bf16,
// then every op in f32 and rounded to bf16 after it — e^-g, 1 + e^-g, 1 / (1 + e^-g), g · that, · u. An epilogue
// that rounded only its result would round in other places than the reference, which in a deep bf16 MoE flips routes.
inline void swiglu_bf16(const float* gate, const float* up, uint16_t* dst, int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) narrow16(swiglu_bf16_values(load(gate + c), load(up + c)), dst + c);
  if (c < n) {  // the tail through zero-padded vectors
    float g[16] = {}, u[16] = {};
    uint16_t out[16];
    std::memcpy(g, gate + c, sizeof(float) * (n - c));
    std::memcpy(u, up + c, sizeof(float) * (n - c));
    narrow16(swiglu_bf16_values(load(g), load(u)), out);
    std::memcpy(dst + c, out, sizeof(uint16_t) * (n - c));
  }
}

inline void widen(const float* __restrict src, float* __restrict dst, int64_t n) { std::memcpy(dst, src, 4 * n); }
inline void narrow(const float* __restrict src, float* __restrict dst, int64_t n) { std::memcpy(dst, src, 4 * n); }

// A row's values as f32 whether the row is f32 or bf16 (for kernels templated over the element type).
inline v16 load_as_f32(const float* p) { return load(p); }
inline v16 load_as_f32(const uint16_t* p) { return widen16(p); }
inline float value_as_f32(const float* p) { return *p; }
inline float value_as_f32(const uint16_t* p) {
  float out;
  widen(p, &out, 1);
  return out;
}

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_BF16_H_
