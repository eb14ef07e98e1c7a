// qcompile's native moves of cache rows for narrow-float (bf16) caches: write rows in place, and gather a block of
// KV pages widened to f32 — XLA FFI custom calls.
//
// Why: XLA CPU has no bf16 scatter or gather. It "float-normalises" them, converting the whole operand to f32 and
// back (and hoists the widening of a loop-invariant cache out of attention's block loop). A bitcast to u16 avoids the
// conversion, but XLA CPU then materialises the bitcast: a copy of the whole cache. Either way every step paid a cost
// that follows the cache's capacity, not the live batch: on the bench preset's bf16 checkpoint at 32 sequences, the
// KV pages took 15 ms of a 75 ms decode step at max_context 160 and 55 of 130 at 2048; the conv state another few.
// These kernels touch only the rows and pages the step names.
//
// qcompile_scatter_rows(array[R0,...,Rj, D...], rows[N, D...] (the array's dtype), index i32[N]) -> array,
//   aliased: with the leading dims flattened into R rows, array.at[index].set(rows) for index in [0, R); other
//   indices are dropped (callers normalise negative ones as jnp would first). Any dtype: rows move as bytes. A
//   repeated index keeps its last row. (Flattening in the kernel, not with a reshape around it: XLA then copied the
//   aliased result.) Further operands are ignored: values that read the old array, passed so that XLA orders
//   those reads before the write instead of copying the array to keep them safe.
// qcompile_kv_gather_f32(pages[P,ps,...] bf16, page_ids i32[W,n]) -> f32[W, n*ps, ...]: pages[page_ids]
//   widened, with jnp's gather index rule (negative counts from the end, then clamped into [0, P)).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error ScatterRows(ffi::AnyBuffer array, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> index,
                       ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> out) {
  const auto ad = array.dimensions();
  const auto rd = rows.dimensions();
  bool fits = rd.size() >= 1 && rd.size() <= ad.size() && rows.element_type() == array.element_type() &&
              index.element_count() == static_cast<size_t>(rd[0]);
  for (size_t d = 1; fits && d < rd.size(); ++d) fits = ad[ad.size() - rd.size() + d] == rd[d];
  if (!fits)
    return ffi::Error::InvalidArgument("qcompile scatter rows: expected array[R0,...,Rj, D...], rows[N, D...] of the "
                                       "array's dtype, index i32[N]");
  int64_t num_rows = 1;  // the array's leading dims, flattened: row r is the r-th run of D... elements
  for (size_t d = 0; d + rd.size() <= ad.size(); ++d) num_rows *= ad[d];
  const int64_t row_bytes = num_rows ? static_cast<int64_t>(array.size_bytes()) / num_rows : 0;
  char* data = static_cast<char*>(out->untyped_data());
  if (data != array.untyped_data()) std::memcpy(data, array.untyped_data(), array.size_bytes());
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* at = index.typed_data();
  for (int64_t i = 0; i < rd[0]; ++i)
    if (at[i] >= 0 && at[i] < num_rows) std::memcpy(data + at[i] * row_bytes, src + i * row_bytes, row_bytes);
  return ffi::Error::Success();
}

ffi::Error KvGatherF32(ffi::AnyBuffer pages, ffi::Buffer<ffi::S32> page_ids, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto pd = pages.dimensions();
  if (pd.size() < 2 || pages.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("qcompile kv gather: expected bf16 pages[P,ps,...]");
  const int64_t num_pages = pd[0];
  if (num_pages < 1) return ffi::Error::InvalidArgument("qcompile kv gather: no pages");
  const int64_t page_elems = static_cast<int64_t>(pages.element_count()) / num_pages;
  if (out->element_count() != page_ids.element_count() * static_cast<size_t>(page_elems))
    return ffi::Error::InvalidArgument("qcompile kv gather: output is not [W, n*ps, ...]");
  const int32_t* ids = page_ids.typed_data();
  float* dst = out->typed_data();
  for (size_t i = 0; i < page_ids.element_count(); ++i) {
    int64_t page = ids[i];
    if (page < 0) page += num_pages;
    page = std::min<int64_t>(std::max<int64_t>(page, 0), num_pages - 1);
    qcompile_native::widen(static_cast<const uint16_t*>(pages.untyped_data()) + page * page_elems,
                           dst + i * page_elems, page_elems);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileScatterRows, ScatterRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileKvGatherF32, KvGatherF32,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<
                                  ffi::Buffer<ffi::F32>>());
