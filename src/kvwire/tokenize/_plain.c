/* kvwire.tokenize._plain: the builtin tokenizer's plain text to ids, in C.
 *
 * encode_plain(text: str) -> list[int]
 *   The ids of every piece of `text`, in order: exactly what BuiltinTokenizer's Python loop
 *   gives (tokenize/builtin.py, which a property test holds this to). No special tokens: the
 *   caller has already cut the text at them.
 *
 *   Pieces are what re.findall(r" ?\w+| ?[^\w\s]+|\s+", text) returns. Every character is
 *   \w (Py_UNICODE_ISALNUM or '_'), \s (Py_UNICODE_ISSPACE) or neither, so findall leaves no
 *   gap, and at each position the first alternative that matches wins, greedily: a ' '
 *   (U+0020 only) followed by a word or a punctuation character starts that run; any other
 *   whitespace character, or a ' ' followed by whitespace or by the end, starts a whole
 *   whitespace run (spaces included, also the last one before a word). A word run is \w
 *   characters, a punctuation run characters that are neither.
 *   Each piece's UTF-8 bytes give ids from the piece's start: a pair b0 b1 is
 *   PAIR_BASE + (b0 << 8 | b1), a last odd byte BYTE_BASE + b.
 *
 *   A lone surrogate cannot be UTF-8: the piece holding the first one is handed to the same
 *   codec the Python loop's piece.encode("utf-8") calls, which raises the same
 *   UnicodeEncodeError (same object, positions and reason).
 *
 *   A text of GIL_THRESHOLD code points or more is scanned with the GIL released: the str
 *   is immutable and referenced for the whole call; Py_UNICODE_ISALNUM / Py_UNICODE_ISSPACE
 *   (macros in CPython 3.10-3.11, static inline functions in 3.12-3.13) call
 *   _PyUnicode_IsAlpha / IsDecimalDigit / IsDigit / IsNumeric / IsWhitespace or read
 *   _Py_ascii_whitespace, all lookups in constant tables with no interpreter state; the ids
 *   go to a plain C buffer (ids_bound: no growth). The list is built after, with the GIL.
 *   Shorter texts keep the GIL: taking it back can cost a switch interval when another
 *   thread runs, far more than their whole call (~45 us for 16k code points of prose).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#define N_SPECIAL 16
#define BYTE_BASE N_SPECIAL
#define PAIR_BASE (BYTE_BASE + 256)
#define VOCAB_SIZE (PAIR_BASE + 65536)
#define GIL_THRESHOLD 16384

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define ALWAYS_INLINE inline
#endif

enum { WORD = 1, SPACE = 2, PUNCT = 3 };

/* The class of each code point below 256 (all of a 1-byte str), filled at import. */
static unsigned char latin1_class[256];
/* The int object of each id, made on first use and kept: a long prompt's ids are mostly
 * repeats, and sharing them saves an allocation per id (at most VOCAB_SIZE ints, ~2 MB). */
static PyObject **ints;

/* Id buffers kept between calls, KEEP_IDS ids each (1 MB of address space, its pages touched
 * only as far as a text needs): a fresh buffer of a long prompt's size comes from mmap, and
 * faulting its pages in took as long as the scan. A call holds one while it runs (taken and
 * given back with the GIL held, so no lock); a text of more ids, or a call finding none
 * free, has a buffer of its own. At most POOL * KEEP_IDS * 4 bytes (4 MB) stay. */
#define POOL 4
#define KEEP_IDS ((size_t)1 << 18)
static struct { uint32_t *ids; int busy; } pool[POOL];

static ALWAYS_INLINE int
char_class(Py_UCS4 c)
{
    if (c < 256) return latin1_class[c];
    if (Py_UNICODE_ISALNUM(c)) return WORD;  /* '_' is below 256 */
    if (Py_UNICODE_ISSPACE(c)) return SPACE;
    return PUNCT;
}

static ALWAYS_INLINE Py_UCS4
at(const void *d, int kind, Py_ssize_t i)
{
    return kind == PyUnicode_1BYTE_KIND ? ((const Py_UCS1 *)d)[i]
         : kind == PyUnicode_2BYTE_KIND ? ((const Py_UCS2 *)d)[i]
         : ((const Py_UCS4 *)d)[i];
}

/* Where the scan writes: `ids` has room for every id (ids_bound). */
typedef struct {
    uint32_t *ids;
    size_t n;
    Py_ssize_t bad_start, bad_end;  /* the piece holding a lone surrogate (else -1) */
} Out;

/* The most ids a text of `len` code points of this kind gives: a piece of m code points is
 * at most 2m UTF-8 bytes in a 1-byte str, so at most m ids; at most 4m bytes otherwise, so
 * at most 2m ids (a 3-byte character alone takes 2). */
static size_t
ids_bound(int kind, Py_ssize_t len)
{
    return (kind == PyUnicode_1BYTE_KIND ? 1 : 2) * (size_t)len;
}

/* One byte of a piece's UTF-8: the first of a pair waits in `pend`. */
#define PUT(b) do {                                             \
        uint32_t b_ = (uint32_t)(b);                            \
        if (pend < 0) pend = (int)b_;                           \
        else { *w++ = PAIR_BASE + ((uint32_t)pend << 8 | b_); pend = -1; } \
    } while (0)

static ALWAYS_INLINE void
scan(const void *d, int kind, Py_ssize_t len, Out *o)
{
    uint32_t *w = o->ids;  /* in a register; o->n is set on leaving */
    Py_ssize_t i = 0;
    while (i < len) {
        Py_ssize_t j = i;
        Py_UCS4 c = at(d, kind, j);
        Py_UCS4 any = c;  /* the piece's code points or'ed: < 0x80 when it is all ASCII */
        int k = char_class(c);
        if (c == ' ' && j + 1 < len) {
            Py_UCS4 c2 = at(d, kind, j + 1);
            int k2 = char_class(c2);
            if (k2 != SPACE) {  /* " ?\w+" or " ?[^\w\s]+": the space leads that run */
                k = k2;
                any |= c2;
                j++;
            }
        }
        for (j++; j < len; j++) {
            Py_UCS4 cj = at(d, kind, j);
            if (char_class(cj) != k) break;
            any |= cj;
        }
        /* the piece is [i, j) */
        if (kind == PyUnicode_1BYTE_KIND && any < 0x80) {  /* one byte a code point */
            const Py_UCS1 *b = (const Py_UCS1 *)d;
            Py_ssize_t p = i;
            for (; p + 1 < j; p += 2) *w++ = PAIR_BASE + ((uint32_t)b[p] << 8 | b[p + 1]);
            if (p < j) *w++ = BYTE_BASE + b[p];
            i = j;
            continue;
        }
        int pend = -1;
        for (Py_ssize_t p = i; p < j; p++) {
            c = at(d, kind, p);
            if (c < 0x80) {
                PUT(c);
            } else if (c < 0x800) {
                PUT(0xC0 | c >> 6);
                PUT(0x80 | (c & 0x3F));
            } else if (c < 0x10000) {
                if (kind != PyUnicode_1BYTE_KIND && c >= 0xD800 && c <= 0xDFFF) {
                    o->bad_start = i;
                    o->bad_end = j;
                    break;
                }
                PUT(0xE0 | c >> 12);
                PUT(0x80 | (c >> 6 & 0x3F));
                PUT(0x80 | (c & 0x3F));
            } else {
                PUT(0xF0 | c >> 18);
                PUT(0x80 | (c >> 12 & 0x3F));
                PUT(0x80 | (c >> 6 & 0x3F));
                PUT(0x80 | (c & 0x3F));
            }
        }
        if (o->bad_start >= 0) return;
        if (pend >= 0) *w++ = BYTE_BASE + (uint32_t)pend;
        i = j;
    }
    o->n = (size_t)(w - o->ids);
}

/* One copy of the scan per str kind, each with its reads and bounds known at compile time. */
static void scan1(const void *d, Py_ssize_t len, Out *o) { scan(d, PyUnicode_1BYTE_KIND, len, o); }
static void scan2(const void *d, Py_ssize_t len, Out *o) { scan(d, PyUnicode_2BYTE_KIND, len, o); }
static void scan4(const void *d, Py_ssize_t len, Out *o) { scan(d, PyUnicode_4BYTE_KIND, len, o); }

static PyObject *
encode_plain(PyObject *module, PyObject *text)
{
    (void)module;
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "encode_plain takes a str, got %.100s",
                     Py_TYPE(text)->tp_name);
        return NULL;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(text) < 0) return NULL;
#endif
    Py_ssize_t len = PyUnicode_GET_LENGTH(text);
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    void (*fn)(const void *, Py_ssize_t, Out *) =
        kind == PyUnicode_1BYTE_KIND ? scan1 : kind == PyUnicode_2BYTE_KIND ? scan2 : scan4;

    size_t need = ids_bound(kind, len) + 1;  /* + 1: never malloc(0) */
    int slot = -1;
    for (int k = 0; need <= KEEP_IDS && k < POOL; k++) {
        if (!pool[k].busy) {
            slot = k;
            break;
        }
    }
    uint32_t *buf;
    if (slot >= 0) {
        if (pool[slot].ids == NULL &&
                (pool[slot].ids = malloc(KEEP_IDS * sizeof(uint32_t))) == NULL)
            return PyErr_NoMemory();
        buf = pool[slot].ids;
        pool[slot].busy = 1;
    } else if ((buf = malloc(need * sizeof(uint32_t))) == NULL) {
        return PyErr_NoMemory();
    }
    Out o = {buf, 0, -1, -1};

    Py_INCREF(text);
    if (len >= GIL_THRESHOLD) {
        Py_BEGIN_ALLOW_THREADS
        fn(data, len, &o);
        Py_END_ALLOW_THREADS
    } else {
        fn(data, len, &o);
    }

    PyObject *list = NULL;
    if (o.bad_start >= 0) {
        PyObject *piece = PyUnicode_Substring(text, o.bad_start, o.bad_end);
        if (piece != NULL) {
            PyObject *b = PyUnicode_AsUTF8String(piece);  /* raises UnicodeEncodeError */
            if (b != NULL) {
                Py_DECREF(b);
                PyErr_SetString(PyExc_SystemError, "encode_plain: a surrogate encoded");
            }
            Py_DECREF(piece);
        }
    } else if ((list = PyList_New((Py_ssize_t)o.n)) != NULL) {
        for (size_t k = 0; k < o.n; k++) {
            uint32_t id = o.ids[k];
            PyObject *v = ints[id];
            if (v == NULL) {
                v = PyLong_FromUnsignedLong(id);
                if (v == NULL) {
                    Py_CLEAR(list);
                    break;
                }
                ints[id] = v;
            }
            Py_INCREF(v);
            PyList_SET_ITEM(list, (Py_ssize_t)k, v);
        }
    }
    Py_DECREF(text);
    if (slot >= 0) pool[slot].busy = 0;
    else free(buf);
    return list;
}


/* The ids of one scan as a list (the shared int objects); NULL with an exception set. */
static PyObject *
ids_list(const uint32_t *ids, size_t n)
{
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL) return NULL;
    for (size_t k = 0; k < n; k++) {
        uint32_t id = ids[k];
        PyObject *v = ints[id];
        if (v == NULL) {
            v = PyLong_FromUnsignedLong(id);
            if (v == NULL) {
                Py_DECREF(list);
                return NULL;
            }
            ints[id] = v;
        }
        Py_INCREF(v);
        PyList_SET_ITEM(list, (Py_ssize_t)k, v);
    }
    return list;
}

/* encode_plain_each(texts) -> list[list[int]]: encode_plain of each text, all scanned in one
 * go with the GIL released when they are GIL_THRESHOLD code points or more in all. A
 * tokenizer's work is often many short texts (the chunks of one long prompt): one by one,
 * none would be long enough to let go of the GIL. */
static PyObject *
encode_plain_each(PyObject *module, PyObject *arg)
{
    (void)module;
    PyObject *seq = PySequence_Fast(arg, "encode_plain_each takes a list of str");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);  /* seq is a list or tuple we own a ref to */
    Py_ssize_t total = 0;
    size_t need = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = items[i];
        if (!PyUnicode_Check(t)) {
            PyErr_Format(PyExc_TypeError, "encode_plain_each takes str items, got %.100s",
                         Py_TYPE(t)->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
#if PY_VERSION_HEX < 0x030C0000
        if (PyUnicode_READY(t) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
#endif
        total += PyUnicode_GET_LENGTH(t);
        need += ids_bound(PyUnicode_KIND(t), PyUnicode_GET_LENGTH(t));
    }
    /* a private copy of the items: the caller's list may change while the GIL is let go */
    PyObject **texts = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(PyObject *));
    Out *outs = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(Out));
    uint32_t *buf = malloc(need * sizeof(uint32_t));
    if (texts == NULL || outs == NULL || buf == NULL) {
        PyMem_Free(texts);
        PyMem_Free(outs);
        free(buf);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        texts[i] = items[i];
        Py_INCREF(texts[i]);
    }
    Py_DECREF(seq);
    const Py_ssize_t n_items = count;  /* count may stop early, at a surrogate */

    int release = total >= GIL_THRESHOLD;
    PyThreadState *ts = release ? PyEval_SaveThread() : NULL;
    uint32_t *w = buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = texts[i];
        Py_ssize_t len = PyUnicode_GET_LENGTH(t);
        int kind = PyUnicode_KIND(t);
        outs[i] = (Out){w, 0, -1, -1};
        (kind == PyUnicode_1BYTE_KIND ? scan1 : kind == PyUnicode_2BYTE_KIND ? scan2 : scan4)(
            PyUnicode_DATA(t), len, &outs[i]);
        if (outs[i].bad_start >= 0) {  /* a lone surrogate: raised below, as encode_plain does */
            count = i + 1;
            break;
        }
        w += outs[i].n;
    }
    if (release) PyEval_RestoreThread(ts);

    PyObject *result = NULL;
    Out *last = count ? &outs[count - 1] : NULL;
    if (last != NULL && last->bad_start >= 0) {
        PyObject *piece = PyUnicode_Substring(texts[count - 1], last->bad_start, last->bad_end);
        if (piece != NULL) {
            PyObject *b = PyUnicode_AsUTF8String(piece);  /* raises UnicodeEncodeError */
            if (b != NULL) {
                Py_DECREF(b);
                PyErr_SetString(PyExc_SystemError, "encode_plain_each: a surrogate encoded");
            }
            Py_DECREF(piece);
        }
    } else if ((result = PyList_New(count)) != NULL) {
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *ids = ids_list(outs[i].ids, outs[i].n);
            if (ids == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, i, ids);
        }
    }
    for (Py_ssize_t i = 0; i < n_items; i++) Py_DECREF(texts[i]);
    PyMem_Free(texts);
    free(buf);
    PyMem_Free(outs);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_plain", (PyCFunction)encode_plain, METH_O,
     "encode_plain(text) -> list[int]: the builtin tokenizer's ids of plain text (no special "
     "tokens); the GIL is released while a text of GIL_THRESHOLD code points or more is "
     "scanned."},
    {"encode_plain_each", (PyCFunction)encode_plain_each, METH_O,
     "encode_plain_each(texts) -> list[list[int]]: encode_plain of each text, scanned in one "
     "go; the GIL is released when they hold GIL_THRESHOLD code points or more in all."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.tokenize._plain", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__plain(void)
{
    for (Py_UCS4 c = 0; c < 256; c++)
        latin1_class[c] = (Py_UNICODE_ISALNUM(c) || c == '_') ? WORD
                        : Py_UNICODE_ISSPACE(c) ? SPACE : PUNCT;
    if (ints == NULL) {
        ints = PyMem_Calloc(VOCAB_SIZE, sizeof(PyObject *));
        if (ints == NULL) return PyErr_NoMemory();
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "GIL_THRESHOLD", GIL_THRESHOLD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
