"""What the privileged sessions run with, and what every wheel carries:

- the publish, index and upload-index sessions install only ci/requirements-publish.txt, with
  --require-hashes; every line of it is pinned (==) with sha256 hashes, and it covers every
  third-party module that publishing imports or runs (checked from the sources, and by a real
  install into a fresh virtual environment that then imports and runs them);
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

from conftest_publish import REPO, Venv

pytestmark = pytest.mark.timeout(300)

LOCK = REPO / "ci" / "requirements-publish.txt"
# The modules those sessions run, and what they import from ci/.
ENTRY_MODULES = ("ci/publish/__main__.py", "ci/publish/github.py", "ci/publish/pages.py", "ci/publish/pypi.py",
                 "ci/publish/_net.py", "ci/index.py")


def locked() -> dict[str, str]:
    """name -> version of every requirement in the lock, checking its form on the way."""
    text = LOCK.read_text()
    out: dict[str, str] = {}
    for entry in re.split(r"(?<!\\)\n(?!\s)", text.replace("\\\n", "\\\n")):
        lines = [ln.strip().rstrip("\\").strip() for ln in entry.splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("#")]
        if not lines:
            continue
        req, hashes = lines[0], lines[1:]
        assert not req.startswith("-"), f"{LOCK.name}: option {req!r} (only pinned, hashed requirements belong here)"
        r = Requirement(req)
        assert r.url is None and not r.marker, req
        (spec,) = r.specifier
        assert spec.operator == "==" and "*" not in spec.version, f"{req}: not pinned with =="
        assert hashes and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), f"{req}: hashes"
        out[canonicalize_name(r.name)] = spec.version
    return out


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(top-level third-party-or-stdlib modules, ci modules) that a file imports."""
    tree = ast.parse(path.read_text())
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    ci = {m for m in mods if m == "ci" or m.startswith("ci.")}
    return {m.split(".")[0] for m in mods - ci}, ci


def publishing_imports() -> tuple[set[str], set[str]]:
    """Every top-level module imported by the publishing modules and the ci modules they pull
    in, and the modules they run with ``python -m``."""
    todo = [REPO / p for p in ENTRY_MODULES]
    seen: set[Path] = set()
    top: set[str] = set()
    run: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        t, ci = _imports(path)
        top |= t
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
    assert third == {"github", "packaging", "requests"}, third  # a new import must join the lock
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


def test_the_sessions_install_only_the_lock(monkeypatch):
    """Run the noxfile's session functions against a recording session (nox itself need not be
    installed): each installs the lock with --require-hashes and nothing else."""
    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()
    fake.Session = object

    def session(*a, **kw):
        return a[0] if a and callable(a[0]) else (lambda f: f)
    fake.session = session
    monkeypatch.setitem(sys.modules, "nox", fake)
    code = compile((REPO / "noxfile.py").read_text(), "noxfile.py", "exec")
    ns: dict = {"__name__": "noxfile_under_test"}
    exec(code, ns)

    class Recorder:
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

    for fn, module in (("publish", "ci.publish"), ("index", "ci.index"), ("upload_index", "ci.publish")):
        rec = Recorder()
        ns[fn](rec)
        assert rec.installs == [("--require-hashes", "--only-binary", ":all:", "-r", "ci/requirements-publish.txt")], fn
        assert [r[:3] for r in rec.runs] == [("python", "-m", module)], fn


def test_the_lock_installs_alone_and_runs_publishing(tmp_path):
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--require-hashes", "--only-binary", ":all:", "-r", str(LOCK))
    installed = {canonicalize_name(k) for k in venv.installed()}
    assert installed == set(locked()), installed ^ set(locked())
    assert venv.pip("check").returncode == 0
    code = ("import ci.publish.github, ci.publish.pages, ci.publish.pypi, ci.index, ci.targets;"
            "ci.targets.Matrix.load(); print('ok')")
    p = subprocess.run([venv.python, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
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
