// dscore multi-tensor apply for CUDA (torch-free: raw device pointers + element counts).
//
// Many tensors are updated by one kernel launch: the host packs, per launch, up to kMaxTensors tensor
// addresses (kDepth arrays per tensor: e.g. param, grad, exp_avg, exp_avg_sq) and up to kMaxBlocks
// (tensor, chunk) work items into a kernel-argument struct (kept under the 4 KiB parameter limit).
// Block b processes chunk block_chunk[b] (kChunk elements) of tensor block_tensor[b]. A tensor whose
// chunks do not fit in one launch continues in the next one.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dscore {

constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int kChunk = 65536;         // elements per block
constexpr int kThreadsPerBlock = 512;

template <int kDepth>
struct TensorListMeta {
    void* addr[kDepth][kMaxTensors];
    int64_t numel[kMaxTensors];
    int global_index[kMaxTensors];      // index of the tensor in the caller's full list
    unsigned char block_tensor[kMaxBlocks];
    int block_chunk[kMaxBlocks];
};
static_assert(sizeof(TensorListMeta<4>) + 128 <= 4096, "kernel parameters must stay under 4 KiB");

template <int kDepth, class Op>
__global__ void multi_tensor_kernel(TensorListMeta<kDepth> meta, Op op) {
    const int t = meta.block_tensor[blockIdx.x];
    const int64_t begin = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kChunk;
    const int64_t n = meta.numel[t];
    const int64_t end = begin + kChunk < n ? begin + kChunk : n;
    op(meta, t, begin, end);
}

inline void check_cuda(cudaError_t err, const char* what) {
    if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// lists[d][i]: device address of array d of tensor i (host array of n_tensors pointers per depth).
template <int kDepth, class Op>
void multi_tensor_apply(int n_tensors, void* const* const* lists, const int64_t* numels, const Op& op,
                        cudaStream_t stream) {
    TensorListMeta<kDepth> meta;
    int tensors = 0, blocks = 0;
    for (int i = 0; i < n_tensors; ++i) {
        if (numels[i] == 0) continue;
        for (int d = 0; d < kDepth; ++d) meta.addr[d][tensors] = lists[d][i];
        meta.numel[tensors] = numels[i];
        meta.global_index[tensors] = i;
        ++tensors;
        const int64_t chunks = (numels[i] + kChunk - 1) / kChunk;
        for (int64_t c = 0; c < chunks; ++c) {
            meta.block_tensor[blocks] = static_cast<unsigned char>(tensors - 1);
            meta.block_chunk[blocks] = static_cast<int>(c);
            ++blocks;
            const bool last_chunk = c == chunks - 1;
            const bool blocks_full = blocks == kMaxBlocks;
            const bool tensors_full = tensors == kMaxTensors && last_chunk;
            const bool last = i == n_tensors - 1 && last_chunk;
            if (blocks_full || tensors_full || last) {
                multi_tensor_kernel<kDepth><<<blocks, kThreadsPerBlock, 0, stream>>>(meta, op);
                check_cuda(cudaGetLastError(), "multi_tensor_apply launch");
                blocks = 0;
                if (last_chunk) {
                    tensors = 0;
                } else {  // the current tensor continues in the next launch, as entry 0
                    for (int d = 0; d < kDepth; ++d) meta.addr[d][0] = meta.addr[d][tensors - 1];
                    meta.numel[0] = meta.numel[tensors - 1];
                    meta.global_index[0] = meta.global_index[tensors - 1];
                    tensors = 1;
                }
            }
        }
    }
    if (blocks > 0) {  // trailing empty tensors after the last launch point
        multi_tensor_kernel<kDepth><<<blocks, kThreadsPerBlock, 0, stream>>>(meta, op);
        check_cuda(cudaGetLastError(), "multi_tensor_apply launch");
    }
}

}  // namespace dscore
