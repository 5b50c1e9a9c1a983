/* Bit fields of messages, written and read in one pass over the packed bytes (bit j of byte i is
 * bit 8i + j, the order of the core's pack_bits). Torch needs a table lookup that widens every
 * bit to a byte, then nonzero, or shifts and a sum over a (count, width) matrix: a handful of
 * passes with their own temporaries for each of the N messages a rank decodes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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

static void fields_range(const uint8_t *packed, int64_t width, int64_t count, int64_t *out)
{
    for (int64_t i = 0; i < count; ++i) {
        uint64_t value = 0;
        int64_t bit = i * width;
        for (int64_t taken = 0; taken < width;) {
            int64_t shift = bit & 7, take = 8 - shift < width - taken ? 8 - shift : width - taken;
            value |= (uint64_t)((packed[bit >> 3] >> shift) & ((1u << take) - 1u)) << taken;
            taken += take;
            bit += take;
        }
        out[i] = (int64_t)value;
    }
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

static PyObject *unpack_fields(PyObject *self, PyObject *args)
{
    unsigned long long packed, out;
    long long width, count;
    if (!PyArg_ParseTuple(args, "KLLK", &packed, &width, &count, &out))
        return NULL;
    if (width < 1 || width > 63 || count < 0) {
        PyErr_Format(PyExc_ValueError, "unpack_fields: width=%lld, count=%lld", width, count);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fields_range((const uint8_t *)(uintptr_t)packed, width, count, (int64_t *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
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
    {"unpack_fields", unpack_fields, METH_VARARGS,
     "unpack_fields(packed, width, count, out): out[i] = the unsigned width-bit field at bit "
     "i * width, lowest bit first, as int64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__bits(void) { return PyModule_Create(&module); }
