// Thin torch binding of fused_adam: checks the tensor lists and launches the torch-free kernel on the
// current CUDA stream.
#include "fused_binding.h"

void fused_adam(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step, bool adamw_mode,
                bool bias_correction) {
    auto lists = dscore::pointer_lists(params, grads, exp_avg, &exp_avg_sq);
    if (lists.numels.empty()) return;
    const c10::cuda::CUDAGuard guard(params[0].device());
    const dscore::AdamArgs args{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                                static_cast<float>(eps), static_cast<float>(weight_decay), static_cast<int>(step),
                                adamw_mode, bias_correction};
    dscore::fused_adam_cuda(static_cast<int>(lists.numels.size()), lists.params.data(), lists.grads.data(),
                            lists.state1.data(), lists.state2.data(), lists.numels.data(), lists.dtype, args,
                            c10::cuda::getCurrentCUDAStream().stream());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("fused_adam", &fused_adam, "multi-tensor Adam/AdamW step (in place)");
}
