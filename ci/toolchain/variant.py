"""A wheel variant: the CUDA major.minor and torch line(s) a wheel is built for.

The canonical string is the PEP 440 local label of the wheel's version, parsed and printed
only here:

- ``cu130.torch2.10.stable``  one LibTorch-stable-ABI wheel for every torch >= 2.10 built for
  a CUDA 13.x variant of torch (the wheel itself was compiled with CUDA 13.0).
- ``cu128.torch2.8``          a wheel for torch 2.8.x (CUDA 12.8) only.

The index directory for a variant is its CUDA part (``cu130``), with one sub-index per torch
line (``cu130/torch2.14``): see ``ci.index``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.version import Version

_LABEL = re.compile(r"^cu(?P<cuda>\d{3,4})\.torch(?P<torch>\d+\.\d+)(?P<stable>\.stable)?$")


def cuda_tag(cuda: str) -> str:
    """'13.0' -> 'cu130', '12.8' -> 'cu128'."""
    major, minor = cuda.split(".")
    return f"cu{int(major)}{int(minor)}"


def cuda_from_tag(tag: str) -> str:
    digits = tag.removeprefix("cu")
    return f"{int(digits[:-1])}.{int(digits[-1])}"


def torch_line(version: str) -> str:
    """'2.14.1+cu130' -> '2.14'."""
    v = Version(version)
    return f"{v.major}.{v.minor}"


@dataclass(frozen=True, order=True)
class Variant:
    cuda: str  # "13.0"
    torch: str  # torch line: the exact line, or the floor when stable
    stable: bool = False

    @property
    def label(self) -> str:
        return f"{cuda_tag(self.cuda)}.torch{self.torch}" + (".stable" if self.stable else "")

    @property
    def cuda_tag(self) -> str:
        return cuda_tag(self.cuda)

    @property
    def cuda_major(self) -> int:
        return int(self.cuda.split(".")[0])

    @property
    def requires_torch(self) -> str:
        """The torch requirement written into the wheel's metadata."""
        major, minor = (int(x) for x in self.torch.split("."))
        if self.stable:
            return f"torch>={major}.{minor}"
        return f"torch>={major}.{minor},<{major}.{minor + 1}"

    def serves(self, torch_version: str, torch_cuda: str | None) -> bool:
        """Would this variant's wheel load into that torch (version and CUDA of the build)?"""
        if torch_cuda is None or int(torch_cuda.split(".")[0]) != self.cuda_major:
            return False
        line = Version(torch_line(torch_version))
        floor = Version(self.torch)
        return line >= floor if self.stable else line == floor

    @classmethod
    def parse(cls, label: str) -> "Variant":
        m = _LABEL.match(label)
        if not m:
            raise ValueError(
                f"not a sageattn3 variant label: {label!r} "
                "(expected e.g. 'cu130.torch2.10.stable' or 'cu128.torch2.8')"
            )
        return cls(cuda_from_tag("cu" + m["cuda"]), m["torch"], bool(m["stable"]))

    @classmethod
    def of_version(cls, version: str) -> "Variant":
        local = Version(version).local
        if local is None:
            raise ValueError(f"version {version!r} has no variant label")
        return cls.parse(local)

    def __str__(self) -> str:
        return self.label
