"""The small CPU build of torch the factory installs for itself: the payload's reference tests
(``nox -s tests``) and the ABI guard's foreign torch of a local build. Never a CUDA build:
PyPI's plain ``torch==X`` on Linux x86_64 is one (gigabytes with its nvidia-* libraries), so
the requirement names the ``+cpu`` build, asked first of pip's configured index (a mirror or
local wheel house may hold it) and then of PyTorch's CPU index, and what got installed is
checked to be a CPU build.

``python -m ci.cpu_torch check`` checks the torch of the running interpreter (exit 1 when it
is not a CPU build, with the reason).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

CPU_TORCH_VERSION = "2.13.0"
CPU_TORCH = f"torch=={CPU_TORCH_VERSION}+cpu"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Where to look, in order: pip's configured index (None), then PyTorch's CPU index.
CPU_TORCH_INDEXES = (None, PYTORCH_CPU_INDEX)
# A CPU build of torch 2.x installs to about 0.7-1 GB; a CUDA build's own files are larger, and
# its CUDA libraries come as nvidia-* requirements.
CPU_BUILD_MAX_BYTES = 1_500_000_000


def cpu_build_problem(dist: md.Distribution | None = None) -> str | None:
    """Why the installed torch is not a CPU build (None: it is): a requirement on an nvidia-*
    package, or more bytes on disk than a CPU build has."""
    dist = dist or md.distribution("torch")
    names = {m.group(0) for m in (re.match(r"[A-Za-z0-9._-]+", r.strip()) for r in dist.requires or []) if m}
    nvidia = sorted(n for n in names if n.lower().startswith("nvidia-"))
    if nvidia:
        return f"torch {dist.version} requires {', '.join(nvidia[:3])}{' ...' if len(nvidia) > 3 else ''}: a CUDA build"
    size = sum(f.size or 0 for f in dist.files or [])
    if size > CPU_BUILD_MAX_BYTES:
        return f"torch {dist.version} installs {size / 1e9:.1f} GB: a CPU build has under {CPU_BUILD_MAX_BYTES / 1e9:.1f} GB"
    return None


def describe(dist: md.Distribution | None = None) -> str:
    dist = dist or md.distribution("torch")
    size = sum(f.size or 0 for f in dist.files or [])
    return f"torch {dist.version}, {size / 1e6:.0f} MB, no nvidia-* requirements"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["check"]:
        print("usage: python -m ci.cpu_torch check", file=sys.stderr)
        return 2
    try:
        dist = md.distribution("torch")
    except md.PackageNotFoundError:
        print(f"no torch installed in {sys.prefix}: install {CPU_TORCH}", file=sys.stderr)
        return 1
    problem = cpu_build_problem(dist)
    if problem:
        print(f"not a CPU build of torch ({Path(str(dist.locate_file(''))).resolve()}): {problem}; "
              f"install {CPU_TORCH} (--extra-index-url {PYTORCH_CPU_INDEX})", file=sys.stderr)
        return 1
    print(f"CPU build: {describe(dist)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
