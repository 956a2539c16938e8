// Fused multi-tensor Adam / AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), torch-free.
// Per element, in fp32 (params/grads may be fp16/bf16, states are fp32), following torch.optim.Adam(W):
//   AdamW: p *= 1 - lr*wd            Adam: g += wd*p
//   m += (1-b1)*(g - m);  v = b2*v + (1-b2)*g*g
//   p += (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)      (bc = 1 - beta^t, or 1 without bias correction)
#include <cmath>

#include "dscore_cuda_types.cuh"
#include "dscore_fused_optim.h"
#include "dscore_multi_tensor.cuh"

namespace dscore {
namespace {

template <class T>
struct AdamOp {
    float lerp_w, beta2, one_m_beta2, neg_step, bc2_sqrt, eps, decay, l2;

    __device__ void operator()(const TensorListMeta<4>& meta, int t, int64_t begin, int64_t end) const {
        T* p = static_cast<T*>(meta.addr[0][t]);
        const T* g = static_cast<const T*>(meta.addr[1][t]);
        float* m = static_cast<float*>(meta.addr[2][t]);
        float* v = static_cast<float*>(meta.addr[3][t]);
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
            float pv = to_float(p[i]), gv = to_float(g[i]), mv = m[i], vv = v[i];
            pv = pv * decay;
            gv = gv + l2 * pv;
            mv = mv + lerp_w * (gv - mv);
            vv = vv * beta2 + one_m_beta2 * gv * gv;
            const float denom = sqrtf(vv) / bc2_sqrt + eps;
            pv = pv + neg_step * mv / denom;
            p[i] = from_float<T>(pv);
            m[i] = mv;
            v[i] = vv;
        }
    }
};

}  // namespace

void fused_adam_cuda(int n_tensors, void* const* params, void* const* grads, float* const* exp_avg,
                     float* const* exp_avg_sq, const int64_t* numels, DType dtype, const AdamArgs& a,
                     cudaStream_t stream) {
    const double bc1 = a.bias_correction ? 1.0 - std::pow(static_cast<double>(a.beta1), a.step) : 1.0;
    const double bc2 = a.bias_correction ? 1.0 - std::pow(static_cast<double>(a.beta2), a.step) : 1.0;
    void* const* lists[4] = {params, grads, reinterpret_cast<void* const*>(exp_avg),
                             reinterpret_cast<void* const*>(exp_avg_sq)};
    DSCORE_DISPATCH_DTYPE(dtype, {
        AdamOp<scalar_t> op{1.0f - a.beta1,
                            a.beta2,
                            1.0f - a.beta2,
                            static_cast<float>(-a.lr / bc1),
                            static_cast<float>(std::sqrt(bc2)),
                            a.eps,
                            a.adamw_mode ? 1.0f - a.lr * a.weight_decay : 1.0f,
                            a.adamw_mode ? 0.0f : a.weight_decay};
        multi_tensor_apply<4>(n_tensors, lists, numels, op, stream);
    });
}

}  // namespace dscore
