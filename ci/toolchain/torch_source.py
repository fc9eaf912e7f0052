"""Where a target's torch comes from: one rule, used by the build, verify and ABI-guard steps.

The torch a target compiles against (and is verified with) is ``torch==<build_torch>`` from the
target's own PyTorch index, ``<root>/<cu tag>`` (e.g. ``https://download.pytorch.org/whl/cu128``),
passed as ``--index-url`` on every OS: that index hosts the CUDA build of torch and its
dependencies, and nothing else can shadow it. ``==X`` matches the index's ``X+cu128`` (a
public version ignores local labels when matching).

The root is the ``pytorch_index`` argument, else ``$SAGEATTN3_PYTORCH_INDEX``, else PyTorch's
own. One exception, for machines that reach PyPI but not PyTorch's index (this factory's
development machines): when no root is configured and the target is Linux x86_64 with the CUDA
variant PyPI ships for that torch, PyPI's ``torch==X`` *is* that build, so PyPI is used.
Never on Windows or aarch64: PyPI's torch is a CPU build there (through at least 2.10).

The ABI guard's foreign torch is the cheapest torch the wheel must refuse: a CPU build
(PyTorch's ``<root>/cpu``, ~200 MB instead of a CUDA build's ~3 GB with its libraries) of a
torch line the wheel does not serve.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from ci.toolchain.targets import Matrix, Target
from ci.toolchain.variant import cuda_tag, torch_line
from ci.runtime.env import FactoryEnv

PYTORCH_INDEX = "https://download.pytorch.org/whl"
INDEX_ENV = FactoryEnv.variable("pytorch_index")
# The OS where PyPI's default torch is a CUDA build (elsewhere it is a CPU build).
PYPI_CUDA_OS = "linux-x86_64"


@dataclass(frozen=True)
class TorchSource:
    """A torch to install: the requirement, the index it must come from (None: pip's default
    index, PyPI) and the CUDA its ``torch.version.cuda`` must report (None: a CPU build)."""

    requirement: str  # "torch==2.8.0"
    index_url: str | None  # "https://download.pytorch.org/whl/cu128"; None = PyPI
    cuda: str | None  # "12.8"; None = CPU build
    why: str = ""

    @property
    def version(self) -> str:
        return self.requirement.split("==", 1)[1]

    def index_args(self) -> list[str]:
        """The pip options that choose where it comes from."""
        return ["--index-url", self.index_url] if self.index_url else []

    def pip_args(self) -> list[str]:
        """``pip install`` arguments: the requirement, then the index options."""
        return [self.requirement, *self.index_args()]

    def describe(self) -> str:
        build = f"CUDA {self.cuda}" if self.cuda else "CPU"
        where = self.index_url or "PyPI"
        return f"{self.requirement} ({build} build) from {where}" + (f": {self.why}" if self.why else "")

    def accepts(self, torch_version: str, torch_cuda: str | None) -> bool:
        """Is an installed torch (``torch.__version__``, ``torch.version.cuda``) this one?"""
        return Version(torch_version).public == Version(self.version).public and torch_cuda == self.cuda


def index_root(pytorch_index: str | None = None) -> tuple[str, bool]:
    """The PyTorch index root and whether it was configured (argument or environment)."""
    root = pytorch_index or FactoryEnv.from_environ().pytorch_index
    return (root or PYTORCH_INDEX).rstrip("/"), bool(root)


def pypi_serves(target: Target) -> bool:
    """Is PyPI's ``torch==<build_torch>`` for this target's OS the CUDA build it needs?"""
    return target.os.key == PYPI_CUDA_OS and target.cuda == target.build_torch_pypi_cuda


def torch_source(target: Target, pytorch_index: str | None = None) -> TorchSource:
    """The torch a target builds and verifies with (see the module docstring for the rule)."""
    root, configured = index_root(pytorch_index)
    requirement = f"torch=={target.build_torch}"
    if not configured and pypi_serves(target):
        return TorchSource(requirement, None, target.cuda,
                           why=f"PyPI's torch {target.build_torch} for {target.os.key} is the CUDA "
                               f"{target.cuda} build (no PyTorch index configured)")
    tag = cuda_tag(target.cuda)
    return TorchSource(requirement, f"{root}/{tag}", target.cuda,
                       why=f"the {tag} build for {target.os.key} from PyTorch's {tag} index")


def unreachable_reason(target: Target, pytorch_index: str | None = None) -> str | None:
    """Why this target's torch cannot be installed on a machine without PyTorch's index (None:
    it can: PyPI serves it, or an index is configured)."""
    _, configured = index_root(pytorch_index)
    src = torch_source(target, pytorch_index)
    if configured or src.index_url is None:
        return None
    if target.os.key != PYPI_CUDA_OS:
        pypi = "a CPU build"
    else:
        pypi = f"the CUDA {target.build_torch_pypi_cuda} build"
    return (f"torch {target.build_torch} for CUDA {target.cuda} on {target.os.key} comes only from "
            f"{src.index_url} (PyPI's is {pypi}); set {INDEX_ENV} where that index is reachable")


def foreign_line(target: Target, matrix: Matrix, python: str) -> str:
    """The torch line the ABI-guard check imports the wheel into: one the wheel does not serve
    and that has a release for ``python``, the nearest to the wheel's own lines (older first)."""
    lines = sorted(matrix.torch, key=lambda t: Version(t.line))
    served = {t.line for t in lines if target.variant.serves(t.build_version, target.cuda)}
    own = [i for i, t in enumerate(lines) if t.line in served]
    candidates = [(min(abs(i - j) for j in own), i, t) for i, t in enumerate(lines)
                  if t.line not in served and python in t.python and target.os.key in t.os]
    if not candidates:
        raise ValueError(f"{target.id}: no torch line outside {sorted(served)} supports Python {python}; "
                         f"the ABI guard cannot be checked (add one to ci/targets.toml)")
    return min(candidates, key=lambda c: (c[0], c[1]))[2].build_version


def foreign_torch_source(target: Target, matrix: Matrix, python: str, pytorch_index: str | None = None,
                         directory: str = "cpu") -> TorchSource:
    """The foreign torch for the ABI-guard check: a build from ``<root>/<directory>`` (default
    ``cpu``, the smallest) of :func:`foreign_line`'s release. A CPU build is never served by a
    CUDA wheel, and its line is outside the wheel's range too, so the guard must name both.
    ``directory`` may be a ``cuXYZ`` where an index has no CPU builds (the local rehearsal)."""
    root, _ = index_root(pytorch_index)
    version = foreign_line(target, matrix, python)
    cuda = None if directory == "cpu" else f"{int(directory[2:-1])}.{directory[-1]}"
    if cuda is not None and target.variant.serves(version, cuda):
        raise ValueError(f"{target.id}: torch {version} from {directory} is served by {target.variant.label}")
    return TorchSource(f"torch=={version}", f"{root}/{directory}", cuda,
                       why=f"torch {torch_line(version)} is outside {target.variant.label}'s range")


def torch_env_for(python: str, source: TorchSource, extra: tuple[str, ...] | None = None):
    """The cached environment holding ``source``'s torch for ``python`` (build and verify ask
    with the same arguments, so they share one environment), checked to be that build."""
    from ci.toolchain.tools import BUILD_ENV_PACKAGES, ToolchainError, torch_env

    env = torch_env(python, source.requirement, extra=BUILD_ENV_PACKAGES if extra is None else extra,
                    index_args=tuple(source.index_args()))
    if not source.accepts(env.torch_version, env.torch_cuda):
        raise ToolchainError(
            f"the environment for {source.describe()} holds torch {env.torch_version} "
            f"({'CUDA ' + env.torch_cuda if env.torch_cuda else 'CPU'} build): {env.root}. Remove it; "
            f"if it comes back, the index serves the wrong build"
        )
    return env
