// fp32/fp16/bf16 load-store helpers that work with torch's -D__CUDA_NO_HALF_CONVERSIONS__ flags.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace dscore {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace dscore

// Instantiate body for the runtime dtype: `scalar_t` names the param/grad type inside body.
#define DSCORE_DISPATCH_DTYPE(dtype, ...)                                              \
    switch (dtype) {                                                                   \
        case ::dscore::DType::kFloat32: { using scalar_t = float; __VA_ARGS__; break; } \
        case ::dscore::DType::kFloat16: { using scalar_t = __half; __VA_ARGS__; break; } \
        case ::dscore::DType::kBFloat16: { using scalar_t = __nv_bfloat16; __VA_ARGS__; break; } \
        default: throw std::runtime_error("unsupported dtype code");                   \
    }
