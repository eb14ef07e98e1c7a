// qcompile's native CPU Gated DeltaNet layer core (f32 compute), an XLA FFI custom call: causal depthwise conv +
// SiLU + q/k L2 norm + decay/β gates + the gated delta rule, one pass per token. Built and registered by
// qcompile/kernels/native.py; the CPU lowering of gated_delta_net (the gdn-conv-fusion pass's op) calls it.
//
// Inputs (ir/ops/gdn.py GatedDeltaNet's contract):
//   x [T, C] f32 (the in_proj_qkv output, columns [q: Hk·dk | k: Hk·dk | v: Hv·dv]), a, b [T, Hv] f32,
//   conv_state [S, C, K-1], conv_w [C, K] f32, A_log, dt_bias [Hv] f32, state [S, Hv, dk, dv],
//   query_start [B+1], state_slots [B].
// Outputs: o [T, Hv, dv] f32, the new conv state and the new recurrent state, both aliasing their inputs (updated
// in place). Two entry points: states in f32, and states in bf16 (the bf16-state pass), read into f32 at the start
// of a sequence's tokens and rounded once (to nearest even) when they are written back — computed in f32 throughout.
//
// Per token of sequence b (slot s = state_slots[b]), per channel c: y_c = silu(Σ_j w[c,j]·x_{t-K+1+j, c}) with the
// taps before the sequence's first new token read from conv_state[s] (column K-2 the most recent); then
//   q = l2norm(y_q)·dk^-½, k = l2norm(y_k) (x·rsqrt(Σx²+1e-6)), value head h reads key head h / (Hv/Hk);
//   g = −exp(A_log)·softplus(a + dt_bias), β = sigmoid(b);
//   S = exp(g)·S;  S = S + k ⊗ β(v − Sᵀk);  o = Sᵀq      (one read pass and one write pass: design.md §4.5)
// The conv state keeps the last K-1 pre-conv columns. Tokens from query_start[B] on are padding: output 0, no state
// touched. A slot outside [0, S) gives the conv the state of the clipped slot and the recurrence a zero state, and is
// not written (as the jnp reference's clip / fill / drop).
//
// Work items are (sequence, key head) pairs: an item owns the conv channels of its key head's q and k and of its
// Hv/Hk value heads' v, and those value heads' states, so no two items write the same bytes (parallel_items.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "delta_rule.h"
#include "parallel_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void store(float* p, float f) { *p = f; }
inline void store(uint16_t* p, float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

inline float silu(float y) { return y / (1.0f + std::exp(-y)); }
inline float softplus(float x) { return x > 0.0f ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

template <class StateT>
struct Job {
  const float *x, *a, *b, *conv_w, *a_log, *dt_bias;
  StateT *conv_state, *state;
  float* out;
  const int32_t *query_start, *slots;
  int64_t t, c, k, s, hk, hv, dk, dv, nseq;
};

template <class StateT>
void run_item(const Job<StateT>& j, int64_t item) {
  const int64_t seq = item / j.hk, kh = item % j.hk;
  const int64_t t0 = std::clamp<int64_t>(j.query_start[seq], 0, j.t);
  const int64_t t1 = std::clamp<int64_t>(j.query_start[seq + 1], t0, j.t);
  if (t0 == t1) return;
  const int64_t ratio = j.hv / j.hk, dk = j.dk, dv = j.dv, width = j.k - 1;
  const int64_t key_dim = j.hk * dk;
  // The item's channels, in order: q of kh, k of kh, v of its value heads (three contiguous column ranges).
  const int64_t nch = 2 * dk + ratio * dv;
  std::vector<int64_t> chan(nch);
  for (int64_t i = 0; i < dk; ++i) chan[i] = kh * dk + i, chan[dk + i] = key_dim + kh * dk + i;
  for (int64_t i = 0; i < ratio * dv; ++i) chan[2 * dk + i] = 2 * key_dim + kh * ratio * dv + i;

  const int64_t slot = j.slots[seq];
  const bool in_range = slot >= 0 && slot < j.s;
  const int64_t conv_slot = std::clamp<int64_t>(slot, 0, j.s - 1);
  // window[tap][ch]: the K-1 previous pre-conv columns, oldest first; weights wt[tap][ch] for the K taps.
  std::vector<float> window(width * nch), wt(j.k * nch), y(nch);
  for (int64_t i = 0; i < nch; ++i) {
    const StateT* cs = j.conv_state + (conv_slot * j.c + chan[i]) * width;
    for (int64_t m = 0; m < width; ++m) window[m * nch + i] = load(cs + m);
    for (int64_t m = 0; m < j.k; ++m) wt[m * nch + i] = j.conv_w[chan[i] * j.k + m];
  }
  // The value heads' states in f32: in place when StateT is float and the slot is real, else a working copy.
  const int64_t per_head = dk * dv;
  constexpr bool in_place_ok = std::is_same<StateT, float>::value;
  std::vector<float> work;
  float* states;
  StateT* stored = in_range ? j.state + (slot * j.hv + kh * ratio) * per_head : nullptr;
  if (in_place_ok && in_range) {
    states = reinterpret_cast<float*>(stored);
  } else {
    work.assign(ratio * per_head, 0.0f);
    if (in_range)
      for (int64_t i = 0; i < ratio * per_head; ++i) work[i] = load(stored + i);
    states = work.data();
  }
  std::vector<float> kst(dv), qst(dv);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t t = t0; t < t1; ++t) {
    const float* xt = j.x + t * j.c;
    for (int64_t i = 0; i < nch; ++i) {
      const float cur = xt[chan[i]];
      float acc = wt[width * nch + i] * cur;
      for (int64_t m = 0; m < width; ++m) acc += wt[m * nch + i] * window[m * nch + i];
      y[i] = silu(acc);
    }
    if (width > 0) {  // shift the window by one column, the current token last
      std::memmove(window.data(), window.data() + nch, sizeof(float) * (width - 1) * nch);
      for (int64_t i = 0; i < nch; ++i) window[(width - 1) * nch + i] = xt[chan[i]];
    }
    float* qv = y.data();
    float* kv = y.data() + dk;
    float qq = 0.0f, kk = 0.0f;
    for (int64_t i = 0; i < dk; ++i) qq += qv[i] * qv[i], kk += kv[i] * kv[i];
    const float qn = 1.0f / std::sqrt(qq + 1e-6f), kn = 1.0f / std::sqrt(kk + 1e-6f);
    for (int64_t i = 0; i < dk; ++i) {
      qv[i] = qv[i] * qn * q_scale;
      kv[i] = kv[i] * kn;
    }
    for (int64_t r = 0; r < ratio; ++r) {
      const int64_t h = kh * ratio + r;
      const float* vt = y.data() + 2 * dk + r * dv;
      const float g = -std::exp(j.a_log[h]) * softplus(j.a[t * j.hv + h] + j.dt_bias[h]);
      const float e = std::exp(g), beta = 1.0f / (1.0f + std::exp(-j.b[t * j.hv + h]));
      qcompile_native::delta_rule_token(states + r * per_head, kv, qv, vt, e, beta, dk, dv,
                                        j.out + (t * j.hv + h) * dv, kst.data(), qst.data());
    }
  }
  if (!in_range) return;
  for (int64_t i = 0; i < nch; ++i) {
    StateT* cs = j.conv_state + (slot * j.c + chan[i]) * width;
    for (int64_t m = 0; m < width; ++m) store(cs + m, window[m * nch + i]);
  }
  if (!(in_place_ok && in_range))
    for (int64_t i = 0; i < ratio * per_head; ++i) store(stored + i, work[i]);
}

template <ffi::DataType SD>
ffi::Error GdnFused(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                    ffi::Buffer<SD> conv_state, ffi::Buffer<ffi::F32> conv_w, ffi::Buffer<ffi::F32> a_log,
                    ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<SD> state, ffi::Buffer<ffi::S32> query_start,
                    ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<SD> new_conv,
                    ffi::ResultBuffer<SD> new_state) {
  using StateT = ffi::NativeType<SD>;
  const auto xd = x.dimensions(), ad = a.dimensions(), csd = conv_state.dimensions(), wd = conv_w.dimensions();
  const auto sd = state.dimensions(), qsd = query_start.dimensions(), sld = slots.dimensions(), od = out->dimensions();
  bool ok = xd.size() == 2 && ad.size() == 2 && csd.size() == 3 && wd.size() == 2 && sd.size() == 4 &&
            qsd.size() == 1 && sld.size() == 1 && od.size() == 3;
  if (ok) {
    const int64_t hv = sd[1], dk = sd[2], dv = sd[3], c = xd[1];
    const int64_t qk = c - hv * dv;
    ok = ad[0] == xd[0] && ad[1] == hv && b.element_count() == a.element_count() && csd[1] == c && wd[0] == c &&
         csd[2] == wd[1] - 1 && csd[0] == sd[0] && a_log.element_count() == hv && dt_bias.element_count() == hv &&
         dk > 0 && qk > 0 && qk % (2 * dk) == 0 && hv % (qk / (2 * dk)) == 0 && qsd[0] == sld[0] + 1 &&
         od[0] == xd[0] && od[1] == hv && od[2] == dv && sd[0] > 0;
  }
  if (!ok)
    return ffi::Error::InvalidArgument(
        "qcompile gdn fused: expected x[T,C], a,b[T,Hv], conv_state[S,C,K-1], conv_w[C,K], A_log,dt_bias[Hv], "
        "state[S,Hv,dk,dv] with C = 2·Hk·dk + Hv·dv, query_start[B+1], state_slots[B]");
  Job<StateT> j{x.typed_data(), a.typed_data(), b.typed_data(), conv_w.typed_data(), a_log.typed_data(),
                dt_bias.typed_data(), new_conv->typed_data(), new_state->typed_data(), out->typed_data(),
                query_start.typed_data(), slots.typed_data(), xd[0], xd[1], wd[1], sd[0],
                (xd[1] - sd[1] * sd[3]) / (2 * sd[2]), sd[1], sd[2], sd[3], sld[0]};
  if (j.conv_state != conv_state.typed_data())  // not aliased: start from the inputs
    std::memcpy(j.conv_state, conv_state.typed_data(), sizeof(StateT) * conv_state.element_count());
  if (j.state != state.typed_data())
    std::memcpy(j.state, state.typed_data(), sizeof(StateT) * state.element_count());
  const int64_t valid = std::clamp<int64_t>(j.query_start[j.nseq], 0, j.t);
  std::fill(j.out + valid * j.hv * j.dv, j.out + j.t * j.hv * j.dv, 0.0f);  // padding rows
  qcompile_native::parallel_items(pool, j.nseq * j.hk, [j](int64_t item) { run_item(j, item); });
  return ffi::Error::Success();
}

}  // namespace

#define QCOMPILE_GDN_FUSED_BINDING(SD)           \
  ffi::Ffi::Bind()                               \
      .Ctx<ffi::ThreadPool>()                    \
      .Arg<ffi::Buffer<ffi::F32>>() /* x */      \
      .Arg<ffi::Buffer<ffi::F32>>() /* a */      \
      .Arg<ffi::Buffer<ffi::F32>>() /* b */      \
      .Arg<ffi::Buffer<SD>>() /* conv_state */   \
      .Arg<ffi::Buffer<ffi::F32>>() /* conv_w */ \
      .Arg<ffi::Buffer<ffi::F32>>() /* A_log */  \
      .Arg<ffi::Buffer<ffi::F32>>() /* dt_bias */\
      .Arg<ffi::Buffer<SD>>() /* state */        \
      .Arg<ffi::Buffer<ffi::S32>>()              \
      .Arg<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::F32>>()              \
      .Ret<ffi::Buffer<SD>>()                    \
      .Ret<ffi::Buffer<SD>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGdnFusedF32, GdnFused<ffi::F32>, QCOMPILE_GDN_FUSED_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGdnFusedBf16State, GdnFused<ffi::BF16>, QCOMPILE_GDN_FUSED_BINDING(ffi::BF16));
