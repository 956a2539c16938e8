// dscore CPU SIMD abstraction: one small vector type per ISA with the same operations, so every CPU
// kernel is written once as a template over the vector type and also instantiated with the 1-lane
// scalar type for loop tails (identical operation order, hence identical rounding).
//
// The ISA is chosen at build time by the op builder (dscore.ops.toolchain.simd_flags):
//   DSCORE_SIMD_AVX512 -> VecF = Avx512F (16 x fp32), needs AVX-512 F/BW/VL/DQ
//   DSCORE_SIMD_AVX2   -> VecF = Avx2F   (8 x fp32),  needs AVX2 + FMA + F16C
//   otherwise          -> VecF = ScalarF (1 x fp32),  portable C++
//
// Low-precision stores round to nearest even: bf16 by integer rounding of the fp32 bit pattern (NaN
// kept quiet), fp16 through the F16C/AVX-512 conversion instructions (or a bit-exact software path).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(DSCORE_SIMD_AVX512) || defined(DSCORE_SIMD_AVX2)
#include <immintrin.h>
#endif

namespace dscore {

// ---------------------------------------------------------------- scalar conversions
inline uint16_t float_to_bf16_bits(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

inline uint16_t float_to_fp16_bits(float f) {
    // IEEE binary32 -> binary16, round to nearest even, with subnormals, inf and NaN.
    uint32_t x;
    std::memcpy(&x, &f, sizeof(x));
    const uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t mag = x & 0x7fffffffu;
    if (mag > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));  // NaN
    if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (>= 65520) -> inf
    if (mag < 0x38800000u) {  // result is subnormal or zero
        if (mag < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to 0
        const uint32_t exp = mag >> 23;
        const uint32_t mant = (mag & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - exp;  // 14..24
        uint32_t half = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u);
        const uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
        return static_cast<uint16_t>(sign | half);
    }
    mag += 0xc8000000u;  // rebias exponent 127 -> 15
    mag += 0xfffu + ((mag >> 13) & 1u);
    return static_cast<uint16_t>(sign | (mag >> 13));
}

// ---------------------------------------------------------------- 1-lane scalar "vector"
struct ScalarF {
    static constexpr int kWidth = 1;
    float v;
    static ScalarF load(const float* p) { return {*p}; }
    static ScalarF set1(float x) { return {x}; }
    void store(float* p) const { *p = v; }
    void store_bf16(uint16_t* p) const { *p = float_to_bf16_bits(v); }
    void store_fp16(uint16_t* p) const { *p = float_to_fp16_bits(v); }
    void stream_bf16(uint16_t* p) const { store_bf16(p); }
    void stream_fp16(uint16_t* p) const { store_fp16(p); }
    friend ScalarF operator+(ScalarF a, ScalarF b) { return {a.v + b.v}; }
    friend ScalarF operator-(ScalarF a, ScalarF b) { return {a.v - b.v}; }
    friend ScalarF operator*(ScalarF a, ScalarF b) { return {a.v * b.v}; }
    friend ScalarF operator/(ScalarF a, ScalarF b) { return {a.v / b.v}; }
    friend ScalarF sqrt(ScalarF a) { return {std::sqrt(a.v)}; }
    // -1, 0 or +1 (like torch.sign; NaN gives 0)
    friend ScalarF sign(ScalarF a) { return {static_cast<float>((a.v > 0.0f) - (a.v < 0.0f))}; }
};

#if defined(DSCORE_SIMD_AVX2)
struct Avx2F {
    static constexpr int kWidth = 8;
    __m256 v;
    static Avx2F load(const float* p) { return {_mm256_loadu_ps(p)}; }
    static Avx2F set1(float x) { return {_mm256_set1_ps(x)}; }
    void store(float* p) const { _mm256_storeu_ps(p, v); }
    // bf16 bits of the 8 lanes, rounded to nearest even (NaN kept quiet)
    __m128i bf16_bits() const {
        const __m256i bits = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x0040));
        r = _mm256_blendv_epi8(r, qnan, nan);
        // values are < 2^16 in each 32-bit lane: pack to 16 bits, then put the two 64-bit halves together
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        return _mm256_castsi256_si128(packed);
    }
    void store_bf16(uint16_t* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits()); }
    void store_fp16(uint16_t* p) const {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    // non-temporal stores (p 16-byte aligned): see kStreamCopyMinElems
    void stream_bf16(uint16_t* p) const { _mm_stream_si128(reinterpret_cast<__m128i*>(p), bf16_bits()); }
    void stream_fp16(uint16_t* p) const {
        _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    friend Avx2F operator+(Avx2F a, Avx2F b) { return {_mm256_add_ps(a.v, b.v)}; }
    friend Avx2F operator-(Avx2F a, Avx2F b) { return {_mm256_sub_ps(a.v, b.v)}; }
    friend Avx2F operator*(Avx2F a, Avx2F b) { return {_mm256_mul_ps(a.v, b.v)}; }
    friend Avx2F operator/(Avx2F a, Avx2F b) { return {_mm256_div_ps(a.v, b.v)}; }
    friend Avx2F sqrt(Avx2F a) { return {_mm256_sqrt_ps(a.v)}; }
    friend Avx2F sign(Avx2F a) {
        const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
        const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_GT_OQ), one);
        const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_LT_OQ), one);
        return {_mm256_sub_ps(pos, neg)};
    }
};
using VecF = Avx2F;
#define DSCORE_SIMD_NAME "avx2"
#elif defined(DSCORE_SIMD_AVX512)
struct Avx512F {
    static constexpr int kWidth = 16;
    __m512 v;
    static Avx512F load(const float* p) { return {_mm512_loadu_ps(p)}; }
    static Avx512F set1(float x) { return {_mm512_set1_ps(x)}; }
    void store(float* p) const { _mm512_storeu_ps(p, v); }
    // bf16 bits of the 16 lanes, rounded to nearest even (NaN kept quiet)
    __m256i bf16_bits() const {
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x0040)));
        return _mm512_cvtepi32_epi16(r);
    }
    void store_bf16(uint16_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits()); }
    void store_fp16(uint16_t* p) const {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    // non-temporal stores (p 32-byte aligned): see kStreamCopyMinElems
    void stream_bf16(uint16_t* p) const { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits()); }
    void stream_fp16(uint16_t* p) const {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    friend Avx512F operator+(Avx512F a, Avx512F b) { return {_mm512_add_ps(a.v, b.v)}; }
    friend Avx512F operator-(Avx512F a, Avx512F b) { return {_mm512_sub_ps(a.v, b.v)}; }
    friend Avx512F operator*(Avx512F a, Avx512F b) { return {_mm512_mul_ps(a.v, b.v)}; }
    friend Avx512F operator/(Avx512F a, Avx512F b) { return {_mm512_div_ps(a.v, b.v)}; }
    friend Avx512F sqrt(Avx512F a) { return {_mm512_sqrt_ps(a.v)}; }
    friend Avx512F sign(Avx512F a) {
        const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
        const __m512 pos = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, zero, _CMP_GT_OQ), one);
        const __m512 neg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, zero, _CMP_LT_OQ), one);
        return {_mm512_sub_ps(pos, neg)};
    }
};
using VecF = Avx512F;
#define DSCORE_SIMD_NAME "avx512"
#else
using VecF = ScalarF;
#define DSCORE_SIMD_NAME "scalar"
#endif

// Low-precision copy target of a fused update: none, IEEE fp16 or bfloat16 (raw 16-bit storage).
enum class CopyDtype : int { kNone = 0, kFp16 = 1, kBf16 = 2 };

// Run body(V-type, index) over [0, n): full vectors first, then the scalar tail, split into static
// OpenMP chunks of whole cache lines across `threads` threads. body must be element-wise and should
// capture by value (pointers, scalars): each thread runs its own copy of it, a local whose address never
// escapes, so the compiler can prove the stores through the array pointers do not modify the captured
// values and keeps them (and the broadcast constants) in registers. With a by-reference capture every
// vector re-loads pointers and scalars through the closure, which cost ~15-20% of the bandwidth.
constexpr int64_t kChunkElems = 1 << 14;  // 64 KiB of fp32 per array per chunk

template <class Body>
inline void parallel_elementwise(int64_t n, int threads, const Body& body) {
    const int64_t chunks = (n + kChunkElems - 1) / kChunkElems;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (chunks > 1)
    {
        const Body local = body;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t begin = c * kChunkElems;
            const int64_t end = begin + kChunkElems < n ? begin + kChunkElems : n;
            int64_t i = begin;
            for (; i + VecF::kWidth <= end; i += VecF::kWidth) local(VecF{}, i);
            for (; i < end; ++i) local(ScalarF{}, i);
        }
#if defined(DSCORE_SIMD_AVX512) || defined(DSCORE_SIMD_AVX2)
        _mm_sfence();  // order this thread's non-temporal copy stores (if any) before the region ends
#endif
    }
}

// Compile-time copy mode of a kernel: the copy dtype, and whether its full vectors are written with
// non-temporal (streaming) stores.
template <CopyDtype D, bool Stream>
struct CopyMode {
    static constexpr CopyDtype dtype = D;
    static constexpr bool stream = Stream;
};

// The low-precision copy is written for another consumer (the device upload), never re-read by the
// optimizer, and ordinary stores add a read-for-ownership of every destination line (2 of the 32 bytes
// per element a bf16-copy step moves; measured ~10% of the step with 2 threads). From this many elements
// per call the kernel itself streams >= 56 MiB (28 B/element) through the caches, more than a core's
// L3 holds on common x86 servers (32 MiB here), so the copy would be evicted before the call returns
// anyway: it is written with streaming stores when its address is aligned to a vector's worth of
// 16-bit values (a misaligned target keeps ordinary stores).
// Smaller calls keep ordinary stores, their copy may still be in cache when read.
constexpr int64_t kStreamCopyMinElems = int64_t(1) << 21;

// Call f(CopyMode<D, Stream>{}) for the copy target (D = kNone when copy is null), so the kernels branch
// on it at compile time instead of per vector.
template <class F>
inline void dispatch_copy(const uint16_t* copy, CopyDtype dtype, int64_t n, F&& f) {
    const bool stream = n >= kStreamCopyMinElems &&
                        reinterpret_cast<uintptr_t>(copy) % (VecF::kWidth * sizeof(uint16_t)) == 0;
    if (copy == nullptr || dtype == CopyDtype::kNone) f(CopyMode<CopyDtype::kNone, false>{});
    else if (dtype == CopyDtype::kBf16 && stream) f(CopyMode<CopyDtype::kBf16, true>{});
    else if (dtype == CopyDtype::kBf16) f(CopyMode<CopyDtype::kBf16, false>{});
    else if (stream) f(CopyMode<CopyDtype::kFp16, true>{});
    else f(CopyMode<CopyDtype::kFp16, false>{});
}

// Call f(std::true_type{}) or f(std::false_type{}): a run-time flag made a compile-time one.
template <class F>
inline void dispatch_bool(bool flag, F&& f) {
    if (flag) f(std::true_type{});
    else f(std::false_type{});
}

// Store x into the copy at dst[i] as Mode says (nothing for kNone, where dst may be null).
template <class Mode, class V>
inline void store_copy_as(const V& x, uint16_t* dst, int64_t i) {
    if constexpr (Mode::dtype == CopyDtype::kBf16) {
        if constexpr (Mode::stream) x.stream_bf16(dst + i);
        else x.store_bf16(dst + i);
    } else if constexpr (Mode::dtype == CopyDtype::kFp16) {
        if constexpr (Mode::stream) x.stream_fp16(dst + i);
        else x.store_fp16(dst + i);
    }
}

}  // namespace dscore
