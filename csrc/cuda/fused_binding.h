// Only c10/cuda headers are used (not ATen/cuda/CUDAContext.h, which needs the cuBLAS/cuSPARSE headers).
// Shared helpers of the thin torch bindings of the fused CUDA optimizers: validate tensor lists and
// turn them into the raw pointer arrays the torch-free kernels take.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <vector>

#include "dscore_fused_optim.h"

namespace dscore {

inline DType dtype_code(const at::Tensor& t) {
    switch (t.scalar_type()) {
        case at::kFloat: return DType::kFloat32;
        case at::kHalf: return DType::kFloat16;
        case at::kBFloat16: return DType::kBFloat16;
        default: TORCH_CHECK(false, "fused optimizers support fp32/fp16/bf16 params, got ", t.scalar_type());
    }
}

struct PointerLists {
    std::vector<void*> params, grads;
    std::vector<float*> state1, state2;
    std::vector<int64_t> numels;
    DType dtype = DType::kFloat32;
};

// params/grads: same dtype, CUDA, contiguous, same numel pairwise; states: fp32, same numel.
inline PointerLists pointer_lists(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                  const std::vector<at::Tensor>& state1, const std::vector<at::Tensor>* state2) {
    const size_t n = params.size();
    TORCH_CHECK(grads.size() == n && state1.size() == n && (!state2 || state2->size() == n),
                "fused optimizer: tensor lists differ in length");
    PointerLists out;
    if (n == 0) return out;
    out.dtype = dtype_code(params[0]);
    const auto device = params[0].device();
    auto check = [&](const at::Tensor& t, at::ScalarType type, int64_t numel, const char* what) {
        TORCH_CHECK(t.device() == device, "fused optimizer: ", what, " on ", t.device(), ", expected ", device);
        TORCH_CHECK(t.scalar_type() == type, "fused optimizer: ", what, " has dtype ", t.scalar_type(), ", expected ", type);
        TORCH_CHECK(t.is_contiguous(), "fused optimizer: ", what, " must be contiguous");
        TORCH_CHECK(t.numel() == numel, "fused optimizer: ", what, " has ", t.numel(), " elements, expected ", numel);
    };
    TORCH_CHECK(device.is_cuda(), "fused optimizer: tensors must be on a CUDA device, got ", device);
    for (size_t i = 0; i < n; ++i) {
        const int64_t numel = params[i].numel();
        check(params[i], params[0].scalar_type(), numel, "param");
        check(grads[i], params[0].scalar_type(), numel, "grad");
        check(state1[i], at::kFloat, numel, "optimizer state");
        out.params.push_back(params[i].data_ptr());
        out.grads.push_back(grads[i].data_ptr());
        out.state1.push_back(state1[i].data_ptr<float>());
        if (state2) {
            check((*state2)[i], at::kFloat, numel, "optimizer state");
            out.state2.push_back((*state2)[i].data_ptr<float>());
        }
        out.numels.push_back(numel);
    }
    return out;
}

}  // namespace dscore
