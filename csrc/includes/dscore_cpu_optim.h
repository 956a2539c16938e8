// dscore CPU optimizer kernels (Adam/AdamW, Adagrad, Lion) on raw fp32 arrays.
//
// All arrays are contiguous fp32 of `n` elements (n is a count of elements, not bytes), updated in
// place; `copy` (optional, may be null) receives the updated parameters as fp16 or bf16 in the same
// pass. Scalars that depend only on the step (bias corrections, decayed lr) are computed by the caller
// in double and passed as fp32, mirroring the operation order of the torch references so results agree
// to fp32 rounding:
//   Adam   (Kingma & Ba 2015) / AdamW (Loshchilov & Hutter 2019): torch.optim.Adam / AdamW
//   Adagrad (Duchi et al. 2011): torch.optim.Adagrad
//   Lion   (Chen et al. 2023): c = b1*m + (1-b1)*g; p = p*(1-lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g
#pragma once

#include <cstdint>

#include "dscore_simd.h"

namespace dscore {

struct AdamScalars {
    float lerp_w;       // 1 - beta1 (exp_avg.lerp_(grad, 1 - beta1))
    float beta2;        // beta2
    float one_m_beta2;  // 1 - beta2
    float neg_step;     // -lr / (1 - beta1^t)            (-lr without bias correction)
    float inv_bc2_sqrt; // 1 / sqrt(1 - beta2^t)          (1 without bias correction)
    float eps;
    float decay;        // AdamW: 1 - lr*wd multiplies p first; 1 when unused
    float l2;           // Adam: grad += l2 * p; 0 when unused
};

// The kernels capture by value and turn their run-time options (weight decay, L2, copy dtype) into
// compile-time ones (see parallel_elementwise / dispatch_* in dscore_simd.h): the inner loop then holds
// only the loads, the arithmetic and the stores, with every constant in a register.

inline void adam_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamScalars& s,
                        uint16_t* copy, CopyDtype copy_dtype, int threads) {
    dispatch_copy(copy, copy_dtype, n, [&](auto copy_mode) {
        dispatch_bool(s.decay != 1.0f, [&](auto use_decay) {
            dispatch_bool(s.l2 != 0.0f, [&](auto use_l2) {
                const AdamScalars c = s;
                parallel_elementwise(n, threads, [=](auto tag, int64_t i) {
                    using V = decltype(tag);
                    V pv = V::load(p + i), gv = V::load(g + i), mv = V::load(m + i), vv = V::load(v + i);
                    if constexpr (decltype(use_decay)::value) pv = pv * V::set1(c.decay);
                    if constexpr (decltype(use_l2)::value) gv = gv + V::set1(c.l2) * pv;
                    mv = mv + V::set1(c.lerp_w) * (gv - mv);
                    vv = vv * V::set1(c.beta2) + V::set1(c.one_m_beta2) * gv * gv;
                    // torch: denom = sqrt(v) / sqrt(bc2) + eps (here * 1/sqrt(bc2)); p += -step * m / denom
                    const V denom = sqrt(vv) * V::set1(c.inv_bc2_sqrt) + V::set1(c.eps);
                    pv = pv + V::set1(c.neg_step) * mv / denom;
                    pv.store(p + i);
                    mv.store(m + i);
                    vv.store(v + i);
                    store_copy_as<decltype(copy_mode)>(pv, copy, i);
                });
            });
        });
    });
}

struct AdagradScalars {
    float neg_clr;  // -lr / (1 + (t-1)*lr_decay)
    float eps;
    float l2;       // grad += l2 * p; 0 when unused
};

inline void adagrad_update(float* p, const float* g, float* sum, int64_t n, const AdagradScalars& s,
                           uint16_t* copy, CopyDtype copy_dtype, int threads) {
    dispatch_copy(copy, copy_dtype, n, [&](auto copy_mode) {
        dispatch_bool(s.l2 != 0.0f, [&](auto use_l2) {
            const AdagradScalars c = s;
            parallel_elementwise(n, threads, [=](auto tag, int64_t i) {
                using V = decltype(tag);
                V pv = V::load(p + i), gv = V::load(g + i), sv = V::load(sum + i);
                if constexpr (decltype(use_l2)::value) gv = gv + V::set1(c.l2) * pv;
                sv = sv + gv * gv;
                const V std_ = sqrt(sv) + V::set1(c.eps);
                pv = pv + V::set1(c.neg_clr) * gv / std_;
                pv.store(p + i);
                sv.store(sum + i);
                store_copy_as<decltype(copy_mode)>(pv, copy, i);
            });
        });
    });
}

struct LionScalars {
    float beta1, one_m_beta1, beta2, one_m_beta2;
    float neg_lr;  // -lr
    float decay;   // 1 - lr*wd
};

inline void lion_update(float* p, const float* g, float* m, int64_t n, const LionScalars& s, uint16_t* copy,
                        CopyDtype copy_dtype, int threads) {
    dispatch_copy(copy, copy_dtype, n, [&](auto copy_mode) {
        dispatch_bool(s.decay != 1.0f, [&](auto use_decay) {
            const LionScalars c = s;
            parallel_elementwise(n, threads, [=](auto tag, int64_t i) {
                using V = decltype(tag);
                V pv = V::load(p + i), gv = V::load(g + i), mv = V::load(m + i);
                const V cv = mv * V::set1(c.beta1) + gv * V::set1(c.one_m_beta1);
                if constexpr (decltype(use_decay)::value) pv = pv * V::set1(c.decay);
                pv = pv + V::set1(c.neg_lr) * sign(cv);
                mv = mv * V::set1(c.beta2) + gv * V::set1(c.one_m_beta2);
                pv.store(p + i);
                mv.store(m + i);
                store_copy_as<decltype(copy_mode)>(pv, copy, i);
            });
        });
    });
}

// Same memory traffic as adam_update (4 fp32 arrays read, 3 written: 28 bytes/element) with trivial
// arithmetic: the in-place bandwidth roofline the Adam kernel is measured against. Same loop machinery
// as the kernels (by-value capture, per-thread closure copy), so it is as tight as they are.
inline void stream_probe(float* p, const float* g, float* m, float* v, int64_t n, int threads) {
    parallel_elementwise(n, threads, [=](auto tag, int64_t i) {
        using V = decltype(tag);
        const V gv = V::load(g + i);
        (V::load(p + i) + gv).store(p + i);
        (V::load(m + i) + gv).store(m + i);
        (V::load(v + i) + gv).store(v + i);
    });
}

}  // namespace dscore
