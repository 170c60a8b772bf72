/* kvwire.router._tokens: a /route body's token ids, parsed straight into int64s.
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

static inline int is_ws(unsigned char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

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
    /* at most one id per comma left, plus one: a cheap first pass (it vectorizes) so the
     * output is allocated once at about its size, not at the text's worst case */
    Py_ssize_t cap = 1, n = 0;
    for (const unsigned char *q = p; q < end; q++) cap += (*q == ',');
    ids = PyBytes_FromStringAndSize(NULL, cap * (Py_ssize_t)sizeof(int64_t));
    if (ids == NULL) goto done;
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(ids);
    while (p < end && is_ws(*p)) p++;
    if (p < end && *p == ']') {
        p++;
    } else {
        for (;;) {
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
    if (_PyBytes_Resize(&ids, n * (Py_ssize_t)sizeof(int64_t)) < 0) goto done;
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
    PyModuleDef_HEAD_INIT, "kvwire.router._tokens", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__tokens(void)
{
    return PyModule_Create(&module);
}
