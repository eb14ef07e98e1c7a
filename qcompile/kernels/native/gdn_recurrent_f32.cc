// qcompile's native CPU gated delta rule (f32, recurrent form), an XLA FFI custom call. Built and registered by
// qcompile/kernels/native.py; the CPU lowering of gdn_recurrence calls it through jax.ffi.ffi_call.
//
// Inputs (kernels/gdn.py's contract, q and k already L2-normalised, q scaled, both expanded to the value heads):
//   q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state [S, H, dk, dv], query_start [B+1], state_slots [B].
// Outputs: o [T, H, dv] and the new state, which aliases the input state (updated in place). Two entry points: an f32
// state, and a bf16 state (the bf16-state pass) read into f32 once per step, computed in f32, rounded once when stored.
// Sequence b owns tokens [query_start[b], query_start[b+1]) and state slot state_slots[b]; per token, head by head:
//     S = exp(g)·S;  S = S + k ⊗ β(v − Sᵀk);  o = Sᵀq          (read after the write; spec/model.md §3.5)
// Tokens from query_start[B] on are padding: they get the output of a zero state, (k·q)·β·v, and touch no state. A
// slot outside [0, S) reads as a zero state and is not written (as the jnp reference's fill/drop gather and scatter).
//
// Why a custom call: XLA runs the jnp recurrence as a scan over token slots, each step gathering and scattering its
// sequence's [H, dk, dv] state (docs/cpu_rules_attention.md); at decode the state is most of the bytes a GDN layer
// moves. This kernel reads each state once and writes it once per token, in place, using the identity
//     Sᵀk after the decay = e·(Sᵀk),   o = e·(Sᵀq) + (k·q)·δ   with e = exp(g), δ = β(v − e·Sᵀk)
// so one pass computes Sᵀk and Sᵀq together and a second pass writes e·S + k ⊗ δ (design.md §4.5). Work items are
// (sequence, head) pairs, run on the caller and XLA's intra-op threads (parallel_items.h); an item walks its
// sequence's tokens in order, so tokens of one sequence chain and sequences never share a state.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "delta_rule.h"
#include "parallel_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

template <class StateT>
struct Job {
  const float *q, *k, *v, *g, *beta;
  StateT* state;
  float* out;
  const int32_t *query_start, *slots;
  int64_t t, h, dk, dv, s, b;
};

// One token of one head against the state matrix st[dk][dv] (f32, or bf16 for a one-token step), in place.
template <class JobT, class T>
void token(const JobT& j, int64_t t, int64_t head, T* st, float* scratch) {
  const int64_t row = t * j.h + head;
  qcompile_native::delta_rule_token(st, j.k + row * j.dk, j.q + row * j.dk, j.v + row * j.dv, std::exp(j.g[row]),
                                    j.beta[row], j.dk, j.dv, j.out + row * j.dv, scratch, scratch + j.dv,
                                    scratch + 2 * j.dv);
}

template <class StateT>
void run_item(const Job<StateT>& j, int64_t item) {
  const int64_t seq = item / j.h, head = item % j.h;
  const int64_t t0 = std::clamp<int64_t>(j.query_start[seq], 0, j.t);
  const int64_t t1 = std::clamp<int64_t>(j.query_start[seq + 1], t0, j.t);
  if (t0 == t1) return;
  static thread_local std::vector<float> scratch, work;  // per thread, reused across items and calls
  const int64_t per_head = j.dk * j.dv;
  if (static_cast<int64_t>(scratch.size()) < 3 * j.dv) scratch.resize(3 * j.dv);
  const int64_t slot = j.slots[seq];
  const bool in_range = slot >= 0 && slot < j.s;
  StateT* stored = in_range ? j.state + (slot * j.h + head) * per_head : nullptr;
  // Used where it lies when f32, or bf16 with one token this step (rows widened and rounded back once); a bf16
  // prefill is read into f32 once and rounded once at the end; an out-of-range slot is a zero state, never stored.
  if (in_range && (std::is_same<StateT, float>::value || t1 - t0 == 1)) {
    for (int64_t t = t0; t < t1; ++t) token(j, t, head, stored, scratch.data());
    return;
  }
  if (static_cast<int64_t>(work.size()) < per_head) work.resize(per_head);
  float* st = work.data();
  if (in_range)
    qcompile_native::widen(stored, st, per_head);
  else
    std::fill(st, st + per_head, 0.0f);
  for (int64_t t = t0; t < t1; ++t) token(j, t, head, st, scratch.data());
  if (in_range) qcompile_native::narrow(st, stored, per_head);  // rounded once per step
}

template <ffi::DataType SD>
ffi::Error GdnRecurrent(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                        ffi::Buffer<SD> state, ffi::Buffer<ffi::S32> query_start,
                        ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::F32> out,
                        ffi::ResultBuffer<SD> new_state) {
  using StateT = ffi::NativeType<SD>;
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = state.dimensions();
  const auto qsd = query_start.dimensions(), sld = slots.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || sd.size() != 4 || qsd.size() != 1 || sld.size() != 1 ||
      kd[0] != qd[0] || kd[1] != qd[1] || kd[2] != qd[2] || vd[0] != qd[0] || vd[1] != qd[1] || sd[1] != qd[1] || sd[2] != qd[2] ||
      sd[3] != vd[2] || qsd[0] != sld[0] + 1 || g.element_count() != qd[0] * qd[1] ||
      beta.element_count() != qd[0] * qd[1])
    return ffi::Error::InvalidArgument(
        "qcompile gdn recurrence: expected q,k[T,H,dk], v[T,H,dv], g,beta[T,H], state[S,H,dk,dv], "
        "query_start[B+1], state_slots[B]");
  Job<StateT> j{q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(), beta.typed_data(),
        new_state->typed_data(), out->typed_data(), query_start.typed_data(), slots.typed_data(),
        qd[0], qd[1], qd[2], vd[2], sd[0], sld[0]};
  if (j.state != state.typed_data())  // not aliased (XLA would have had to copy): start from the input state
    std::memcpy(j.state, state.typed_data(), sizeof(StateT) * state.element_count());
  if (j.t == 0 || j.h == 0 || j.dv == 0) return ffi::Error::Success();
  // Padding tokens: the output of a zero state, (k·q)·β·v.
  const int64_t valid = std::clamp<int64_t>(j.query_start[j.b], 0, j.t);
  for (int64_t row = valid * j.h; row < j.t * j.h; ++row) {
    float kq = 0.0f;
    for (int64_t i = 0; i < j.dk; ++i) kq += j.k[row * j.dk + i] * j.q[row * j.dk + i];
    for (int64_t c = 0; c < j.dv; ++c) j.out[row * j.dv + c] = kq * j.beta[row] * j.v[row * j.dv + c];
  }
  qcompile_native::parallel_items(pool, j.b * j.h, [j](int64_t item) { run_item(j, item); });
  return ffi::Error::Success();
}

}  // namespace

#define QCOMPILE_GDN_RECURRENT_BINDING(SD) \
  ffi::Ffi::Bind()                         \
      .Ctx<ffi::ThreadPool>()              \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<SD>>()              \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Ret<ffi::Buffer<ffi::F32>>()        \
      .Ret<ffi::Buffer<SD>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGdnRecurrentF32, GdnRecurrent<ffi::F32>, QCOMPILE_GDN_RECURRENT_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileGdnRecurrentBf16State, GdnRecurrent<ffi::BF16>,
                              QCOMPILE_GDN_RECURRENT_BINDING(ffi::BF16));
