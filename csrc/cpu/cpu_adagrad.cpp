// Python binding of the cpu_adagrad op (raw addresses + element counts; checked by the Python side).
#include <pybind11/pybind11.h>

#include "dscore_cpu_optim.h"

namespace py = pybind11;
using namespace dscore;

template <class T>
static T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dscore cpu_adagrad: fused Adagrad step on fp32 CPU arrays, optional fp16/bf16 copy";
    m.attr("simd") = DSCORE_SIMD_NAME;
    m.def(
        "adagrad_update",
        [](uintptr_t p, uintptr_t g, uintptr_t sum, int64_t n, float neg_clr, float eps, float l2, uintptr_t copy,
           int copy_dtype, int threads) {
            const AdagradScalars s{neg_clr, eps, l2};
            adagrad_update(ptr<float>(p), ptr<const float>(g), ptr<float>(sum), n, s, ptr<uint16_t>(copy),
                           static_cast<CopyDtype>(copy_dtype), threads);
        },
        py::call_guard<py::gil_scoped_release>(),
        "In-place Adagrad update of n fp32 elements; copy (address or 0) gets fp16 (1) / bf16 (2) params.");
}
