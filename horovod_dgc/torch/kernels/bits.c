/* Bit fields of messages, written and read in one pass over the packed bytes (bit j of byte i is
 * bit 8i + j, the order of the core's pack_bits). Torch needs a table lookup that widens every
 * bit to a byte, then nonzero, or shifts and a sum over a (count, width) matrix: a handful of
 * passes with their own temporaries for each of the N messages a rank decodes.
 *
 * decode_messages: every step of decoding one allgather's sparse messages but the sum, in one
 * call: each header checked against its bounds, the positions of each index coding (raw,
 * Elias-Fano, bitmap) and the values of each value coding (float32, float16, bfloat16, int8
 * and a scale) written to scratch arrays, for streaming.c's sum_sparse. What the header words
 * mean and what each coding holds is the core's (wire.py, codecs.py): the adapter hands this
 * kernel a plan of offsets and kinds derived from them.
 *
 * encode_message: the reverse for one message: header, index coding and value coding written
 * in one call, with the values receivers will decode (the rounding of float16, bfloat16 and
 * int8 is the composition's, bit for bit). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "common.h"

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

/* The lowest `width` bits of each value, one field after another, ORed into zeroed bytes.
 * Up to 56 bits wide, the fields go through a 64-bit accumulator a whole byte at a time
 * (a field never straddles more than it holds); wider ones bit range by bit range. */
static void pack_fields_range(const int64_t *values, int64_t count, int64_t width, uint8_t *packed)
{
    uint64_t mask = (width < 64 ? (1ull << width) : 0ull) - 1ull;
    if (width <= 56) {
        uint64_t held = 0;
        int64_t bits = 0;
        for (int64_t i = 0; i < count; ++i) {
            held |= ((uint64_t)values[i] & mask) << bits;
            for (bits += width; bits >= 8; bits -= 8, held >>= 8)
                *packed++ |= (uint8_t)held;
        }
        if (bits)
            *packed |= (uint8_t)held;
        return;
    }
    for (int64_t i = 0; i < count; ++i) {
        uint64_t value = (uint64_t)values[i] & mask;
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

/* A message's index and value codings, as the plan names them. */
enum { INDEX_RAW32 = 0, INDEX_RAW64 = 1, INDEX_ELIAS_FANO = 2, INDEX_BITMAP = 3 };
enum { VALUE_FLOAT32 = 0, VALUE_FLOAT16 = 1, VALUE_BFLOAT16 = 2, VALUE_INT8 = 3, VALUE_NONE = 4 };
/* The plan's columns, one row per message. */
enum {
    PLAN_OFFSET,        /* byte offset of the message in the received data */
    PLAN_INDEX_KIND,
    PLAN_NUMEL,         /* elements of the tensor */
    PLAN_CAPACITY,      /* slots of the message */
    PLAN_LOW_BITS,      /* Elias-Fano: low bits per position */
    PLAN_UPPER_BITS,    /* Elias-Fano: bits of the upper bitvector */
    PLAN_INDEX_AT,      /* byte offset in the message of the (first) index part */
    PLAN_UPPER_AT,      /* Elias-Fano: byte offset of the upper bitvector */
    PLAN_VALUE_KIND,
    PLAN_VALUE_AT,      /* byte offset of the values */
    PLAN_SCALE_AT,      /* int8: byte offset of the float32 scale */
    PLAN_SLOT,          /* row of (positions, values, count) in the output table */
    PLAN_SCRATCH_AT,    /* entry offset of the message's slots in the scratch arrays */
    PLAN_COLUMNS
};

/* The first `count` positions of a message into `out` (room for its capacity, the rest 0);
 * whether they agree with its count and lie inside its tensor, as codecs.py decides. */
static int decode_positions(const uint8_t *message, const int64_t *row, int64_t count, int64_t *out)
{
    int64_t numel = row[PLAN_NUMEL], capacity = row[PLAN_CAPACITY];
    const uint8_t *part = message + row[PLAN_INDEX_AT];
    switch (row[PLAN_INDEX_KIND]) {
    case INDEX_RAW32:
    case INDEX_RAW64:
        for (int64_t i = 0; i < capacity; ++i) {
            int64_t p;
            if (row[PLAN_INDEX_KIND] == INDEX_RAW32) {
                int32_t q;
                memcpy(&q, part + 4 * i, 4);
                p = q;
            } else {
                memcpy(&p, part + 8 * i, 8);
            }
            if (p < 0 || p >= numel)  /* padding slots too: the raw coding writes them 0 */
                return 0;
            out[i] = i < count ? p : 0;  /* past the count: padding, whatever the bytes hold */
        }
        return 1;
    case INDEX_ELIAS_FANO: {
        int in_range;
        int64_t found = elias_fano_range(part, row[PLAN_LOW_BITS], message + row[PLAN_UPPER_AT],
                                         row[PLAN_UPPER_BITS], capacity, count, numel, out, &in_range);
        return found == count && in_range;
    }
    case INDEX_BITMAP:
        if (count_range(part, numel) != count)
            return 0;
        positions_range(part, numel, out);
        for (int64_t i = count; i < capacity; ++i)
            out[i] = 0;
        return 1;
    }
    return 0;
}

/* The first `count` values of a message as float32 (none for a message of positions only). */
static void decode_values(const uint8_t *message, const int64_t *row, int64_t count, float *out)
{
    const uint8_t *part = message + row[PLAN_VALUE_AT];
    if (row[PLAN_VALUE_KIND] == VALUE_NONE) {
        return;
    } else if (row[PLAN_VALUE_KIND] == VALUE_FLOAT32) {
        memcpy(out, part, (size_t)count * 4);
    } else if (row[PLAN_VALUE_KIND] == VALUE_INT8) {
        float scale;
        memcpy(&scale, message + row[PLAN_SCALE_AT], 4);
        for (int64_t i = 0; i < count; ++i)
            out[i] = (float)(int8_t)part[i] * scale;
    } else {
        int half = row[PLAN_VALUE_KIND] == VALUE_FLOAT16;
        for (int64_t i = 0; i < count; ++i) {
            uint16_t v;
            memcpy(&v, part + 2 * i, 2);
            out[i] = half ? half_to_float(v) : bfloat16_to_float(v);
        }
    }
}

typedef struct {
    const uint8_t *data;
    const int64_t *plan;
    int64_t n_messages;
    const int32_t *low, *high;  /* accepted header words, n_messages x n_words each */
    int64_t n_words, step_word, step, count_word, flags_word;
    int64_t *positions;
    float *values;
    int64_t *table;             /* per slot: positions pointer, values pointer, count */
    int32_t *flags;             /* each message's flags word, in message order */
} Decode;

/* Decodes every message; returns the first that cannot be summed (a header outside its
 * bounds, positions that disagree with the count or the tensor, or raw positions out of
 * order), or -1. */
static int64_t decode_all(const Decode *d)
{
    for (int64_t m = 0; m < d->n_messages; ++m) {
        const int64_t *row = d->plan + m * PLAN_COLUMNS;
        const uint8_t *message = d->data + row[PLAN_OFFSET];
        const int32_t *low = d->low + m * d->n_words, *high = d->high + m * d->n_words;
        for (int64_t w = 0; w < d->n_words; ++w) {
            int32_t word;
            memcpy(&word, message + 4 * w, 4);
            if (w == d->step_word ? word != d->step : (word < low[w] || word > high[w]))
                return m;
        }
        int32_t count, flags;
        memcpy(&count, message + 4 * d->count_word, 4);
        memcpy(&flags, message + 4 * d->flags_word, 4);
        int64_t *positions = d->positions + row[PLAN_SCRATCH_AT];
        float *values = d->values + row[PLAN_SCRATCH_AT];
        if (!decode_positions(message, row, count, positions) || !ascending(positions, count))
            return m;
        decode_values(message, row, count, values);
        int64_t *entry = d->table + 3 * row[PLAN_SLOT];
        entry[0] = (int64_t)(uintptr_t)positions;
        entry[1] = (int64_t)(uintptr_t)values;
        entry[2] = count;
        d->flags[m] = flags;
    }
    return -1;
}

static PyObject *decode_messages(PyObject *self, PyObject *args)
{
    unsigned long long data, plan, bounds, positions, values, table, flags;
    long long n_messages, n_words, step_word, step, count_word, flags_word;
    if (!PyArg_ParseTuple(args, "KKLKLLLLLKKKK", &data, &plan, &n_messages, &bounds, &n_words,
                          &step_word, &step, &count_word, &flags_word, &positions, &values, &table,
                          &flags))
        return NULL;
    if (n_messages < 0 || n_words < 1 || step_word < 0 || step_word >= n_words || count_word < 0 ||
        count_word >= n_words || flags_word < 0 || flags_word >= n_words) {
        PyErr_Format(PyExc_ValueError, "decode_messages: n_messages=%lld, n_words=%lld, words "
                     "%lld/%lld/%lld", n_messages, n_words, step_word, count_word, flags_word);
        return NULL;
    }
    const int32_t *low = (const int32_t *)(uintptr_t)bounds;
    Decode d = {(const uint8_t *)(uintptr_t)data, (const int64_t *)(uintptr_t)plan, n_messages,
                low, low + n_messages * n_words, n_words, step_word, step, count_word, flags_word,
                (int64_t *)(uintptr_t)positions, (float *)(uintptr_t)values,
                (int64_t *)(uintptr_t)table, (int32_t *)(uintptr_t)flags};
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = decode_all(&d);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

/* float to IEEE half, rounded to nearest even (the compiler's conversion), or 0 where the
 * compiler has no _Float16: the adapter then leaves float16 values to the composition. */
#if defined(__FLT16_MAX__)
#define HAS_FLOAT16 1
static inline uint16_t float_to_half(float f)
{
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}
#else
#define HAS_FLOAT16 0
static inline uint16_t float_to_half(float f) { (void)f; return 0; }
#endif

/* float to bfloat16 as torch rounds it: to nearest even, NaN to the quiet NaN 0x7fc0. */
static inline uint16_t float_to_bfloat16(float f)
{
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The positions' index coding into the zeroed message; 0 where one is outside the tensor or
 * out of order (Elias-Fano and the bitmap need them ascending). */
static int encode_positions(uint8_t *message, const int64_t *row, const int64_t *positions, int64_t count)
{
    int64_t numel = row[PLAN_NUMEL];
    uint8_t *part = message + row[PLAN_INDEX_AT];
    for (int64_t i = 0; i < count; ++i)
        if (positions[i] < 0 || positions[i] >= numel || (i && positions[i] <= positions[i - 1]))
            return 0;
    switch (row[PLAN_INDEX_KIND]) {
    case INDEX_RAW32:
        for (int64_t i = 0; i < count; ++i) {
            int32_t p = (int32_t)positions[i];
            memcpy(part + 4 * i, &p, 4);
        }
        return 1;
    case INDEX_RAW64:
        memcpy(part, positions, (size_t)count * 8);
        return 1;
    case INDEX_ELIAS_FANO: {
        int64_t l = row[PLAN_LOW_BITS];
        uint8_t *upper = message + row[PLAN_UPPER_AT];
        for (int64_t i = 0; i < count; ++i) {
            int64_t mark = (positions[i] >> l) + i;
            if (mark >= row[PLAN_UPPER_BITS])
                return 0;
            upper[mark >> 3] |= (uint8_t)(1u << (mark & 7));
        }
        if (l)
            pack_fields_range(positions, count, l, part);
        return 1;
    }
    case INDEX_BITMAP:
        return set_bits_range(positions, count, numel, part) < 0;
    }
    return 0;
}

/* The `count` values' coding (zeros to the capacity) and, in `decoded` (capacity entries),
 * what receivers will read back; 0 for float16 without a compiler conversion. Cloned for
 * x86-64-v3, whose F16C converts to float16 in one instruction (libgcc's routine otherwise
 * took 15 ns a value: most of an encode). */
VECTOR_CLONES static int encode_values(uint8_t *message, const int64_t *row, const float *values, int64_t count,
                         float *decoded)
{
    int64_t capacity = row[PLAN_CAPACITY];
    uint8_t *part = message + row[PLAN_VALUE_AT];
    for (int64_t i = count; i < capacity; ++i)
        decoded[i] = 0.0f;
    switch (row[PLAN_VALUE_KIND]) {
    case VALUE_FLOAT32:
        memcpy(part, values, (size_t)count * 4);
        memcpy(decoded, values, (size_t)count * 4);
        return 1;
    case VALUE_FLOAT16:
        if (!HAS_FLOAT16)
            return 0;
        for (int64_t i = 0; i < count; ++i) {
            float v = values[i] > 65504.0f ? 65504.0f : values[i] < -65504.0f ? -65504.0f : values[i];
            uint16_t h = float_to_half(v);  /* clamped first, as codecs.FORMAT_MAX says */
            memcpy(part + 2 * i, &h, 2);
            decoded[i] = half_to_float(h);
        }
        return 1;
    case VALUE_BFLOAT16:
        for (int64_t i = 0; i < count; ++i) {
            uint16_t b = float_to_bfloat16(values[i]);
            memcpy(part + 2 * i, &b, 2);
            decoded[i] = bfloat16_to_float(b);
        }
        return 1;
    case VALUE_INT8: {
        /* codecs.Int8Values: scale = max|v| * (1/127); level = round(v * (1 / max(scale,
         * 1e-30))) within +-127, each step rounded to float32 as torch rounds it. */
        float largest = 0.0f;
        int nan = 0;
        for (int64_t i = 0; i < count; ++i) {
            float a = fabsf(values[i]);
            nan |= a != a;
            largest = a > largest ? a : largest;
        }
        float scale = (nan ? NAN : largest) * (float)(1.0 / 127.0);
        float inverse = 1.0f / (scale < 1e-30f ? 1e-30f : scale);  /* NaN stays NaN */
        for (int64_t i = 0; i < count; ++i) {
            float level = nearbyintf(values[i] * inverse);
            level = level > 127.0f ? 127.0f : level < -127.0f ? -127.0f : level;
            part[i] = (uint8_t)(int8_t)level;
            decoded[i] = level * scale;
        }
        memcpy(message + row[PLAN_SCALE_AT], &scale, 4);
        return 1;
    }
    }
    return 0;
}

static PyObject *encode_message(PyObject *self, PyObject *args)
{
    unsigned long long plan_row, positions, values, out, decoded;
    const char *header;
    Py_ssize_t header_bytes;
    long long count, nbytes;
    if (!PyArg_ParseTuple(args, "Ky#KKLKLK", &plan_row, &header, &header_bytes, &positions,
                          &values, &count, &out, &nbytes, &decoded))
        return NULL;
    const int64_t *row = (const int64_t *)(uintptr_t)plan_row;
    if (count < 0 || count > row[PLAN_CAPACITY] || header_bytes > nbytes) {
        PyErr_Format(PyExc_ValueError, "encode_message: count=%lld for a capacity of %lld, a "
                     "header of %zd bytes in a message of %lld", count,
                     (long long)row[PLAN_CAPACITY], header_bytes, nbytes);
        return NULL;
    }
    uint8_t *message = (uint8_t *)(uintptr_t)out;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    memset(message, 0, (size_t)nbytes);
    memcpy(message, header, (size_t)header_bytes);
    ok = encode_positions(message, row, (const int64_t *)(uintptr_t)positions, count) &&
         encode_values(message, row, (const float *)(uintptr_t)values, count,
                       (float *)(uintptr_t)decoded);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
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
    {"decode_messages", decode_messages, METH_VARARGS,
     "decode_messages(data, plan, n_messages, bounds, n_words, step_word, step, count_word, "
     "flags_word, positions, values, table, flags) -> the first message that cannot be summed, "
     "or -1: every message's header checked, its positions and float32 values written to the "
     "scratch arrays, (positions, values, count) to its table slot, its flags word to flags."},
    {"encode_message", encode_message, METH_VARARGS,
     "encode_message(plan_row, header, positions, values, count, out, nbytes, decoded) -> ok: "
     "the message of `count` ascending int64 positions and float32 values written to out (nbytes, "
     "header bytes first), the values receivers will decode to decoded (capacity float32); False "
     "for a position outside the tensor or out of order, or a coding this build lacks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__bits(void) { return PyModule_Create(&module); }
