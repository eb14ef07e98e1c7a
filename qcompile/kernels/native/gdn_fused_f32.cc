// qcompile's native CPU Gated DeltaNet layer core (f32 compute), an XLA FFI custom call: causal depthwise conv +
// SiLU + q/k L2 norm + decay/β gates + the gated delta rule, one pass per token. Built and registered by
// qcompile/kernels/native.py; the CPU lowering of gated_delta_net (the gdn-conv-fusion pass's op) calls it.
//
// Inputs (ir/ops/gdn.py GatedDeltaNet's contract):
//   x [T, C] f32 or bf16 (the in_proj_qkv output, columns [q: Hk·dk | k: Hk·dk | v: Hv·dv]; bf16 values are
//   widened as each token's channels are gathered), a, b [T, Hv] f32,
//   (attr bf16_graph: x, a, b are a bf16 graph's values widened; the conv's sum is rounded to bf16 and SiLU and β's
//   sigmoid computed as that graph's bf16 ops round them as compiled, bf16.h — the rest is f32 there too),
//   conv_state [S, C, K-1], conv_w [C, K] f32, A_log, dt_bias [Hv] f32, state [S, Hv, dk, dv],
//   query_start [B+1], state_slots [B].
// Outputs: o [T, Hv, dv] f32 or bf16 (computed in f32; bf16 rounds each value once to nearest even, as converting
// the f32 result would), the new conv state and the new recurrent state, both aliasing their inputs (updated
// in place). Three entry points: states in f32; states in bf16 (the bf16-state pass), read into f32 at the start
// of a sequence's tokens and rounded once (to nearest even) when they are written back — computed in f32 throughout;
// and a bf16 conv state with an f32 recurrent state (a bf16 graph's caches).
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

#include "bf16.h"
#include "delta_rule.h"
#include "parallel_items.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float softplus(float x) { return x > 0.0f ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

// β = sigmoid(b) of a bf16 value as the reference computes it on CPU: e^-b and 1 + e^-b rounded to bf16, the
// quotient left in f32 — the graph converts β to f32 at once (kernels/gdn_fused.py gates), and XLA drops the
// quotient's rounding before such a conversion (its HLO divides in f32 and feeds the result on). Rounding it too
// flipped a near-tie route of a bf16 test model (tests/test_bf16_state.py's slow bf16 checkpoint) past the check.
inline float bf16_graph_beta(float b) {
  using qcompile_native::round16;
  using qcompile_native::splat;
  return (1.0f / round16(round16(qcompile_native::exp16_to_inf(-splat(b))) + 1.0f))[0];
}

// Between a run of conv history as stored, [n][width], and the kernel's window, [width][n] with rows `stride` apart
// (to_window true: run -> window, else back). width 3 (the K = 4 of every Qwen3.5 / Qwen3-Next size) is a
// compile-time stride, which the compiler vectorises with permutes; the scalar copy cost more than a decode token's
// delta rule.
template <int W, bool ToWindow>
inline void transpose_fixed(float* __restrict run, float* __restrict window, int64_t n, int64_t stride) {
  for (int64_t i = 0; i < n; ++i)
    for (int m = 0; m < W; ++m) {
      if constexpr (ToWindow)
        window[m * stride + i] = run[i * W + m];
      else
        run[i * W + m] = window[m * stride + i];
    }
}

inline void transpose_history(float* run, float* window, int64_t n, int64_t width, int64_t stride, bool to_window) {
  if (width == 3)
    return to_window ? transpose_fixed<3, true>(run, window, n, stride)
                     : transpose_fixed<3, false>(run, window, n, stride);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t m = 0; m < width; ++m) {
      if (to_window)
        window[m * stride + i] = run[i * width + m];
      else
        run[i * width + m] = window[m * stride + i];
    }
}

template <class ConvT, class StateT>
struct Job {
  const void* x;  // [T, C], f32 or bf16 (x_bf16)
  const float *a, *b, *conv_wt, *a_log, *dt_bias;  // conv_wt: the conv weights transposed, [K][C]
  ConvT* conv_state;
  StateT* state;
  const ConvT* const* conv_read;  // per sequence: the conv history it starts from ([C][K-1]), as stored before the call
  void* out;  // [T, Hv, dv], f32 or bf16 (out_bf16)
  const int32_t *query_start, *slots;
  int64_t t, c, k, s, hk, hv, dk, dv, nseq;
  bool bf16_graph;  // x, a, b hold bf16 values: the conv output and SiLU, and β, rounded as a bf16 graph rounds them
  bool x_bf16, out_bf16;
};

template <class ConvT, class StateT>
void run_item(const Job<ConvT, StateT>& j, int64_t item) {
  const int64_t seq = item / j.hk, kh = item % j.hk;
  const int64_t t0 = std::clamp<int64_t>(j.query_start[seq], 0, j.t);
  const int64_t t1 = std::clamp<int64_t>(j.query_start[seq + 1], t0, j.t);
  if (t0 == t1) return;
  const int64_t ratio = j.hv / j.hk, dk = j.dk, dv = j.dv, width = j.k - 1;
  const int64_t key_dim = j.hk * dk;
  // The item's channels, in order: q of kh, k of kh, v of its value heads — three contiguous column ranges of x,
  // packed into one run of nch channels (so every per-channel loop below is a plain vectorisable loop).
  const int64_t nch = 2 * dk + ratio * dv;
  const int64_t first[3] = {kh * dk, key_dim + kh * dk, 2 * key_dim + kh * ratio * dv};
  const int64_t count[3] = {dk, dk, ratio * dv};
  const int64_t offset[3] = {0, dk, 2 * dk};
  auto gather = [&](const float* row, float* dst) {
    for (int r = 0; r < 3; ++r) std::memcpy(dst + offset[r], row + first[r], sizeof(float) * count[r]);
  };
  auto gather_token = [&](int64_t t, float* dst) {  // token t's channels of x, in f32
    if (!j.x_bf16) return gather(static_cast<const float*>(j.x) + t * j.c, dst);
    const uint16_t* row = static_cast<const uint16_t*>(j.x) + t * j.c;
    for (int r = 0; r < 3; ++r) qcompile_native::widen(row + first[r], dst + offset[r], count[r]);
  };

  const int64_t slot = j.slots[seq];
  const bool in_range = slot >= 0 && slot < j.s;
  // window[tap][ch]: the K-1 previous pre-conv columns, oldest first; wt[tap][ch] the K taps' weights; xc, y: the
  // token's inputs and conv outputs. Per thread, reused across items and calls.
  static thread_local std::vector<float> window, wt, xc, y;
  for (auto* buf : {&window, &wt, &xc, &y})
    if (static_cast<int64_t>(buf->size()) < j.k * nch) buf->resize(j.k * nch);
  for (int64_t m = 0; m < j.k; ++m) gather(j.conv_wt + m * j.c, wt.data() + m * nch);
  // The conv history of a column range is one contiguous run of count·(K-1) values ([C][K-1]): widened (or copied)
  // as a run, then transposed — per-value conversions here cost more than the decode token's delta rule.
  static thread_local std::vector<float> run;
  if (static_cast<int64_t>(run.size()) < nch * width) run.resize(nch * width);
  for (int r = 0; r < 3; ++r) {
    qcompile_native::widen(j.conv_read[seq] + first[r] * width, run.data(), count[r] * width);
    transpose_history(run.data(), window.data() + offset[r], count[r], width, nch, true);
  }
  // The value heads' states: used where they lie when f32, or when bf16 and the sequence has one token this step
  // (each row widened and rounded back once); else (a bf16 prefill) read into f32 once, rounded once at the end.
  const int64_t per_head = dk * dv;
  const bool direct = in_range && (std::is_same<StateT, float>::value || t1 - t0 == 1);
  static thread_local std::vector<float> work;
  StateT* stored = in_range ? j.state + (slot * j.hv + kh * ratio) * per_head : nullptr;
  float* states = nullptr;
  if (!direct) {
    if (static_cast<int64_t>(work.size()) < ratio * per_head) work.resize(ratio * per_head);
    states = work.data();
    if (in_range)
      qcompile_native::widen(stored, states, ratio * per_head);
    else
      std::fill(states, states + ratio * per_head, 0.0f);
  }
  static thread_local std::vector<float> kst, qst, row, orow;  // orow: a bf16 output's f32 values
  for (auto* buf : {&kst, &qst, &row, &orow})
    if (static_cast<int64_t>(buf->size()) < dv) buf->resize(dv);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t t = t0; t < t1; ++t) {
    gather_token(t, xc.data());
    const float* w_cur = wt.data() + width * nch;
    for (int64_t i = 0; i < nch; ++i) y[i] = w_cur[i] * xc[i];
    for (int64_t m = 0; m < width; ++m) {
      const float* wm = wt.data() + m * nch;
      const float* xm = window.data() + m * nch;
      for (int64_t i = 0; i < nch; ++i) y[i] += wm[i] * xm[i];
    }
    if (j.bf16_graph)
      qcompile_native::silu_bf16_inplace(y.data(), nch);  // the conv's f32 sum rounded, then SiLU's ops
    else
      qcompile_native::silu_inplace(y.data(), nch);
    if (width > 0) {  // shift the window by one column, the current token last
      std::memmove(window.data(), window.data() + nch, sizeof(float) * (width - 1) * nch);
      std::memcpy(window.data() + (width - 1) * nch, xc.data(), sizeof(float) * nch);
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
      const float bt = j.b[t * j.hv + h];
      const float e = std::exp(g), beta = j.bf16_graph ? bf16_graph_beta(bt) : 1.0f / (1.0f + std::exp(-bt));
      float* ot = j.out_bf16 ? orow.data() : static_cast<float*>(j.out) + (t * j.hv + h) * dv;
      if (direct)
        qcompile_native::delta_rule_token(stored + r * per_head, kv, qv, vt, e, beta, dk, dv, ot, kst.data(),
                                          qst.data(), row.data());
      else
        qcompile_native::delta_rule_token(states + r * per_head, kv, qv, vt, e, beta, dk, dv, ot, kst.data(),
                                          qst.data(), row.data());
      if (j.out_bf16) qcompile_native::narrow(ot, static_cast<uint16_t*>(j.out) + (t * j.hv + h) * dv, dv);
    }
  }
  if (!in_range) return;
  for (int r = 0; r < 3; ++r) {
    transpose_history(run.data(), window.data() + offset[r], count[r], width, nch, false);
    qcompile_native::narrow(run.data(), j.conv_state + (slot * j.c + first[r]) * width, count[r] * width);
  }
  if (!direct) qcompile_native::narrow(states, stored, ratio * per_head);
}

template <ffi::DataType CD, ffi::DataType SD>
ffi::Error GdnFused(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                    ffi::Buffer<CD> conv_state, ffi::Buffer<ffi::F32> conv_w, ffi::Buffer<ffi::F32> a_log,
                    ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<SD> state, ffi::Buffer<ffi::S32> query_start,
                    ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<CD> new_conv,
                    ffi::ResultBuffer<SD> new_state, int64_t bf16_graph) {
  using ConvT = ffi::NativeType<CD>;
  using StateT = ffi::NativeType<SD>;
  const auto xd = x.dimensions(), ad = a.dimensions(), csd = conv_state.dimensions(), wd = conv_w.dimensions();
  const auto sd = state.dimensions(), qsd = query_start.dimensions(), sld = slots.dimensions(), od = out->dimensions();
  const auto is_f32_or_bf16 = [](ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; };
  bool ok = is_f32_or_bf16(x.element_type()) && is_f32_or_bf16(out->element_type()) && xd.size() == 2 &&
            ad.size() == 2 && csd.size() == 3 && wd.size() == 2 && sd.size() == 4 &&
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
        "qcompile gdn fused: expected x[T,C] (f32 or bf16), a,b[T,Hv], conv_state[S,C,K-1], conv_w[C,K], "
        "A_log,dt_bias[Hv], state[S,Hv,dk,dv] with C = 2·Hk·dk + Hv·dv, query_start[B+1], state_slots[B]; "
        "o[T,Hv,dv] f32 or bf16");
  std::vector<float> conv_wt(conv_w.element_count());  // [C][K] -> [K][C], once per call (C·K floats)
  for (int64_t c = 0; c < wd[0]; ++c)
    for (int64_t m = 0; m < wd[1]; ++m) conv_wt[m * wd[0] + c] = conv_w.typed_data()[c * wd[1] + m];
  std::vector<const ConvT*> conv_read(sld[0]);
  Job<ConvT, StateT> j{x.untyped_data(), a.typed_data(), b.typed_data(), conv_wt.data(), a_log.typed_data(),
                dt_bias.typed_data(), new_conv->typed_data(), new_state->typed_data(), conv_read.data(),
                out->untyped_data(), query_start.typed_data(), slots.typed_data(), xd[0], xd[1], wd[1], sd[0],
                (xd[1] - sd[1] * sd[3]) / (2 * sd[2]), sd[1], sd[2], sd[3], sld[0], bf16_graph != 0,
                x.element_type() == ffi::DataType::BF16, out->element_type() == ffi::DataType::BF16};
  if (j.conv_state != conv_state.typed_data())  // not aliased: start from the inputs
    std::memcpy(j.conv_state, conv_state.typed_data(), sizeof(ConvT) * conv_state.element_count());
  if (j.state != state.typed_data())
    std::memcpy(j.state, state.typed_data(), sizeof(StateT) * state.element_count());
  // A sequence with an out-of-range slot starts from the clamped slot's conv history as stored before this call
  // (as the reference does) and stores nothing; that slot may belong to another sequence of the batch, which
  // updates it in place meanwhile, so those histories are copied first (C·(K-1) values each; never in a served batch).
  const int64_t block = j.c * (j.k - 1);
  std::vector<ConvT> snapshots;
  for (int64_t seq = 0; seq < j.nseq; ++seq) {
    const int64_t slot = j.slots[seq];
    if (slot >= 0 && slot < j.s) {
      conv_read[seq] = j.conv_state + slot * block;
    } else if (j.query_start[seq + 1] > j.query_start[seq]) {
      const ConvT* from = j.conv_state + std::clamp<int64_t>(slot, 0, j.s - 1) * block;
      snapshots.insert(snapshots.end(), from, from + block);
    }
  }
  for (int64_t seq = 0, taken = 0; seq < j.nseq; ++seq) {  // pointers after the vector stopped growing
    const int64_t slot = j.slots[seq];
    if ((slot < 0 || slot >= j.s) && j.query_start[seq + 1] > j.query_start[seq])
      conv_read[seq] = snapshots.data() + (taken++) * block;
  }
  const int64_t valid = std::clamp<int64_t>(j.query_start[j.nseq], 0, j.t);
  const int64_t out_bytes = j.out_bf16 ? 2 : 4;  // padding rows: 0
  std::memset(static_cast<char*>(j.out) + out_bytes * valid * j.hv * j.dv, 0,
              out_bytes * (j.t - valid) * j.hv * j.dv);
  qcompile_native::parallel_items(pool, j.nseq * j.hk, [j](int64_t item) { run_item(j, item); });
  return ffi::Error::Success();
}

}  // namespace

#define QCOMPILE_GDN_FUSED_BINDING(CD, SD)       \
  ffi::Ffi::Bind()                               \
      .Ctx<ffi::ThreadPool>()                    \
      .Arg<ffi::AnyBuffer>() /* x */             \
      .Arg<ffi::Buffer<ffi::F32>>() /* a */      \
      .Arg<ffi::Buffer<ffi::F32>>() /* b */      \
      .Arg<ffi::Buffer<CD>>() /* conv_state */   \
      .Arg<ffi::Buffer<ffi::F32>>() /* conv_w */ \
      .Arg<ffi::Buffer<ffi::F32>>() /* A_log */  \
      .Arg<ffi::Buffer<ffi::F32>>() /* dt_bias */\
      .Arg<ffi::Buffer<SD>>() /* state */        \
      .Arg<ffi::Buffer<ffi::S32>>()              \
      .Arg<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::AnyBuffer>() /* o */             \
      .Ret<ffi::Buffer<CD>>()                    \
      .Ret<ffi::Buffer<SD>>()                    \
      .Attr<int64_t>("bf16_graph")

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGdnFusedF32, (GdnFused<ffi::F32, ffi::F32>),
                              QCOMPILE_GDN_FUSED_BINDING(ffi::F32, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGdnFusedBf16State, (GdnFused<ffi::BF16, ffi::BF16>),
                              QCOMPILE_GDN_FUSED_BINDING(ffi::BF16, ffi::BF16));
// A bf16 graph's caches without the bf16-state pass: the conv state (pre-conv bf16 values) in bf16, the recurrent
// state in f32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGdnFusedBf16Conv, (GdnFused<ffi::BF16, ffi::F32>),
                              QCOMPILE_GDN_FUSED_BINDING(ffi::BF16, ffi::F32));
