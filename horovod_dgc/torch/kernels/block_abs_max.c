/* Largest |x| of every block of a float32 array in one read pass.
 *
 * PyTorch has no fused abs-max reduction: amax and amin over the blocks read the tensor
 * twice, and abs().amax() writes a full-size temporary first. This kernel reads it once.
 * A NaN in a block makes its maximum NaN, as torch.amax does. Calls run with the GIL
 * released, so the adapter runs one call per thread on separate ranges of blocks. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

/* Independent running maxima: the element-wise comparison vectorises, a single running
 * maximum would be a serial dependency chain. */
#define LANES 16

static void block_abs_max_range(const float *x, int64_t n_blocks, int64_t block, float *out)
{
    for (int64_t b = 0; b < n_blocks; ++b) {
        const float *row = x + b * block;
        float lane[LANES] = {0.0f};
        int64_t i = 0;
        for (; i + LANES <= block; i += LANES)
            for (int j = 0; j < LANES; ++j) {
                float a = fabsf(row[i + j]);
                lane[j] = (a > lane[j] || a != a) ? a : lane[j];
            }
        float largest = 0.0f;
        for (; i < block; ++i) {
            float a = fabsf(row[i]);
            largest = (a > largest || a != a) ? a : largest;
        }
        for (int j = 0; j < LANES; ++j)
            largest = (lane[j] > largest || lane[j] != lane[j]) ? lane[j] : largest;
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
    block_abs_max_range((const float *)(uintptr_t)x_address, n_blocks, block,
                        (float *)(uintptr_t)out_address);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"block_abs_max", block_abs_max, METH_VARARGS,
     "block_abs_max(x_address, n_blocks, block, out_address): out[b] = max |x[b*block:(b+1)*block]| "
     "for contiguous float32 buffers given by address."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_abs_max", NULL, -1, methods};

PyMODINIT_FUNC PyInit__block_abs_max(void) { return PyModule_Create(&module); }
