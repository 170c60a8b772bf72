/* int_list(buf) -> list[int]: a msgpack array of integers (the token ids of a BlockStored)
 * as a list whose ints below TABLE are shared objects, made once per value.
 *
 * msgspec makes a new int object per id (~20 ns each to make, more to free): for a
 * 15k-token prompt's event that was a third of a millisecond of the router's CPU, while
 * token ids repeat from a vocabulary of at most a few hundred thousand. The values are the
 * ones msgspec gives for ``list[int]`` (every msgpack integer format, nothing else); any
 * other input raises ValueError, and the caller then decodes with msgspec as before. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Values 0..TABLE-1 are kept as shared objects (8 bytes a slot: 2 MiB, filled as seen). */
#define TABLE (1u << 18)

static PyObject **shared = NULL;

static inline uint64_t be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

static PyObject *
bad(const char *what)
{
    PyErr_SetString(PyExc_ValueError, what);
    return NULL;
}

static PyObject *
int_list(PyObject *module, PyObject *arg)
{
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = view.buf, *end = p + view.len;
    PyObject *list = NULL;
    uint64_t n;
    if (p >= end) goto truncated;
    if ((*p & 0xF0) == 0x90) {
        n = *p & 0x0F;
        p += 1;
    } else if (*p == 0xDC && end - p >= 3) {
        n = be(p + 1, 2);
        p += 3;
    } else if (*p == 0xDD && end - p >= 5) {
        n = be(p + 1, 4);
        p += 5;
    } else {
        PyBuffer_Release(&view);
        return bad("not a msgpack array");
    }
    if (n > (uint64_t)(end - p)) goto truncated;  /* each item takes a byte at least */
    if ((list = PyList_New((Py_ssize_t)n)) == NULL) goto fail;
    for (uint64_t k = 0; k < n; k++) {
        if (p >= end) goto truncated;
        unsigned char c = *p;
        int neg = 0;
        uint64_t u = 0;
        int64_t s = 0;
        int len;
        if (c <= 0x7F) {
            u = c;
            len = 1;
        } else if (c == 0xCD && end - p >= 3) {  /* the common case: ids of 128..65535 */
            u = (uint64_t)p[1] << 8 | p[2];
            len = 3;
        } else if (c == 0xCE && end - p >= 5) {
            u = (uint64_t)p[1] << 24 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 8 | p[4];
            len = 5;
        } else if (c >= 0xE0) {
            s = (int8_t)c;
            neg = 1;
            len = 1;
        } else {
            int w;
            switch (c) {
            case 0xCC: w = 1; break;
            case 0xCD: w = 2; break;
            case 0xCE: w = 4; break;
            case 0xCF: w = 8; break;
            case 0xD0: w = -1; break;
            case 0xD1: w = -2; break;
            case 0xD2: w = -4; break;
            case 0xD3: w = -8; break;
            default:
                Py_DECREF(list);
                PyBuffer_Release(&view);
                return bad("a msgpack array item is not an integer");
            }
            int width = w < 0 ? -w : w;
            if (end - p < 1 + width) goto truncated;
            uint64_t raw = be(p + 1, width);
            if (w > 0) {
                u = raw;
            } else {
                /* sign-extend a big-endian two's complement of `width` bytes */
                if (width < 8 && (raw >> (8 * width - 1)) & 1)
                    raw |= ~(uint64_t)0 << (8 * width);
                s = (int64_t)raw;
                if (s >= 0) u = (uint64_t)s; else neg = 1;
            }
            len = 1 + width;
        }
        p += len;
        PyObject *v;
        if (!neg && u < TABLE) {
            v = shared[u];
            if (v == NULL) {
                if ((v = PyLong_FromUnsignedLongLong(u)) == NULL) goto fail;
                shared[u] = v;  /* the table's reference, kept for the process's life */
            }
            Py_INCREF(v);
        } else if (neg) {
            if ((v = PyLong_FromLongLong(s)) == NULL) goto fail;
        } else {
            if ((v = PyLong_FromUnsignedLongLong(u)) == NULL) goto fail;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)k, v);
    }
    if (p != end) {
        Py_DECREF(list);
        PyBuffer_Release(&view);
        return bad("bytes after the msgpack array");
    }
    PyBuffer_Release(&view);
    return list;
truncated:
    PyErr_SetString(PyExc_ValueError, "truncated msgpack array");
fail:
    Py_XDECREF(list);
    PyBuffer_Release(&view);
    return NULL;
}

static PyMethodDef methods[] = {
    {"int_list", (PyCFunction)int_list, METH_O,
     "int_list(buf) -> list[int]: a msgpack array of integers, its small values shared "
     "int objects; ValueError for anything else."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.wire._ids", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__ids(void)
{
    if (shared == NULL) {
        shared = PyMem_Calloc(TABLE, sizeof(PyObject *));
        if (shared == NULL) return PyErr_NoMemory();
    }
    return PyModule_Create(&module);
}
