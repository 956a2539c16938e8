// Python binding of the cpu_adam op. Arguments are raw addresses (tensor.data_ptr()) and element
// counts; the Python optimizer (dscore_plugins.ops.cpu_optim) checks dtype, device, contiguity and
// sizes before calling. The GIL is released while the kernel runs.
#include <pybind11/pybind11.h>

#include "dscore_cpu_optim.h"

namespace py = pybind11;
using namespace dscore;

template <class T>
static T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dscore cpu_adam: fused Adam/AdamW step on fp32 CPU arrays, optional fp16/bf16 copy";
    m.attr("simd") = DSCORE_SIMD_NAME;
    m.def(
        "adam_update",
        [](uintptr_t p, uintptr_t g, uintptr_t exp_avg, uintptr_t exp_avg_sq, int64_t n, float lerp_w, float beta2,
           float one_m_beta2, float neg_step, float inv_bc2_sqrt, float eps, float decay, float l2, uintptr_t copy,
           int copy_dtype, int threads) {
            const AdamScalars s{lerp_w, beta2, one_m_beta2, neg_step, inv_bc2_sqrt, eps, decay, l2};
            adam_update(ptr<float>(p), ptr<const float>(g), ptr<float>(exp_avg), ptr<float>(exp_avg_sq), n, s,
                        ptr<uint16_t>(copy), static_cast<CopyDtype>(copy_dtype), threads);
        },
        py::call_guard<py::gil_scoped_release>(),
        "In-place Adam(W) update of n fp32 elements; copy (address or 0) gets fp16 (1) / bf16 (2) params.");
    m.def(
        "stream_probe",
        [](uintptr_t p, uintptr_t g, uintptr_t a, uintptr_t b, int64_t n, int threads) {
            stream_probe(ptr<float>(p), ptr<const float>(g), ptr<float>(a), ptr<float>(b), n, threads);
        },
        py::call_guard<py::gil_scoped_release>(),
        "Bandwidth probe with Adam's traffic: p,a,b += g (28 bytes per element).");
}
