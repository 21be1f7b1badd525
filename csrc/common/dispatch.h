// AT_DISPATCH over the activation dtypes the attention ops accept: float32, float16, bfloat16.
// Every public op refuses float64 in its Python checks (ragattn/ops/_validate.py FLOAT_DTYPES),
// so no kernel is compiled for it (a quarter of the CPU kernels' compile time); a private op
// called directly with another dtype raises ATen's "NAME" not implemented for 'Double'.
#pragma once

#include <ATen/Dispatch.h>

#define RAGATTN_DISPATCH_ATTENTION_TYPES(TYPE, NAME, ...)                                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                       \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)                    \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))
