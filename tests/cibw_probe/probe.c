/* @file probe.c @brief The cibuildwheel probe's extension: add(a, b) through the limited API. */
#include <Python.h>

static PyObject *add(PyObject *self, PyObject *args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
    return PyLong_FromLong(a + b);
}

static PyMethodDef methods[] = {{"add", add, METH_VARARGS, "a + b"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "sageattn3_cibw_probe", NULL, -1, methods};

PyMODINIT_FUNC PyInit_sageattn3_cibw_probe(void) { return PyModule_Create(&module); }
