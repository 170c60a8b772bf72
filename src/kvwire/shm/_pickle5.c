/* kvwire.shm._pickle5: a pickle protocol-5 codec for a subset of plain types, in C.
 *
 * Compiled into kvwire.shm._ring (setup.py lists both sources); the ring's hot path calls
 * it through _pickle5.h. Kept apart from the ring so it can be read, fuzzed
 * (tests/test_shm_pickle5.py, through _ring.dumps_fast / _ring.loads_fast) and changed on
 * its own. Written from the pickle protocol (Lib/pickletools.py documents the opcodes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_pickle5.h"

/* ============================================================ pickle subset codec
 *
 * pickle.dumps/loads cost ~0.5 us each here before touching the object (a Pickler or
 * Unpickler object, its memo, a 4 KiB output buffer, attribute look-ups). Small
 * messages are mostly tuples, lists, dicts, str, int, float, bytes, None and bools, so
 * for exactly these types (no subclasses) we write and read the same standard pickle
 * protocol-5 opcodes ourselves:
 *   enc_obj  writes an object straight into the chunk; it gives up (returns -1, no
 *            Python error) on any other type, a container met twice (pickle would keep
 *            the sharing through its memo; we never memoize), ints beyond 64 bits, str
 *            that do not encode as UTF-8, depth > 64 or a full chunk. The caller then
 *            uses pickle.dumps. Output is valid pickle: a pure-Python reader loads it.
 *   fast_loads  a pickle VM for those opcodes plus PROTO/FRAME/MEMOIZE/PUT/GET (what
 *            pickle.dumps emits for them). Anything else -> NULL without an error and
 *            the caller runs pickle.loads on the same bytes, so errors and every other
 *            type behave exactly as pickle's.
 * Neither runs Python code (no __reduce__, no __hash__ of user types: keys are
 * builtins), so the objects cannot change under them.
 */
enum {
    OP_MARK = '(', OP_STOP = '.', OP_BININT = 'J', OP_BININT1 = 'K', OP_BININT2 = 'M',
    OP_NONE = 'N', OP_BINUNICODE = 'X', OP_APPEND = 'a', OP_APPENDS = 'e',
    OP_EMPTY_DICT = '}', OP_EMPTY_LIST = ']', OP_SETITEM = 's', OP_SETITEMS = 'u',
    OP_TUPLE = 't', OP_EMPTY_TUPLE = ')', OP_BINFLOAT = 'G', OP_BINBYTES = 'B',
    OP_SHORT_BINBYTES = 'C', OP_BINGET = 'h', OP_LONG_BINGET = 'j', OP_BINPUT = 'q',
    OP_LONG_BINPUT = 'r', OP_PROTO = 0x80, OP_TUPLE1 = 0x85, OP_TUPLE2 = 0x86,
    OP_TUPLE3 = 0x87, OP_NEWTRUE = 0x88, OP_NEWFALSE = 0x89, OP_LONG1 = 0x8a,
    OP_SHORT_BINUNICODE = 0x8c, OP_BINUNICODE8 = 0x8d, OP_BINBYTES8 = 0x8e,
    OP_MEMOIZE = 0x94, OP_FRAME = 0x95,
};

#define ENC_MAX_DEPTH 64
#define ENC_MAX_CONTAINERS 256

typedef struct {
    unsigned char *p, *end;
    PyObject *seen[ENC_MAX_CONTAINERS]; /* lists and dicts written so far */
    int nseen;
} Enc;

static inline int enc_room(Enc *e, Py_ssize_t k) { return e->end - e->p >= k; }

static inline void put_le(unsigned char *p, uint64_t v, int nbytes) {
    for (int i = 0; i < nbytes; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint64_t get_le(const unsigned char *p, int nbytes) {
    uint64_t v = 0;
    for (int i = 0; i < nbytes; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int enc_sized(Enc *e, int op1, int op4, int op8, const char *s, Py_ssize_t n) {
    if (n < 256) {
        if (!enc_room(e, 2 + n))
            return -1;
        *e->p++ = (unsigned char)op1;
        *e->p++ = (unsigned char)n;
    } else if ((uint64_t)n <= 0xFFFFFFFFu) {
        if (!enc_room(e, 5 + n))
            return -1;
        *e->p++ = (unsigned char)op4;
        put_le(e->p, (uint64_t)n, 4);
        e->p += 4;
    } else {
        if (!enc_room(e, 9 + n))
            return -1;
        *e->p++ = (unsigned char)op8;
        put_le(e->p, (uint64_t)n, 8);
        e->p += 8;
    }
    memcpy(e->p, s, (size_t)n);
    e->p += n;
    return 0;
}

static int enc_container_once(Enc *e, PyObject *o) {
    for (int i = 0; i < e->nseen; i++)
        if (e->seen[i] == o)
            return -1; /* shared or recursive: pickle's memo semantics needed */
    if (e->nseen == ENC_MAX_CONTAINERS)
        return -1;
    e->seen[e->nseen++] = o;
    return 0;
}

static int enc_obj(Enc *e, PyObject *o, int depth) {
    PyTypeObject *t = Py_TYPE(o);
    if (depth > ENC_MAX_DEPTH)
        return -1;
    if (t == &PyUnicode_Type) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(o, &n);
        if (s == NULL) { /* lone surrogates: pickle's surrogatepass handles them */
            PyErr_Clear();
            return -1;
        }
        return enc_sized(e, OP_SHORT_BINUNICODE, OP_BINUNICODE, OP_BINUNICODE8, s, n);
    }
    if (t == &PyLong_Type) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow)
            return -1;
        if (!enc_room(e, 10))
            return -1;
        if (v >= 0 && v < 256) {
            *e->p++ = OP_BININT1;
            *e->p++ = (unsigned char)v;
        } else if (v >= 0 && v < 65536) {
            *e->p++ = OP_BININT2;
            put_le(e->p, (uint64_t)v, 2);
            e->p += 2;
        } else if (v >= INT32_MIN && v <= INT32_MAX) {
            *e->p++ = OP_BININT;
            put_le(e->p, (uint64_t)v, 4);
            e->p += 4;
        } else { /* LONG1: shortest little-endian two's complement */
            int nb = 5;
            while (nb < 8) {
                long long lim = (long long)1 << (8 * nb - 1);
                if (v >= -lim && v < lim)
                    break;
                nb++;
            }
            *e->p++ = OP_LONG1;
            *e->p++ = (unsigned char)nb;
            put_le(e->p, (uint64_t)v, nb);
            e->p += nb;
        }
        return 0;
    }
    if (t == &PyTuple_Type) {
        Py_ssize_t n = PyTuple_GET_SIZE(o);
        if (n == 0) {
            if (!enc_room(e, 1))
                return -1;
            *e->p++ = OP_EMPTY_TUPLE;
            return 0;
        }
        if (n > 3) {
            if (!enc_room(e, 1))
                return -1;
            *e->p++ = OP_MARK;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (enc_obj(e, PyTuple_GET_ITEM(o, i), depth + 1) < 0)
                return -1;
        if (!enc_room(e, 1))
            return -1;
        *e->p++ = n == 1 ? OP_TUPLE1 : n == 2 ? OP_TUPLE2 : n == 3 ? OP_TUPLE3 : OP_TUPLE;
        return 0;
    }
    if (t == &PyList_Type) {
        if (enc_container_once(e, o) < 0 || !enc_room(e, 2))
            return -1;
        Py_ssize_t n = PyList_GET_SIZE(o);
        *e->p++ = OP_EMPTY_LIST;
        if (n == 0)
            return 0;
        if (n > 1)
            *e->p++ = OP_MARK;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i >= PyList_GET_SIZE(o)) /* cannot shrink (no Python code runs), but cheap */
                return -1;
            if (enc_obj(e, PyList_GET_ITEM(o, i), depth + 1) < 0)
                return -1;
        }
        if (!enc_room(e, 1))
            return -1;
        *e->p++ = n == 1 ? OP_APPEND : OP_APPENDS;
        return 0;
    }
    if (t == &PyDict_Type) {
        if (enc_container_once(e, o) < 0 || !enc_room(e, 2))
            return -1;
        Py_ssize_t n = PyDict_GET_SIZE(o), pos = 0;
        PyObject *k, *v;
        *e->p++ = OP_EMPTY_DICT;
        if (n == 0)
            return 0;
        if (n > 1)
            *e->p++ = OP_MARK;
        while (PyDict_Next(o, &pos, &k, &v))
            if (enc_obj(e, k, depth + 1) < 0 || enc_obj(e, v, depth + 1) < 0)
                return -1;
        if (!enc_room(e, 1))
            return -1;
        *e->p++ = n == 1 ? OP_SETITEM : OP_SETITEMS;
        return 0;
    }
    if (t == &PyFloat_Type) {
        if (!enc_room(e, 9))
            return -1;
        double d = PyFloat_AS_DOUBLE(o);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        *e->p++ = OP_BINFLOAT;
        for (int i = 7; i >= 0; i--) /* big-endian IEEE 754 */
            *e->p++ = (unsigned char)(bits >> (8 * i));
        return 0;
    }
    if (t == &PyBytes_Type)
        return enc_sized(e, OP_SHORT_BINBYTES, OP_BINBYTES, OP_BINBYTES8, PyBytes_AS_STRING(o),
                         PyBytes_GET_SIZE(o));
    if (o == Py_None || o == Py_True || o == Py_False) {
        if (!enc_room(e, 1))
            return -1;
        *e->p++ = o == Py_None ? OP_NONE : o == Py_True ? OP_NEWTRUE : OP_NEWFALSE;
        return 0;
    }
    return -1;
}

/* Pickle `o` into [buf, buf+cap). Returns the length, or -1 (no Python error set):
 * not one of our types, or does not fit. */
Py_ssize_t kvw_p5_dumps_into(PyObject *o, unsigned char *buf, Py_ssize_t cap) {
    Enc e;
    e.p = buf;
    e.end = buf + cap;
    e.nseen = 0;
    if (!enc_room(&e, 3))
        return -1;
    *e.p++ = OP_PROTO;
    *e.p++ = 5;
    if (enc_obj(&e, o, 0) < 0 || !enc_room(&e, 1))
        return -1;
    *e.p++ = OP_STOP;
    return e.p - buf;
}

typedef struct {
    PyObject **st;      /* value stack (owned references) */
    Py_ssize_t n, cap;
    Py_ssize_t *marks;
    Py_ssize_t nm, mcap;
    PyObject **memo;    /* owned references, NULL holes */
    Py_ssize_t memo_cap, memo_len;
    Py_ssize_t memo_max; /* indices are below the input's length (one opcode each) */
} VM;

static int vm_push(VM *m, PyObject *o) { /* steals o */
    if (o == NULL)
        return -1;
    if (m->n == m->cap) {
        Py_ssize_t cap = m->cap * 2;
        PyObject **st = PyMem_Realloc(m->st, (size_t)cap * sizeof(PyObject *));
        if (st == NULL) {
            Py_DECREF(o);
            return -1;
        }
        m->st = st;
        m->cap = cap;
    }
    m->st[m->n++] = o;
    return 0;
}

static int vm_mark(VM *m) {
    if (m->nm == m->mcap) {
        Py_ssize_t cap = m->mcap * 2;
        Py_ssize_t *mk = PyMem_Realloc(m->marks, (size_t)cap * sizeof(Py_ssize_t));
        if (mk == NULL)
            return -1;
        m->marks = mk;
        m->mcap = cap;
    }
    m->marks[m->nm++] = m->n;
    return 0;
}

static int vm_memo_put(VM *m, Py_ssize_t idx) {
    if (m->n == 0 || idx < 0 || idx >= m->memo_max)
        return -1;
    if (idx >= m->memo_cap) {
        Py_ssize_t cap = m->memo_cap ? m->memo_cap : 16;
        while (cap <= idx)
            cap *= 2;
        PyObject **memo = PyMem_Realloc(m->memo, (size_t)cap * sizeof(PyObject *));
        if (memo == NULL)
            return -1;
        for (Py_ssize_t i = m->memo_cap; i < cap; i++)
            memo[i] = NULL;
        m->memo = memo;
        m->memo_cap = cap;
    }
    PyObject *o = m->st[m->n - 1];
    Py_INCREF(o);
    Py_XSETREF(m->memo[idx], o);
    if (idx >= m->memo_len)
        m->memo_len = idx + 1;
    return 0;
}

/* Unpickle [p, p+n) if it uses only the opcodes above. NULL (error cleared) when not. */
PyObject *kvw_p5_loads(const unsigned char *p, Py_ssize_t n) {
    VM m = {NULL, 0, 32, NULL, 0, 8, NULL, 0, 0, n};
    PyObject *result = NULL;
    const unsigned char *end = p + n;
    m.st = PyMem_Malloc((size_t)m.cap * sizeof(PyObject *));
    m.marks = PyMem_Malloc((size_t)m.mcap * sizeof(Py_ssize_t));
    if (m.st == NULL || m.marks == NULL)
        goto fail;
#define NEED(k) do { if (end - p < (k)) goto fail; } while (0)
    while (p < end) {
        int op = *p++;
        switch (op) {
        case OP_PROTO:
            NEED(1);
            if (*p++ > 5)
                goto fail;
            break;
        case OP_FRAME:
            NEED(8);
            p += 8;
            break;
        case OP_MEMOIZE:
            if (vm_memo_put(&m, m.memo_len) < 0)
                goto fail;
            break;
        case OP_BINPUT:
            NEED(1);
            if (vm_memo_put(&m, *p++) < 0)
                goto fail;
            break;
        case OP_LONG_BINPUT:
            NEED(4);
            if (vm_memo_put(&m, (Py_ssize_t)get_le(p, 4)) < 0)
                goto fail;
            p += 4;
            break;
        case OP_BINGET:
        case OP_LONG_BINGET: {
            Py_ssize_t idx;
            if (op == OP_BINGET) {
                NEED(1);
                idx = *p++;
            } else {
                NEED(4);
                idx = (Py_ssize_t)get_le(p, 4);
                p += 4;
            }
            if (idx >= m.memo_len || m.memo[idx] == NULL)
                goto fail;
            Py_INCREF(m.memo[idx]);
            if (vm_push(&m, m.memo[idx]) < 0)
                goto fail;
            break;
        }
        case OP_MARK:
            if (vm_mark(&m) < 0)
                goto fail;
            break;
        case OP_NONE:
            Py_INCREF(Py_None);
            if (vm_push(&m, Py_None) < 0)
                goto fail;
            break;
        case OP_NEWTRUE:
        case OP_NEWFALSE: {
            PyObject *b = op == OP_NEWTRUE ? Py_True : Py_False;
            Py_INCREF(b);
            if (vm_push(&m, b) < 0)
                goto fail;
            break;
        }
        case OP_BININT1:
            NEED(1);
            if (vm_push(&m, PyLong_FromLong(*p++)) < 0)
                goto fail;
            break;
        case OP_BININT2:
            NEED(2);
            if (vm_push(&m, PyLong_FromLong((long)get_le(p, 2))) < 0)
                goto fail;
            p += 2;
            break;
        case OP_BININT:
            NEED(4);
            if (vm_push(&m, PyLong_FromLong((long)(int32_t)(uint32_t)get_le(p, 4))) < 0)
                goto fail;
            p += 4;
            break;
        case OP_LONG1: {
            NEED(1);
            int nb = *p++;
            if (nb > 8)
                goto fail; /* > 64 bits: pickle.loads */
            NEED(nb);
            uint64_t v = get_le(p, nb);
            if (nb > 0 && nb < 8 && (p[nb - 1] & 0x80))
                v |= ~(uint64_t)0 << (8 * nb); /* sign-extend */
            p += nb;
            if (vm_push(&m, PyLong_FromLongLong((long long)v)) < 0)
                goto fail;
            break;
        }
        case OP_BINFLOAT: {
            NEED(8);
            uint64_t bits = 0;
            for (int i = 0; i < 8; i++)
                bits = (bits << 8) | p[i];
            double d;
            memcpy(&d, &bits, 8);
            p += 8;
            if (vm_push(&m, PyFloat_FromDouble(d)) < 0)
                goto fail;
            break;
        }
        case OP_SHORT_BINUNICODE:
        case OP_BINUNICODE:
        case OP_BINUNICODE8:
        case OP_SHORT_BINBYTES:
        case OP_BINBYTES:
        case OP_BINBYTES8: {
            int w = (op == OP_SHORT_BINUNICODE || op == OP_SHORT_BINBYTES) ? 1
                    : (op == OP_BINUNICODE || op == OP_BINBYTES) ? 4 : 8;
            NEED(w);
            uint64_t len = get_le(p, w);
            p += w;
            if (len > (uint64_t)(end - p))
                goto fail;
            PyObject *o = (op == OP_SHORT_BINBYTES || op == OP_BINBYTES || op == OP_BINBYTES8)
                              ? PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)len)
                              : PyUnicode_DecodeUTF8((const char *)p, (Py_ssize_t)len,
                                                     "surrogatepass");
            p += len;
            if (vm_push(&m, o) < 0)
                goto fail;
            break;
        }
        case OP_EMPTY_TUPLE:
            if (vm_push(&m, PyTuple_New(0)) < 0)
                goto fail;
            break;
        case OP_TUPLE1:
        case OP_TUPLE2:
        case OP_TUPLE3:
        case OP_TUPLE: {
            Py_ssize_t k;
            if (op == OP_TUPLE) {
                if (m.nm == 0)
                    goto fail;
                k = m.n - m.marks[--m.nm];
            } else {
                k = op - OP_TUPLE1 + 1;
            }
            if (k > m.n)
                goto fail;
            PyObject *t = PyTuple_New(k);
            if (t == NULL)
                goto fail;
            for (Py_ssize_t i = 0; i < k; i++) /* steal the stack's references */
                PyTuple_SET_ITEM(t, i, m.st[m.n - k + i]);
            m.n -= k;
            if (vm_push(&m, t) < 0)
                goto fail;
            break;
        }
        case OP_EMPTY_LIST:
            if (vm_push(&m, PyList_New(0)) < 0)
                goto fail;
            break;
        case OP_EMPTY_DICT:
            if (vm_push(&m, PyDict_New()) < 0)
                goto fail;
            break;
        case OP_APPEND:
        case OP_APPENDS: {
            Py_ssize_t start = op == OP_APPEND ? m.n - 1 : (m.nm ? m.marks[--m.nm] : -1);
            if (start < 1 || start > m.n || !PyList_CheckExact(m.st[start - 1]))
                goto fail;
            PyObject *lst = m.st[start - 1];
            for (Py_ssize_t i = start; i < m.n; i++)
                if (PyList_Append(lst, m.st[i]) < 0)
                    goto fail;
            while (m.n > start)
                Py_DECREF(m.st[--m.n]);
            break;
        }
        case OP_SETITEM:
        case OP_SETITEMS: {
            Py_ssize_t start = op == OP_SETITEM ? m.n - 2 : (m.nm ? m.marks[--m.nm] : -1);
            if (start < 1 || start > m.n || (m.n - start) % 2 ||
                !PyDict_CheckExact(m.st[start - 1]))
                goto fail;
            PyObject *d = m.st[start - 1];
            /* every object here was built by this VM, from builtin types only: hashing
             * and comparing keys runs no Python code (unhashable ones fail: pickle.loads
             * then raises its own error) */
            for (Py_ssize_t i = start; i < m.n; i += 2)
                if (PyDict_SetItem(d, m.st[i], m.st[i + 1]) < 0)
                    goto fail;
            while (m.n > start)
                Py_DECREF(m.st[--m.n]);
            break;
        }
        case OP_STOP:
            if (m.n != 1 || m.nm != 0)
                goto fail;
            result = m.st[--m.n];
            goto done;
        default:
            goto fail;
        }
    }
#undef NEED
fail:
    if (PyErr_Occurred())
        PyErr_Clear();
done:
    while (m.n > 0)
        Py_DECREF(m.st[--m.n]);
    for (Py_ssize_t i = 0; i < m.memo_len; i++)
        Py_XDECREF(m.memo[i]);
    PyMem_Free(m.memo);
    PyMem_Free(m.st);
    PyMem_Free(m.marks);
    return result;
}
