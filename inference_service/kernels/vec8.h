// 8-float vectors for the attention kernels (GCC/Clang vector extensions: AVX2's ymm, two SSE or
// NEON registers), and 8 cache elements (fp32 or bf16) loaded as one.
#ifndef LORAPLEX_KERNELS_VEC8_H
#define LORAPLEX_KERNELS_VEC8_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float vf8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));
typedef uint32_t vu8 __attribute__((vector_size(32)));

static inline vf8 load8(const float *p) {
    vf8 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store8(float *p, vf8 v) { memcpy(p, &v, sizeof v); }
// 8 elements of the cache at p, as fp32 (`wide`: bf16; a constant at each call).
static inline __attribute__((always_inline)) vf8 cache8(const void *p, const int wide) {
    if (!wide) return load8((const float *)p);
#ifdef __AVX2__  // one widening move (GCC lowers the generic conversion below to two 4-lane halves)
    const __m256i bits256 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    vf8 w;
    memcpy(&w, &bits256, sizeof w);
    return w;
#endif
    vh8 h;
    memcpy(&h, p, sizeof h);
    const vu8 bits = __builtin_convertvector(h, vu8) << 16;
    vf8 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
#endif
