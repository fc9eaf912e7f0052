"""The machines the factory cross-compiles for, as data (``ci.toolchain.cross`` does the work): each one's
GNU triple, cross g++ package, Debian architecture, emulator and wheel platform tags; and
whether a target is another machine's. Imports nothing of the factory, so the flag profile
(``ci.toolchain.flags``) can ask it without reaching the toolchain lookups."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from ci.runtime.errors import InputError


class CrossSpecError(InputError, ValueError):
    pass


@dataclass(frozen=True)
class CrossSpec:
    """What cross-building for one machine takes: its GNU triple, the Debian package of its
    cross g++, its Debian architecture, its qemu-user emulator and the pip platform tags of its
    wheels (newest first; pip matches each ``--platform`` exactly)."""

    machine: str
    triple: str
    compiler_package: str
    debian_arch: str
    emulator: str
    wheel_platforms: tuple[str, ...]

    @property
    def cxx_name(self) -> str:
        return f"{self.triple}-g++"


CROSS_SPECS = {
    "aarch64": CrossSpec("aarch64", "aarch64-linux-gnu", "g++-aarch64-linux-gnu", "arm64", "qemu-aarch64",
                         ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_17_aarch64",
                          "manylinux2014_aarch64")),
}


def host_machine() -> str:
    m = platform.machine().lower()
    return "aarch64" if m == "arm64" else m


def is_cross(target_os) -> bool:
    """Is ``target_os`` (a ``ci.toolchain.targets.OsSpec``) Linux on another machine than this Linux one?"""
    return (sys.platform.startswith("linux") and target_os.platform == "linux"
            and target_os.machine != host_machine())


def spec_for(machine: str) -> CrossSpec:
    try:
        return CROSS_SPECS[machine]
    except KeyError:
        raise CrossSpecError(f"no cross toolchain is known for {machine!r} (known: {', '.join(CROSS_SPECS)})") from None
