"""The small CPU build of torch the factory installs for itself: the payload's reference tests
(``nox -s tests``) and the ABI guard's foreign torch of a local build. Never a CUDA build:
PyPI's plain ``torch==X`` on Linux x86_64 is one (gigabytes with its nvidia-* libraries), so
the requirement names the ``+cpu`` build, asked first of pip's configured index (a mirror or
local wheel house may hold it) and then of PyTorch's CPU index, and what got installed is
checked to be a CPU build.

``python -m ci.toolchain.cpu_torch check`` checks the torch of the running interpreter (exit 1 when it
is not a CPU build, with the reason). ``python -m ci.toolchain.cpu_torch install`` installs it into the
running interpreter (``nox -s tests`` does): the ``+cpu`` build from pip's index, else from
PyTorch's CPU index, else (neither reachable) the plain release from pip's index with a warning
that it is not a CPU build; exit 2 when no torch could be installed at all.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys

from ci.runtime.log import default_log

CPU_TORCH_VERSION = "2.13.0"
CPU_TORCH = f"torch=={CPU_TORCH_VERSION}+cpu"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Where to look, in order: pip's configured index (None), then PyTorch's CPU index.
CPU_TORCH_INDEXES = (None, PYTORCH_CPU_INDEX)
PIPS_INDEX = "pip's index"
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


def install(spec: str = CPU_TORCH, indexes: tuple[str | None, ...] = CPU_TORCH_INDEXES, log=default_log) -> int:
    """Install ``spec`` into the running interpreter from each of ``indexes`` in turn (None: pip's
    configured index alone; a URL: added as an extra index), then, where none has it, the plain
    release (``torch==X``) from pip's index. 0: installed (a warning where it is not a CPU build),
    2: nothing could be installed."""
    from ci.runtime.pip_env import pip_environ

    env = pip_environ()
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    plain = spec.split("+")[0]
    tries = [([spec] + (["--extra-index-url", i] if i else []), f"{spec} from {i or PIPS_INDEX}") for i in indexes]
    tries.append(([plain], f"{plain} from {PIPS_INDEX}"))
    for n, (args, what) in enumerate(tries):
        log(f"[cpu-torch] installing {what}")
        proc = subprocess.run(pip + args, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        log(f"[cpu-torch] {what}: not found ({_last_error(proc.stderr)})")
    else:
        log(f"error: no torch could be installed ({spec}, then {plain}): make pip's index or {PYTORCH_CPU_INDEX} "
            f"reachable, or put a {spec} wheel where pip finds it (PIP_FIND_LINKS)")
        return 2
    md_dist = md.distribution("torch")
    problem = cpu_build_problem(md_dist)
    if problem:
        log(f"warning: {problem}: {spec} was not reachable, so the tests run with this torch "
            f"(make {PYTORCH_CPU_INDEX} reachable for the small CPU build)")
    else:
        log(f"[cpu-torch] CPU build: {describe(md_dist)}")
    return 0


def _last_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip().startswith("ERROR")]
    return (lines[0] if lines else (stderr.strip().splitlines() or ["pip failed"])[-1])[:200]
