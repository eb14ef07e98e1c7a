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

namespace qcompile_native {

inline void delta_rule_token(float* st, const float* kt, const float* qt, const float* vt, float e, float beta,
                             int64_t dk, int64_t dv, float* out, float* kst, float* qst) {
  for (int64_t c = 0; c < dv; ++c) kst[c] = qst[c] = 0.0f;
  float kq = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = kt[i], qi = qt[i];
    const float* __restrict sr = st + i * dv;
    kq += ki * qi;
    for (int64_t c = 0; c < dv; ++c) {
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
    float* __restrict sr = st + i * dv;
    for (int64_t c = 0; c < dv; ++c) sr[c] = e * sr[c] + ki * kst[c];
  }
}

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_DELTA_RULE_H_
