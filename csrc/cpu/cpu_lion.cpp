// Python binding of the cpu_lion op (raw addresses + element counts; checked by the Python side).
#include <pybind11/pybind11.h>

#include "dscore_cpu_optim.h"

namespace py = pybind11;
using namespace dscore;

template <class T>
static T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dscore cpu_lion: fused Lion step on fp32 CPU arrays, optional fp16/bf16 copy";
    m.attr("simd") = DSCORE_SIMD_NAME;
    m.def(
        "lion_update",
        [](uintptr_t p, uintptr_t g, uintptr_t exp_avg, int64_t n, float beta1, float one_m_beta1, float beta2,
           float one_m_beta2, float neg_lr, float decay, uintptr_t copy, int copy_dtype, int threads) {
            const LionScalars s{beta1, one_m_beta1, beta2, one_m_beta2, neg_lr, decay};
            lion_update(ptr<float>(p), ptr<const float>(g), ptr<float>(exp_avg), n, s, ptr<uint16_t>(copy),
                        static_cast<CopyDtype>(copy_dtype), threads);
        },
        py::call_guard<py::gil_scoped_release>(),
        "In-place Lion update of n fp32 elements; copy (address or 0) gets fp16 (1) / bf16 (2) params.");
}
