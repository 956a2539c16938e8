// Fused multi-tensor LAMB (You et al. 2020), torch-free. Two launches over all tensors:
//   1. m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; u = (m/bc1) / (sqrt(v/bc2) + eps) + wd*p;
//      accumulate ||p||^2 and ||u||^2 per tensor (block reduction + atomicAdd into `norms`).
//   2. r = ||p|| / ||u|| (1 when either is 0), clamped to [min_coeff, max_coeff]; p -= lr * r * u
//      (u recomputed from the updated m, v and the unchanged p, so no scratch copy of u is needed).
#include <cmath>

#include "dscore_cuda_types.cuh"
#include "dscore_fused_optim.h"
#include "dscore_multi_tensor.cuh"

namespace dscore {
namespace {

struct LambScalars {
    float beta1, beta2, inv_bc1, inv_bc2, eps, weight_decay;
};

__device__ __forceinline__ float lamb_update(const LambScalars& s, float p, float m, float v) {
    return (m * s.inv_bc1) / (sqrtf(v * s.inv_bc2) + s.eps) + s.weight_decay * p;
}

template <class T>
struct LambMomentsOp {
    LambScalars s;
    float* norms;
    int n_total;

    __device__ void operator()(const TensorListMeta<4>& meta, int t, int64_t begin, int64_t end) const {
        const T* p = static_cast<const T*>(meta.addr[0][t]);
        const T* g = static_cast<const T*>(meta.addr[1][t]);
        float* m = static_cast<float*>(meta.addr[2][t]);
        float* v = static_cast<float*>(meta.addr[3][t]);
        float p_sq = 0.0f, u_sq = 0.0f;
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const float pv = to_float(p[i]), gv = to_float(g[i]);
            const float mv = s.beta1 * m[i] + (1.0f - s.beta1) * gv;
            const float vv = s.beta2 * v[i] + (1.0f - s.beta2) * gv * gv;
            m[i] = mv;
            v[i] = vv;
            const float u = lamb_update(s, pv, mv, vv);
            p_sq += pv * pv;
            u_sq += u * u;
        }
        __shared__ float red[2][kThreadsPerBlock / 32];
        for (int offset = 16; offset > 0; offset /= 2) {
            p_sq += __shfl_down_sync(0xffffffffu, p_sq, offset);
            u_sq += __shfl_down_sync(0xffffffffu, u_sq, offset);
        }
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        if (lane == 0) {
            red[0][warp] = p_sq;
            red[1][warp] = u_sq;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float a = 0.0f, b = 0.0f;
            for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
                a += red[0][w];
                b += red[1][w];
            }
            atomicAdd(norms + meta.global_index[t], a);
            atomicAdd(norms + n_total + meta.global_index[t], b);
        }
    }
};

template <class T>
struct LambApplyOp {
    LambScalars s;
    const float* norms;
    int n_total;
    float lr, max_coeff, min_coeff;

    __device__ void operator()(const TensorListMeta<4>& meta, int t, int64_t begin, int64_t end) const {
        T* p = static_cast<T*>(meta.addr[0][t]);
        const float* m = static_cast<const float*>(meta.addr[2][t]);
        const float* v = static_cast<const float*>(meta.addr[3][t]);
        const float p_norm = sqrtf(norms[meta.global_index[t]]);
        const float u_norm = sqrtf(norms[n_total + meta.global_index[t]]);
        float ratio = (p_norm > 0.0f && u_norm > 0.0f) ? p_norm / u_norm : 1.0f;
        ratio = fminf(fmaxf(ratio, min_coeff), max_coeff);
        const float scale = -lr * ratio;
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const float pv = to_float(p[i]);
            p[i] = from_float<T>(pv + scale * lamb_update(s, pv, m[i], v[i]));
        }
    }
};

}  // namespace

void fused_lamb_cuda(int n_tensors, void* const* params, void* const* grads, float* const* exp_avg,
                     float* const* exp_avg_sq, const int64_t* numels, DType dtype, const LambArgs& a, float* norms,
                     cudaStream_t stream) {
    const double bc1 = a.bias_correction ? 1.0 - std::pow(static_cast<double>(a.beta1), a.step) : 1.0;
    const double bc2 = a.bias_correction ? 1.0 - std::pow(static_cast<double>(a.beta2), a.step) : 1.0;
    const LambScalars s{a.beta1, a.beta2, static_cast<float>(1.0 / bc1), static_cast<float>(1.0 / bc2), a.eps,
                        a.weight_decay};
    check_cuda(cudaMemsetAsync(norms, 0, sizeof(float) * 2 * static_cast<size_t>(n_tensors), stream),
               "fused_lamb norms reset");
    void* const* lists[4] = {params, grads, reinterpret_cast<void* const*>(exp_avg),
                             reinterpret_cast<void* const*>(exp_avg_sq)};
    DSCORE_DISPATCH_DTYPE(dtype, {
        multi_tensor_apply<4>(n_tensors, lists, numels, LambMomentsOp<scalar_t>{s, norms, n_tensors}, stream);
        multi_tensor_apply<4>(n_tensors, lists, numels,
                              LambApplyOp<scalar_t>{s, norms, n_tensors, a.lr, a.max_coeff, a.min_coeff}, stream);
    });
}

}  // namespace dscore
