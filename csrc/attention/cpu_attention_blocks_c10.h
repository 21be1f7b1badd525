// cpu_attention_blocks.h's widening loads for torch's half types (vec8.h: integer vector code,
// exact), for the .cpp files that instantiate the CPU attention kernels with c10 types.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "attention/cpu_attention_blocks.h"

namespace ragattn {

template <>
RAGATTN_ALWAYS_INLINE v8f load8<c10::BFloat16>(const c10::BFloat16* p) {
  return bf16x8_to_float(p);
}

template <>
RAGATTN_ALWAYS_INLINE v8f load8<c10::Half>(const c10::Half* p) {
  return f16x8_to_float(p);
}

}  // namespace ragattn
