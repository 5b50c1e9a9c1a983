/* Bit fields of messages, written and read in one pass over the packed bytes (bit j of byte i is
 * bit 8i + j, the order of the core's pack_bits). Torch needs a table lookup that widens every
 * bit to a byte, then nonzero, or shifts and a sum over a (count, width) matrix: a handful of
 * passes with their own temporaries for each of the N messages a rank decodes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int64_t count_range(const uint8_t *packed, int64_t n_bits)
{
    int64_t count = 0, full = n_bits / 8;
    for (int64_t i = 0; i < full; ++i)
        count += __builtin_popcount(packed[i]);
    if (n_bits % 8)
        count += __builtin_popcount(packed[full] & ((1u << (n_bits % 8)) - 1u));
    return count;
}

static void positions_range(const uint8_t *packed, int64_t n_bits, int64_t *out)
{
    int64_t count = 0;
    for (int64_t i = 0; i * 8 < n_bits; ++i) {
        uint32_t byte = packed[i];
        if (i * 8 + 8 > n_bits)
            byte &= (1u << (n_bits - i * 8)) - 1u;
        while (byte) {
            out[count++] = i * 8 + __builtin_ctz(byte);
            byte &= byte - 1u;
        }
    }
}

/* The unsigned `width`-bit field that starts at bit `bit`, lowest bit first. */
static uint64_t field_at(const uint8_t *packed, int64_t width, int64_t bit)
{
    uint64_t value = 0;
    for (int64_t taken = 0; taken < width;) {
        int64_t shift = bit & 7, take = 8 - shift < width - taken ? 8 - shift : width - taken;
        value |= (uint64_t)((packed[bit >> 3] >> shift) & ((1u << take) - 1u)) << taken;
        taken += take;
        bit += take;
    }
    return value;
}

/* Elias-Fano positions (codecs.EliasFano): the i-th set bit b of `upper` and the i-th
 * `low_bits`-bit field of `lower` give position ((b - i) << low_bits) + field. Writes `capacity`
 * positions, 0 from `count` on; returns how many bits of the first n_upper_bits are set (all
 * of them are counted, also past `capacity`) and sets *in_range to whether every position
 * written before `count` is below `numel`. */
static int64_t elias_fano_range(const uint8_t *lower, int64_t low_bits, const uint8_t *upper,
                                int64_t n_upper_bits, int64_t capacity, int64_t count,
                                int64_t numel, int64_t *out, int *in_range)
{
    int64_t wanted = count < capacity ? count : capacity, found = 0;
    int64_t lower_bytes = (wanted * low_bits + 7) / 8;  /* what the caller checked is there */
    uint64_t low_mask = (1ull << low_bits) - 1ull;      /* low_bits <= 56: one load suffices */
    *in_range = 1;
    for (int64_t i = 0; i * 8 < n_upper_bits; ++i) {
        uint32_t byte = upper[i];
        if (i * 8 + 8 > n_upper_bits)
            byte &= (1u << (n_upper_bits - i * 8)) - 1u;
        if (found >= wanted) {
            found += __builtin_popcount(byte);
            continue;
        }
        while (byte) {
            if (found < wanted) {
                int64_t high = i * 8 + __builtin_ctz(byte) - found;
                int64_t bit = found * low_bits, low = 0;
                if ((bit >> 3) + 8 <= lower_bytes) {  /* one unaligned load holds the field */
                    uint64_t word;
                    memcpy(&word, lower + (bit >> 3), 8);
                    low = (int64_t)((word >> (bit & 7)) & low_mask);
                } else if (low_bits) {
                    low = (int64_t)field_at(lower, low_bits, bit);
                }
                int64_t position = (high << low_bits) + low;
                if (position >= numel)
                    *in_range = 0;
                out[found] = position;
            }
            ++found;
            byte &= byte - 1u;
        }
    }
    /* Fewer set bits than `count`: the message is inconsistent; its missing slots read 0. */
    for (int64_t i = found < wanted ? found : wanted; i < capacity; ++i)
        out[i] = 0;
    return found;
}

/* The lowest `width` bits of each value, one field after another, ORed into zeroed bytes. */
static void pack_fields_range(const int64_t *values, int64_t count, int64_t width, uint8_t *packed)
{
    for (int64_t i = 0; i < count; ++i) {
        uint64_t value = (uint64_t)values[i] & ((width < 64 ? (1ull << width) : 0ull) - 1ull);
        int64_t bit = i * width;
        for (int64_t put = 0; put < width;) {
            int64_t shift = bit & 7, take = 8 - shift < width - put ? 8 - shift : width - put;
            packed[bit >> 3] |= (uint8_t)(((value >> put) & ((1u << take) - 1u)) << shift);
            put += take;
            bit += take;
        }
    }
}

/* Sets bit p of the bytes for every listed position; returns the first one outside
 * [0, n_bits), or -1. */
static int64_t set_bits_range(const int64_t *positions, int64_t count, int64_t n_bits, uint8_t *packed)
{
    for (int64_t i = 0; i < count; ++i) {
        int64_t p = positions[i];
        if (p < 0 || p >= n_bits)
            return i;
        packed[p >> 3] |= (uint8_t)(1u << (p & 7));
    }
    return -1;
}

static PyObject *pack_fields(PyObject *self, PyObject *args)
{
    unsigned long long values, packed;
    long long count, width;
    if (!PyArg_ParseTuple(args, "KLLK", &values, &count, &width, &packed))
        return NULL;
    if (width < 1 || width > 63 || count < 0) {
        PyErr_Format(PyExc_ValueError, "pack_fields: width=%lld, count=%lld", width, count);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pack_fields_range((const int64_t *)(uintptr_t)values, count, width, (uint8_t *)(uintptr_t)packed);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *set_bits(PyObject *self, PyObject *args)
{
    unsigned long long positions, packed;
    long long count, n_bits;
    if (!PyArg_ParseTuple(args, "KLLK", &positions, &count, &n_bits, &packed))
        return NULL;
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = set_bits_range((const int64_t *)(uintptr_t)positions, count, n_bits, (uint8_t *)(uintptr_t)packed);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "set_bits: position %lld is outside %lld bits",
                     (long long)((const int64_t *)(uintptr_t)positions)[bad], n_bits);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *count_set_bits(PyObject *self, PyObject *args)
{
    unsigned long long packed;
    long long n_bits;
    if (!PyArg_ParseTuple(args, "KL", &packed, &n_bits))
        return NULL;
    if (n_bits < 0) {
        PyErr_Format(PyExc_ValueError, "count_set_bits: n_bits=%lld", n_bits);
        return NULL;
    }
    int64_t count;
    Py_BEGIN_ALLOW_THREADS
    count = count_range((const uint8_t *)(uintptr_t)packed, n_bits);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(count);
}

static PyObject *set_bit_positions(PyObject *self, PyObject *args)
{
    unsigned long long packed, out;
    long long n_bits;
    if (!PyArg_ParseTuple(args, "KLK", &packed, &n_bits, &out))
        return NULL;
    if (n_bits < 0) {
        PyErr_Format(PyExc_ValueError, "set_bit_positions: n_bits=%lld", n_bits);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    positions_range((const uint8_t *)(uintptr_t)packed, n_bits, (int64_t *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *elias_fano_positions(PyObject *self, PyObject *args)
{
    unsigned long long lower, upper, out;
    long long low_bits, n_upper_bits, capacity, count, numel;
    if (!PyArg_ParseTuple(args, "KLKLLLLK", &lower, &low_bits, &upper, &n_upper_bits, &capacity,
                          &count, &numel, &out))
        return NULL;
    if (low_bits < 0 || low_bits > 56 || n_upper_bits < 0 || capacity < 0 || count < 0) {
        PyErr_Format(PyExc_ValueError, "elias_fano_positions: low_bits=%lld, n_upper_bits=%lld, "
                     "capacity=%lld, count=%lld", low_bits, n_upper_bits, capacity, count);
        return NULL;
    }
    int64_t found;
    int in_range;
    Py_BEGIN_ALLOW_THREADS
    found = elias_fano_range((const uint8_t *)(uintptr_t)lower, low_bits,
                             (const uint8_t *)(uintptr_t)upper, n_upper_bits, capacity, count, numel,
                             (int64_t *)(uintptr_t)out, &in_range);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(LO)", (long long)found, in_range ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"pack_fields", pack_fields, METH_VARARGS,
     "pack_fields(values, count, width, packed): the lowest width bits of each int64 value, one "
     "field after another, lowest bit first, ORed into zeroed bytes."},
    {"set_bits", set_bits, METH_VARARGS,
     "set_bits(positions, count, n_bits, packed): sets bit p for every int64 position p of the "
     "list; IndexError for one outside [0, n_bits)."},
    {"count_set_bits", count_set_bits, METH_VARARGS,
     "count_set_bits(packed, n_bits) -> count: set bits among the first n_bits."},
    {"set_bit_positions", set_bit_positions, METH_VARARGS,
     "set_bit_positions(packed, n_bits, out): the int64 positions of the set bits among the first "
     "n_bits, ascending (out has room for count_set_bits of them)."},
    {"elias_fano_positions", elias_fano_positions, METH_VARARGS,
     "elias_fano_positions(lower, low_bits, upper, n_upper_bits, capacity, count, numel, out) -> "
     "(set bits, in range): the capacity int64 positions of an Elias-Fano coding, 0 from count "
     "on, and whether those before count are below numel."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__bits(void) { return PyModule_Create(&module); }
