// qcompile's native slot reset: zero row `slot` of an array (any dtype), in place — an XLA FFI custom call whose
// output aliases its input. The engine zeroes a new sequence's GDN state slots with it.
//
// Why: XLA CPU runs a bf16 dynamic-update-slice (what `state.at[slot].set(0)` becomes) as a convert fusion over the
// whole array — 3-5 ms per 8.6 MB state cache, once per layer per new sequence: 170 ms of a 32-sequence prefill step
// with bf16 states (the bf16-state pass). A row of zero bytes is +0.0 in every float dtype. Out-of-range slots are a
// no-op.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error ZeroSlot(ffi::AnyBuffer array, ffi::Buffer<ffi::S32> slot, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = array.dimensions();
  if (dims.size() < 1 || slot.element_count() != 1)
    return ffi::Error::InvalidArgument("qcompile zero slot: expected array[S, ...] and a scalar slot");
  char* data = static_cast<char*>(out->untyped_data());
  if (data != array.untyped_data()) std::memcpy(data, array.untyped_data(), array.size_bytes());
  const int64_t rows = dims[0];
  const int64_t row_bytes = rows ? static_cast<int64_t>(array.size_bytes()) / rows : 0;
  const int64_t s = slot.typed_data()[0];
  if (s >= 0 && s < rows) std::memset(data + s * row_bytes, 0, row_bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcompileZeroSlot, ZeroSlot,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>());
