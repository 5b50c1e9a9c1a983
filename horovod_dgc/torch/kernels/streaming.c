/* One-pass kernels over gradient-sized arrays: error feedback and momentum correction fused
 * with the block statistic the next step needs, and the sign packing of blocksign.
 *
 * accumulate: the memory update of every method in one read of the gradient and the memories
 *   residual:  r' = r + s * g
 *   momentum:  u' = m * u + s * g;          v' = v + u'
 *   nesterov:  u' = m * u + (s * m) * g;    v' = v + u' + s * g
 * with, over the new memory that selection reads (r' or v'), the largest |x| per block (DGC's
 * block filter) or the float64 sum of |x| per block (blocksign's scales), and whether every
 * gradient entry is finite. With the block maxima it can also collect the candidates of a
 * threshold known before the pass: the position and |x| of every entry with |x| >= bound,
 * read from the chunk while it is still in the first-level cache (a chunk whose maximum is
 * below the bound is skipped), so that selection need not read the memory again. The bound
 * may be one per statistic block (a bucket's tensors, each at its own bound). The gradient may
 * be given as pieces (a bucket's members where they lie, zeros between them) instead of one
 * array: no copy into the bucket's buffer first. Torch runs each line as a separate pass with its own temporary,
 * then reads the result again for the statistic and the gradient again for its finiteness.
 * The rounding is the composition's (core/ops.py): a product rounded, then added by one fused
 * multiply-add, so float32 results are bit-identical to it.
 *
 * sign_pack: bit j of byte i is x[8i + j] >= 0 (entries past `valid` are zero padding), and
 *   the residual x - scale_b * sign(x) over x's first `valid` entries, in one pass.
 * sign_decode: scale_b * sign written to (or added to) a float32 array.
 *
 * scatter_add and zero: what decoding N sparse messages does to a gradient-sized output;
 * sum_sparse: both at once, for messages whose positions are sorted.
 *
 * Gradients may be float32, float16 or bfloat16; memories are float32. Every call covers one
 * range and runs with the GIL released, so the adapter runs one call per thread. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h> /* for the AVX-512 stores, compiled for that target alone */
#endif

enum { GRAD_FLOAT32 = 0, GRAD_FLOAT16 = 1, GRAD_BFLOAT16 = 2 };
enum { MODE_RESIDUAL = 0, MODE_MOMENTUM = 1, MODE_NESTEROV = 2 };
enum { STAT_NONE = 0, STAT_MAX = 1, STAT_SUM = 2 };

/* Elements combined before their statistic is taken: small enough that the statistic reads
 * them from the first-level cache, not from memory. */
#define CHUNK 1024
#define LANES 8
#define ABS_BITS 0x7fffffffu

#define LOAD_FLOAT32(v) (v)
#define LOAD_FLOAT16(v) half_to_float(v)
#define LOAD_BFLOAT16(v) bfloat16_to_float(v)
#define BAD_FLOAT32(v) ((float_bits(v) & 0x7f800000u) == 0x7f800000u)
#define BAD_FLOAT16(v) (((v) & 0x7c00u) == 0x7c00u)
#define BAD_BFLOAT16(v) (((v) & 0x7f80u) == 0x7f80u)

typedef struct {
    int mode;
    float scale;    /* s: the gradient's factor */
    float momentum; /* m */
    float scale_m;  /* s * m, rounded once, as the composition passes it */
} Plan;

/* The new memories of `len` entries; returns whether some gradient entry is not finite. */
#define DEFINE_COMBINE(SUFFIX, GTYPE, LOAD, BAD)                                              \
    VECTOR_CLONES static uint32_t combine_##SUFFIX(const Plan *p, const GTYPE *g, const float *a, \
                                                   float *a_out, const float *b, float *b_out, \
                                                   int64_t len)                                \
    {                                                                                         \
        uint32_t bad = 0;                                                                     \
        const float s = p->scale, m = p->momentum, sm = p->scale_m;                           \
        if (p->mode == MODE_RESIDUAL) {                                                       \
            for (int64_t i = 0; i < len; ++i) {                                               \
                bad |= BAD(g[i]);                                                             \
                a_out[i] = fmaf(LOAD(g[i]), s, a[i]);                                         \
            }                                                                                 \
        } else if (p->mode == MODE_MOMENTUM) {                                                \
            for (int64_t i = 0; i < len; ++i) {                                               \
                bad |= BAD(g[i]);                                                             \
                float u = fmaf(LOAD(g[i]), s, a[i] * m);                                      \
                a_out[i] = u;                                                                 \
                b_out[i] = b[i] + u;                                                          \
            }                                                                                 \
        } else {                                                                              \
            for (int64_t i = 0; i < len; ++i) {                                               \
                bad |= BAD(g[i]);                                                             \
                float x = LOAD(g[i]);                                                         \
                float u = fmaf(x, sm, a[i] * m);                                              \
                a_out[i] = u;                                                                 \
                b_out[i] = fmaf(x, s, b[i] + u);                                              \
            }                                                                                 \
        }                                                                                     \
        return bad;                                                                           \
    }

DEFINE_COMBINE(float32, float, LOAD_FLOAT32, BAD_FLOAT32)
DEFINE_COMBINE(float16, uint16_t, LOAD_FLOAT16, BAD_FLOAT16)
DEFINE_COMBINE(bfloat16, uint16_t, LOAD_BFLOAT16, BAD_BFLOAT16)

/* Bit patterns with the sign cleared: their integer order is the order of |x|, and every NaN
 * lies above infinity, so a NaN wins as it does in torch's amax. */
VECTOR_CLONES static uint32_t abs_max_bits(const float *x, int64_t len)
{
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t largest = 0;
    for (int64_t i = 0; i < len; ++i) {
        uint32_t a = bits[i] & ABS_BITS;
        largest = a > largest ? a : largest;
    }
    return largest;
}

VECTOR_CLONES static double abs_sum(const float *x, int64_t len)
{
    double lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= len; i += LANES)
        for (int j = 0; j < LANES; ++j)
            lane[j] += fabs((double)x[i + j]);
    double total = 0.0;
    for (; i < len; ++i)
        total += fabs((double)x[i]);
    for (int j = 0; j < LANES; ++j)
        total += lane[j];
    return total;
}

typedef uint32_t (*Combine)(const Plan *, const void *, const float *, float *, const float *,
                            float *, int64_t);

#if defined(__x86_64__) && defined(__GNUC__)
/* 64-byte non-temporal stores: a quarter of the instructions of 16-byte ones, which on a CPU
 * with AVX-512 keeps the store loop from being the bottleneck of a gradient-sized output.
 * `dst` is 64-byte aligned. */
__attribute__((target("avx512f"))) static int64_t stream_wide(float *dst, const float *src, int64_t len)
{
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
        _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
    return i;
}
static int wide_streams = 0; /* whether the CPU has AVX-512: set when the module loads */
#endif

/* dst[0:len] = src[0:len]. `stream`: with non-temporal stores where the destination is
 * aligned, which write memory without reading it into the cache first: a gradient-sized
 * output that is not read again soon costs one pass of memory traffic instead of two. */
static void store(float *dst, const float *src, int64_t len, int stream)
{
#if defined(__SSE2__)
    if (stream && ((uintptr_t)dst & 15u) == 0) {
        int64_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
        if (wide_streams && ((uintptr_t)dst & 63u) == 0)
            i = stream_wide(dst, src, len);
#endif
        for (; i + 4 <= len; i += 4)
            _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
        for (; i < len; ++i)
            dst[i] = src[i];
        return;
    }
#endif
    memcpy(dst, src, (size_t)len * sizeof(float));
}

/* Entries [0, n) of a range whose entry 0 sits `phase` entries into its statistic block:
 * the statistic of the range's k-th (possibly partial) block goes to stat_out[k]. Each chunk
 * is combined into buffers that stay in the first-level cache, its statistic read from there,
 * and the buffers then stored. */
typedef struct {
    uint32_t bound_bits; /* |x| >= bound as bit patterns with the sign cleared */
    const uint32_t *block_bounds; /* or NULL; else bound_bits of each of the range's blocks */
    int32_t *block_counts;        /* with block_bounds: entries of each block that reached it */
    int64_t base;        /* position of the range's entry 0 in the whole tensor */
    int64_t capacity;    /* entries the outputs hold; past it only the count goes on */
    int64_t *positions;
    float *magnitudes;
    int64_t count;       /* entries that reached the bound, stored or not */
} Candidates;

static void collect(Candidates *c, const float *x, int64_t len, int64_t at)
{
    const uint32_t *bits = (const uint32_t *)x;
    for (int64_t j = 0; j < len; ++j) {
        uint32_t a = bits[j] & ABS_BITS;
        if (a >= c->bound_bits) {
            if (c->count < c->capacity) {
                c->positions[c->count] = c->base + at + j;
                c->magnitudes[c->count] = bits_float(a);
            }
            ++c->count;
        }
    }
}

/* A gradient given as its pieces (a bucket's members, each in its own storage) instead of
 * one array: piece j covers positions [ends[j-1], ends[j]) of the whole buffer, read from
 * address grads[j], or as zeros (padding) where that is 0. */
typedef struct {
    const int64_t *ends;
    const uint64_t *grads;
    int64_t count;
} Pieces;

static const float zeros[CHUNK]; /* what a padding piece reads, in every gradient dtype */

/* Where entry `at` of the whole buffer is read from, and how many entries from it on lie in
 * the same piece; `*piece` is the piece of the previous call, or 0. */
static const char *piece_at(const Pieces *pieces, int64_t *piece, int64_t at, size_t grad_bytes,
                            int64_t *left)
{
    while (pieces->ends[*piece] <= at)
        ++*piece;
    int64_t start = *piece ? pieces->ends[*piece - 1] : 0;
    *left = pieces->ends[*piece] - at;
    uint64_t address = pieces->grads[*piece];
    return address ? (const char *)(uintptr_t)address + (size_t)(at - start) * grad_bytes : (const char *)zeros;
}

static uint32_t accumulate_range(Combine combine, size_t grad_bytes, const Plan *p,
                                 const char *g, const Pieces *pieces, int64_t base,
                                 const float *a, float *a_out, const float *b,
                                 float *b_out, int64_t n, int stat, int64_t block, int64_t phase,
                                 void *stat_out, int stream, Candidates *candidates)
{
    int64_t piece = 0;
    float a_chunk[CHUNK], b_chunk[CHUNK];
    const float *selected = p->mode == MODE_RESIDUAL ? a_chunk : b_chunk;
    uint32_t bad = 0, block_max = 0;
    double block_sum = 0.0;
    int64_t in_block = phase, k = 0;
    for (int64_t i = 0; i < n;) {
        int64_t len = n - i;
        if (len > CHUNK) len = CHUNK;
        if (stat != STAT_NONE && len > block - in_block) len = block - in_block;
        const char *from = g + i * grad_bytes;
        if (pieces) {
            int64_t left;
            from = piece_at(pieces, &piece, base + i, grad_bytes, &left);
            if (len > left) len = left;
        }
        if (candidates && candidates->block_bounds)
            candidates->bound_bits = candidates->block_bounds[k];
        bad |= combine(p, from, a + i, a_chunk, b ? b + i : NULL, b_chunk, len);
        if (stat == STAT_MAX) {
            uint32_t m = abs_max_bits(selected, len);
            block_max = m > block_max ? m : block_max;
            if (candidates && m >= candidates->bound_bits) {
                int64_t before = candidates->count;
                collect(candidates, selected, len, i);
                if (candidates->block_counts)
                    candidates->block_counts[k] += (int32_t)(candidates->count - before);
            }
        } else if (stat == STAT_SUM) {
            block_sum += abs_sum(selected, len);
        }
        store(a_out + i, a_chunk, len, stream);
        if (b_out)
            store(b_out + i, b_chunk, len, stream);
        i += len;
        in_block += len;
        if (stat != STAT_NONE && (in_block == block || i == n)) {
            if (stat == STAT_MAX)
                ((uint32_t *)stat_out)[k] = block_max;
            else
                ((double *)stat_out)[k] = block_sum;
            ++k;
            block_max = 0;
            block_sum = 0.0;
            in_block = 0;
        }
    }
#if defined(__SSE2__)
    if (stream)
        _mm_sfence(); /* the streamed stores are visible before the call returns */
#endif
    return bad;
}

static PyObject *accumulate(PyObject *self, PyObject *args)
{
    int mode, grad_kind, stat, stream;
    unsigned long long g, a, a_out, b, b_out, stat_out, positions, magnitudes, block_bounds, block_counts,
        piece_ends, piece_grads;
    long long n, block, phase, base, capacity, n_pieces;
    double scale, momentum, scale_m, bound;
    if (!PyArg_ParseTuple(args, "iiKKKKKLdddiLLKpdLLKKKKKKL", &mode, &grad_kind, &g, &a, &a_out, &b,
                          &b_out, &n, &scale, &momentum, &scale_m, &stat, &block, &phase, &stat_out,
                          &stream, &bound, &base, &capacity, &positions, &magnitudes, &block_bounds,
                          &block_counts, &piece_ends, &piece_grads, &n_pieces))
        return NULL;
    Pieces pieces = {(const int64_t *)(uintptr_t)piece_ends, (const uint64_t *)(uintptr_t)piece_grads, n_pieces};
    if (piece_ends && (n_pieces < 1 || !piece_grads || base < 0 || pieces.ends[n_pieces - 1] < base + n)) {
        PyErr_Format(PyExc_ValueError, "accumulate: %lld pieces do not cover entries %lld to %lld",
                     n_pieces, base, base + n);
        return NULL;
    }
    /* A NaN bound is "collect nothing"; a bound is only taken with the block maxima. */
    int collecting = !isnan(bound);
    if (mode < MODE_RESIDUAL || mode > MODE_NESTEROV || stat < STAT_NONE || stat > STAT_SUM
        || n < 0 || block < 1 || phase < 0 || phase >= block || (mode != MODE_RESIDUAL && (!b || !b_out))) {
        PyErr_Format(PyExc_ValueError, "accumulate: mode=%d, stat=%d, n=%lld, block=%lld, phase=%lld",
                     mode, stat, n, block, phase);
        return NULL;
    }
    if (collecting && (stat != STAT_MAX || !(bound >= 0.0) || base < 0 || capacity < 0
                       || (capacity > 0 && (!positions || !magnitudes)))) {
        PyErr_Format(PyExc_ValueError, "accumulate: candidates need block maxima (stat 1, got %d), "
                     "a bound of at least 0, base %lld and capacity %lld of at least 0",
                     stat, base, capacity);
        return NULL;
    }
    /* Compared in float32, the bound rounded to nearest, as torch compares a float32 tensor
     * with a Python number. */
    if (block_bounds && (!block_counts || phase != 0)) {
        PyErr_SetString(PyExc_ValueError, "accumulate: a bound per block needs its counts and a range "
                                          "that starts at a block");
        return NULL;
    }
    Candidates candidates = {float_bits((float)bound) & ABS_BITS, (const uint32_t *)(uintptr_t)block_bounds,
                             (int32_t *)(uintptr_t)block_counts, base, capacity,
                             (int64_t *)(uintptr_t)positions, (float *)(uintptr_t)magnitudes, 0};
    Combine combine;
    size_t grad_bytes;
    switch (grad_kind) {
    case GRAD_FLOAT32: combine = (Combine)combine_float32; grad_bytes = 4; break;
    case GRAD_FLOAT16: combine = (Combine)combine_float16; grad_bytes = 2; break;
    case GRAD_BFLOAT16: combine = (Combine)combine_bfloat16; grad_bytes = 2; break;
    default:
        PyErr_Format(PyExc_ValueError, "accumulate: gradient kind %d", grad_kind);
        return NULL;
    }
    Plan plan = {mode, (float)scale, (float)momentum, (float)scale_m};
    uint32_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = accumulate_range(combine, grad_bytes, &plan, (const char *)(uintptr_t)g,
                           piece_ends ? &pieces : NULL, base, (const float *)(uintptr_t)a, (float *)(uintptr_t)a_out,
                           (const float *)(uintptr_t)b, (float *)(uintptr_t)b_out, n, stat, block,
                           phase, (void *)(uintptr_t)stat_out, stream,
                           collecting ? &candidates : NULL);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(NL)", PyBool_FromLong(!bad), (long long)candidates.count);
}

/* Entries of one scale block at a time: the block of entry `at` is tracked by stepping a
 * boundary forward, never by a division per entry. */
#define ADVANCE(at, blk, boundary, block) \
    while ((at) >= (boundary)) { ++(blk); (boundary) += (block); }

/* Eight entries of one block: their sign bits, and v - scale * sign(v) written to r. */
static inline uint32_t pack8(const float *v, float scale, float *r)
{
#if defined(__SSE2__)
    const __m128 zero = _mm_setzero_ps(), up = _mm_set1_ps(scale), down = _mm_set1_ps(-scale);
    uint32_t bits = 0;
    for (int half = 0; half < 2; ++half) {
        __m128 x = _mm_loadu_ps(v + 4 * half), positive = _mm_cmpge_ps(x, zero);
        __m128 decoded = _mm_or_ps(_mm_and_ps(positive, up), _mm_andnot_ps(positive, down));
        _mm_storeu_ps(r + 4 * half, _mm_sub_ps(x, decoded));
        bits |= (uint32_t)_mm_movemask_ps(positive) << (4 * half);
    }
    return bits;
#else
    uint32_t bits = 0;
    for (int j = 0; j < 8; ++j) {
        uint32_t positive = v[j] >= 0.0f;
        bits |= positive << j;
        r[j] = v[j] - (positive ? scale : -scale);
    }
    return bits;
#endif
}

/* o[j] = (or +=) scale * (bit j of bits ? 1 : -1) for eight entries of one block. */
static inline void decode8(uint32_t bits, float scale, float *o, int add)
{
#if defined(__SSE2__)
    const __m128 up = _mm_set1_ps(scale), down = _mm_set1_ps(-scale);
    const __m128i lane = _mm_set_epi32(8, 4, 2, 1);
    for (int half = 0; half < 2; ++half) {
        __m128i word = _mm_set1_epi32((int)(bits >> (4 * half)));
        __m128 set = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(word, lane), lane));
        __m128 value = _mm_or_ps(_mm_and_ps(set, up), _mm_andnot_ps(set, down));
        if (add)
            value = _mm_add_ps(_mm_loadu_ps(o + 4 * half), value);
        _mm_storeu_ps(o + 4 * half, value);
    }
#else
    for (int j = 0; j < 8; ++j) {
        float value = (bits >> j) & 1u ? scale : -scale;
        o[j] = add ? o[j] + value : value;
    }
#endif
}

static void sign_pack_range(const float *x, int64_t valid, int64_t n, const float *scales,
                                          int64_t block, int64_t first, uint8_t *packed, float *residual)
{
    int64_t blk = first / block, boundary = (blk + 1) * block;
    for (int64_t byte = 0; byte < n / 8; ++byte) {
        int64_t at = first + byte * 8;
        const float *v = x + byte * 8;
        float *r = residual + byte * 8;
        uint32_t bits = 0;
        ADVANCE(at, blk, boundary, block)
        if (at + 8 <= boundary && at + 8 <= valid) {
            bits = pack8(v, scales[blk], r);
        } else {
            for (int j = 0; j < 8; ++j) {
                ADVANCE(at + j, blk, boundary, block)
                float value = at + j < valid ? v[j] : 0.0f;
                uint32_t positive = value >= 0.0f;
                bits |= positive << j;
                if (at + j < valid)
                    r[j] = value - (positive ? scales[blk] : -scales[blk]);
            }
        }
        packed[byte] = (uint8_t)bits;
    }
}

static PyObject *sign_pack(PyObject *self, PyObject *args)
{
    unsigned long long x, scales, packed, residual;
    long long valid, n, block, first;
    if (!PyArg_ParseTuple(args, "KLLKLLKK", &x, &valid, &n, &scales, &block, &first, &packed, &residual))
        return NULL;
    if (n < 0 || n % 8 || block < 1 || first < 0 || first % 8) {
        PyErr_Format(PyExc_ValueError, "sign_pack: n=%lld, block=%lld, first=%lld", n, block, first);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    sign_pack_range((const float *)(uintptr_t)x, valid, n, (const float *)(uintptr_t)scales, block,
                    first, (uint8_t *)(uintptr_t)packed, (float *)(uintptr_t)residual);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void sign_decode_range(const uint8_t *packed, int64_t n, const float *scales,
                                            int64_t block, int64_t first, float *out, int add)
{
    int64_t blk = first / block, boundary = (blk + 1) * block;
    for (int64_t byte = 0; byte * 8 < n; ++byte) {
        int64_t at = first + byte * 8;
        float *o = out + byte * 8;
        uint32_t bits = packed[byte];
        ADVANCE(at, blk, boundary, block)
        if (at + 8 <= boundary && byte * 8 + 8 <= n) {
            decode8(bits, scales[blk], o, add);
        } else {
            for (int j = 0; j < 8 && byte * 8 + j < n; ++j) {
                ADVANCE(at + j, blk, boundary, block)
                float value = (bits >> j) & 1u ? scales[blk] : -scales[blk];
                o[j] = add ? o[j] + value : value;
            }
        }
    }
}

static PyObject *sign_decode(PyObject *self, PyObject *args)
{
    unsigned long long packed, scales, out;
    long long n, block, first;
    int add;
    if (!PyArg_ParseTuple(args, "KLKLLKp", &packed, &n, &scales, &block, &first, &out, &add))
        return NULL;
    if (n < 0 || block < 1 || first < 0 || first % 8) {
        PyErr_Format(PyExc_ValueError, "sign_decode: n=%lld, block=%lld, first=%lld", n, block, first);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    sign_decode_range((const uint8_t *)(uintptr_t)packed, n, (const float *)(uintptr_t)scales, block,
                      first, (float *)(uintptr_t)out, add);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* out[index[i]] += alpha * values[i] (alpha = 0: out[index[i]] = 0), in order; returns the
 * first index out of range, or -1. alpha is 1 or -1, so the product is exact. */
static int64_t scatter_add_range(float *out, int64_t numel, const int64_t *index, const float *values,
                                 int64_t count, float alpha)
{
    for (int64_t i = 0; i < count; ++i) {
        if (index[i] < 0 || index[i] >= numel)
            return i;
        out[index[i]] = alpha == 0.0f ? 0.0f : out[index[i]] + alpha * values[i];
    }
    return -1;
}

static PyObject *scatter_add(PyObject *self, PyObject *args)
{
    unsigned long long out, index, values;
    long long numel, count;
    int alpha;
    if (!PyArg_ParseTuple(args, "KLKKLi", &out, &numel, &index, &values, &count, &alpha))
        return NULL;
    if (alpha < -1 || alpha > 1) {
        PyErr_Format(PyExc_ValueError, "scatter_add: alpha=%d (1, -1 or 0)", alpha);
        return NULL;
    }
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = scatter_add_range((float *)(uintptr_t)out, numel, (const int64_t *)(uintptr_t)index,
                            (const float *)(uintptr_t)values, count, (float)alpha);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "scatter_add: index %lld at %lld is outside a tensor of %lld",
                     (long long)((const int64_t *)(uintptr_t)index)[bad], (long long)bad, numel);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* One message of sum_sparse: `count` entries, positions non-decreasing. */
typedef struct {
    const int64_t *positions;
    const float *values;
    int64_t count;
} Message;

/* Index of the first of `count` non-decreasing positions that is >= `at`. */
static int64_t first_at_least(const int64_t *positions, int64_t count, int64_t at)
{
    int64_t low = 0, high = count;
    while (low < high) {
        int64_t mid = low + (high - low) / 2;
        if (positions[mid] < at)
            low = mid + 1;
        else
            high = mid;
    }
    return low;
}

/* out[start, start + len) = for each message in order, += scale * value at its position, over
 * zeros: each chunk is summed in a buffer that stays in the first-level cache and stored
 * once (non-temporal where aligned), so the output is written in one pass and the entries are
 * added where they are cached instead of at random places in memory. The buffer is zeroed
 * once and then only where a chunk's entries landed: a memset of the whole buffer per chunk
 * is a `rep stosb` in glibc, which beside the streamed stores doubled the kernel's time.
 * Returns 0, or -1 when a cursor array cannot be allocated. */
static int sum_sparse_range(float *out, int64_t start, int64_t len, const Message *messages,
                            int64_t n_messages, float scale)
{
    /* cursor[m]: message m's first entry not yet added; begin[m]: its first in this chunk. */
    int64_t *cursor = malloc((size_t)(n_messages > 0 ? 2 * n_messages : 1) * sizeof(int64_t));
    if (!cursor)
        return -1;
    int64_t *begin = cursor + n_messages;
    for (int64_t m = 0; m < n_messages; ++m)
        cursor[m] = first_at_least(messages[m].positions, messages[m].count, start);
    float buffer[CHUNK] = {0};
    for (int64_t at = start; at < start + len; at += CHUNK) {
        int64_t n = start + len - at < CHUNK ? start + len - at : CHUNK;
        for (int64_t m = 0; m < n_messages; ++m) {
            const Message *msg = &messages[m];
            int64_t i = begin[m] = cursor[m];
            for (; i < msg->count && msg->positions[i] < at + n; ++i)
                buffer[msg->positions[i] - at] += scale * msg->values[i];
            cursor[m] = i;
        }
        store(out + at, buffer, n, 1);
        for (int64_t m = 0; m < n_messages; ++m)
            for (int64_t i = begin[m]; i < cursor[m]; ++i)
                buffer[messages[m].positions[i] - at] = 0.0f;
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
    free(cursor);
    return 0;
}

static PyObject *sum_sparse(PyObject *self, PyObject *args)
{
    unsigned long long out, table;
    long long start, len, n_messages;
    float scale;
    if (!PyArg_ParseTuple(args, "KLLKLf", &out, &start, &len, &table, &n_messages, &scale))
        return NULL;
    const int64_t *words = (const int64_t *)(uintptr_t)table;
    Message *messages = malloc((size_t)(n_messages > 0 ? n_messages : 1) * sizeof(Message));
    if (!messages)
        return PyErr_NoMemory();
    for (long long m = 0; m < n_messages; ++m) {
        messages[m].positions = (const int64_t *)(uintptr_t)words[3 * m];
        messages[m].values = (const float *)(uintptr_t)words[3 * m + 1];
        messages[m].count = words[3 * m + 2];
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = sum_sparse_range((float *)(uintptr_t)out, start, len, messages, n_messages, scale);
    Py_END_ALLOW_THREADS
    free(messages);
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Whether every message's `count` positions are non-decreasing and inside [0, numel): what
 * sum_sparse assumes. One C loop instead of a few torch operations per message. */
static PyObject *sorted_within(PyObject *self, PyObject *args)
{
    unsigned long long table;
    long long n_messages, numel;
    if (!PyArg_ParseTuple(args, "KLL", &table, &n_messages, &numel))
        return NULL;
    const int64_t *words = (const int64_t *)(uintptr_t)table;
    for (long long m = 0; m < n_messages; ++m) {
        const int64_t *positions = (const int64_t *)(uintptr_t)words[3 * m];
        int64_t count = words[3 * m + 2];
        if ((count > 0 && (positions[0] < 0 || positions[count - 1] >= numel)) ||
            !ascending(positions, count))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* memset, which writes large ranges with non-temporal stores: zeroing a gradient-sized
 * output costs one pass of memory traffic, not a read and a write. */
static PyObject *zero(PyObject *self, PyObject *args)
{
    unsigned long long out;
    long long nbytes;
    if (!PyArg_ParseTuple(args, "KL", &out, &nbytes))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    memset((void *)(uintptr_t)out, 0, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sum_sparse", sum_sparse, METH_VARARGS,
     "sum_sparse(out, start, len, table, n_messages, scale): out[start:start+len] = the sum over "
     "messages, in order, of scale * values at positions (table: per message the int64 words "
     "positions pointer, float32 values pointer, count; positions in range and non-decreasing)."},
    {"sorted_within", sorted_within, METH_VARARGS,
     "sorted_within(table, n_messages, numel) -> bool: whether each message's counted positions "
     "(table as for sum_sparse) are non-decreasing and inside [0, numel)."},
    {"scatter_add", scatter_add, METH_VARARGS,
     "scatter_add(out, numel, index, values, count, alpha): out[index[i]] += alpha * values[i] "
     "(alpha 1 or -1; 0: out[index[i]] = 0) for float32 out and values and int64 indices, in "
     "order; IndexError for an index outside [0, numel)."},
    {"zero", zero, METH_VARARGS, "zero(out, nbytes): memset(out, 0, nbytes)."},
    {"accumulate", accumulate, METH_VARARGS,
     "accumulate(mode, grad_kind, g, a, a_out, b, b_out, n, scale, momentum, scale_m, stat, block, "
     "phase, stat_out, stream, bound, base, capacity, positions, magnitudes, block_bounds, "
     "block_counts, piece_ends, piece_grads, n_pieces) -> "
     "(finite, count): one "
     "range of the memory update (mode 0 residual, 1 momentum, 2 Nesterov; kind 0 float32, 1 float16, "
     "2 bfloat16 gradient) and its per-block statistic (stat 1: uint32 bits of max |x|, 2: float64 "
     "sum of |x|) of the range's blocks, the first starting `phase` entries before the range; "
     "arguments after mode and kind are addresses, counts and factors; stream: store the memories "
     "with non-temporal stores. With stat 1 and a bound that is not NaN, the int64 position "
     "(plus base) and float32 |x| of the first `capacity` entries with |x| >= bound, in order, and "
     "count, how many reached it (else count 0); block_bounds, where not 0, the address of each "
     "of the range's blocks' own bound (uint32 bits of a float32 of at least 0) in place of bound, "
     "and block_counts that of int32 counts, one per block, to which each block's adds how many "
     "reached its bound (phase 0). piece_ends, where not 0: the gradient is read from n_pieces "
     "pieces, piece j's entries up to position piece_ends[j] (int64, ascending) from address "
     "piece_grads[j] (zeros where 0), g ignored."},
    {"sign_pack", sign_pack, METH_VARARGS,
     "sign_pack(x, valid, n, scales, block, first, packed, residual): signs of entries "
     "[first, first + n) of a zero-padded tensor of `valid` entries packed 8 per byte, and the "
     "residual x - scale * sign over the valid ones (x and residual may be the same array)."},
    {"sign_decode", sign_decode, METH_VARARGS,
     "sign_decode(packed, n, scales, block, first, out, add): out = (or +=) scale * sign for "
     "entries [first, first + n) of packed signs (packed points at byte first // 8)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_streaming", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__streaming(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    wide_streams = __builtin_cpu_supports("avx512f") ? 1 : 0;
#endif
    return PyModule_Create(&module);
}
