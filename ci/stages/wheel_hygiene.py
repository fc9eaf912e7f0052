"""Wheel hygiene: the one check every door of the publishing side runs on a wheel before it
reads, copies, indexes or uploads it (gather, ``publish github``, the index, ``publish pypi``;
all through ``ci.stages.record.check_wheel`` and ``ci.stages.record.load_records``).

What it refuses, naming the wheel and the member or the name:

1. A file name that is not the canonical form the factory writes:
   ``<project>-<version>-<python>-<abi>-<platform>.whl`` with the project name normalised as
   the wheel spec says (``sageattn3``, never ``SageAttn3`` or ``sage_attn3``), the version in
   PEP 440 normal form, and no build tag (the factory never writes one; pip prefers the wheel
   with the higher build tag, so a stray ``-1-`` wins over the real one).
2. A member whose path could land outside the install directory, or that installers read
   differently: absolute (``/x``), a drive letter (``C:x``), a backslash, a ``..`` or ``.``
   segment or an empty one (``a//b``), a control character; a name Windows reads as another
   (a ``:``, which names an alternate data stream; a segment ending in ``.`` or a space, which
   Windows drops; a reserved device name such as ``CON`` or ``NUL.txt``); and two members of the
   same name (also when they differ only in case: one file on Windows and macOS).
3. A member outside the project's own folders: its package (``sageattn3/``), the libraries
   auditwheel and delvewheel graft beside it (``sageattn3.libs/``) and its own
   ``<name>-<version>.dist-info/``. Nothing else: no ``.pth`` beside site-packages, no
   ``.data/scripts``.
4. Two wheels of one set whose (project, version) agree and that are for the same operating
   system and machine (``manylinux_2_28_x86_64`` and ``manylinux_2_17_x86_64``, or ``cp310-abi3``
   and ``cp311-abi3`` of one platform): the factory makes one wheel per target, and pip would
   take either where both install (:func:`check_distinct`).
"""

from __future__ import annotations

import re
import zipfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from ci.runtime.errors import InputError


class UnsafeWheel(InputError, ValueError):
    """A wheel that no door lets through; the message names the wheel and what to change."""


@dataclass(frozen=True)
class WheelName:
    file: str
    project: str  # the normalised distribution name, as in the file name
    version: Version
    tags: frozenset[Tag]

    @property
    def dist_info(self) -> str:
        return f"{self.project}-{self.version}.dist-info"


def wheel_project(project: str) -> str:
    """A project name as wheel file names and ``.dist-info`` folders spell it (the binary
    distribution format: runs of ``-_.`` become ``_``, lower case)."""
    return re.sub(r"[-_.]+", "_", project).lower()


def check_name(name: str, project: str) -> WheelName:
    """The file name in the canonical form the factory writes, or UnsafeWheel."""
    if not name.endswith(".whl"):
        raise UnsafeWheel(f"{name}: file name: not a wheel (*.whl)")
    parts = name[:-len(".whl")].split("-")
    want = wheel_project(project)
    if len(parts) == 6:
        raise UnsafeWheel(f"{name}: file name: build tag {parts[2]!r}; the factory never writes one (pip would "
                          f"prefer this wheel to the one without): rename it to "
                          f"{'-'.join(parts[:2] + parts[3:])}.whl or remove it")
    if len(parts) != 5:
        raise UnsafeWheel(f"{name}: file name: {len(parts)} dash-separated parts; a wheel of {want} has 5 "
                          f"({want}-VERSION-PYTHON-ABI-PLATFORM.whl)")
    try:
        dist, version, _build, tags = parse_wheel_filename(name)
    except (InvalidWheelFilename, InvalidVersion) as e:
        raise UnsafeWheel(f"{name}: file name: not a valid wheel file name ({e})") from None
    if parts[0] != want:
        raise UnsafeWheel(f"{name}: file name: project {parts[0]!r}, the factory writes {want!r} "
                          f"(the normalised name): this is not a wheel the factory made")
    if parts[1] != str(version):
        raise UnsafeWheel(f"{name}: file name: version {parts[1]!r} is not in normal form ({version})")
    return WheelName(name, want, version, frozenset(tags))


_DRIVE = re.compile(r"^[A-Za-z]:")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# names Windows opens as devices, whatever the extension (CON, con.txt, COM1.py)
_DEVICE = re.compile(r"^(con|prn|aux|nul|com[0-9¹²³]|lpt[0-9¹²³])(\..*)?$", re.IGNORECASE)


def member_problem(member: str, allowed_tops: tuple[str, ...]) -> str | None:
    """Why a member path is refused (None: it is fine)."""
    if _CONTROL.search(member):
        return "a control character in its path"
    if "\\" in member:
        return "a backslash in its path (a folder separator on Windows only)"
    if member.startswith("/"):
        return "an absolute path"
    if _DRIVE.match(member):
        return "a drive letter"
    segments = member[:-1].split("/") if member.endswith("/") else member.split("/")
    if ".." in segments:
        return "a '..' segment (it would be written outside the install directory)"
    if "." in segments or "" in segments:
        return "an empty or '.' segment (not a normalised path)"
    if ":" in member:
        return "a ':' in its path (on Windows an alternate data stream of another file)"
    if any(seg.endswith((".", " ")) for seg in segments):
        return "a path segment ending in '.' or a space (Windows drops it: the name of another file)"
    if any(_DEVICE.match(seg) for seg in segments):
        return "a reserved Windows device name (CON, PRN, AUX, NUL, COM1-9, LPT1-9) in its path"
    if segments[0] not in allowed_tops and segments[0].endswith(".dist-info"):
        return (f"a .dist-info folder other than the one its file name needs ({allowed_tops[-1]}/): "
                "another project's or version's metadata")
    if segments[0] not in allowed_tops:
        return (f"outside the project's own folders ({', '.join(t + '/' for t in allowed_tops)}): installers "
                "would write it into site-packages beside other projects")
    return None


def check_members(names: list[str], wheel: WheelName) -> None:
    """Every member of the archive inside the project's folders, safe to extract, named once."""
    tops = (wheel.project, f"{wheel.project}.libs", wheel.dist_info)
    for member in names:
        why = member_problem(member, tops)
        if why is not None:
            raise UnsafeWheel(f"{wheel.file}: member {member!r}: {why}; the wheel is refused: rebuild it "
                              "with the factory (nox -s build-wheels)")
    for member, n in Counter(names).items():
        if n > 1:
            raise UnsafeWheel(f"{wheel.file}: member {member!r}: {n} entries of the same name (installers keep "
                              "one of them, which one differs); rebuild the wheel")
    folded: dict[str, str] = {}
    for member in names:
        other = folded.setdefault(member.casefold(), member)
        if other != member:
            raise UnsafeWheel(f"{wheel.file}: member {member!r}: the same name as {other!r} but for case (one "
                              "file on Windows and macOS); rebuild the wheel")


def check_wheel_file(path: Path, project: str) -> WheelName:
    """The file name and every member of a wheel; UnsafeWheel for the first problem. A file
    that is not a readable zip archive is left to the caller's own check."""
    name = check_name(Path(path).name, project)
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return name
    check_members(names, name)
    return name


def platform_family(tag: Tag) -> str:
    """The operating system and machine a platform tag is for: ``linux_x86_64`` for every
    manylinux/musllinux/linux tag of x86_64, the tag itself elsewhere (``win_amd64``)."""
    m = re.match(r"^(?:many|musl)?linux(?:_\d+_\d+|1|2010|2014)?_(.+)$", tag.platform)
    return f"linux_{m.group(1)}" if m else tag.platform


def check_distinct(names: Iterable[str], where: str = "") -> None:
    """No two wheels of the same project and version for the same operating system and
    machine, whatever their Python, ABI or glibc tags (file names that are not wheels are
    skipped: :func:`check_name` refuses them where they matter)."""
    seen: dict[tuple[str, Version, str], str] = {}
    for n in sorted(set(names)):
        try:
            dist, version, _build, tags = parse_wheel_filename(n)
        except (InvalidWheelFilename, InvalidVersion):
            continue
        for family in sorted({platform_family(t) for t in tags}):
            other = seen.setdefault((str(dist), version, family), n)
            if other != n:
                raise UnsafeWheel(f"{n}: the same project and version ({version}) for the same platform ({family}) "
                                  f"as {other}{' ' + where if where else ''}: the factory makes one wheel per target, "
                                  "and pip would pick either where both install; keep the one its build made")
