/* kvwire.indexer._answer: a /query answer's JSON bytes straight from the per-medium walk's
 * ints, for a query plan made in Python (indexer/indexer.py, _Fast): what add_rank and
 * shape_answer build as dicts and msgspec then encodes, byte for byte, without a dict or an
 * int object per request (about a third of a query's Python before).
 *
 * answer(dynamo, tenant, insts, members, media, nt, flats) -> bytes
 *   dynamo: Dynamo's shape (else Mooncake's); tenant: the tenant's JSON string (bytes);
 *   insts: the instances' JSON strings in answer order; members: per registration
 *   (instance index, rank's JSON string, block size, group index, position in its group's
 *   walk or -1); media: the tier index of GPU, CPU, DISK (-1: no such tier); nt: tiers;
 *   flats: per group, tier_walk's cumulative ints (2 nt per position) or None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Buf;

static int
buf_grow(Buf *b, Py_ssize_t more)
{
    if (b->len + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap * 2;
    if (cap < b->len + more) cap = b->len + more + 256;
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL) { PyErr_NoMemory(); return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int
put(Buf *b, const char *s, Py_ssize_t n)
{
    if (buf_grow(b, n) < 0) return -1;
    memcpy(b->p + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUTS(b, lit) put((b), (lit), (Py_ssize_t)(sizeof(lit) - 1))

static inline int
put_obj(Buf *b, PyObject *bytes)
{
    return put(b, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes));
}

static inline int
put_int(Buf *b, long long v)
{
    char tmp[24];
    int n = snprintf(tmp, sizeof tmp, "%lld", v);
    return put(b, tmp, n);
}

typedef struct {
    long long lm, alone[3], cum[3];
} Row;

typedef struct {
    Py_ssize_t inst;
    PyObject *rank;  /* borrowed bytes */
    long long n, gpu;
} Rank;

static PyObject *
answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 || !PyBytes_Check(args[1]) || !PyTuple_Check(args[2])
        || !PyTuple_Check(args[3]) || !PyTuple_Check(args[4]) || !PyTuple_Check(args[6])
        || PyTuple_GET_SIZE(args[4]) != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "answer(dynamo, tenant, insts, members, media, nt, flats)");
        return NULL;
    }
    int dynamo = PyObject_IsTrue(args[0]);
    if (dynamo < 0) return NULL;
    PyObject *tenant = args[1], *insts = args[2], *members = args[3], *flats = args[6];
    long nt = PyLong_AsLong(args[5]);
    if (nt == -1 && PyErr_Occurred()) return NULL;
    long media[3];
    for (int m = 0; m < 3; m++) {
        media[m] = PyLong_AsLong(PyTuple_GET_ITEM(args[4], m));
        if (media[m] == -1 && PyErr_Occurred()) return NULL;
        if (media[m] >= nt) {
            PyErr_SetString(PyExc_ValueError, "answer: a medium's tier past nt");
            return NULL;
        }
    }
    Py_ssize_t ni = PyTuple_GET_SIZE(insts), nm = PyTuple_GET_SIZE(members);
    for (Py_ssize_t i = 0; i < ni; i++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(insts, i))) {
            PyErr_SetString(PyExc_TypeError, "answer: instance names must be bytes");
            return NULL;
        }
    }
    Row *rows = PyMem_Calloc((size_t)(ni ? ni : 1), sizeof(Row));
    Rank *ranks = PyMem_Calloc((size_t)(nm ? nm : 1), sizeof(Rank));
    Buf b = {NULL, 0, 0};
    PyObject *out = NULL;
    if (rows == NULL || ranks == NULL) { PyErr_NoMemory(); goto done; }
    Py_ssize_t nl = 2 * nt;
    /* add_rank, member by member */
    for (Py_ssize_t j = 0; j < nm; j++) {
        PyObject *mem = PyTuple_GET_ITEM(members, j);
        if (!PyTuple_Check(mem) || PyTuple_GET_SIZE(mem) != 5
            || !PyBytes_Check(PyTuple_GET_ITEM(mem, 1))) {
            PyErr_SetString(PyExc_TypeError, "answer: a member is (inst, rank, bs, group, pos)");
            goto done;
        }
        Py_ssize_t inst = PyLong_AsSsize_t(PyTuple_GET_ITEM(mem, 0));
        long long bs = PyLong_AsLongLong(PyTuple_GET_ITEM(mem, 2));
        Py_ssize_t gi = PyLong_AsSsize_t(PyTuple_GET_ITEM(mem, 3));
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(mem, 4));
        if (PyErr_Occurred()) goto done;
        if (inst < 0 || inst >= ni || gi < 0 || gi >= PyTuple_GET_SIZE(flats)) {
            PyErr_SetString(PyExc_ValueError, "answer: a member's instance or group out of range");
            goto done;
        }
        long long got[2 * 14 + 2] = {0};
        PyObject *flat = PyTuple_GET_ITEM(flats, gi);
        if (pos >= 0 && flat != Py_None) {
            if (!PyTuple_Check(flat) || (pos + 1) * nl > PyTuple_GET_SIZE(flat) || nl > 28) {
                PyErr_SetString(PyExc_ValueError, "answer: a walk's ints do not cover a member");
                goto done;
            }
            for (Py_ssize_t l = 0; l < nl; l++) {
                got[l] = PyLong_AsLongLong(PyTuple_GET_ITEM(flat, pos * nl + l));
                if (got[l] == -1 && PyErr_Occurred()) goto done;
            }
        }
        Row *r = &rows[inst];
        long long n = got[0] * bs;
        if (n > r->lm) r->lm = n;
        long long gpu = 0;
        for (int m = 0; m < 3; m++) {
            long t = media[m];
            long long alone = t < 0 ? 0 : got[1 + t] * bs;
            long long cum = t < 0 ? 0 : (t == 0 ? got[1] : got[nt + t]) * bs;
            if (alone > r->alone[m]) r->alone[m] = alone;
            if (cum > r->cum[m]) r->cum[m] = cum;
            if (m == 0) gpu = alone;
        }
        ranks[j] = (Rank){inst, PyTuple_GET_ITEM(mem, 1), n, gpu};
    }
    if (!dynamo) {
        if (put(&b, "{", 1) < 0 || put_obj(&b, tenant) < 0 || PUTS(&b, ":{") < 0) goto done;
        for (Py_ssize_t i = 0; i < ni; i++) {
            Row *r = &rows[i];
            if ((i && put(&b, ",", 1) < 0) || put_obj(&b, PyTuple_GET_ITEM(insts, i)) < 0
                || PUTS(&b, ":{\"longest_matched\":") < 0 || put_int(&b, r->lm) < 0
                || PUTS(&b, ",\"GPU\":") < 0 || put_int(&b, r->alone[0]) < 0
                || PUTS(&b, ",\"CPU\":") < 0 || put_int(&b, r->alone[1]) < 0
                || PUTS(&b, ",\"DISK\":") < 0 || put_int(&b, r->alone[2]) < 0
                || PUTS(&b, ",\"DP\":{") < 0)
                goto done;
            int first = 1;
            for (Py_ssize_t j = 0; j < nm; j++) {
                if (ranks[j].inst != i) continue;
                if ((!first && put(&b, ",", 1) < 0) || put_obj(&b, ranks[j].rank) < 0
                    || put(&b, ":", 1) < 0 || put_int(&b, ranks[j].n) < 0)
                    goto done;
                first = 0;
            }
            if (PUTS(&b, "}}") < 0) goto done;
        }
        if (PUTS(&b, "}}") < 0) goto done;
    } else {
        if (PUTS(&b, "{\"scores\":{") < 0) goto done;
        int first_i = 1;
        for (Py_ssize_t i = 0; i < ni; i++) {
            if (!rows[i].lm) continue;
            int any = 0;
            for (Py_ssize_t j = 0; j < nm && !any; j++)
                any = ranks[j].inst == i && ranks[j].gpu != 0;
            if (!any) continue;
            if ((!first_i && put(&b, ",", 1) < 0) || put_obj(&b, PyTuple_GET_ITEM(insts, i)) < 0
                || PUTS(&b, ":{") < 0)
                goto done;
            first_i = 0;
            int first = 1;
            for (Py_ssize_t j = 0; j < nm; j++) {
                if (ranks[j].inst != i || !ranks[j].gpu) continue;
                if ((!first && put(&b, ",", 1) < 0) || put_obj(&b, ranks[j].rank) < 0
                    || put(&b, ":", 1) < 0 || put_int(&b, ranks[j].gpu) < 0)
                    goto done;
                first = 0;
            }
            if (put(&b, "}", 1) < 0) goto done;
        }
        if (PUTS(&b, "},\"frequencies\":[],\"instances\":{") < 0) goto done;
        first_i = 1;
        for (Py_ssize_t i = 0; i < ni; i++) {
            Row *r = &rows[i];
            if (!r->lm) continue;
            if ((!first_i && put(&b, ",", 1) < 0) || put_obj(&b, PyTuple_GET_ITEM(insts, i)) < 0
                || PUTS(&b, ":{\"longest_matched\":") < 0 || put_int(&b, r->lm) < 0
                || PUTS(&b, ",\"gpu\":") < 0 || put_int(&b, r->alone[0]) < 0
                || PUTS(&b, ",\"dp\":{") < 0)
                goto done;
            first_i = 0;
            int first = 1;
            for (Py_ssize_t j = 0; j < nm; j++) {
                if (ranks[j].inst != i) continue;
                if ((!first && put(&b, ",", 1) < 0) || put_obj(&b, ranks[j].rank) < 0
                    || put(&b, ":", 1) < 0 || put_int(&b, ranks[j].gpu) < 0)
                    goto done;
                first = 0;
            }
            if (PUTS(&b, "},\"cpu\":") < 0 || put_int(&b, r->cum[1]) < 0
                || PUTS(&b, ",\"disk\":") < 0 || put_int(&b, r->cum[2]) < 0
                || put(&b, "}", 1) < 0)
                goto done;
        }
        if (PUTS(&b, "}}") < 0) goto done;
    }
    out = PyBytes_FromStringAndSize(b.p, b.len);
done:
    PyMem_Free(b.p);
    PyMem_Free(rows);
    PyMem_Free(ranks);
    return out;
}

static PyMethodDef methods[] = {
    {"answer", (PyCFunction)(void (*)(void))answer, METH_FASTCALL,
     "answer(dynamo, tenant, insts, members, media, nt, flats) -> the /query answer's JSON"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.indexer._answer", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__answer(void)
{
    return PyModule_Create(&module);
}
