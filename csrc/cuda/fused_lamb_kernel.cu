// Fused multi-tensor LAMB (You et al. 2020), torch-free. Two launches over all tensors:
//   1. m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; u = (m/bc1) / (sqrt(v/bc2) + eps) + wd*p;
//      each block writes its partial ||p||^2 and ||u||^2 into its own slot (one per (tensor, chunk)).
//   2. one thread per tensor adds its chunks' partials in chunk order into `norms`.
//   3. r = ||p|| / ||u|| (1 when either is 0), clamped to [min_coeff, max_coeff]; p -= lr * r * u
//      (u recomputed from the updated m, v and the unchanged p, so no scratch copy of u is needed).
// Deterministic: every sum has a fixed order (warp shuffles, warps in index order, chunks in index
// order), so the same inputs give the same bits on every run. Float atomicAdd into one per-tensor
// sum (what this file did before) adds the blocks in whatever order they finish.
#include <cmath>
#include <vector>

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
    float* partials;        // [2][total_chunks]: ||p||^2 slots, then ||u||^2 slots
    const int* chunk_base;  // [n_tensors + 1]: first slot of each tensor (prefix sum of its chunks)
    int total_chunks;

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
            // this block's own slot: no other block writes it, so no atomics and no order to race on
            const int slot = chunk_base[meta.global_index[t]] + static_cast<int>(begin / kChunk);
            partials[slot] = a;
            partials[total_chunks + slot] = b;
        }
    }
};

// norms[i] = sum of tensor i's partials in chunk order (norms[n + i] for the updates).
__global__ void lamb_norms_kernel(const float* partials, const int* chunk_base, int n_tensors, int total_chunks,
                                  float* norms) {
    const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n_tensors) return;
    float a = 0.0f, b = 0.0f;
    for (int c = chunk_base[i]; c < chunk_base[i + 1]; ++c) {
        a += partials[c];
        b += partials[total_chunks + c];
    }
    norms[i] = a;
    norms[n_tensors + i] = b;
}

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

static int64_t chunks_of(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

size_t fused_lamb_scratch_bytes(int n_tensors, const int64_t* numels) {
    int64_t chunks = 0;
    for (int i = 0; i < n_tensors; ++i) chunks += chunks_of(numels[i]);
    return sizeof(float) * static_cast<size_t>(2 * n_tensors + 2 * chunks) + sizeof(int) * static_cast<size_t>(n_tensors + 1);
}

void fused_lamb_cuda(int n_tensors, void* const* params, void* const* grads, float* const* exp_avg,
                     float* const* exp_avg_sq, const int64_t* numels, DType dtype, const LambArgs& a, void* scratch,
                     cudaStream_t stream) {
    const double bc1 = a.bias_correction ? 1.0 - std::pow(static_cast<double>(a.beta1), a.step) : 1.0;
    const double bc2 = a.bias_correction ? 1.0 - std::pow(static_cast<double>(a.beta2), a.step) : 1.0;
    const LambScalars s{a.beta1, a.beta2, static_cast<float>(1.0 / bc1), static_cast<float>(1.0 / bc2), a.eps,
                        a.weight_decay};
    std::vector<int> base(static_cast<size_t>(n_tensors) + 1, 0);
    for (int i = 0; i < n_tensors; ++i) base[i + 1] = base[i] + static_cast<int>(chunks_of(numels[i]));
    const int total = base[n_tensors];
    // scratch layout (fused_lamb_scratch_bytes): norms [2n] floats, partials [2 * total] floats, chunk_base [n + 1] ints
    float* norms = static_cast<float*>(scratch);
    float* partials = norms + 2 * n_tensors;
    int* chunk_base = reinterpret_cast<int*>(partials + 2 * static_cast<int64_t>(total));
    // from pageable memory: returns once `base` has been staged, so it may go out of scope afterwards
    check_cuda(cudaMemcpyAsync(chunk_base, base.data(), sizeof(int) * base.size(), cudaMemcpyHostToDevice, stream),
               "fused_lamb chunk offsets");
    void* const* lists[4] = {params, grads, reinterpret_cast<void* const*>(exp_avg),
                             reinterpret_cast<void* const*>(exp_avg_sq)};
    DSCORE_DISPATCH_DTYPE(dtype, {
        multi_tensor_apply<4>(n_tensors, lists, numels, LambMomentsOp<scalar_t>{s, partials, chunk_base, total},
                              stream);
        lamb_norms_kernel<<<(n_tensors + 255) / 256, 256, 0, stream>>>(partials, chunk_base, n_tensors, total, norms);
        check_cuda(cudaGetLastError(), "fused_lamb norms launch");
        multi_tensor_apply<4>(n_tensors, lists, numels,
                              LambApplyOp<scalar_t>{s, norms, n_tensors, a.lr, a.max_coeff, a.min_coeff}, stream);
    });
}

}  // namespace dscore
