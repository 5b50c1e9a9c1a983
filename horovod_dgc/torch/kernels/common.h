/* What the kernels share: float32 <-> its bits, 16-bit floats to float, the order sum_sparse
 * assumes of positions, and the clones of a function for CPUs with AVX2, FMA and F16C
 * (x86-64-v3) beside the baseline. */
#ifndef HOROVOD_DGC_COMMON_H
#define HOROVOD_DGC_COMMON_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

static inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* IEEE half precision to float, exact for every input and free of branches (it vectorises):
 * a normal or special value only moves its fields and rebiases the exponent (by 127 - 15,
 * or to 255 for infinities and NaN); a subnormal is its mantissa times 2^-24. */
static inline float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t rest = h & 0x7fffu;
    uint32_t special = 0u - (uint32_t)(rest >= 0x7c00u), subnormal = 0u - (uint32_t)(rest < 0x0400u);
    uint32_t moved = (rest << 13) + (112u << 23) + (special & (112u << 23));
    uint32_t small = float_bits((float)(int32_t)rest * 0x1p-24f);
    return bits_float(sign | (small & subnormal) | (moved & ~subnormal));
}

static inline float bfloat16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

/* Whether `count` positions are non-decreasing: what sum_sparse assumes of a message. */
static inline int ascending(const int64_t *positions, int64_t count)
{
    for (int64_t i = 1; i < count; ++i)
        if (positions[i] < positions[i - 1])
            return 0;
    return 1;
}
#endif
