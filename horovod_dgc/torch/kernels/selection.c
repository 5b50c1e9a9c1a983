/* The two steps of DGC's block filter (core/selection.py) on float32 arrays, fused.
 *
 * block_abs_max: the largest |x| of every block in one read pass. PyTorch has no fused
 * abs-max reduction: amax and amin over the blocks read the tensor twice, and abs().amax()
 * writes a full-size temporary first. A NaN in a block makes its maximum NaN, as amax does.
 * Calls run with the GIL released, so the adapter runs one call per thread on separate
 * ranges of blocks.
 *
 * collect_at_least: positions and magnitudes of the entries with |x| >= threshold inside a
 * list of blocks, in one pass over those blocks; torch needs a gather, abs, compare, nonzero
 * and index arithmetic, each a separate pass with its own temporary.
 *
 * top_of_segments: the k largest of each segment of a bucket's candidates, in linear time
 * (radix selection of the k-th largest, then one scan that keeps the candidates' order);
 * torch sorts them all. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The maxima are taken over the bit patterns with the sign bit cleared: for non-negative
 * floats the integer order is the float order, and every NaN pattern lies above infinity's,
 * so a NaN wins as it does in amax. Integer maxima vectorise; a float maximum that also
 * tests for NaN does not. LANES independent running maxima (a multiple of the vector width,
 * and at most the smallest block, 8) avoid a serial dependency chain. */
#define LANES 8
#define ABS_BITS 0x7fffffffu

/* An AVX2 copy beside the baseline one, picked when the module loads. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

VECTOR_CLONES static void block_abs_max_range(const int32_t *x, int64_t n_blocks, int64_t block, int32_t *out)
{
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int32_t *row = x + b * block;
        int32_t lane[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= block; i += LANES)
            for (int j = 0; j < LANES; ++j) {
                int32_t a = (int32_t)((uint32_t)row[i + j] & ABS_BITS);
                lane[j] = a > lane[j] ? a : lane[j];
            }
        int32_t largest = 0;
        for (; i < block; ++i) {
            int32_t a = (int32_t)((uint32_t)row[i] & ABS_BITS);
            largest = a > largest ? a : largest;
        }
        for (int j = 0; j < LANES; ++j)
            largest = lane[j] > largest ? lane[j] : largest;
        out[b] = largest;
    }
}

static PyObject *block_abs_max(PyObject *self, PyObject *args)
{
    unsigned long long x_address, out_address;
    long long n_blocks, block;
    if (!PyArg_ParseTuple(args, "KLLK", &x_address, &n_blocks, &block, &out_address))
        return NULL;
    if (n_blocks < 0 || block < 1) {
        PyErr_Format(PyExc_ValueError, "block_abs_max: n_blocks=%lld, block=%lld", n_blocks, block);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    block_abs_max_range((const int32_t *)(uintptr_t)x_address, n_blocks, block,
                        (int32_t *)(uintptr_t)out_address);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* How many listed blocks ahead collect_at_least asks for memory. */
#define PREFETCH_BLOCKS 16

static int64_t collect_at_least_range(const float *x, int64_t numel, const int64_t *blocks,
                                      int64_t n_blocks, int64_t block, float threshold,
                                      int64_t *positions, float *magnitudes)
{
    int64_t count = 0;
    for (int64_t b = 0; b < n_blocks; ++b) {
        int64_t start = blocks[b] * block;
        int64_t end = start + block < numel ? start + block : numel;
        if (b + PREFETCH_BLOCKS < n_blocks) {
            /* The listed blocks lie far apart: each one's first touch would wait for memory. */
            const char *ahead = (const char *)(x + blocks[b + PREFETCH_BLOCKS] * block);
            int64_t ahead_bytes = block * (int64_t)sizeof(float);
            for (int64_t line = 0; line < ahead_bytes && blocks[b + PREFETCH_BLOCKS] * block + line / 4 < numel; line += 64)
                __builtin_prefetch(ahead + line);
        }
        for (int64_t p = start; p < end; ++p) {
            float a = fabsf(x[p]);
            if (a >= threshold) {
                positions[count] = p;
                magnitudes[count] = a;
                ++count;
            }
        }
    }
    return count;
}

/* The same count without writing the entries: no store to wait on, so the loop vectorises. */
static int64_t count_at_least_range(const float *x, int64_t numel, const int64_t *blocks,
                                    int64_t n_blocks, int64_t block, float threshold)
{
    int64_t count = 0;
    for (int64_t b = 0; b < n_blocks; ++b) {
        int64_t start = blocks[b] * block;
        int64_t end = start + block < numel ? start + block : numel;
        if (b + PREFETCH_BLOCKS < n_blocks)
            __builtin_prefetch(x + blocks[b + PREFETCH_BLOCKS] * block);
        for (int64_t p = start; p < end; ++p)
            count += fabsf(x[p]) >= threshold;
    }
    return count;
}

static PyObject *collect_at_least(PyObject *self, PyObject *args)
{
    unsigned long long x_address, blocks_address, positions_address, magnitudes_address;
    long long numel, n_blocks, block;
    float threshold;
    if (!PyArg_ParseTuple(args, "KLKLLfKK", &x_address, &numel, &blocks_address, &n_blocks,
                          &block, &threshold, &positions_address, &magnitudes_address))
        return NULL;
    if (numel < 0 || n_blocks < 0 || block < 1) {
        PyErr_Format(PyExc_ValueError, "collect_at_least: numel=%lld, n_blocks=%lld, block=%lld",
                     numel, n_blocks, block);
        return NULL;
    }
    const int64_t *blocks = (const int64_t *)(uintptr_t)blocks_address;
    int64_t block_count = (numel + block - 1) / block;
    for (int64_t b = 0; b < n_blocks; ++b)
        if (blocks[b] < 0 || blocks[b] >= block_count) {
            PyErr_Format(PyExc_IndexError, "collect_at_least: block %lld of a tensor of %lld blocks",
                         (long long)blocks[b], (long long)block_count);
            return NULL;
        }
    int64_t count;
    Py_BEGIN_ALLOW_THREADS
    if (positions_address == 0)
        count = count_at_least_range((const float *)(uintptr_t)x_address, numel, blocks, n_blocks,
                                     block, threshold);
    else
        count = collect_at_least_range((const float *)(uintptr_t)x_address, numel, blocks, n_blocks,
                                       block, threshold, (int64_t *)(uintptr_t)positions_address,
                                       (float *)(uintptr_t)magnitudes_address);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(count);
}

/* Positions of the entries >= threshold (a NaN never is), ascending; returns their count. */
static int64_t at_least_range(const float *x, int64_t n, float threshold, int64_t *out)
{
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i)
        if (x[i] >= threshold)
            out[count++] = i;
    return count;
}

static PyObject *positions_at_least(PyObject *self, PyObject *args)
{
    unsigned long long x_address, out_address;
    long long n;
    float threshold;
    if (!PyArg_ParseTuple(args, "KLfK", &x_address, &n, &threshold, &out_address))
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "positions_at_least: n=%lld", n);
        return NULL;
    }
    int64_t count;
    Py_BEGIN_ALLOW_THREADS
    count = at_least_range((const float *)(uintptr_t)x_address, n, threshold,
                           (int64_t *)(uintptr_t)out_address);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(count);
}

/* The k-th largest of the bit patterns of one segment's magnitudes, by radix selection (four
 * counting passes over the segment, no worst case): its bit pattern, and in *equal_wanted how
 * many entries equal to it belong to the k largest. */
static uint32_t kth_largest_bits(const uint32_t *bits, int64_t n, int64_t k, int64_t *equal_wanted)
{
    uint32_t prefix = 0, mask = 0;
    int64_t need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t counts[256] = {0};
        for (int64_t j = 0; j < n; ++j)
            if ((bits[j] & mask) == prefix)
                ++counts[(bits[j] >> shift) & 255u];
        int digit = 255;
        for (; digit > 0 && counts[digit] < need; --digit)
            need -= counts[digit];
        prefix |= (uint32_t)digit << shift;
        mask |= 255u << shift;
    }
    *equal_wanted = need;
    return prefix;
}

/* Each segment's k largest candidates: those above its k-th largest magnitude and the first
 * of those equal to it, in the candidates' (ascending) order. */
static void top_of_segments_range(const int64_t *positions, const uint32_t *magnitude_bits,
                                  int64_t n_segments, const int64_t *starts, const int64_t *counts,
                                  const int64_t *ks, int64_t *out, float *thresholds)
{
    for (int64_t s = 0; s < n_segments; ++s) {
        const int64_t *at = positions + starts[s];
        const uint32_t *bits = magnitude_bits + starts[s];
        int64_t equal_wanted;
        uint32_t kth = kth_largest_bits(bits, counts[s], ks[s], &equal_wanted);
        /* At most k written, whatever the magnitudes: the output holds the ks' sum. */
        for (int64_t j = 0, left = ks[s]; j < counts[s] && left > 0; ++j)
            if (bits[j] > kth || (bits[j] == kth && equal_wanted-- > 0)) {
                *out++ = at[j];
                --left;
            }
        memcpy(thresholds + s, &kth, sizeof kth);
    }
}

static PyObject *top_of_segments(PyObject *self, PyObject *args)
{
    unsigned long long positions, magnitudes, starts, counts, ks, out, thresholds;
    long long n_segments, n_candidates;
    if (!PyArg_ParseTuple(args, "KKLLKKKKK", &positions, &magnitudes, &n_candidates, &n_segments,
                          &starts, &counts, &ks, &out, &thresholds))
        return NULL;
    const int64_t *s = (const int64_t *)(uintptr_t)starts, *c = (const int64_t *)(uintptr_t)counts,
                  *k = (const int64_t *)(uintptr_t)ks;
    for (long long i = 0; i < n_segments; ++i)
        if (k[i] < 1 || k[i] > c[i] || s[i] < 0 || s[i] + c[i] > n_candidates) {
            PyErr_Format(PyExc_ValueError, "top_of_segments: segment %lld takes k=%lld of %lld candidates "
                         "from %lld (of %lld)", i, (long long)k[i], (long long)c[i], (long long)s[i],
                         n_candidates);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    top_of_segments_range((const int64_t *)(uintptr_t)positions, (const uint32_t *)(uintptr_t)magnitudes,
                          n_segments, s, c, k, (int64_t *)(uintptr_t)out, (float *)(uintptr_t)thresholds);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"positions_at_least", positions_at_least, METH_VARARGS,
     "positions_at_least(x_address, n, threshold, out_address) -> count: the int64 positions of "
     "the float32 entries >= threshold, ascending; out needs room for n."},
    {"block_abs_max", block_abs_max, METH_VARARGS,
     "block_abs_max(x_address, n_blocks, block, out_address): out[b] = max |x[b*block:(b+1)*block]| "
     "for contiguous float32 buffers given by address."},
    {"collect_at_least", collect_at_least, METH_VARARGS,
     "collect_at_least(x_address, numel, blocks_address, n_blocks, block, threshold, "
     "positions_address, magnitudes_address) -> count: the entries of the listed int64 blocks "
     "with |x| >= threshold, ascending; the outputs need room for n_blocks * block entries. "
     "With positions_address 0 it only counts them (nothing is written)."},
    {"top_of_segments", top_of_segments, METH_VARARGS,
     "top_of_segments(positions_address, magnitudes_address, n_candidates, n_segments, "
     "starts_address, counts_address, ks_address, out_address, thresholds_address): for each "
     "segment s of candidates (int64 positions ascending, float32 magnitudes >= 0; its counts[s] "
     "from starts[s] on), the positions of its ks[s] largest magnitudes, ties to the first, in "
     "order, written one segment after another to out, and its ks[s]-th largest magnitude to "
     "thresholds[s]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_selection", NULL, -1, methods};

PyMODINIT_FUNC PyInit__selection(void) { return PyModule_Create(&module); }
