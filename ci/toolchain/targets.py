"""The build matrix, read from ``ci/targets.toml`` and checked once into frozen values.

Everything else (nox parametrisation, the GitHub Actions matrix, the index layout, the docs
table) is derived from :class:`Matrix`. A bad entry raises :class:`MatrixError` naming the
entry and saying what to change.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ci.toolchain.variant import Variant, cuda_tag
from ci.runtime.errors import InputError
from ci.runtime.env import FactoryEnv

TARGETS_FILE = Path(__file__).resolve().parents[1] / "targets.toml"

# The first CUDA release that can compile each arch (FACTS: 12.8 adds sm_120, 12.9 adds
# sm_121 and the family targets, 13.0 adds sm_110).
ARCH_MIN_CUDA = {
    "sm_120a": "12.8",
    "sm_121a": "12.9",
    "sm_120f": "12.9",
    "sm_100a": "12.8",
    "sm_103a": "12.9",
    "sm_110a": "13.0",
    "sm_90a": "12.0",
}
MIN_BUILD_CUDA = "12.8"  # below this nothing of the sm_120 family compiles

GHA_RUNNERS = {
    "linux-x86_64": "ubuntu-24.04",
    "linux-aarch64": "ubuntu-24.04-arm",
    "windows-amd64": "windows-2022",
}


class MatrixError(InputError, ValueError):
    """A targets-file entry that cannot be right; the message names it."""


def _v(s: str) -> Version:
    return Version(s)


@dataclass(frozen=True)
class OsSpec:
    key: str  # "linux-x86_64"
    platform: str  # "linux" | "windows"
    machine: str  # "x86_64" | "aarch64" | "amd64"


@dataclass(frozen=True)
class TorchLine:
    line: str
    build_version: str
    pypi_default: str
    published: tuple[str, ...]
    cuda: tuple[str, ...]
    python: tuple[str, ...]
    os: tuple[str, ...]
    # Per-OS exceptions to ``published``: (os key, the CUDA variants PyTorch published there).
    published_by_os: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def published_on(self, os_key: str) -> tuple[str, ...]:
        """The CUDA variants PyTorch published for this line on one OS."""
        return dict(self.published_by_os).get(os_key, self.published)

    def builds(self, cuda: str, os_key: str) -> bool:
        """Is (this line, ``cuda``, ``os_key``) a combination we build (listed, and published there)?"""
        return cuda in self.cuda and os_key in self.os and cuda in self.published_on(os_key)


@dataclass(frozen=True)
class Target:
    """One build unit: one wheel."""

    os: OsSpec
    cuda: str
    archs: tuple[str, ...]
    variant: Variant
    torch_lines: tuple[str, ...]  # every torch line this wheel serves
    build_torch: str  # exact torch release compiled against
    build_torch_pypi_cuda: str  # CUDA of the wheel PyPI serves for build_torch
    python: str  # the interpreter that builds and verifies it (one its build torch exists for)
    abi3: bool
    # The wheel's limited-API floor: its tag (cp310-abi3) and Requires-Python. The build Python
    # unless the build torch dropped that Python (torch 2.15 has no 3.10; the stable-ABI wheel
    # built with it still serves 3.10 with torch 2.10-2.14).
    floor_python: str

    @property
    def id(self) -> str:
        tail = "-stable" if self.variant.stable else ""
        return f"{self.os.key}-{cuda_tag(self.cuda)}-torch{self.variant.torch}{tail}"

    @property
    def python_tag(self) -> str:
        """The wheel's interpreter tag (``cp310`` of ``cp310-abi3``)."""
        return f"cp{self.floor_python.replace('.', '')}"

    @property
    def build_python_tag(self) -> str:
        """The build interpreter's tag (cibuildwheel's identifier)."""
        return f"cp{self.python.replace('.', '')}"

    @property
    def requires_torch(self) -> str:
        return self.variant.requires_torch

    @property
    def torch_major_minor(self) -> tuple[int, int]:
        v = _v(self.build_torch)
        return v.major, v.minor

    def describe(self) -> str:
        lines = ", ".join(self.torch_lines)
        kind = ("stable ABI" if self.variant.stable else "per-torch") + f", {self.python_tag}-abi3"
        return (
            f"{self.id}: CUDA {self.cuda}, archs {' '.join(self.archs)}, torch {lines} "
            f"({kind}; built against torch {self.build_torch}"
            + (f" with Python {self.python})" if self.python != self.floor_python else ")")
        )


@dataclass(frozen=True)
class Matrix:
    name: str
    stable_abi_floor: str
    limited_api_python: str
    index_url: str
    oses: dict[str, OsSpec]
    cuda_archs: dict[str, tuple[str, ...]]
    torch: tuple[TorchLine, ...]

    @classmethod
    def load(cls, path: Path | None = None) -> "Matrix":
        path = Path(path or FactoryEnv.from_environ().targets_file or TARGETS_FILE)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise MatrixError(f"{path}: not valid TOML: {e}") from e
        return cls.from_data(data, source=str(path.name))

    @classmethod
    def from_data(cls, data: dict, source: str = "targets") -> "Matrix":
        pkg = data.get("package", {})
        oses = {
            key: OsSpec(key, spec["platform"], spec["machine"])
            for key, spec in data.get("os", {}).items()
        }
        cuda_archs = {ver: tuple(spec["archs"]) for ver, spec in data.get("cuda", {}).items()}
        lines = []
        for i, t in enumerate(data.get("torch", [])):
            where = f"{source}: [[torch]] #{i + 1} (line {t.get('line', '?')!r})"
            missing = {"line", "build_version", "pypi_default", "published", "cuda", "python", "os"} - t.keys()
            if missing:
                raise MatrixError(f"{where}: missing keys {sorted(missing)}")
            unknown = t.keys() - {"line", "build_version", "pypi_default", "published", "cuda", "python", "os",
                                  "published_by_os"}
            if unknown:
                raise MatrixError(f"{where}: unknown keys {sorted(unknown)}")
            by_os = t.get("published_by_os", {})
            if not isinstance(by_os, dict) or not all(isinstance(v, list) for v in by_os.values()):
                raise MatrixError(f'{where}: published_by_os must be a table like {{ "linux-aarch64" = ["12.9"] }}')
            lines.append(
                TorchLine(
                    t["line"], t["build_version"], t["pypi_default"], tuple(t["published"]),
                    tuple(t["cuda"]), tuple(t["python"]), tuple(t["os"]),
                    tuple((k, tuple(v)) for k, v in sorted(by_os.items())),
                )
            )
        m = cls(
            name=pkg.get("name", "sageattn3"),
            stable_abi_floor=pkg.get("stable_abi_floor", "2.10"),
            limited_api_python=pkg.get("limited_api_python", "3.10"),
            index_url=pkg.get("index_url", ""),
            oses=oses,
            cuda_archs=cuda_archs,
            torch=tuple(lines),
        )
        m._validate(source)
        return m

    # -- validity rules ---------------------------------------------------------------
    def _validate(self, source: str) -> None:
        for ver, archs in self.cuda_archs.items():
            where = f'{source}: [cuda."{ver}"]'
            try:
                cv = _v(ver)
            except InvalidVersion:
                raise MatrixError(f"{where}: {ver!r} is not a CUDA version like '13.0'") from None
            if cv < _v(MIN_BUILD_CUDA):
                raise MatrixError(
                    f"{where}: CUDA {ver} cannot compile the sm_120 family; the first that can is "
                    f"{MIN_BUILD_CUDA}. Remove the entry."
                )
            if not archs:
                raise MatrixError(f"{where}: empty arch list")
            for arch in archs:
                if arch not in ARCH_MIN_CUDA:
                    raise MatrixError(
                        f"{where}: unknown arch {arch!r}; known: {', '.join(sorted(ARCH_MIN_CUDA))}"
                    )
                if cv < _v(ARCH_MIN_CUDA[arch]):
                    raise MatrixError(
                        f"{where}: {arch} needs CUDA >= {ARCH_MIN_CUDA[arch]}; "
                        f"drop it from CUDA {ver}'s archs"
                    )
        seen = set()
        for t in self.torch:
            where = f"{source}: torch {t.line}"
            if t.line in seen:
                raise MatrixError(f"{where}: declared twice")
            seen.add(t.line)
            try:
                bv = _v(t.build_version)
            except InvalidVersion:
                raise MatrixError(f"{where}: build_version {t.build_version!r} is not a version") from None
            if f"{bv.major}.{bv.minor}" != t.line:
                raise MatrixError(f"{where}: build_version {t.build_version} is not a {t.line}.x release")
            if t.pypi_default not in t.published:
                raise MatrixError(
                    f"{where}: pypi_default {t.pypi_default} is not among the published CUDA "
                    f"variants {list(t.published)}"
                )
            for c in t.cuda:
                if c not in t.published:
                    raise MatrixError(
                        f"{where} + CUDA {c}: PyTorch never published this combination "
                        f"(published for {t.line}: {', '.join(t.published)}). "
                        f"Remove {c!r} from its cuda list."
                    )
                if c not in self.cuda_archs:
                    raise MatrixError(
                        f"{where} + CUDA {c}: unknown CUDA toolkit; add a [cuda.\"{c}\"] entry "
                        f"with its archs, or remove {c!r}"
                        + (f" (CUDA {c} cannot compile sm_120)" if _v(c) < _v(MIN_BUILD_CUDA) else "")
                    )
            for o in t.os:
                if o not in self.oses:
                    raise MatrixError(f"{where}: unknown os {o!r}; known: {', '.join(self.oses)}")
            for o, variants in t.published_by_os:
                if o not in t.os:
                    raise MatrixError(f"{where}: published_by_os names {o!r}, which is not among the line's os "
                                      f"{list(t.os)}")
                for c in variants:
                    if c not in t.published:
                        raise MatrixError(f"{where} on {o}: CUDA {c} is not among the line's published variants "
                                          f"{list(t.published)}; add it there too")
            for py in t.python:
                parts = py.split(".")
                if len(parts) != 2 or parts[0] != "3" or not parts[1].isdigit():
                    raise MatrixError(f"{where}: python {py!r} is not like '3.12'")

    # -- derived ----------------------------------------------------------------------
    @cached_property
    def targets(self) -> tuple[Target, ...]:
        floor = _v(self.stable_abi_floor)
        out: list[Target] = []
        for os_key, os_spec in self.oses.items():
            for cuda in self.cuda_archs:
                lines = [t for t in self.torch if t.builds(cuda, os_key) and _v(t.line) >= floor]
                if lines:
                    newest = max(lines, key=lambda t: _v(t.line))
                    # Built (and verified) by the oldest Python the build torch has from the
                    # limited-API floor on; tagged with the floor either way.
                    floor_py = self.limited_api_python
                    newer = [p for p in newest.python if _v(p) >= _v(floor_py)]
                    py = floor_py if floor_py in newest.python else (newer[0] if newer else newest.python[0])
                    out.append(Target(
                        os=os_spec, cuda=cuda, archs=self.cuda_archs[cuda],
                        variant=Variant(cuda, self.stable_abi_floor, stable=True),
                        torch_lines=tuple(t.line for t in sorted(lines, key=lambda t: _v(t.line))),
                        build_torch=newest.build_version,
                        build_torch_pypi_cuda=newest.pypi_default,
                        python=py, abi3=True, floor_python=floor_py if newer else py,
                    ))
                for t in self.torch:
                    if not t.builds(cuda, os_key) or _v(t.line) >= floor:
                        continue
                    # Below the stable-ABI floor: one wheel per torch line, still one binary
                    # for every Python of the line (limited API of its oldest Python).
                    out.append(Target(
                        os=os_spec, cuda=cuda, archs=self.cuda_archs[cuda],
                        variant=Variant(cuda, t.line, stable=False),
                        torch_lines=(t.line,), build_torch=t.build_version,
                        build_torch_pypi_cuda=t.pypi_default,
                        python=t.python[0], abi3=True, floor_python=t.python[0],
                    ))
        ids = [t.id for t in out]
        dupes = {i for i in ids if ids.count(i) > 1}
        if dupes:
            raise MatrixError(f"targets: duplicate target ids {sorted(dupes)}")
        return tuple(sorted(out, key=lambda t: t.id))

    def target(self, target_id: str) -> Target:
        for t in self.targets:
            if t.id == target_id:
                return t
        close = [t.id for t in self.targets if target_id.split("-")[0] in t.id][:5]
        raise MatrixError(
            f"unknown target {target_id!r}. List them with `nox -s build-wheels -- --list-targets`"
            + (f"; e.g. {', '.join(close)}" if close else "")
        )

    def line(self, line: str) -> TorchLine:
        for t in self.torch:
            if t.line == line:
                return t
        raise MatrixError(f"torch {line} is not in the matrix (lines: {', '.join(t.line for t in self.torch)})")

    def target_for_torch(self, os_key: str, python: str, torch_version: str, torch_cuda: str) -> Target:
        """The target whose wheel serves this (os, python, torch, CUDA) combination."""
        reasons = []
        for t in self.targets:
            if t.os.key != os_key:
                continue
            if not t.variant.serves(torch_version, torch_cuda) or t.cuda != torch_cuda:
                continue
            if Version(python) < Version(t.floor_python):
                reasons.append(f"{t.id}: needs Python >= {t.floor_python}")
                continue
            return t
        raise MatrixError(
            f"no target serves torch {torch_version} (CUDA {torch_cuda}) on {os_key} with Python "
            f"{python}" + (f": {'; '.join(reasons)}" if reasons else "")
            + ". Add the CUDA variant to that torch line in ci/targets.toml."
        )

    def gha_matrix(self) -> dict:
        """The GitHub Actions matrix: one job per build unit."""
        return {
            "include": [
                {
                    "id": t.id,
                    "runner": GHA_RUNNERS[t.os.key],
                    "os": t.os.key,
                    "python": t.python,
                    "cuda": t.cuda,
                    "torch": t.build_torch,
                    "archs": " ".join(t.archs),
                    "variant": t.variant.label,
                }
                for t in self.targets
            ]
        }
