"""The sageattn3 wheel factory: targets, toolchains, patches, build, repair, tagging,
verification, index and publishing. ``python -m ci --help``; nox sessions call into it."""

import sys

# The factory itself runs on Python 3.11 or newer (tomllib, among others); the wheels it builds
# cover older Pythons. Said once, here, before any module of it fails to import.
if sys.version_info < (3, 11):
    sys.stderr.write(f"error: the sageattn3 factory needs Python 3.11 or newer to run; this is Python "
                     f"{sys.version.split()[0]} ({sys.executable}). Run nox with a newer one: "
                     f"`uvx --python 3.11 nox ...` or `pipx run --python python3.11 nox ...`\n")
    raise SystemExit(2)
