"""Patches applied to a build's staging copy before compiling.

``patches/manifest.toml`` declares each patch: its file, the files it touches with the
sha256 of each pristine file (the pin), the predicate saying which targets get it, and why.
Files are named by root: ``src:`` (the staged sageattn3 tree), ``torch:`` (the build torch's
``include/``), ``cutlass:`` (the pinned CUTLASS ``include/``). Torch and CUTLASS files are
never patched where they are installed: they are copied into the build's include overlay,
which comes first on the include path.

Patches apply with ``git apply`` (no fuzz, no offsets), are detected as already applied by a
clean reverse check, and a pin that does not match stops the build before anything compiles.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ci.runtime.files import sha256_of
from ci.runtime.errors import InputError
from ci.runtime.env import FactoryEnv, child_environ

PATCHES_DIR = Path(__file__).resolve().parents[3] / "patches"
MANIFEST = PATCHES_DIR / "manifest.toml"
ROOTS = ("src", "torch", "cutlass")


class PatchError(InputError, RuntimeError):
    pass


class PatchDrift(PatchError):
    """A pinned file's hash differs from the pin: the patch may no longer be right."""


@dataclass(frozen=True)
class PinnedFile:
    root: str  # src | torch | cutlass
    path: str  # relative to the root
    sha256: str

    @property
    def ref(self) -> str:
        return f"{self.root}:{self.path}"


@dataclass(frozen=True)
class Predicate:
    os: tuple[str, ...] = ()
    compiler: tuple[str, ...] = ()
    cuda: str = ""  # specifier, e.g. ">=12.8"
    torch: str = ""  # specifier on the build torch's version

    def matches(self, *, os_key: str, compiler: str, cuda: str, torch_version: str) -> bool:
        if self.os and os_key not in self.os:
            return False
        if self.compiler and compiler not in self.compiler:
            return False
        if self.cuda and Version(cuda) not in SpecifierSet(self.cuda):
            return False
        tv = Version(Version(torch_version).base_version)
        if self.torch and tv not in SpecifierSet(self.torch):
            return False
        return True


@dataclass(frozen=True)
class Patch:
    name: str
    file: Path
    files: tuple[PinnedFile, ...]
    when: Predicate
    reason: str
    root: str = field(default="src")

    def describe(self) -> str:
        return f"{self.name}: {self.reason} (touches {', '.join(f.ref for f in self.files)})"


def load_manifest(path: Path | None = None) -> list[Patch]:
    path = Path(path or FactoryEnv.from_environ().patch_manifest or MANIFEST)
    if not path.exists():
        return []
    data = tomllib.loads(path.read_text())
    out = []
    for i, p in enumerate(data.get("patch", [])):
        where = f"{path.name}: [[patch]] #{i + 1} ({p.get('name', '?')})"
        for key in ("name", "file", "files", "reason"):
            if key not in p:
                raise PatchError(f"{where}: missing {key!r}")
        files = []
        for f in p["files"]:
            root, _, rel = f["path"].partition(":")
            if root not in ROOTS or not rel:
                raise PatchError(f"{where}: file {f['path']!r} must be '<root>:<path>' with root in {ROOTS}")
            files.append(PinnedFile(root, rel, f["sha256"]))
        roots = {f.root for f in files}
        if len(roots) != 1:
            raise PatchError(f"{where}: a patch touches one root; split it")
        w = p.get("when", {})
        pred = Predicate(tuple(w.get("os", ())), tuple(w.get("compiler", ())), w.get("cuda", ""), w.get("torch", ""))
        pfile = (path.parent / p["file"]).resolve()
        if not pfile.exists():
            raise PatchError(f"{where}: patch file {p['file']} not found")
        out.append(Patch(p["name"], pfile, tuple(files), pred, p["reason"], roots.pop()))
    return out


def select(patches: list[Patch], *, os_key: str, compiler: str, cuda: str, torch_version: str,
           force: tuple[str, ...] = ()) -> list[Patch]:
    names = {p.name for p in patches}
    unknown = [f for f in force if f not in names]
    if unknown:
        raise PatchError(f"--force-patch {', '.join(unknown)}: no such patch (known: {', '.join(sorted(names)) or 'none'})")
    return [
        p for p in patches
        if p.name in force or p.when.matches(os_key=os_key, compiler=compiler, cuda=cuda, torch_version=torch_version)
    ]


def _git_apply(patch: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "apply", "--unsafe-paths", "-p1", *extra, str(patch)],
        cwd=cwd, capture_output=True, text=True,
        env=child_environ(GIT_DIR=os.devnull),
    )


def state(patch: Path, cwd: Path) -> str:
    """'applies', 'applied' (reverses cleanly) or 'conflict'."""
    if _git_apply(patch, cwd, "--check").returncode == 0:
        return "applies"
    if _git_apply(patch, cwd, "--check", "--reverse").returncode == 0:
        return "applied"
    return "conflict"


def crlf_hint(path: Path, pin: str) -> str | None:
    """Why a pinned file differs when only its line endings do: the pins are sha256 sums of
    LF files, and a Windows checkout with ``core.autocrlf`` writes CRLF. None otherwise."""
    data = path.read_bytes()
    if b"\r\n" not in data or hashlib.sha256(data.replace(b"\r\n", b"\n")).hexdigest() != pin:
        return None
    return ("Nothing was built. The file is the pinned one with CRLF line endings: the checkout converted "
            "LF to CRLF (git's core.autocrlf, the default on Windows). Check out with LF endings: the "
            "repository's .gitattributes says `* text=auto eol=lf` (re-clone, or `git add --renormalize .`), "
            "and `git config --global core.autocrlf false` before cloning.")


def apply(patch: Patch, roots: dict[str, Path], overlay: Path) -> None:
    """Apply one patch: check every pin, copy non-src files into the overlay, then apply.

    roots: "src" -> staging dir; "torch"/"cutlass" -> their include dirs (read-only)."""
    base = roots[patch.root]
    for f in patch.files:
        src = base / f.path
        if not src.exists():
            raise PatchDrift(
                f"patch {patch.name}: {f.ref} does not exist in this build ({src}). The file moved or "
                f"the pinned package changed: refresh the patch in patches/, or narrow its 'when'."
            )
        found = sha256_of(src)
        if found != f.sha256:
            crlf = crlf_hint(src, f.sha256)
            raise PatchDrift(
                f"patch {patch.name}: {f.ref} has changed.\n  expected sha256 {f.sha256}\n  found    sha256 {found}\n"
                + (crlf or f"Nothing was built. Refresh the patch against the new file (and its pin in "
                           f"patches/manifest.toml), or, after checking it still applies as intended, widen the pin.")
            )
    work = base
    if patch.root != "src":
        work = overlay
        for f in patch.files:
            dst = overlay / f.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                shutil.copy2(base / f.path, dst)
    st = state(patch.file, work)
    if st == "applied":
        return
    if st == "conflict":
        raise PatchDrift(f"patch {patch.name} does not apply cleanly to {', '.join(f.ref for f in patch.files)}: refresh it")
    res = _git_apply(patch.file, work)
    if res.returncode != 0:
        raise PatchError(f"patch {patch.name} failed to apply: {res.stderr.strip()}")


# -- checks and listing (nox -s patches -- check | list --target ID) --------------------

def pristine_roots(torch_include: Path | None = None, cutlass_include: Path | None = None) -> dict[str, Path]:
    from ci.payload.interface import PAYLOAD

    roots = {"src": PAYLOAD}
    if torch_include:
        roots["torch"] = torch_include
    if cutlass_include:
        roots["cutlass"] = cutlass_include
    return roots


def check_patch(patch: Patch, roots: dict[str, Path], work: Path) -> list[str]:
    """Apply to a copy of the pinned files: pins match, applies with no fuzz, is detected as
    applied afterwards (idempotent), and reverses to the pristine bytes. Returns problems."""
    if patch.root not in roots:
        return [f"{patch.name}: no {patch.root!r} tree to check against here"]
    base = roots[patch.root]
    problems = []
    for f in patch.files:
        src = base / f.path
        if not src.exists():
            problems.append(f"{patch.name}: {f.ref} missing")
            continue
        if sha256_of(src) != f.sha256:
            crlf = crlf_hint(src, f.sha256)
            problems.append(f"{patch.name}: {f.ref} drifted (pin {f.sha256[:12]}…, found {sha256_of(src)[:12]}…)"
                            + (f": {crlf}" if crlf else ""))
        dst = work / f.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    if problems:
        return problems
    if state(patch.file, work) != "applies":
        return [f"{patch.name}: does not apply cleanly"]
    if _git_apply(patch.file, work).returncode != 0:
        return [f"{patch.name}: git apply failed"]
    if state(patch.file, work) != "applied":
        problems.append(f"{patch.name}: not detected as applied after applying")
    if _git_apply(patch.file, work, "--reverse").returncode != 0:
        problems.append(f"{patch.name}: does not reverse cleanly")
    for f in patch.files:
        if sha256_of(work / f.path) != f.sha256:
            problems.append(f"{patch.name}: reversing does not restore {f.ref}")
    return problems
