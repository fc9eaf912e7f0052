"""The release jobs' torch specs resolved by real pip (``pip install --dry-run --report``) in
each target's floor Python against the stand-in index, and checked against what the job
asks for.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ci.runtime.log import default_log
from ci.runtime.pip_env import pip_environ
from ci.release import ReleaseError
from ci.release.standin import standin_dir, standin_serves
from ci.toolchain.targets import Matrix



# The CUDA runtime a torch build depends on (PyPI's builds carry no +cuXYZ label): its pinned
# nvidia-cuda-runtime-cu12 (12.8.90 -> 12.8), nvidia-cuda-runtime (13.0.96 -> 13.0), or the
# cuda-toolkit with the cudart extra (13.0.3 -> 13.0).
CUDA_RUNTIME_DIST = re.compile(r"^nvidia-cuda-runtime(-cu\d+)?$")
RESOLVE_TIMEOUT_S = 10 * 60


@dataclass
class TorchResolution:
    """One torch spec of a release job (the build's, or the ABI guard's foreign torch) as pip
    resolves it in the target's floor Python against the stand-in index."""

    target: str
    role: str  # "build" | "guard"
    python: str  # "3.9"
    interpreter: str
    source: object  # ci.toolchain.torch_source.TorchSource: what the job asks for
    version: str | None = None  # as resolved
    cuda: str | None = None  # CUDA of the resolved build (None: a CPU build)
    url: str | None = None  # where pip would download torch from
    seconds: float = 0.0
    problem: str | None = None

    def describe(self) -> str:
        got = (f"torch {self.version} ({'CUDA ' + self.cuda if self.cuda else 'CPU'}) from {self.url}"
               if self.version else "nothing")
        return f"{self.role} in Python {self.python}: {self.source.requirement} -> {got}"


def _runtime_cuda(name: str, version: str, extras=()) -> str | None:
    from packaging.version import Version

    if CUDA_RUNTIME_DIST.match(name) or (name == "cuda-toolkit" and "cudart" in extras):
        v = Version(version)
        return f"{v.major}.{v.minor}"
    return None


def resolved_torch(report: dict) -> tuple[str, str | None, str]:
    """(version, CUDA, URL) of torch in a ``pip install --report`` document. The CUDA is the
    build's local label (``+cu128``, ``+cpu``: PyTorch's index) or, for an unlabelled build
    (PyPI's), the CUDA runtime it installs or pins for the report's interpreter; None for a CPU
    build."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    items = {canonicalize_name(i["metadata"]["name"]): i for i in report.get("install", [])}
    torch = items.get("torch")
    if torch is None:
        raise ReleaseError(f"pip's report installs no torch (it installs {sorted(items) or 'nothing'})")
    version = Version(torch["metadata"]["version"])
    label = version.local or ""
    if re.fullmatch(r"cu\d{3,4}", label):
        return str(version), f"{int(label[2:-1])}.{label[-1]}", torch["download_info"]["url"]
    if label == "cpu":
        return str(version), None, torch["download_info"]["url"]
    found = [c for n, i in items.items() if (c := _runtime_cuda(n, i["metadata"]["version"]))]
    if not found:  # resolved without its dependencies: what torch pins for this interpreter
        env = {**report.get("environment", {}), "extra": ""}
        for line in torch["metadata"].get("requires_dist", []):
            req = Requirement(line)
            pins = [sp.version for sp in req.specifier if sp.operator == "=="]
            if pins and (req.marker is None or Marker(str(req.marker)).evaluate(env)):
                cuda = _runtime_cuda(canonicalize_name(req.name), pins[0], req.extras)
                if cuda:
                    found.append(cuda)
    return str(version), (found[0] if found else None), torch["download_info"]["url"]


def resolve_torch(python: str | Path, source, *, timeout: float = RESOLVE_TIMEOUT_S) -> tuple[str, str | None, str]:
    """``pip install --dry-run --report`` of ``source`` (a TorchSource) by ``python``'s own pip,
    with nothing but the source's index (pip's configuration files off, nothing installed
    counted): (version, CUDA, URL) of the torch it would install. Without torch's dependencies:
    the check is which torch build the spec selects (theirs would add gigabytes of downloads,
    and the environments the jobs make install them anyway)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sageattn3-resolve-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--no-cache-dir",
               "--quiet", "--report", str(out), *source.pip_args()]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_environ(sources=False), timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ReleaseError(f"pip did not resolve {source.describe()} within {timeout:.0f}s") from e
        if proc.returncode != 0 or not out.exists():
            raise ReleaseError(f"pip could not resolve {source.describe()} (exit {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-2000:]}")
        return resolved_torch(json.loads(out.read_text()))


def check_resolution(r: TorchResolution) -> str | None:
    """Why the resolved torch is not the one the job asked for (None: it is)."""
    from packaging.version import Version

    want = r.source
    if Version(r.version).public != Version(want.version).public:
        return f"pip resolved torch {r.version}, the job asks for {want.requirement}"
    if r.cuda != want.cuda:
        return (f"pip resolved the {'CUDA ' + r.cuda if r.cuda else 'CPU'} build of torch {r.version}, the job needs "
                f"{'CUDA ' + want.cuda if want.cuda else 'a CPU build'}")
    if want.index_url and not r.url.startswith(want.index_url.rstrip("/") + "/"):
        return f"pip would download torch from {r.url}, not from {want.index_url}"
    return None


def standin_resolutions(matrix: Matrix, index_url: str, skip: list[str] = ()) -> list[tuple]:
    """For every target whose torch the stand-in serves (but ``skip``): (target, role,
    TorchSource) of its build torch and of its ABI guard's foreign torch (from the stand-in
    directory PyPI's build of that release belongs in), both in the target's floor Python, as
    the job asks for them."""
    from ci.toolchain.torch_source import foreign_line, foreign_torch_source, torch_source

    out = []
    for t in matrix.targets:
        if standin_serves(t, matrix) or t.id in skip:
            continue
        foreign_dir = standin_dir(foreign_line(t, matrix, t.python), matrix)
        out.append((t, "build", torch_source(t, index_url)))
        out.append((t, "guard", foreign_torch_source(t, matrix, t.python, index_url, directory=foreign_dir)))
    return out


def resolve_served_targets(matrix: Matrix, index_url: str, *, skip: list[str] = (), workers: int = 2,
                           log=default_log) -> list[TorchResolution]:
    """Every served target's build and guard torch (but those of ``skip``: the targets the
    rehearsal builds, whose build and verify install them for real) resolved by real pip
    (``resolve_torch``) in the target's floor Python (ci.toolchain.tools.find_python) against the
    stand-in at ``index_url``, two at a time, and checked."""
    from ci.toolchain.tools import find_python

    todo = []
    for t, role, source in standin_resolutions(matrix, index_url, skip):
        todo.append(TorchResolution(t.id, role, t.python, str(find_python(t.python)), source))

    def one(r: TorchResolution) -> TorchResolution:
        t0 = time.monotonic()
        try:
            r.version, r.cuda, r.url = resolve_torch(r.interpreter, r.source)
            r.problem = check_resolution(r)
        except ReleaseError as e:
            r.problem = str(e)
        r.seconds = time.monotonic() - t0
        log(f"[resolve] {r.target}: {r.describe()} ({r.seconds:.0f}s)" + (f": PROBLEM {r.problem}" if r.problem else ""))
        return r

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, todo))


