/* @file probe.c @brief The cibuildwheel probe's extension: add(a, b) through the limited API,
 * and has_env(name) through libc (auditwheel tells the libc of an extension by what it links). */
#include <Python.h>
#include <stdlib.h>

static PyObject *add(PyObject *self, PyObject *args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
    return PyLong_FromLong(a + b);
}

static PyObject *has_env(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    return PyBool_FromLong(getenv(name) != NULL);
}

static PyMethodDef methods[] = {{"add", add, METH_VARARGS, "a + b"},
                                {"has_env", has_env, METH_VARARGS, "whether the variable is set"},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "sageattn3_cibw_probe", NULL, -1, methods};

PyMODINIT_FUNC PyInit_sageattn3_cibw_probe(void) { return PyModule_Create(&module); }
