// Thin torch binding of fused_lion.
#include "fused_binding.h"

void fused_lion(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avg, double lr, double beta1, double beta2, double weight_decay) {
    auto lists = dscore::pointer_lists(params, grads, exp_avg, nullptr);
    if (lists.numels.empty()) return;
    const c10::cuda::CUDAGuard guard(params[0].device());
    const dscore::LionArgs args{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                                static_cast<float>(weight_decay)};
    dscore::fused_lion_cuda(static_cast<int>(lists.numels.size()), lists.params.data(), lists.grads.data(),
                            lists.state1.data(), lists.numels.data(), lists.dtype, args,
                            c10::cuda::getCurrentCUDAStream().stream());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("fused_lion", &fused_lion, "multi-tensor Lion step (in place)");
}
