/* kvwire.index._keys: the chained block keys of kvwire.index.keys.chain, in C.
 *
 * chain_tokens(tokens, block_size, n, seed, start=0) -> list[int]
 *   keys of blocks start..n-1 of the token-id sequence `tokens`: key[i] =
 *   XXH3_64bits_withSeed(int64 native bytes of block i, seed = key[i-1]), key[start-1] = seed
 *   (so a walk can hash a first few blocks, and the rest only if it gets that far).
 *   Exactly what the pure-Python path computes (array('q') bytes + xxhash's xxh3_64), but
 *   reading the ints straight from the list: no intermediate bytes object, no slices.
 *
 * XXH3 comes from the system's libxxhash (the same algorithm, stable since xxHash 0.8.0, as
 * the `xxhash` Python package bundles); its one prototype is declared here because Debian
 * ships the header only in libxxhash-dev. The module is optional: without libxxhash or a
 * compiler the build skips it and kvwire uses the pure-Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

unsigned long long XXH3_64bits_withSeed(const void *input, size_t length,
                                        unsigned long long seed);

#define STACK_TOKENS 1024

static PyObject *
chain_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "chain_tokens(tokens, block_size, n, seed, start=0)");
        return NULL;
    }
    Py_ssize_t start = 0;
    if (nargs == 5) {
        start = PyLong_AsSsize_t(args[4]);
        if (start == -1 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[3]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (bs <= 0 || n < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive, n and start >= 0");
        return NULL;
    }
    PyObject *src = args[0];
    if (!PyList_CheckExact(src) && !PyTuple_CheckExact(src) && PyObject_CheckBuffer(src)) {
        /* an int64 buffer (array('q'), numpy int64): hash its memory directly */
        Py_buffer view;
        if (PyObject_GetBuffer(src, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            const char *f = view.format ? view.format : "B";
            if (*f == '<' || *f == '=' || *f == '@') f++;
            if (view.itemsize == 8 && view.ndim == 1 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0)) {
                Py_ssize_t blen = view.len / 8;
                if (n > blen / bs) {
                    PyBuffer_Release(&view);
                    PyErr_SetString(PyExc_ValueError, "fewer token ids than n blocks of block_size");
                    return NULL;
                }
                PyObject *res = PyList_New(n > start ? n - start : 0);
                if (res != NULL) {
                    const int64_t *toks = (const int64_t *)view.buf;
                    unsigned long long k = seed;
                    for (Py_ssize_t i = start; i < n; i++) {
                        k = XXH3_64bits_withSeed(toks + i * bs, (size_t)bs * 8, k);
                        PyObject *key = PyLong_FromUnsignedLongLong(k);
                        if (key == NULL) { Py_CLEAR(res); break; }
                        PyList_SET_ITEM(res, i - start, key);
                    }
                }
                PyBuffer_Release(&view);
                return res;
            }
            PyBuffer_Release(&view);
        } else {
            PyErr_Clear();
        }
    }
    PyObject *seq = PySequence_Fast(src, "token ids must be a sequence of integers");
    if (seq == NULL) {
        PyErr_SetString(PyExc_ValueError, "token ids must be a sequence of integers");
        return NULL;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (n > len / bs) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "fewer token ids than n blocks of block_size");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t stackbuf[STACK_TOKENS];
    int64_t *buf = stackbuf;
    if (bs > STACK_TOKENS) {
        buf = PyMem_Malloc((size_t)bs * sizeof(int64_t));
        if (buf == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
    PyObject *out = PyList_New(n > start ? n - start : 0);
    if (out == NULL) goto fail;
    unsigned long long k = seed;
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject **blk = items + i * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            PyObject *o = blk[j];
            if (!PyLong_Check(o)) {
                PyErr_SetString(PyExc_ValueError, "token ids must be a sequence of integers");
                goto fail;
            }
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
            if (overflow) {
                PyErr_SetString(PyExc_ValueError,
                                "token ids must fit in a signed 64-bit integer");
                goto fail;
            }
            buf[j] = (int64_t)v;
        }
        k = XXH3_64bits_withSeed(buf, (size_t)bs * sizeof(int64_t), k);
        PyObject *key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) goto fail;
        PyList_SET_ITEM(out, i - start, key);
    }
    if (buf != stackbuf) PyMem_Free(buf);
    Py_DECREF(seq);
    return out;
fail:
    if (buf != stackbuf) PyMem_Free(buf);
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

/* scan_tokens(tokens, block_size, n, start, seed, masks, alive, not_best, pred)
 *     -> (i, key)
 *   The match walk's fast path: hash blocks start.. of `tokens` (chained from `seed`) and
 *   look each key up in `masks`, while the block is held by every stream in `alive`, by none
 *   of them outside the best tier (`v & not_best == 0`) and not in `pred`. Returns the first
 *   block that is not so (and its key), or (n, key of block n-1) / (n, seed) at the end.
 *   Only list/tuple tokens or an int64 buffer. */
static PyObject *
scan_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 9 || !PyDict_CheckExact(args[5]) || !PyDict_CheckExact(args[8])) {
        PyErr_SetString(PyExc_TypeError,
                        "scan_tokens(tokens, bs, n, start, seed, masks, alive, not_best, pred)");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    unsigned long long k = PyLong_AsUnsignedLongLong(args[4]);
    if (k == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *masks = args[5], *alive = args[6], *not_best = args[7], *pred = args[8];
    if (bs <= 0 || n < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive, n and start >= 0");
        return NULL;
    }
    PyObject *src = args[0];
    Py_buffer view;
    int have_view = 0;
    const int64_t *flat = NULL;
    PyObject **items = NULL;
    Py_ssize_t len;
    if (PyList_CheckExact(src) || PyTuple_CheckExact(src)) {
        items = PySequence_Fast_ITEMS(src);
        len = PySequence_Fast_GET_SIZE(src);
    } else {
        if (PyObject_GetBuffer(src, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
        have_view = 1;
        const char *f = view.format ? view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (!(view.itemsize == 8 && view.ndim == 1 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0))) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "scan_tokens: tokens must be a list, tuple or int64 buffer");
            return NULL;
        }
        flat = (const int64_t *)view.buf;
        len = view.len / 8;
    }
    if (n > len / bs) {
        if (have_view) PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "fewer token ids than n blocks of block_size");
        return NULL;
    }
    int64_t stackbuf[STACK_TOKENS];
    int64_t *buf = stackbuf;
    if (items != NULL && bs > STACK_TOKENS) {
        buf = PyMem_Malloc((size_t)bs * sizeof(int64_t));
        if (buf == NULL) {
            if (have_view) PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
    }
    int check_pred = PyDict_GET_SIZE(pred) > 0;
    PyObject *key = NULL, *result = NULL;
    Py_ssize_t i = start;
    for (; i < n; i++) {
        const void *data;
        if (items != NULL) {
            PyObject **blk = items + i * bs;
            for (Py_ssize_t j = 0; j < bs; j++) {
                PyObject *o = blk[j];
                if (!PyLong_Check(o)) {
                    PyErr_SetString(PyExc_ValueError, "token ids must be a sequence of integers");
                    goto done;
                }
                int overflow = 0;
                long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
                if (overflow) {
                    PyErr_SetString(PyExc_ValueError,
                                    "token ids must fit in a signed 64-bit integer");
                    goto done;
                }
                buf[j] = (int64_t)v;
            }
            data = buf;
        } else {
            data = flat + i * bs;
        }
        k = XXH3_64bits_withSeed(data, (size_t)bs * sizeof(int64_t), k);
        Py_XDECREF(key);
        key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) goto done;
        PyObject *v = PyDict_GetItemWithError(masks, key); /* borrowed */
        if (v == NULL) {
            if (PyErr_Occurred()) goto done;
            break;
        }
        if (check_pred) {
            int c = PyDict_Contains(pred, key);
            if (c < 0) goto done;
            if (c) break;
        }
        PyObject *t = PyNumber_And(v, alive);
        if (t == NULL) goto done;
        int eq = PyObject_RichCompareBool(t, alive, Py_EQ);
        Py_DECREF(t);
        if (eq < 0) goto done;
        if (!eq) break;
        t = PyNumber_And(v, not_best);
        if (t == NULL) goto done;
        int nz = PyObject_IsTrue(t);
        Py_DECREF(t);
        if (nz < 0) goto done;
        if (nz) break;
    }
    if (key == NULL) {  /* nothing hashed: start >= n */
        key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) goto done;
    }
    result = Py_BuildValue("(nO)", i, key);
done:
    Py_XDECREF(key);
    if (buf != stackbuf) PyMem_Free(buf);
    if (have_view) PyBuffer_Release(&view);
    return result;
}

/* add_bits(masks, keys, setb, keep, tb) -> list of the keys whose masks already had tb
 *   for each key: masks[key] = setb when absent, else (masks[key] | setb) & keep unless
 *   masks[key] & tb (then the key is returned: a second engine hash for it). The ingest
 *   loop of PrefixIndex._add for new best-tier blocks, without the interpreter per block. */
static PyObject *
add_bits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "add_bits(dict, list, setb, keep, tb)");
        return NULL;
    }
    PyObject *masks = args[0], *keys = args[1], *setb = args[2], *keep = args[3];
    PyObject *tb = args[4];
    PyObject *dups = PyList_New(0);
    if (dups == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        PyObject *v = PyDict_GetItemWithError(masks, k); /* borrowed */
        if (v == NULL) {
            if (PyErr_Occurred() || PyDict_SetItem(masks, k, setb) < 0) goto fail;
            continue;
        }
        PyObject *has = PyNumber_And(v, tb);
        if (has == NULL) goto fail;
        int dup = PyObject_IsTrue(has);
        Py_DECREF(has);
        if (dup < 0) goto fail;
        if (dup) {
            if (PyList_Append(dups, k) < 0) goto fail;
            continue;
        }
        PyObject *o = PyNumber_Or(v, setb);
        if (o == NULL) goto fail;
        PyObject *nv = PyNumber_And(o, keep);
        Py_DECREF(o);
        if (nv == NULL) goto fail;
        int rc = PyDict_SetItem(masks, k, nv);
        Py_DECREF(nv);
        if (rc < 0) goto fail;
    }
    return dups;
fail:
    Py_DECREF(dups);
    return NULL;
}

static PyMethodDef methods[] = {
    {"scan_tokens", (PyCFunction)(void (*)(void))scan_tokens, METH_FASTCALL,
     "scan_tokens(tokens, bs, n, start, seed, masks, alive, not_best, pred) -> (i, key)"},
    {"add_bits", (PyCFunction)(void (*)(void))add_bits, METH_FASTCALL,
     "add_bits(masks, keys, setb, keep, tb) -> keys already holding tb"},
    {"chain_tokens", (PyCFunction)(void (*)(void))chain_tokens, METH_FASTCALL,
     "chain_tokens(tokens, block_size, n, seed, start=0) -> chained xxh3 block keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.index._keys", "Chained xxh3 block keys (C).", -1, methods,
};

PyMODINIT_FUNC
PyInit__keys(void)
{
    return PyModule_Create(&module);
}
