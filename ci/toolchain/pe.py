"""Reading Windows PE files (a ``.pyd`` or a DLL) on any machine: the machine they are for, the
DLLs and names they import, the names they export, their sections. Standard library only; the
format is Microsoft's "PE Format" specification (PE32+ for x64).

Used to inspect a Windows wheel built here (``ci.stages.windows_build.inspect_module``) and to find
the build paths or cubins it carries.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from ci.runtime.errors import FactoryError

MACHINES = {0x8664: "x64", 0x14C: "x86", 0xAA64: "arm64"}
PE32_PLUS = 0x20B


class PeError(FactoryError, ValueError):
    pass


@dataclass(frozen=True)
class Section:
    name: str
    virtual_address: int
    virtual_size: int
    raw_offset: int
    raw_size: int


@dataclass
class PeFile:
    path: Path
    machine: str
    is_dll: bool
    sections: list[Section]
    imports: dict[str, list[str]] = field(default_factory=dict)  # DLL name (as written) -> names/ordinals
    exports: list[str] = field(default_factory=list)

    def section_bytes(self, name: str) -> bytes:
        s = next((s for s in self.sections if s.name == name), None)
        if s is None:
            raise PeError(f"{self.path.name} has no {name} section (it has {[x.name for x in self.sections]})")
        with open(self.path, "rb") as f:
            f.seek(s.raw_offset)
            return f.read(min(s.raw_size, s.virtual_size or s.raw_size))

    @property
    def imported_dlls(self) -> list[str]:
        return sorted(self.imports, key=str.lower)


def _cstr(data: bytes, off: int) -> str:
    end = data.index(b"\0", off)
    return data[off:end].decode("ascii", "replace")


def read_pe(path: str | Path) -> PeFile:
    """Parse ``path``'s headers, import and export tables. Raises PeError on anything that is
    not a PE32+ image."""
    path = Path(path)
    data = path.read_bytes()
    if data[:2] != b"MZ" or len(data) < 0x40:
        raise PeError(f"{path.name} is not a PE file (no MZ header)")
    pe = struct.unpack_from("<I", data, 0x3C)[0]
    if data[pe:pe + 4] != b"PE\0\0":
        raise PeError(f"{path.name} is not a PE file (no PE signature)")
    machine, nsec, _, _, _, opt_size, characteristics = struct.unpack_from("<HHIIIHH", data, pe + 4)
    opt = pe + 24
    magic = struct.unpack_from("<H", data, opt)[0]
    if magic != PE32_PLUS:
        raise PeError(f"{path.name}: optional header magic {magic:#x}, not PE32+ (a 64-bit image)")
    ndirs = struct.unpack_from("<I", data, opt + 108)[0]
    dirs = [struct.unpack_from("<II", data, opt + 112 + 8 * i) for i in range(min(ndirs, 16))]
    sections = []
    for i in range(nsec):
        off = opt + opt_size + 40 * i
        raw_name, vsize, va, rsize, roff = struct.unpack_from("<8sIIII", data, off)
        sections.append(Section(raw_name.rstrip(b"\0").decode("ascii", "replace"), va, vsize, roff, rsize))

    def at(rva: int) -> int:
        for s in sections:
            if s.virtual_address <= rva < s.virtual_address + max(s.virtual_size, s.raw_size):
                return rva - s.virtual_address + s.raw_offset
        raise PeError(f"{path.name}: address {rva:#x} lies in no section")

    pe_file = PeFile(path, MACHINES.get(machine, f"{machine:#x}"), bool(characteristics & 0x2000), sections)
    if len(dirs) > 1 and dirs[1][0]:
        off = at(dirs[1][0])
        while True:
            lookup, _, _, name_rva, first = struct.unpack_from("<IIIII", data, off)
            if not name_rva:
                break
            names = []
            t = at(lookup or first)
            while True:
                (entry,) = struct.unpack_from("<Q", data, t)
                if not entry:
                    break
                names.append(f"#{entry & 0xFFFF}" if entry >> 63 else _cstr(data, at(entry & 0x7FFFFFFF) + 2))
                t += 8
            pe_file.imports[_cstr(data, at(name_rva))] = names
            off += 20
    if dirs and dirs[0][0]:
        off = at(dirs[0][0])
        nnames, _, names_rva = struct.unpack_from("<III", data, off + 24)[0], None, struct.unpack_from("<I", data, off + 32)[0]
        for i in range(nnames):
            (rva,) = struct.unpack_from("<I", data, at(names_rva) + 4 * i)
            pe_file.exports.append(_cstr(data, at(rva)))
    return pe_file


def strings(data: bytes, min_len: int = 6) -> list[str]:
    """The printable ASCII and UTF-16LE runs of ``data`` (what ``strings`` shows)."""
    import re

    ascii_runs = re.findall(rb"[\x20-\x7e]{%d,}" % min_len, data)
    wide = re.findall(rb"(?:[\x20-\x7e]\x00){%d,}" % min_len, data)
    return [r.decode("ascii") for r in ascii_runs] + [w.decode("utf-16le") for w in wide]
