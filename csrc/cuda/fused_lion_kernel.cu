// Fused multi-tensor Lion (Chen et al. 2023), torch-free. Per element, in fp32:
//   c = b1*m + (1-b1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = b2*m + (1-b2)*g
#include "dscore_cuda_types.cuh"
#include "dscore_fused_optim.h"
#include "dscore_multi_tensor.cuh"

namespace dscore {
namespace {

template <class T>
struct LionOp {
    float beta1, beta2, neg_lr, decay;

    __device__ void operator()(const TensorListMeta<3>& meta, int t, int64_t begin, int64_t end) const {
        T* p = static_cast<T*>(meta.addr[0][t]);
        const T* g = static_cast<const T*>(meta.addr[1][t]);
        float* m = static_cast<float*>(meta.addr[2][t]);
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const float gv = to_float(g[i]), mv = m[i];
            const float c = mv * beta1 + gv * (1.0f - beta1);
            const float sgn = static_cast<float>((c > 0.0f) - (c < 0.0f));
            p[i] = from_float<T>(to_float(p[i]) * decay + neg_lr * sgn);
            m[i] = mv * beta2 + gv * (1.0f - beta2);
        }
    }
};

}  // namespace

void fused_lion_cuda(int n_tensors, void* const* params, void* const* grads, float* const* exp_avg,
                     const int64_t* numels, DType dtype, const LionArgs& a, cudaStream_t stream) {
    void* const* lists[3] = {params, grads, reinterpret_cast<void* const*>(exp_avg)};
    DSCORE_DISPATCH_DTYPE(dtype, {
        LionOp<scalar_t> op{a.beta1, a.beta2, -a.lr, 1.0f - a.lr * a.weight_decay};
        multi_tensor_apply<3>(n_tensors, lists, numels, op, stream);
    });
}

}  // namespace dscore
