"""``python -m ci.toolchain.torch_msvc``: the command line of :mod:`ci.toolchain.torch_msvc`."""

from __future__ import annotations

from pathlib import Path

from ci.toolchain.torch_msvc import status_in_wheel


if __name__ == "__main__":
    import sys

    for w in sys.argv[1:]:
        print(f"{Path(w).name}: {status_in_wheel(Path(w))}")
