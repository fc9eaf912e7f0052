"""What the privileged sessions run with, and what every wheel carries:

- the publish, index, upload-index, gather and pages sessions install only
  ci/requirements-publish.txt, with --require-hashes; every line of it is pinned (==) with
  sha256 hashes, and it covers every third-party module that publishing imports or runs
  (checked from the sources, and by a real install into a fresh virtual environment that then
  imports and runs them, the publish job's gate included);
- every step of the release workflow's publish job (the one holding the token) runs one of
  those sessions, and nox itself comes from a hashed lock (ci/requirements-nox.txt) that pins
  the workflows' nox version;
- LICENSE (Apache-2.0) in the repository and in the payload, the third-party notices beside
  it, and both in the wheel's metadata (License-File, .dist-info/licenses/), from setuptools'
  own metadata hook on the payload's pyproject.toml and setup.py."""

from __future__ import annotations

import ast
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest_publish import REPO, Venv, sage_wheel

pytestmark = pytest.mark.timeout(300)

LOCK = REPO / "ci" / "requirements-publish.txt"
NOX_LOCK = REPO / "ci" / "requirements-nox.txt"
RELEASE_YML = REPO / ".github" / "workflows" / "release.yml"
LOCK_INSTALL = ("--require-hashes", "--only-binary", ":all:", "-r", "ci/requirements-publish.txt")
# session -> the module it runs: the sessions that hold (or gate) the release token
LOCK_ONLY_SESSIONS = {"publish": "ci.release.publish", "index": "ci.index", "upload-index": "ci.release.publish",
                      "gather": "ci.release", "pages": "ci.release.publish"}
# The modules those sessions run, and what they import from ci/.
ENTRY_MODULES = ("ci/release/publish/__main__.py", "ci/release/publish/github.py", "ci/release/publish/pages.py", "ci/release/publish/pypi.py",
                 "ci/release/publish/_net.py", "ci/index/__init__.py", "ci/index/__main__.py")


def locked(lock: Path = LOCK) -> dict[str, str]:
    """name -> version of every requirement in a lock, checking its form on the way."""
    text = lock.read_text()
    out: dict[str, str] = {}
    for entry in re.split(r"(?<!\\)\n(?!\s)", text.replace("\\\n", "\\\n")):
        lines = [ln.strip().rstrip("\\").strip() for ln in entry.splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("#")]
        if not lines:
            continue
        req, hashes = lines[0], lines[1:]
        assert not req.startswith("-"), f"{lock.name}: option {req!r} (only pinned, hashed requirements belong here)"
        r = Requirement(req)
        assert r.url is None and not r.marker, req
        (spec,) = r.specifier
        assert spec.operator == "==" and "*" not in spec.version, f"{req}: not pinned with =="
        assert hashes and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), f"{req}: hashes"
        out[canonicalize_name(r.name)] = spec.version
    return out


# Third-party modules the ci modules publishing pulls in may import only inside a function, only
# where they are installed, and never on publishing's path: not in the lock, and the install test
# below runs publishing without them. rich: the live progress line of ci.runtime.progress (which
# the factory's logger, ci.runtime.log, hands out as its step), drawn on a terminal only, after
# live_terminal has found rich installed.
OPTIONAL = {"rich"}


def _imports(path: Path) -> tuple[set[str], set[str], set[str]]:
    """(top-level third-party-or-stdlib modules, ci modules, the former imported at module level)
    that a file imports, inside functions too."""
    tree = ast.parse(path.read_text())
    mods: set[str] = set()
    eager: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        mods.update(names)
        if not in_function:
            eager.update(names)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    ci = {m for m in mods if m == "ci" or m.startswith("ci.")}
    return {m.split(".")[0] for m in mods - ci}, ci, {m.split(".")[0] for m in eager - ci}


def publishing_imports() -> tuple[set[str], set[str]]:
    """Every top-level module imported by the publishing modules and the ci modules they pull
    in (but the OPTIONAL ones, which none imports at module level), and the modules they run
    with ``python -m``."""
    todo = [REPO / p for p in ENTRY_MODULES]
    seen: set[Path] = set()
    top: set[str] = set()
    run: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        t, ci, eager = _imports(path)
        assert not eager & OPTIONAL, f"{path.relative_to(REPO)} imports {sorted(eager & OPTIONAL)} at module level"
        top |= t - OPTIONAL
        run |= set(re.findall(r'"-m",\s*"([A-Za-z_][\w.]*)"', path.read_text()))
        for m in ci:
            base = REPO / Path(*m.split("."))
            for cand in (base.with_suffix(".py"), base / "__init__.py"):
                if cand.exists():
                    todo.append(cand)
    third = {m for m in top if m not in sys.stdlib_module_names and m != "__future__"}
    return third, {m for m in run if not m.startswith("ci")}


def test_the_lock_is_pinned_with_hashes_and_covers_what_publishing_imports():
    lock = locked()
    third, run = publishing_imports()
    assert third == {"github", "markdown_it", "packaging", "requests"}, third  # a new import must join the lock
    assert run == {"twine"}, run
    dists = packages_distributions()
    for mod in sorted(third | run):
        names = {canonicalize_name(d) for d in dists.get(mod, [])}
        assert names & set(lock), f"{mod} (from {names or '?'}) is not in {LOCK.name}"
    # closed under dependencies, as far as this environment can tell (the install test checks it for real)
    for name in lock:
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                assert canonicalize_name(req.name) in lock, f"{name} needs {req.name}, not in {LOCK.name}"


class Recorder:
    """A nox session that records what a session function installs and runs."""

    posargs = ["--help"]

    def __init__(self) -> None:
        self.installs: list[tuple[str, ...]] = []
        self.runs: list[tuple[str, ...]] = []

    def install(self, *args: str, **kw) -> None:
        self.installs.append(args)

    def run(self, *args: str, **kw) -> None:
        self.runs.append(args)

    def log(self, *a) -> None:
        pass


def noxfile_sessions(monkeypatch) -> dict:
    """The noxfile's session functions by session name (nox itself need not be installed)."""
    sessions: dict = {}
    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()
    fake.Session = object

    def session(*a, **kw):
        def register(f):
            sessions[kw.get("name") or f.__name__] = f
            return f
        return register(a[0]) if a and callable(a[0]) else register
    fake.session = session
    command = types.ModuleType("nox.command")
    command.CommandFailed = type("CommandFailed", (Exception,), {})
    fake.command = command
    monkeypatch.setitem(sys.modules, "nox", fake)
    monkeypatch.setitem(sys.modules, "nox.command", command)
    exec(compile((REPO / "noxfile.py").read_text(), "noxfile.py", "exec"), {"__name__": "noxfile_under_test"})
    return sessions


def test_the_sessions_install_only_the_lock(monkeypatch):
    """Each session that holds or gates the token installs the lock with --require-hashes and
    nothing else, then runs its module."""
    sessions = noxfile_sessions(monkeypatch)
    for name, module in LOCK_ONLY_SESSIONS.items():
        rec = Recorder()
        sessions[name](rec)
        assert rec.installs == [LOCK_INSTALL], name
        assert [r[:3] for r in rec.runs] == [("python", "-m", module)], name


def _publish_job_commands() -> list[str]:
    """Every shell command line of the release workflow's publish job (run: lines and blocks)."""
    job = RELEASE_YML.read_text().split("\n  publish:\n", 1)[1]
    out: list[str] = []
    block_indent = None
    for line in job.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if block_indent is not None:
            if stripped and indent < block_indent:
                block_indent = None
            elif stripped:
                out.append(stripped)
                continue
            else:
                continue
        m = re.match(r"^(?:-\s+)?run:\s*(.*)$", stripped)
        if m:
            if m.group(1) in ("|", ">"):
                block_indent = indent + 2
            else:
                out.append(m.group(1))
    return out


def test_every_step_of_the_publish_job_runs_a_lock_only_session(monkeypatch):
    """The job that holds the release token installs nox from its hashed lock and then runs
    nothing but sessions that install only the publish lock (no build or test toolset)."""
    sessions = noxfile_sessions(monkeypatch)
    used = []
    commands = _publish_job_commands()
    assert commands, "no run: step found in the publish job"
    for cmd in commands:
        if cmd.startswith("python -m pip "):
            assert cmd == "python -m pip install --require-hashes --only-binary :all: -r ci/requirements-nox.txt", cmd
            continue
        if re.fullmatch(r'url="\$\{[A-Z_]+:-[^"]*\}"', cmd):  # a shell variable for the next line
            continue
        m = re.fullmatch(r"nox -s ([\w-]+) -- .+", cmd)
        assert m, f"publish job runs {cmd!r}: only `nox -s <lock-only session> -- ...` belongs there"
        assert m.group(1) in LOCK_ONLY_SESSIONS, f"{m.group(1)} is not a lock-only session"
        rec = Recorder()
        sessions[m.group(1)](rec)
        assert rec.installs == [LOCK_INSTALL], m.group(1)
        used.append(m.group(1))
    assert used == ["gather", "publish", "index", "pages"], used


def test_nox_for_the_publish_job_is_hashed_and_is_the_workflows_version():
    lock = locked(NOX_LOCK)
    version = re.search(r'^  NOX_VERSION: "([^"]+)"$', RELEASE_YML.read_text(), re.M).group(1)
    assert lock["nox"] == version
    assert {"virtualenv", "packaging", "argcomplete", "colorlog"} <= set(lock)  # its dependencies, pinned too
    assert "ci/requirements-nox.txt" in RELEASE_YML.read_text().split("\n  publish:\n", 1)[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the nox lock is resolved for the publish job's Python (3.12)")
def test_the_nox_lock_installs_alone_and_lists_the_sessions(tmp_path):
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--require-hashes", "--only-binary", ":all:", "-r", str(NOX_LOCK))
    assert {canonicalize_name(k) for k in venv.installed()} == set(locked(NOX_LOCK))
    nox = str(Path(venv.python).parent / "nox")
    p = subprocess.run([nox, "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and (p.stdout + p.stderr).strip() == locked(NOX_LOCK)["nox"], p.stderr
    p = subprocess.run([nox, "--list", "--json", "--sessions", *LOCK_ONLY_SESSIONS], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr  # this nox reads the noxfile and finds every one of them
    assert {s["session"] for s in json.loads(p.stdout)} == set(LOCK_ONLY_SESSIONS)


def test_the_lock_installs_alone_and_runs_publishing(tmp_path):
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--require-hashes", "--only-binary", ":all:", "-r", str(LOCK))
    installed = {canonicalize_name(k) for k in venv.installed()}
    assert installed == set(locked()), installed ^ set(locked())
    assert venv.pip("check").returncode == 0
    code = ("import ci.release.publish.github, ci.release.publish.pages, ci.release.publish.pypi, ci.index, ci.toolchain.targets, ci.release;"
            "ci.toolchain.targets.Matrix.load(); print('ok')")
    p = subprocess.run([venv.python, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    # the publish job's gate, as the gather session runs it: one planned target's artifact
    target = "linux-x86_64-cu130-torch2.10-stable"
    art = tmp_path / "artifacts" / f"wheel-{target}"
    wheel, _ = sage_wheel(art, "cu130.torch2.10.stable", "0.1.0", platform="manylinux_2_28_x86_64", target=target)
    planned = {"include": [{"id": target, "variant": "cu130.torch2.10.stable"}]}
    p = subprocess.run([venv.python, "-m", "ci.release", "gather", "--plan", json.dumps(planned), "--artifacts",
                        str(tmp_path / "artifacts"), "--out", str(tmp_path / "wheels")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "gathered 1 wheel(s)" in p.stdout, p.stdout + p.stderr
    assert (tmp_path / "wheels" / wheel.name).read_bytes() == wheel.read_bytes()
    p = subprocess.run([venv.python, "-m", "twine", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "twine version" in p.stdout, p.stderr


# -- licenses ------------------------------------------------------------------------------

def test_license_files_in_the_repository_and_the_payload():
    root, payload = (REPO / "LICENSE").read_text(), (REPO / "sageattn3" / "LICENSE").read_text()
    assert root == payload
    assert re.search(r"Apache License\s+Version 2\.0, January 2004", root)
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in root
    assert "END OF TERMS AND CONDITIONS" in root and "APPENDIX: How to apply the Apache License" in root
    notices = (REPO / "sageattn3" / "THIRD_PARTY_NOTICES.md").read_text()
    for name in ("CUTLASS", "PyTorch"):
        section = " ".join(notices.split(f"## {name}", 1)[1].split("\n## ", 1)[0].split())
        assert "Redistribution and use in source and binary forms" in section, name
        assert "Neither the name" in section and "EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGE" in section, name
    assert "NVIDIA CORPORATION & AFFILIATES" in notices and "nvidia-cutlass==4.2.0.0" in notices


def _wheel_metadata_checks(meta: str, licenses: dict[str, bytes]) -> None:
    msg = email.parser.Parser().parsestr(meta)
    assert msg.get("License-Expression") == "Apache-2.0", meta[:500]
    assert sorted(msg.get_all("License-File") or []) == ["LICENSE", "THIRD_PARTY_NOTICES.md"]
    assert licenses["LICENSE"] == (REPO / "LICENSE").read_bytes()
    assert licenses["THIRD_PARTY_NOTICES.md"] == (REPO / "sageattn3" / "THIRD_PARTY_NOTICES.md").read_bytes()


def test_the_wheel_metadata_carries_the_license_files(tmp_path):
    """setuptools' PEP 517 metadata hook (what pip runs before building the wheel, whose
    .dist-info it becomes) on a copy of the payload, with a build config as the factory writes
    it; no compiler is involved."""
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "setuptools>=77", "wheel", "packaging")
    src = tmp_path / "payload"
    shutil.copytree(REPO / "sageattn3", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so",
                                                                          "_build_record.json"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "profile": {"torch_unit": "csrc/torch/stable.cpp"}, "cuda_home": str(tmp_path / "no-cuda"),
        "local_label": "cu130.torch2.10.stable", "requires_torch": "torch>=2.10", "limited_api": "cp310",
        "record": {"variant": "cu130.torch2.10.stable", "requires_python": ">=3.10"},
    }))
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    p = subprocess.run([venv.python, "-c", code, str(meta_dir)], cwd=src, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "SAGEATTN3_BUILD_CONFIG": str(config)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    info = meta_dir / p.stdout.strip().splitlines()[-1]
    licenses = {f.name: f.read_bytes() for f in (info / "licenses").iterdir()}
    _wheel_metadata_checks((info / "METADATA").read_text(), licenses)


built = sorted((REPO / "dist" / "wheels").glob("sageattn3-*.whl")) if (REPO / "dist" / "wheels").is_dir() else []


@pytest.mark.skipif(not built, reason="no wheel built in dist/wheels (nox -s build-wheels)")
@pytest.mark.parametrize("wheel", built, ids=lambda w: w.name)
def test_a_built_wheel_carries_the_license_files(wheel):
    with zipfile.ZipFile(wheel) as z:
        info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        licenses = {n.rsplit("/", 1)[1]: z.read(n) for n in z.namelist() if n.startswith(f"{info}/licenses/")}
        _wheel_metadata_checks(z.read(f"{info}/METADATA").decode(), licenses)
