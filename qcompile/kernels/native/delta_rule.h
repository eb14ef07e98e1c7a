// Shared by qcompile's native GDN kernels: one token of the gated delta rule for one head, in place.
//
//     S = e·S;  S = S + k ⊗ β(v − Sᵀk);  o = Sᵀq          (read after the write; spec/model.md §3.5)
//
// computed with one read pass and one write pass over S[dk][dv] (design.md §4.5):
//     Sᵀk after the decay = e·(Sᵀk),   o = e·(Sᵀq) + (k·q)·δ   with δ = β(v − e·Sᵀk)
// kst and qst are caller scratch of dv floats each.

#ifndef QCOMPILE_NATIVE_DELTA_RULE_H_
#define QCOMPILE_NATIVE_DELTA_RULE_H_

#include <cstdint>
#include <type_traits>

#include "bf16.h"
#include "vec16.h"

namespace qcompile_native {

// delta_rule_token for dv == 16·NV (128 at every Qwen3.5 / Qwen3-Next size): Sᵀk, Sᵀq and δ in registers across
// the rows of S instead of going through memory at every row (same operations in the same order: the same bits).
template <int NV, class StateT>
inline void delta_rule_token_fixed(StateT* st, const float* kt, const float* qt, const float* vt, float e, float beta,
                                   int64_t dk, float* out) {
  constexpr int64_t dv = 16 * NV;
  v16 ks[NV], qs[NV];
  for (int v = 0; v < NV; ++v) ks[v] = qs[v] = v16{};
  float kq = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = kt[i], qi = qt[i];
    kq += ki * qi;
    for (int v = 0; v < NV; ++v) {
      const v16 s = load_as_f32(st + i * dv + 16 * v);
      ks[v] = ks[v] + ki * s;
      qs[v] = qs[v] + qi * s;
    }
  }
  v16 delta[NV];
  for (int v = 0; v < NV; ++v) {
    delta[v] = beta * (load(vt + 16 * v) - e * ks[v]);
    store(out + 16 * v, e * qs[v] + kq * delta[v]);
  }
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = kt[i];
    for (int v = 0; v < NV; ++v) {
      const v16 updated = e * load_as_f32(st + i * dv + 16 * v) + ki * delta[v];
      if constexpr (std::is_same<StateT, float>::value)
        store(st + i * dv + 16 * v, updated);
      else
        narrow16(updated, st + i * dv + 16 * v);
    }
  }
}

template <class StateT>
inline void delta_rule_token(StateT* st, const float* kt, const float* qt, const float* vt, float e, float beta,
                             int64_t dk, int64_t dv, float* out, float* kst, float* qst, float* row) {
  if (dv == 128) return delta_rule_token_fixed<8>(st, kt, qt, vt, e, beta, dk, out);
  // st is f32 (used in place) or bf16 (each row widened in registers, 16 values at a time, and rounded back once:
  // for one token per step that is the same single rounding as a whole-state copy, without the copy; `row`, dv
  // floats of caller scratch, serves the rows' last dv % 16 values).
  constexpr bool f32 = std::is_same<StateT, float>::value;
  const int64_t dv16 = f32 ? 0 : dv - dv % 16;  // bf16: columns done 16 at a time
  auto row_f32 = [&](int64_t i) -> const float* {
    if constexpr (f32) {
      return st + i * dv;
    } else {
      widen(st + i * dv + dv16, row + dv16, dv - dv16);
      return row;
    }
  };
  for (int64_t c = 0; c < dv; ++c) kst[c] = qst[c] = 0.0f;
  float kq = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = kt[i], qi = qt[i];
    const float* __restrict sr = row_f32(i);
    kq += ki * qi;
    if constexpr (!f32) {
      for (int64_t c = 0; c < dv16; c += 16) {
        const v16 s = widen16(st + i * dv + c);
        store(kst + c, load(kst + c) + ki * s);
        store(qst + c, load(qst + c) + qi * s);
      }
    }
    for (int64_t c = dv16; c < dv; ++c) {
      kst[c] += ki * sr[c];
      qst[c] += qi * sr[c];
    }
  }
  for (int64_t c = 0; c < dv; ++c) {
    const float delta = beta * (vt[c] - e * kst[c]);
    out[c] = e * qst[c] + kq * delta;
    kst[c] = delta;  // reused: δ
  }
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = kt[i];
    if constexpr (f32) {
      float* __restrict sr = st + i * dv;
      for (int64_t c = 0; c < dv; ++c) sr[c] = e * sr[c] + ki * kst[c];
    } else {
      for (int64_t c = 0; c < dv16; c += 16)
        narrow16(e * widen16(st + i * dv + c) + ki * load(kst + c), st + i * dv + c);
      const float* sr = row_f32(i);
      for (int64_t c = dv16; c < dv; ++c) row[c] = e * sr[c] + ki * kst[c];
      narrow(row + dv16, st + i * dv + dv16, dv - dv16);
    }
  }
}

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_DELTA_RULE_H_
