/* kvwire.routing._tokens: a /route body's token ids, parsed straight into int64s.
 *
 * parse_route_body(body) -> (ids, rest) | None
 *   For a body that starts `{"token_ids": [` (JSON whitespace allowed between tokens) whose
 *   array holds only plain non-negative integers below 2**32 (digits, no leading zeros,
 *   commas, whitespace): ids = their native int64 bytes, rest = the JSON object of the other
 *   members (b'{' + what follows the array's comma, or None when the object ends there),
 *   for msgspec to decode. Anything else gives None and the caller decodes the whole body
 *   the strict way (msgspec), which accepts or rejects it with the exact reason; so this path
 *   is never more lenient, only faster: no Python int per token and no second pass over
 *   the array (a 2k-token prompt's ints cost about as much CPU as the routing decision).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SCRATCH 16384
static int64_t scratch[SCRATCH];

static inline int is_ws(unsigned char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

#ifdef __SSE2__
#include <emmintrin.h>

/* Bit i set where p[i] (i < 64) is a comma / an ASCII digit. */
static inline void
masks64(const unsigned char *p, uint64_t *comma, uint64_t *digit)
{
    const __m128i c = _mm_set1_epi8(','), lo = _mm_set1_epi8('0' - 1), hi = _mm_set1_epi8('9' + 1);
    uint64_t cm = 0, dm = 0;
    for (int k = 0; k < 4; k++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(p + 16 * k));
        cm |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(x, c)) << (16 * k);
        /* signed compares: bytes >= 0x80 are negative, so never digits */
        dm |= (uint64_t)(uint16_t)_mm_movemask_epi8(
                  _mm_and_si128(_mm_cmpgt_epi8(x, lo), _mm_cmpgt_epi8(hi, x))) << (16 * k);
    }
    *comma = cm;
    *digit = dm;
}
#endif

/* From p (the start of an id), while whole 64-byte blocks remain: the ids that are 1-8
 * digits followed by a comma, written to dst[*n...]. The comma positions come from a mask,
 * so finding each id's end is not a chain of byte compares (the scalar loop's exit
 * mispredicted about once per id, and each id's end waited on the one before); each id's
 * digits are then converted by three multiplies. Returns where the scalar loop goes on (the
 * start of an id not taken: before a byte that is neither digit nor comma, a 9+ digit id,
 * or the last partial block), or NULL for a text the strict decode must reject (an empty
 * element, a leading zero). Needs 8 bytes of the body before p (the `{"token_ids":[`). */
static const unsigned char *
blocks(const unsigned char *base, const unsigned char *p, const unsigned char *end,
       int64_t *dst, Py_ssize_t *n)
{
#ifdef __SSE2__
    if (p - base < 8) return p;
    Py_ssize_t k = *n;
    const unsigned char *start = p;  /* the id being read starts here */
    while (end - p >= 64) {
        uint64_t comma, digit;
        masks64(p, &comma, &digit);
        uint64_t other = ~(comma | digit);
        /* only commas before the block's first other byte count */
        uint64_t usable = other ? comma & ((other & -other) - 1) : comma;
        while (usable) {
            const unsigned char *c = p + __builtin_ctzll(usable);
            usable &= usable - 1;
            size_t len = (size_t)(c - start);
            if (len == 0) return NULL;  /* ",," or "[," */
            if (len > 8) { *n = k; return start; }  /* the scalar loop checks the range */
            if (len > 1 && *start == '0') return NULL;  /* 01 */
            uint64_t w;
            memcpy(&w, c - 8, 8);  /* the id's digits are its top len bytes */
            uint64_t keep = ~0ull << (8 * (8 - len));
            uint64_t d = (w & keep) - (0x3030303030303030ull & keep);
            d = ((d & 0x0F0F0F0F0F0F0F0Full) * 2561) >> 8;
            d = ((d & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
            d = ((d & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32;
            dst[k++] = (int64_t)d;
            start = c + 1;
        }
        if (other) break;
        p += 64;
    }
    *n = k;
    return start;
#else
    (void)base; (void)end; (void)dst; (void)n;
    return p;
#endif
}

static PyObject *
parse_route_body(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *base = view.buf, *p = base, *end = base + view.len;
    PyObject *ids = NULL, *rest = NULL, *result = NULL;
    static const char key[] = "\"token_ids\"";
    const size_t klen = sizeof(key) - 1;
    while (p < end && is_ws(*p)) p++;
    if (p == end || *p++ != '{') goto reject;
    while (p < end && is_ws(*p)) p++;
    if ((size_t)(end - p) < klen || memcmp(p, key, klen) != 0) goto reject;
    p += klen;
    while (p < end && is_ws(*p)) p++;
    if (p == end || *p++ != ':') goto reject;
    while (p < end && is_ws(*p)) p++;
    if (p == end || *p++ != '[') goto reject;
    /* Where the ids go: a prompt of up to SCRATCH ids (every id takes at least two bytes
     * of text, its digit and a comma, so the text's length bounds the count) into a static
     * scratch array (the GIL is held: one caller at a time), copied out at its size; a
     * longer text is counted first (one id per comma, plus one) and allocated at that
     * size. (The count was a third of a 2,048-token prompt's parse.) */
    Py_ssize_t cap = (end - p) / 2 + 1, n = 0;
    int64_t *dst = scratch;
    if (cap > SCRATCH) {
        cap = 1;
        for (const unsigned char *q = p; q < end; q++) cap += (*q == ',');
        ids = PyBytes_FromStringAndSize(NULL, cap * (Py_ssize_t)sizeof(int64_t));
        if (ids == NULL) goto done;
        dst = (int64_t *)PyBytes_AS_STRING(ids);
    }
    while (p < end && is_ws(*p)) p++;
    if (p < end && *p == ']') {
        p++;
    } else {
        int fast = 1;
        for (;;) {
            /* the common case, 64 bytes at a time: ids of plain digits, one comma after
             * each (see blocks()); it stops before anything else (whitespace, the array's
             * end, 9+ digits), which the scalar loop below takes */
            if (fast) {
                const unsigned char *q = blocks(base, p, end, dst, &n);
                if (q == NULL) goto reject;
                fast = q != p;  /* no id taken (", " spacing, the last block): scalar */
                p = q;
                while (p < end && is_ws(*p)) p++;  /* it stops after a comma, before any */
            }
            if (p == end || (unsigned)(*p - '0') > 9) goto reject;
            if (*p == '0' && p + 1 < end && (unsigned)(p[1] - '0') <= 9) goto reject;  /* 01 */
            const unsigned char *start = p;
            uint64_t v = (uint64_t)(*p++ - '0');
            while (p < end && (unsigned)(*p - '0') <= 9) v = v * 10 + (uint64_t)(*p++ - '0');
            /* 2**32 has 10 digits: longer ones (which could wrap v) or larger values are out
             * of range, and the strict decode names them */
            if (p - start > 10 || v > 0xFFFFFFFFu) goto reject;
            if (n >= cap) goto reject;  /* cannot happen: the bound above */
            dst[n++] = (int64_t)v;
            while (p < end && is_ws(*p)) p++;
            if (p == end) goto reject;
            if (*p == ',') {
                p++;
                while (p < end && is_ws(*p)) p++;
                continue;
            }
            if (*p++ == ']') break;
            goto reject;  /* 1.5, 1e3, anything else */
        }
    }
    while (p < end && is_ws(*p)) p++;
    if (p == end) goto reject;
    if (*p == '}') {  /* the object ends here: nothing but whitespace may follow */
        p++;
        while (p < end && is_ws(*p)) p++;
        if (p != end) goto reject;
        rest = Py_None;
        Py_INCREF(rest);
    } else if (*p == ',') {  /* more members: the rest must start with a key */
        p++;
        while (p < end && is_ws(*p)) p++;
        if (p == end || *p != '"') goto reject;
        rest = PyBytes_FromStringAndSize(NULL, 1 + (end - p));
        if (rest == NULL) goto done;
        PyBytes_AS_STRING(rest)[0] = '{';
        memcpy(PyBytes_AS_STRING(rest) + 1, p, (size_t)(end - p));
    } else {
        goto reject;
    }
    if (ids == NULL) {
        ids = PyBytes_FromStringAndSize((const char *)scratch, n * (Py_ssize_t)sizeof(int64_t));
        if (ids == NULL) goto done;
    } else if (_PyBytes_Resize(&ids, n * (Py_ssize_t)sizeof(int64_t)) < 0) {
        goto done;
    }
    result = PyTuple_Pack(2, ids, rest);
    goto done;
reject:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(ids);
    Py_XDECREF(rest);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"parse_route_body", (PyCFunction)parse_route_body, METH_O,
     "parse_route_body(body) -> (int64 bytes of token_ids, rest-of-object JSON or None) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.routing._tokens", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__tokens(void)
{
    return PyModule_Create(&module);
}
