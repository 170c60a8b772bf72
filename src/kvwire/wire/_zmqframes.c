/* kvwire._zmqframes: whole multipart messages in and out of a ZeroMQ socket in one call.
 *
 * Why: pyzmq costs about 1.5-2 us per frame on a small machine (a Frame object per part,
 * a getsockopt for "more", a GIL release per call), and a KV event message has three
 * frames. This module calls libzmq directly and keeps the GIL for the microsecond a
 * non-blocking call takes. It links against nothing: Python hands it the addresses of
 * pyzmq's own libzmq functions (see kvwire/wire/frames.py), so the socket handles are pyzmq's.
 *
 * Only non-blocking use is allowed (the GIL stays held): callers pass ZMQ_DONTWAIT for the
 * first frame; the remaining parts of a message arrive with the first, atomically.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

/* zmq_msg_t is 64 opaque bytes, pointer-aligned (zmq.h). */
typedef struct { unsigned char d[64]; } __attribute__((aligned(sizeof(void *)))) zmsg;

typedef int (*msg_init_fn)(zmsg *);
typedef int (*msg_recv_fn)(zmsg *, void *, int);
typedef void *(*msg_data_fn)(zmsg *);
typedef size_t (*msg_size_fn)(const zmsg *);
typedef int (*msg_more_fn)(const zmsg *);
typedef int (*msg_close_fn)(zmsg *);
typedef int (*send_fn)(void *, const void *, size_t, int);
typedef int (*errno_fn)(void);

static msg_init_fn z_init;
static msg_recv_fn z_recv;
static msg_data_fn z_data;
static msg_size_fn z_size;
static msg_more_fn z_more;
static msg_close_fn z_close;
static send_fn z_send;
static errno_fn z_errno;

#define ZMQ_SNDMORE_ 2

static void *as_ptr(PyObject *o) {
    void *p = PyLong_AsVoidPtr(o);
    if (p == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "null function or socket address");
    return p;
}

PyDoc_STRVAR(bind_doc,
"bind(msg_init, msg_recv, msg_data, msg_size, msg_more, msg_close, send, errno)\n"
"Addresses of libzmq's functions, from the library pyzmq loaded.");

static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 8) {
        PyErr_SetString(PyExc_TypeError, "bind() takes 8 function addresses");
        return NULL;
    }
    void *p[8];
    for (int i = 0; i < 8; i++)
        if ((p[i] = as_ptr(args[i])) == NULL)
            return NULL;
    z_init = (msg_init_fn)p[0];
    z_recv = (msg_recv_fn)p[1];
    z_data = (msg_data_fn)p[2];
    z_size = (msg_size_fn)p[3];
    z_more = (msg_more_fn)p[4];
    z_close = (msg_close_fn)p[5];
    z_send = (send_fn)p[6];
    z_errno = (errno_fn)p[7];
    Py_RETURN_NONE;
}

static int bound(void) {
    if (z_recv == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvwire._zmqframes: bind() was not called");
        return 0;
    }
    return 1;
}

/* One message into a new list; NULL with *err set to libzmq's errno (or 0 and a Python
 * error set). The first part is received with `flags`, the others cannot block. */
static PyObject *recv_one(void *sock, int flags, int *err) {
    zmsg m;
    *err = 0;
    z_init(&m);
    if (z_recv(&m, sock, flags) < 0) {
        *err = z_errno();
        z_close(&m);
        return NULL;
    }
    PyObject *out = PyList_New(0);
    for (;;) {
        PyObject *b = out == NULL ? NULL
            : PyBytes_FromStringAndSize((const char *)z_data(&m), (Py_ssize_t)z_size(&m));
        int more = z_more(&m);
        z_close(&m);
        if (b == NULL || PyList_Append(out, b) < 0) {
            Py_XDECREF(b);
            Py_XDECREF(out);
            /* Drain the rest so the socket stays aligned on message boundaries. */
            while (more) {
                z_init(&m);
                if (z_recv(&m, sock, 0) < 0) { z_close(&m); break; }
                more = z_more(&m);
                z_close(&m);
            }
            return NULL;
        }
        Py_DECREF(b);
        if (!more)
            return out;
        z_init(&m);
        if (z_recv(&m, sock, 0) < 0) {
            *err = z_errno();
            z_close(&m);
            Py_DECREF(out);
            return NULL;
        }
    }
}

/* The (socket_address, flags, ...) head shared by every call; 0 with a Python error set. */
static int sock_flags(const char *fn, PyObject *const *args, Py_ssize_t n, Py_ssize_t want,
                      void **sock, int *flags) {
    if (want >= 0 ? n != want : n < -want) {
        PyErr_Format(PyExc_TypeError, "%s() got %zd arguments", fn, n);
        return 0;
    }
    if (!bound())
        return 0;
    if ((*sock = as_ptr(args[0])) == NULL)
        return 0;
    long f = PyLong_AsLong(args[1]);
    if (f == -1 && PyErr_Occurred())
        return 0;
    *flags = (int)f;
    return 1;
}

PyDoc_STRVAR(recv_doc,
"recv_multipart(socket_address, flags) -> list[bytes] | int\n"
"One whole message as a list of frames, or libzmq's errno (EAGAIN: none waiting).\n"
"flags must contain ZMQ_DONTWAIT: the GIL is held.");

static PyObject *recv_multipart(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *sock;
    int flags;
    if (!sock_flags("recv_multipart", args, n, 2, &sock, &flags))
        return NULL;
    int err;
    PyObject *msg = recv_one(sock, flags, &err);
    if (msg == NULL && err)
        return PyLong_FromLong(err);
    return msg;
}

PyDoc_STRVAR(recv_many_doc,
"recv_many(socket_address, flags, max_messages) -> list[list[bytes]] | int\n"
"Up to max_messages whole messages, as many as wait now (an empty list: none).\n"
"libzmq's errno only if the very first receive fails otherwise than EAGAIN.");

static PyObject *recv_many(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *sock;
    int flags;
    if (!sock_flags("recv_many", args, n, 3, &sock, &flags))
        return NULL;
    Py_ssize_t max = PyLong_AsSsize_t(args[2]);
    if (max == -1 && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < max; i++) {
        int err;
        PyObject *msg = recv_one(sock, flags, &err);
        if (msg == NULL) {
            if (!err) { /* a Python error (memory) */
                Py_DECREF(out);
                return NULL;
            }
            if (i == 0 && err != EAGAIN) {
                Py_DECREF(out);
                return PyLong_FromLong(err);
            }
            break; /* EAGAIN, or an error the next call reports */
        }
        int rc = PyList_Append(out, msg);
        Py_DECREF(msg);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

PyDoc_STRVAR(send_doc,
"send_frames(socket_address, flags, *frames) -> int\n"
"Send frames as one message; 0 on success, else libzmq's errno (EAGAIN: not sent).\n"
"flags apply to every frame (pass ZMQ_DONTWAIT); SNDMORE is added between frames.");

static PyObject *send_frames(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *sock;
    int flags;
    if (!sock_flags("send_frames", args, n, -3, &sock, &flags))
        return NULL;
    /* Check every frame before sending any, so a bad one never leaves half a message. */
    for (Py_ssize_t i = 2; i < n; i++) {
        if (!PyBytes_CheckExact(args[i]) && !PyObject_CheckBuffer(args[i])) {
            PyErr_Format(PyExc_TypeError, "frame %zd is %.100s, not bytes-like", i - 2,
                         Py_TYPE(args[i])->tp_name);
            return NULL;
        }
    }
    for (Py_ssize_t i = 2; i < n; i++) {
        PyObject *f = args[i];
        int fl = flags | (i + 1 < n ? ZMQ_SNDMORE_ : 0);
        int rc;
        if (PyBytes_CheckExact(f)) {
            rc = z_send(sock, PyBytes_AS_STRING(f), (size_t)PyBytes_GET_SIZE(f), fl);
        } else {
            Py_buffer view;
            if (PyObject_GetBuffer(f, &view, PyBUF_SIMPLE) < 0)
                return NULL; /* checked above; a buffer that still refuses is a bug */
            rc = z_send(sock, view.buf, (size_t)view.len, fl);
            PyBuffer_Release(&view);
        }
        if (rc < 0)
            return PyLong_FromLong(z_errno());
    }
    return PyLong_FromLong(0);
}

PyDoc_STRVAR(send_batch_doc,
"send_batch(socket_address, flags, topic, messages) -> (sent, errno)\n"
"Send [topic, seq, payload] for each (seq, payload) 2-tuple of bytes in the list messages,\n"
"in order. A message refused with EAGAIN is skipped (not sent, nothing of it queued);\n"
"any other error stops there with libzmq's errno (else 0). sent counts messages queued.");

static PyObject *send_batch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *sock;
    int flags;
    if (!sock_flags("send_batch", args, n, 4, &sock, &flags))
        return NULL;
    PyObject *topic = args[2], *msgs = args[3];
    if (!PyBytes_CheckExact(topic) || !PyList_CheckExact(msgs)) {
        PyErr_SetString(PyExc_TypeError, "send_batch: topic must be bytes, messages a list");
        return NULL;
    }
    const char *t = PyBytes_AS_STRING(topic);
    size_t tn = (size_t)PyBytes_GET_SIZE(topic);
    Py_ssize_t sent = 0;
    int err = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(msgs); i++) {
        PyObject *m = PyList_GET_ITEM(msgs, i);
        if (!PyTuple_CheckExact(m) || PyTuple_GET_SIZE(m) != 2 ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(m, 0)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(m, 1))) {
            PyErr_Format(PyExc_TypeError, "send_batch: message %zd is not (bytes, bytes)", i);
            return NULL; /* checked before any of its frames goes out */
        }
        PyObject *seq = PyTuple_GET_ITEM(m, 0), *payload = PyTuple_GET_ITEM(m, 1);
        if (z_send(sock, t, tn, flags | ZMQ_SNDMORE_) < 0) {
            err = z_errno();
            if (err == EAGAIN) {
                err = 0;
                continue; /* refused whole: the next one may go */
            }
            break;
        }
        if (z_send(sock, PyBytes_AS_STRING(seq), (size_t)PyBytes_GET_SIZE(seq),
                   flags | ZMQ_SNDMORE_) < 0 ||
            z_send(sock, PyBytes_AS_STRING(payload), (size_t)PyBytes_GET_SIZE(payload),
                   flags) < 0) {
            err = z_errno(); /* later parts are never refused; anything else is fatal */
            break;
        }
        sent++;
    }
    return Py_BuildValue("(ni)", sent, err);
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, bind_doc},
    {"recv_multipart", (PyCFunction)(void (*)(void))recv_multipart, METH_FASTCALL, recv_doc},
    {"recv_many", (PyCFunction)(void (*)(void))recv_many, METH_FASTCALL, recv_many_doc},
    {"send_frames", (PyCFunction)(void (*)(void))send_frames, METH_FASTCALL, send_doc},
    {"send_batch", (PyCFunction)(void (*)(void))send_batch, METH_FASTCALL, send_batch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire._zmqframes",
    "Whole ZeroMQ multipart messages per call, GIL held (see kvwire/wire/frames.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__zmqframes(void) { return PyModule_Create(&module); }
