// Thin torch binding of fused_lamb (allocates the norm scratch on the params' device).
#include "fused_binding.h"

void fused_lamb(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step, bool bias_correction,
                double max_coeff, double min_coeff) {
    auto lists = dscore::pointer_lists(params, grads, exp_avg, &exp_avg_sq);
    if (lists.numels.empty()) return;
    const c10::cuda::CUDAGuard guard(params[0].device());
    const int n = static_cast<int>(lists.numels.size());
    auto scratch = at::empty({static_cast<int64_t>(dscore::fused_lamb_scratch_bytes(n, lists.numels.data()))},
                             params[0].options().dtype(at::kByte));
    const dscore::LambArgs args{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                                static_cast<float>(eps), static_cast<float>(weight_decay),
                                static_cast<float>(max_coeff), static_cast<float>(min_coeff),
                                static_cast<int>(step), bias_correction};
    dscore::fused_lamb_cuda(n, lists.params.data(), lists.grads.data(), lists.state1.data(), lists.state2.data(),
                            lists.numels.data(), lists.dtype, args, scratch.data_ptr(),
                            c10::cuda::getCurrentCUDAStream().stream());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("fused_lamb", &fused_lamb, "multi-tensor LAMB step (in place)");
}
