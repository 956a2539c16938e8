// Host entry points of the fused CUDA optimizers (torch-free). All pointer arrays are host arrays of
// n_tensors device addresses; numels are element counts. Params and grads share one dtype
// (DType), optimizer states are fp32. Launches go to `stream`; errors throw std::runtime_error.
//   fused_adam: Adam (Kingma & Ba 2015) / AdamW (Loshchilov & Hutter 2019)
//   fused_lamb: LAMB (You et al. 2020), per-tensor trust ratio clamped to [min_coeff, max_coeff]
//   fused_lion: Lion (Chen et al. 2023)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dscore {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct AdamArgs {
    float lr, beta1, beta2, eps, weight_decay;
    int step;             // 1-based step count (for bias correction)
    bool adamw_mode;      // decoupled weight decay
    bool bias_correction;
};

void fused_adam_cuda(int n_tensors, void* const* params, void* const* grads, float* const* exp_avg,
                     float* const* exp_avg_sq, const int64_t* numels, DType dtype, const AdamArgs& args,
                     cudaStream_t stream);

struct LambArgs {
    float lr, beta1, beta2, eps, weight_decay, max_coeff, min_coeff;
    int step;
    bool bias_correction;
};

// Device scratch for fused_lamb_cuda, in bytes: per-tensor squared norms, one partial per (tensor, 64Ki
// chunk) and the chunk offsets, so the norms are summed in a fixed order (deterministic, no atomics).
size_t fused_lamb_scratch_bytes(int n_tensors, const int64_t* numels);

// scratch: fused_lamb_scratch_bytes(n_tensors, numels) bytes of device memory (overwritten).
void fused_lamb_cuda(int n_tensors, void* const* params, void* const* grads, float* const* exp_avg,
                     float* const* exp_avg_sq, const int64_t* numels, DType dtype, const LambArgs& args,
                     void* scratch, cudaStream_t stream);

struct LionArgs {
    float lr, beta1, beta2, weight_decay;
};

void fused_lion_cuda(int n_tensors, void* const* params, void* const* grads, float* const* exp_avg,
                     const int64_t* numels, DType dtype, const LionArgs& args, cudaStream_t stream);

}  // namespace dscore
