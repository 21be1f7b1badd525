// Declarations of every C++ op implementation registered in torch_bindings.cpp.
// CPU twins are always built; CUDA launchers only when RAGATTN_WITH_CUDA is defined.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <vector>

namespace ragattn {

// ---- KV cache ops (csrc/kv_cache/) ----

// ---- speculative verification (csrc/speculative/) ----

}  // namespace ragattn
