/* kvwire.tokenize._bpe: a byte-level BPE tokenizer.json (Qwen2/Qwen3's, Llama 3's pre-
 * tokenizer) on ASCII text, in C: the ids `tokenizers` gives, for a small part of its CPU.
 *
 * ByteBPE(byte_ids, merges, digits, table, vocab=None)
 *   byte_ids: 256 ints, the id of each byte's one-character token (the byte-level alphabet).
 *   merges:   (left id, right id, merged id) triples in rank order; a pair listed twice keeps
 *             its last rank, as tokenizers' map of merges does.
 *   digits:   how many digits a number piece takes at most: 1 (\p{N}) or 3 (\p{N}{1,3}).
 *   table:    a tuple with table[i] == i: the int objects the ids are returned as, shared
 *             with what keeps them (prefix.py's interner).
 *   vocab:    (bytes, id) pairs of every token, for a model with ignore_merges (Llama 3's):
 *             a piece that is a token whole is that token, merged or not.
 *
 * .encode(texts) -> list[tuple[int, ...]]
 *   Each text's ids. Every text must be ASCII (ValueError otherwise): the caller hands the
 *   rest to tokenizers. On ASCII the pipeline is exact by construction:
 *   - NFC leaves ASCII unchanged;
 *   - the Split regex, behaviour Isolated, is scanned by hand below. On ASCII \p{L} is
 *     [A-Za-z], \p{N} [0-9], \s [\t\n\v\f\r ] (Unicode's White_Space, which oniguruma's \s
 *     is); every other byte is [^\s\p{L}\p{N}]. At each position the first alternative that
 *     matches wins (a backtracking engine), and every ASCII byte starts a match, so the
 *     pieces tile the text;
 *   - ByteLevel (no regex, no prefix space) maps each byte to one token of the alphabet;
 *   - BPE (after the whole-piece lookup of ignore_merges) merges the adjacent pair of
 *     lowest rank, leftmost first, until none is in `merges`. tokenizers pops merges from
 *     a heap keyed (rank, position) and skips one whose pair has changed since it was
 *     pushed; a pair's text only grows at a position, so that is the same as always
 *     merging the lowest-ranked pair present.
 *   tests/test_tokenize_bpe.py holds it to tokenizers with hypothesis.
 *
 *   Pieces up to WORD_BYTES bytes are kept with their ids (a bounded table, emptied when
 *   three-quarters full): prose repeats its words, and a kept word costs a hash and a compare.
 *   The table is taken with a trylock: a call running beside another one merges its words
 *   without it, never waits.
 *
 *   A call of more than GIL_BYTES bytes in all (module constant GIL_CHARS) lets the GIL go
 *   while it scans: its texts are held in a tuple for the call (immutable str, referenced),
 *   and the ids go to a C buffer; the tuples are built after, with the GIL. A shorter call
 *   (~0.25 ms at most) keeps it: the router runs those on its event loop, which would
 *   otherwise wait to take it back from whatever thread took it meanwhile. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GIL_BYTES 16384
#define WORD_BYTES 30
#define WORD_IDS 8
#define WORDS (1u << 16)
#define NO_RANK UINT32_MAX
#define DEAD UINT32_MAX

enum { L = 1, N = 2, S = 4, NL = 8 };
static unsigned char cls[128];

typedef struct { uint64_t key; uint32_t rank, id; } Merge;
typedef struct { uint64_t hash; size_t at; uint32_t len, id; } Token;
typedef struct {
    uint64_t hash;
    uint8_t len, n;
    unsigned char text[WORD_BYTES];
    uint32_t ids[WORD_IDS];
} Word;

typedef struct {
    PyObject_HEAD
    uint32_t byte_ids[256];
    Merge *merges;          /* open addressing, rank NO_RANK: empty */
    uint64_t mask;
    int digits;
    Token *vocab;           /* ignore_merges: open addressing, len 0: empty; else NULL */
    unsigned char *vocab_text;
    uint64_t vocab_mask;
    PyObject *table;        /* tuple of int objects */
    Word *words;            /* WORDS slots, len 0: empty */
    uint32_t used;
    pthread_mutex_t lock;
} ByteBPE;

static inline uint64_t
mix(uint64_t x)
{
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static inline const Merge *
find_merge(const ByteBPE *b, uint32_t left, uint32_t right)
{
    uint64_t key = (uint64_t)left << 32 | right;
    for (uint64_t i = mix(key) & b->mask;; i = (i + 1) & b->mask) {
        const Merge *m = &b->merges[i];
        if (m->rank == NO_RANK) return NULL;
        if (m->key == key) return m;
    }
}

/* ---- growable buffers ---------------------------------------------------------------- */
typedef struct { uint32_t *v; size_t n, cap; } Ids;

static int
ids_push(Ids *o, uint32_t id)
{
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 4096;
        uint32_t *v = realloc(o->v, cap * sizeof *v);
        if (!v) return -1;
        o->v = v; o->cap = cap;
    }
    o->v[o->n++] = id;
    return 0;
}

typedef struct { uint32_t *id; int32_t *prev, *next; uint64_t *heap; size_t cap; } Scratch;

static int
scratch_fit(Scratch *s, size_t n)
{
    if (n <= s->cap) return 0;
    size_t cap = n < 64 ? 64 : n;
    uint32_t *id = realloc(s->id, cap * sizeof *id);
    if (id) s->id = id;
    int32_t *prev = realloc(s->prev, cap * sizeof *prev);
    if (prev) s->prev = prev;
    int32_t *next = realloc(s->next, cap * sizeof *next);
    if (next) s->next = next;
    uint64_t *heap = realloc(s->heap, 3 * cap * sizeof *heap);
    if (heap) s->heap = heap;
    if (!id || !prev || !next || !heap) return -1;
    s->cap = cap;
    return 0;
}

static void
scratch_free(Scratch *s)
{
    free(s->id); free(s->prev); free(s->next); free(s->heap);
}

/* ---- a min-heap of (rank << 32 | position) -------------------------------------------- */
static inline void
heap_push(uint64_t *h, size_t *n, uint64_t v)
{
    size_t i = (*n)++;
    while (i) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p]; i = p;
    }
    h[i] = v;
}

static inline uint64_t
heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0], v = h[--*n];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c]; i = c;
    }
    if (m) h[i] = v;
    return top;
}

static inline uint64_t
hash_bytes(const unsigned char *p, size_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ n;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return mix(h);
}

/* The id of the token that is the whole piece, or DEAD (ignore_merges). */
static uint32_t
whole_token(const ByteBPE *b, const unsigned char *p, size_t n)
{
    uint64_t h = hash_bytes(p, n);
    for (uint64_t i = h & b->vocab_mask;; i = (i + 1) & b->vocab_mask) {
        const Token *t = &b->vocab[i];
        if (!t->len) return DEAD;
        if (t->hash == h && t->len == n && !memcmp(b->vocab_text + t->at, p, n)) return t->id;
    }
}

/* The ids of one piece (n >= 2 bytes), appended to out. */
static int
merge_piece(const ByteBPE *b, const unsigned char *p, size_t n, Scratch *s, Ids *out)
{
    if (b->vocab) {
        uint32_t whole = whole_token(b, p, n);
        if (whole != DEAD) return ids_push(out, whole);
    }
    if (scratch_fit(s, n) < 0) return -1;
    uint32_t *id = s->id;
    int32_t *prev = s->prev, *next = s->next;
    uint64_t *heap = s->heap;
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        id[i] = b->byte_ids[p[i]];
        prev[i] = (int32_t)i - 1;
        next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        const Merge *m = find_merge(b, id[i], id[i + 1]);
        if (m) heap_push(heap, &hn, (uint64_t)m->rank << 32 | i);
    }
    while (hn) {
        uint64_t top = heap_pop(heap, &hn);
        uint32_t pos = (uint32_t)top, rank = (uint32_t)(top >> 32);
        if (id[pos] == DEAD || next[pos] < 0) continue;
        int32_t r = next[pos];
        const Merge *m = find_merge(b, id[pos], id[r]);
        if (!m || m->rank != rank) continue;  /* the pair changed since it was pushed */
        id[pos] = m->id;
        id[r] = DEAD;
        int32_t rr = next[r];
        next[pos] = rr;
        if (rr >= 0) prev[rr] = (int32_t)pos;
        if (prev[pos] >= 0) {
            int32_t l = prev[pos];
            const Merge *ml = find_merge(b, id[l], id[pos]);
            if (ml) heap_push(heap, &hn, (uint64_t)ml->rank << 32 | (uint32_t)l);
        }
        if (rr >= 0) {
            const Merge *mr = find_merge(b, id[pos], id[rr]);
            if (mr) heap_push(heap, &hn, (uint64_t)mr->rank << 32 | pos);
        }
    }
    for (int32_t i = 0; i >= 0; i = next[i])
        if (ids_push(out, id[i]) < 0) return -1;
    return 0;
}

static int
piece(ByteBPE *b, const unsigned char *p, size_t n, Scratch *s, Ids *out, int cached)
{
    if (n == 1) return ids_push(out, b->byte_ids[p[0]]);
    if (!cached || n > WORD_BYTES) return merge_piece(b, p, n, s, out);
    uint64_t h = hash_bytes(p, n);
    uint32_t i = (uint32_t)h & (WORDS - 1);
    for (;; i = (i + 1) & (WORDS - 1)) {
        Word *w = &b->words[i];
        if (!w->len) break;
        if (w->hash == h && w->len == n && !memcmp(w->text, p, n)) {
            for (int k = 0; k < w->n; k++)
                if (ids_push(out, w->ids[k]) < 0) return -1;
            return 0;
        }
    }
    size_t start = out->n;
    if (merge_piece(b, p, n, s, out) < 0) return -1;
    size_t got = out->n - start;
    if (got > WORD_IDS) return 0;
    if (b->used >= WORDS / 4 * 3) {  /* full: start again (no slot can be freed alone) */
        memset(b->words, 0, WORDS * sizeof(Word));
        b->used = 0;
        i = (uint32_t)h & (WORDS - 1);
    }
    Word *w = &b->words[i];
    w->hash = h; w->len = (uint8_t)n; w->n = (uint8_t)got;
    memcpy(w->text, p, n);
    memcpy(w->ids, out->v + start, got * sizeof(uint32_t));
    b->used++;
    return 0;
}

/* The end of the Split pattern's match at i (module docstring), on ASCII. */
static inline size_t
match_end(const unsigned char *t, size_t i, size_t n, int digits)
{
    unsigned c = t[i], k = cls[c];
    if (c == '\'' && i + 1 < n) {  /* (?i:'s|'t|'re|'ve|'m|'ll|'d) */
        unsigned a = t[i + 1] | 0x20;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
        if (i + 2 < n) {
            unsigned z = t[i + 2] | 0x20;
            if ((a == 'r' && z == 'e') || (a == 'v' && z == 'e') || (a == 'l' && z == 'l'))
                return i + 3;
        }
    }
    if (!(k & (L | N)) && c != '\r' && c != '\n' && i + 1 < n && (cls[t[i + 1]] & L)) {
        size_t j = i + 2;  /* [^\r\n\p{L}\p{N}]?\p{L}+ with its first character */
        while (j < n && (cls[t[j]] & L)) j++;
        return j;
    }
    if (k & L) {  /* \p{L}+ */
        size_t j = i + 1;
        while (j < n && (cls[t[j]] & L)) j++;
        return j;
    }
    if (k & N) {  /* \p{N} or \p{N}{1,3} */
        size_t j = i + 1;
        while (j < n && j < i + (size_t)digits && (cls[t[j]] & N)) j++;
        return j;
    }
    size_t p = (c == ' ' && i + 1 < n && !cls[t[i + 1]]) ? i + 1 : i;
    if (!cls[t[p]]) {  /* ' '?[^\s\p{L}\p{N}]+[\r\n]* */
        size_t j = p + 1;
        while (j < n && !cls[t[j]]) j++;
        while (j < n && (cls[t[j]] & NL)) j++;
        return j;
    }
    /* whitespace from i to j */
    size_t j = i + 1, last_nl = (k & NL) ? i + 1 : 0;
    while (j < n && (cls[t[j]] & S)) {
        if (cls[t[j]] & NL) last_nl = j + 1;
        j++;
    }
    if (last_nl) return last_nl;           /* \s*[\r\n]+ */
    if (j == n) return j;                  /* \s+(?!\S) at the end */
    if (j - 1 > i) return j - 1;           /* \s+(?!\S) before a non-space */
    return j;                              /* \s+ */
}

static int
encode_text(ByteBPE *b, const unsigned char *t, size_t n, Scratch *s, Ids *out, int cached)
{
    for (size_t i = 0; i < n;) {
        size_t e = match_end(t, i, n, b->digits);
        if (piece(b, t + i, e - i, s, out, cached) < 0) return -1;
        i = e;
    }
    return 0;
}

static PyObject *
ByteBPE_encode(ByteBPE *self, PyObject *arg)
{
    PyObject *texts = PySequence_Tuple(arg);
    if (!texts) return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(texts);
    size_t total = 0;
    const unsigned char **data = PyMem_Malloc((k ? k : 1) * sizeof *data);
    size_t *len = PyMem_Malloc((k ? k : 1) * sizeof *len);
    size_t *ends = PyMem_Malloc((k ? k : 1) * sizeof *ends);
    PyObject *result = NULL;
    Ids out = {0};
    Scratch s = {0};
    if (!data || !len || !ends) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *t = PyTuple_GET_ITEM(texts, i);
        if (!PyUnicode_Check(t)) {
            PyErr_Format(PyExc_TypeError, "encode takes str texts, got %.80s",
                         Py_TYPE(t)->tp_name);
            goto done;
        }
        if (PyUnicode_READY(t) < 0) goto done;
        if (!PyUnicode_IS_ASCII(t)) {
            PyErr_SetString(PyExc_ValueError, "ByteBPE.encode takes ASCII texts only");
            goto done;
        }
        data[i] = PyUnicode_1BYTE_DATA(t);
        len[i] = (size_t)PyUnicode_GET_LENGTH(t);
        total += len[i];
    }
    int failed = 0;
    /* (short calls keep the GIL: taking it back can cost a switch interval) */
    PyThreadState *ts = total > GIL_BYTES ? PyEval_SaveThread() : NULL;
    int cached = pthread_mutex_trylock(&self->lock) == 0;
    for (Py_ssize_t i = 0; i < k && !failed; i++) {
        failed = encode_text(self, data[i], len[i], &s, &out, cached) < 0;
        ends[i] = out.n;
    }
    if (cached) pthread_mutex_unlock(&self->lock);
    if (ts) PyEval_RestoreThread(ts);
    if (failed) { PyErr_NoMemory(); goto done; }
    result = PyList_New(k);
    if (!result) goto done;
    PyObject *table = self->table;
    size_t known = (size_t)PyTuple_GET_SIZE(table), start = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *tup = PyTuple_New((Py_ssize_t)(ends[i] - start));
        if (!tup) { Py_CLEAR(result); goto done; }
        for (size_t j = start; j < ends[i]; j++) {
            uint32_t id = out.v[j];
            PyObject *o;
            if (id < known) { o = PyTuple_GET_ITEM(table, id); Py_INCREF(o); }
            else if (!(o = PyLong_FromUnsignedLong(id))) {
                Py_DECREF(tup); Py_CLEAR(result); goto done;
            }
            PyTuple_SET_ITEM(tup, (Py_ssize_t)(j - start), o);
        }
        PyObject_GC_UnTrack(tup);  /* ints only: see untrack() */
        PyList_SET_ITEM(result, i, tup);
        start = ends[i];
    }
done:
    PyMem_Free(data); PyMem_Free(len); PyMem_Free(ends);
    free(out.v);
    scratch_free(&s);
    Py_DECREF(texts);
    return result;
}

static int
set_vocab(ByteBPE *self, PyObject *vocab)
{
    PyObject *vs = PySequence_Fast(vocab, "vocab must be a sequence of (bytes, id)");
    if (!vs) return -1;
    Py_ssize_t nv = PySequence_Fast_GET_SIZE(vs);
    size_t bytes = 0;
    uint64_t cap = 16;
    while (cap < (uint64_t)nv * 2) cap <<= 1;
    for (Py_ssize_t i = 0; i < nv; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(vs, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2
                || !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))) {
            Py_DECREF(vs);
            PyErr_SetString(PyExc_TypeError, "vocab must be a sequence of (bytes, id)");
            return -1;
        }
        bytes += (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, 0));
    }
    self->vocab = PyMem_Calloc(cap, sizeof(Token));
    self->vocab_text = PyMem_Malloc(bytes ? bytes : 1);
    if (!self->vocab || !self->vocab_text) { Py_DECREF(vs); PyErr_NoMemory(); return -1; }
    self->vocab_mask = cap - 1;
    size_t at = 0;
    for (Py_ssize_t i = 0; i < nv; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(vs, i);
        PyObject *text = PyTuple_GET_ITEM(pair, 0);
        unsigned long id = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(pair, 1));
        if (id == (unsigned long)-1 && PyErr_Occurred()) { Py_DECREF(vs); return -1; }
        size_t n = (size_t)PyBytes_GET_SIZE(text);
        if (!n || id >= DEAD) continue;  /* (never a piece; no id) */
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(text);
        uint64_t h = hash_bytes(p, n);
        for (uint64_t j = h & self->vocab_mask;; j = (j + 1) & self->vocab_mask) {
            Token *t = &self->vocab[j];
            if (!t->len) {
                memcpy(self->vocab_text + at, p, n);
                t->hash = h; t->at = at; t->len = (uint32_t)n; t->id = (uint32_t)id;
                at += n;
                break;
            }
            if (t->hash == h && t->len == n && !memcmp(self->vocab_text + t->at, p, n)) {
                t->id = (uint32_t)id;  /* (the last one, as a dict built from them keeps) */
                break;
            }
        }
    }
    Py_DECREF(vs);
    return 0;
}

static int
ByteBPE_init(ByteBPE *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"byte_ids", "merges", "digits", "table", "vocab", NULL};
    PyObject *byte_ids, *merges, *table, *vocab = Py_None;
    int digits;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOiO!|O", names, &byte_ids, &merges, &digits,
                                     &PyTuple_Type, &table, &vocab))
        return -1;
    if (digits < 1) {
        PyErr_SetString(PyExc_ValueError, "digits must be >= 1");
        return -1;
    }
    if (self->merges) { PyErr_SetString(PyExc_RuntimeError, "ByteBPE is set up once"); return -1; }
    PyObject *bs = PySequence_Fast(byte_ids, "byte_ids must be a sequence");
    if (!bs) return -1;
    if (PySequence_Fast_GET_SIZE(bs) != 256) {
        Py_DECREF(bs);
        PyErr_SetString(PyExc_ValueError, "byte_ids must hold 256 ids");
        return -1;
    }
    for (int i = 0; i < 256; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(bs, i));
        if (v == (unsigned long)-1 && PyErr_Occurred()) { Py_DECREF(bs); return -1; }
        if (v >= DEAD) {
            Py_DECREF(bs);
            PyErr_SetString(PyExc_ValueError, "id too large");
            return -1;
        }
        self->byte_ids[i] = (uint32_t)v;
    }
    Py_DECREF(bs);
    PyObject *ms = PySequence_Fast(merges, "merges must be a sequence");
    if (!ms) return -1;
    Py_ssize_t nm = PySequence_Fast_GET_SIZE(ms);
    if (nm >= (Py_ssize_t)NO_RANK) {
        Py_DECREF(ms);
        PyErr_SetString(PyExc_ValueError, "too many merges");
        return -1;
    }
    uint64_t cap = 16;
    while (cap < (uint64_t)nm * 2) cap <<= 1;
    self->merges = PyMem_Malloc(cap * sizeof(Merge));
    self->words = PyMem_Calloc(WORDS, sizeof(Word));
    if (!self->merges || !self->words) { Py_DECREF(ms); PyErr_NoMemory(); return -1; }
    for (uint64_t i = 0; i < cap; i++) self->merges[i].rank = NO_RANK;
    self->mask = cap - 1;
    for (Py_ssize_t r = 0; r < nm; r++) {
        unsigned long a, c, id;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(ms, r),
                              "kkk;a merge is (left, right, merged)", &a, &c, &id)) {
            Py_DECREF(ms); return -1;
        }
        if (a >= DEAD || c >= DEAD || id >= DEAD) {
            Py_DECREF(ms); PyErr_SetString(PyExc_ValueError, "id too large"); return -1;
        }
        uint64_t key = (uint64_t)a << 32 | c;
        for (uint64_t i = mix(key) & self->mask;; i = (i + 1) & self->mask) {
            Merge *m = &self->merges[i];
            if (m->rank == NO_RANK || m->key == key) {
                m->key = key; m->rank = (uint32_t)r; m->id = (uint32_t)id;
                break;
            }
        }
    }
    Py_DECREF(ms);
    if (vocab != Py_None && set_vocab(self, vocab) < 0) return -1;
    self->digits = digits;
    Py_INCREF(table);
    self->table = table;
    return 0;
}

static PyObject *
ByteBPE_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kw))
{
    ByteBPE *self = (ByteBPE *)type->tp_alloc(type, 0);
    if (self && pthread_mutex_init(&self->lock, NULL) != 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void
ByteBPE_dealloc(ByteBPE *self)
{
    PyMem_Free(self->merges);
    PyMem_Free(self->words);
    PyMem_Free(self->vocab);
    PyMem_Free(self->vocab_text);
    Py_XDECREF(self->table);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* untrack(t): ``t``, out of the cyclic collector's sight if it is a tuple of objects that
 * hold no references (ints), as CPython would leave it after its first collection. Until
 * then a young collection walks every id of every tuple made since the last one: the
 * token ids a router keeps (millions) made collections of 30-50 ms on its event loop. */
static PyObject *
untrack(PyObject *mod, PyObject *t)
{
    (void)mod;
    if (PyTuple_CheckExact(t) && PyObject_GC_IsTracked(t)) {
        Py_ssize_t n = PyTuple_GET_SIZE(t), i;
        for (i = 0; i < n; i++) {
            PyObject *o = PyTuple_GET_ITEM(t, i);
            if (!o || PyObject_IS_GC(o)) break;
        }
        if (i == n) PyObject_GC_UnTrack(t);
    }
    Py_INCREF(t);
    return t;
}

static PyMethodDef module_methods[] = {
    {"untrack", (PyCFunction)untrack, METH_O,
     "untrack(t) -> t: a tuple of ints (no references) out of the cyclic collector's sight."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef ByteBPE_methods[] = {
    {"encode", (PyCFunction)ByteBPE_encode, METH_O,
     "encode(texts) -> list of tuples of ids, one per text; every text ASCII."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ByteBPEType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.tokenize._bpe.ByteBPE",
    .tp_basicsize = sizeof(ByteBPE),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A byte-level BPE tokenizer.json model and its Split pre-tokenizer, on ASCII.",
    .tp_new = ByteBPE_new,
    .tp_init = (initproc)ByteBPE_init,
    .tp_dealloc = (destructor)ByteBPE_dealloc,
    .tp_methods = ByteBPE_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.tokenize._bpe",
    "A byte-level BPE tokenizer on ASCII text (see _bpe.c).", -1, module_methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC
PyInit__bpe(void)
{
    for (int c = 'A'; c <= 'Z'; c++) cls[c] = cls[c | 0x20] = L;
    for (int c = '0'; c <= '9'; c++) cls[c] = N;
    cls['\t'] = cls['\v'] = cls['\f'] = cls[' '] = S;
    cls['\n'] = cls['\r'] = S | NL;
    if (PyType_Ready(&ByteBPEType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ByteBPEType);
    if (PyModule_AddIntConstant(m, "GIL_CHARS", GIL_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObject(m, "ByteBPE", (PyObject *)&ByteBPEType) < 0) {
        Py_DECREF(&ByteBPEType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
