"""The probe's extension: limited API of the Python floor given by SAGEATTN3_PROBE_LIMITED_API
(cp39, cp310, ...), so the wheel is abi3 like the release's. The extension alone: no Python
module (cibw_stages.py, beside it, is the hooks' code, not the wheel's)."""

import os

from setuptools import Extension, setup

limited = os.environ.get("SAGEATTN3_PROBE_LIMITED_API", "cp39")
hexversion = "0x03%02x0000" % int(limited[3:])

setup(
    py_modules=[],
    ext_modules=[Extension("sageattn3_cibw_probe", ["probe.c"], py_limited_api=True,
                           define_macros=[("Py_LIMITED_API", hexversion)])],
    options={"bdist_wheel": {"py_limited_api": limited}},
)
