"""The build record: what a wheel was built for and with. One JSON document travels inside
the wheel (``sageattn3/_build_record.json``, read by ``sageattn3.build_info()``) and a copy
with the wheel's final name and sha256 lies beside it (``<wheel>.json``). Index and
publishing read these records; they never re-derive facts from file names by hand."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import zipfile
import zlib
from dataclasses import MISSING, asdict, dataclass, field
from email.parser import BytesHeaderParser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from ci.runtime.files import sha256_of
from ci.toolchain.variant import Variant
from ci.stages.wheel_hygiene import UnsafeWheel, check_distinct, check_wheel_file
from ci.runtime.errors import InputError

RECORD_IN_WHEEL = "sageattn3/_build_record.json"


@dataclass(frozen=True)
class BuildRecord:
    target: str
    variant: str
    version: str
    requires_torch: str
    requires_python: str
    torch_build: str
    cuda: str
    archs: tuple[str, ...]
    os: str
    toolchain: dict
    flags: dict
    patches: tuple[str, ...]
    source_commit: str
    index_url: str = ""
    wheel: str = ""
    sha256: str = ""
    size: int = 0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        d["archs"] = list(self.archs)
        d["patches"] = list(self.patches)
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "BuildRecord":
        known = {f for f in cls.__dataclass_fields__}
        d = {k: v for k, v in d.items() if k in known}
        d["archs"] = tuple(d.get("archs", ()))
        d["patches"] = tuple(d.get("patches", ()))
        return cls(**d)

    @classmethod
    def load(cls, path: Path) -> "BuildRecord":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def variant_value(self) -> Variant:
        return Variant.parse(self.variant)

    def with_wheel(self, wheel: Path) -> "BuildRecord":
        d = asdict(self)
        d.update(wheel=wheel.name, sha256=sha256_of(wheel), size=wheel.stat().st_size)
        return BuildRecord.from_dict(d)


def record_path(wheel: Path) -> Path:
    return wheel.with_name(wheel.name + ".json")


class RecordError(InputError, ValueError):
    """A wheel and what is said about it disagree, or a record cannot be read. The message is
    one line naming the file and the field."""


def read_record_in_wheel(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        return json.loads(z.read(RECORD_IN_WHEEL))


def wheel_metadata(wheel: Path) -> bytes:
    """The METADATA file of a wheel (served as the PEP 658 .metadata file)."""
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            if n.endswith(".dist-info/METADATA") and n.count("/") == 1:
                return z.read(n)
    raise RecordError(f"{wheel.name}: METADATA: the wheel has no .dist-info/METADATA")


def load_record_beside(wheel: Path) -> BuildRecord:
    """The beside-record of a wheel, or a RecordError saying what is wrong with it."""
    rp = record_path(wheel)
    if not rp.exists():
        raise RecordError(f"{wheel.name}: no build record beside it ({rp.name}); rebuild it with nox -s build-wheels")
    try:
        d = json.loads(rp.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{rp.name}: not a readable JSON build record ({e})") from None
    return record_from_dict(d, rp.name)


def record_from_dict(d: object, what: str) -> BuildRecord:
    """A build record from parsed JSON, every field checked: RecordError naming ``what`` and
    the first field that is missing or of the wrong type."""
    if not isinstance(d, dict):
        raise RecordError(f"{what}: a build record is a JSON object, this is {type(d).__name__}")
    missing = [f for f, spec in BuildRecord.__dataclass_fields__.items()
               if f not in d and spec.default is MISSING and spec.default_factory is MISSING]
    if missing:
        raise RecordError(f"{what}: field {missing[0]}: missing from the build record")
    types = {"archs": list, "patches": list, "toolchain": dict, "flags": dict, "extra": dict, "size": int}
    for f in BuildRecord.__dataclass_fields__:
        if f in d and not isinstance(d[f], types.get(f, str)):
            raise RecordError(f"{what}: field {f}: {type(d[f]).__name__}, expected {types.get(f, str).__name__}")
    return BuildRecord.from_dict(d)


# Record os key -> what the wheel's platform tags must look like.
_OS_PLATFORM = {
    "linux-x86_64": re.compile(r"^(linux|manylinux\d*(_\d+_\d+)?|musllinux_\d+_\d+)_x86_64$"),
    "linux-aarch64": re.compile(r"^(linux|manylinux\d*(_\d+_\d+)?|musllinux_\d+_\d+)_aarch64$"),
    "windows-amd64": re.compile(r"^win_amd64$"),
}
_WHEEL_FIELDS = ("wheel", "sha256", "size")  # only the beside-record has these


def _short(v: object) -> str:
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _differ(wheel: str, field: str, said: object, found: object, where: str) -> RecordError:
    return RecordError(f"{wheel}: {field}: the beside-record says {_short(said)}, {where} says {_short(found)}")


def check_wheel(wheel: Path, rec: BuildRecord, project: str = "sageattn3", sha256: str | None = None) -> None:
    """Do the wheel's file name, its METADATA, its WHEEL tags and the build record inside it
    all agree with ``rec`` (its beside-record)? Raises RecordError naming the file and the
    first field that differs. The one consistency check publishing and the index share; it also
    refuses the test and proof flavours, which are never indexed or published, and, first,
    anything ``ci.stages.wheel_hygiene`` refuses (a file name the factory does not write, a member
    that is unsafe or outside the project's folders)."""
    name = wheel.name
    try:
        check_wheel_file(wheel, project)
    except UnsafeWheel as e:
        raise RecordError(str(e)) from None
    if rec.extra.get("mma_model"):
        raise RecordError(f"{name}: extra.mma_model: a test-flavour wheel (FP4 MMA software model); "
                          "never indexed or published")
    if rec.extra.get("proof"):
        raise RecordError(f"{name}: extra.proof: a proof-flavour wheel (compiled with a stand-in CUDA "
                          "toolkit); never indexed or published")
    try:
        dist, version, _build, tags = parse_wheel_filename(name)
    except (InvalidWheelFilename, InvalidVersion) as e:
        raise RecordError(f"{name}: file name: not a valid wheel file name ({e})") from None
    if dist != canonicalize_name(project):
        raise RecordError(f"{name}: file name: project {dist!r}, expected {project!r}")
    if rec.wheel != name:
        raise _differ(name, "wheel", rec.wheel, name, "the file name")
    size = wheel.stat().st_size
    if rec.size != size:
        raise _differ(name, "size", rec.size, size, "the file")
    actual = sha256 or sha256_of(wheel)
    if rec.sha256 != actual:
        raise _differ(name, "sha256", rec.sha256, actual, "the file")
    try:
        rec_version = Version(rec.version)
    except InvalidVersion:
        raise RecordError(f"{name}: version: the beside-record's {rec.version!r} is not a PEP 440 version") from None
    if rec_version != version or str(rec_version) != str(version):
        raise _differ(name, "version", rec.version, str(version), "the file name")
    if version.local != rec.variant:
        raise _differ(name, "variant", rec.variant, version.local, "the version's local label")
    try:
        variant = Variant.parse(rec.variant)
    except ValueError as e:
        raise RecordError(f"{name}: variant: {e}") from None
    if variant.cuda != rec.cuda:
        raise _differ(name, "cuda", rec.cuda, variant.cuda, f"variant {rec.variant}")
    os_re = _OS_PLATFORM.get(rec.os)
    if os_re is None:
        raise RecordError(f"{name}: os: {rec.os!r} is not one of {', '.join(sorted(_OS_PLATFORM))}")
    platforms = sorted({t.platform for t in tags})
    if not all(os_re.match(p) for p in platforms):
        raise _differ(name, "os", rec.os, ".".join(platforms), "the file name's platform tag")
    floor = re.search(r"(?:^|,)\s*>=\s*(\d+)\.(\d+)\s*(?:,|$)", rec.requires_python)
    pythons = sorted({t.interpreter for t in tags})
    if floor is None or pythons != [f"cp{floor.group(1)}{floor.group(2)}"]:
        raise _differ(name, "requires_python", rec.requires_python, ".".join(pythons),
                      "the file name's Python tag (the factory tags a wheel cpXY for its floor >=X.Y)")

    _check_archive(wheel, rec, project, dist, rec_version, tags)



def _check_archive(wheel: Path, rec: BuildRecord, project: str, dist: str, rec_version: Version, tags) -> None:
    """The inside of a wheel against its beside-record: one ``.dist-info`` of the file name's
    project and version, METADATA (name, version, Requires-Python, the torch requirement),
    WHEEL's tags, RECORD's hashes and the build record the wheel carries."""
    name = wheel.name
    try:
        z = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise RecordError(f"{name}: file: not a readable zip archive ({e})") from None
    with z:
        names = set(z.namelist())
        infos = sorted({n.split("/", 1)[0] for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA")})
        want_info = f"{name.split('-', 1)[0]}-{name.split('-')[1]}.dist-info"
        if infos != [want_info]:
            raise RecordError(f"{name}: .dist-info: the wheel holds {', '.join(infos) or 'none'}, its file name "
                              f"needs {want_info}")
        meta = BytesHeaderParser().parsebytes(z.read(f"{want_info}/METADATA"))
        if canonicalize_name(meta.get("Name", "")) != dist:
            raise _differ(name, "METADATA Name", project, meta.get("Name"), "METADATA")
        try:
            meta_version = Version(meta.get("Version", ""))
        except InvalidVersion:
            meta_version = None
        if meta_version is None or str(meta_version) != str(rec_version):
            raise _differ(name, "METADATA Version", rec.version, meta.get("Version"), "METADATA")
        rp = (meta.get("Requires-Python") or "").replace(" ", "")
        if rp != rec.requires_python.replace(" ", ""):
            raise _differ(name, "requires_python", rec.requires_python, meta.get("Requires-Python"), "METADATA Requires-Python")
        torch_reqs = sorted(str(r.specifier) for r in _requirements(meta.get_all("Requires-Dist") or [], name)
                            if r.name == "torch")
        want = [str(Requirement(rec.requires_torch).specifier)] if rec.requires_torch else []
        if torch_reqs != want:
            raise _differ(name, "requires_torch", rec.requires_torch, torch_reqs, "METADATA Requires-Dist")
        if f"{want_info}/WHEEL" not in names:
            raise RecordError(f"{name}: WHEEL: the wheel has no {want_info}/WHEEL")
        wheel_file = BytesHeaderParser().parsebytes(z.read(f"{want_info}/WHEEL"))
        file_tags = sorted(str(t) for t in tags)
        inside_tags = sorted(wheel_file.get_all("Tag") or [])
        if inside_tags != file_tags:
            raise RecordError(f"{name}: WHEEL Tag: the file name says {', '.join(file_tags)}, "
                              f"WHEEL says {', '.join(inside_tags) or 'none'}")
        check_wheel_record(z, f"{want_info}/RECORD", name)
        if RECORD_IN_WHEEL not in names:
            raise RecordError(f"{name}: {RECORD_IN_WHEEL}: the wheel carries no build record; rebuild it with nox -s build-wheels")
        try:
            inside = json.loads(z.read(RECORD_IN_WHEEL))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RecordError(f"{name}: {RECORD_IN_WHEEL}: not valid JSON ({e})") from None
    inner = record_from_dict(inside, f"{name}: {RECORD_IN_WHEEL}")
    for f in BuildRecord.__dataclass_fields__:
        if f in _WHEEL_FIELDS:
            continue
        said, found = getattr(rec, f), getattr(inner, f)
        if said != found:
            raise _differ(name, f, said, found, f"the record inside the wheel ({RECORD_IN_WHEEL})")


# Files a wheel's RECORD lists without a hash (PEP 376 / the wheel spec): itself and its signatures.
_UNHASHED = ("RECORD", "RECORD.jws", "RECORD.p7s")


def check_wheel_record(z: zipfile.ZipFile, record_name: str, wheel: str) -> None:
    """Every member of the wheel is listed in its ``.dist-info/RECORD`` with the sha256 and size
    of its bytes, and every listed file is there (the hashes pip checks when it installs; a
    changed byte anywhere in the wheel shows here). Raises RecordError naming the member."""
    try:
        text = z.read(record_name).decode("utf-8")
    except KeyError:
        raise RecordError(f"{wheel}: RECORD: the wheel has no {record_name}") from None
    except UnicodeDecodeError:
        raise RecordError(f"{wheel}: RECORD: {record_name} is not UTF-8") from None
    listed: dict[str, tuple[str, str]] = {}
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if len(row) != 3:
            raise RecordError(f"{wheel}: RECORD: row {row!r} is not path,hash,size")
        listed[row[0]] = (row[1], row[2])
    members = [i for i in z.infolist() if not i.is_dir()]
    for info in members:
        path = info.filename
        unhashed = path.rsplit("/", 1)[-1] in _UNHASHED and path.startswith(record_name.rsplit("/", 1)[0] + "/")
        if path not in listed:
            raise RecordError(f"{wheel}: RECORD: {path} is in the wheel but not in its RECORD")
        digest, size = listed.pop(path)
        if unhashed:
            continue
        algo, _, want = digest.partition("=")
        if algo != "sha256" or not want:
            raise RecordError(f"{wheel}: RECORD: {path} has no sha256 hash ({digest!r})")
        h = hashlib.sha256()
        try:
            with z.open(info) as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as e:
            raise RecordError(f"{wheel}: RECORD: {path} cannot be read from the archive ({e})") from None
        got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
        if got != want:
            raise RecordError(f"{wheel}: RECORD: {path}: its bytes hash to sha256={got}, RECORD says sha256={want}")
        if size and size != str(info.file_size):
            raise RecordError(f"{wheel}: RECORD: {path}: {info.file_size} bytes, RECORD says {size}")
    if listed:
        missing = sorted(listed)
        raise RecordError(f"{wheel}: RECORD: lists {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                          + ", not in the wheel")


def _requirements(lines: list[str], wheel: str) -> list[Requirement]:
    out = []
    for line in lines:
        try:
            out.append(Requirement(line))
        except InvalidRequirement:
            raise RecordError(f"{wheel}: METADATA Requires-Dist: {line!r} is not a valid requirement") from None
    return out


def load_records(wheels_dir: Path, project: str = "sageattn3") -> list[BuildRecord]:
    """Every wheel of a directory with its beside-record, each checked by :func:`check_wheel`.
    A directory that is missing or holds no wheel is an error: publishing or indexing nothing
    is never what was meant."""
    wheels_dir = Path(wheels_dir)
    if not wheels_dir.is_dir():
        raise RecordError(f"{wheels_dir}: no such directory; build wheels first (nox -s build-wheels) or fix --wheels")
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise RecordError(f"{wheels_dir}: holds no wheel (*.whl); build wheels first (nox -s build-wheels) or fix --wheels")
    out = []
    for wheel in wheels:
        rec = load_record_beside(wheel)
        check_wheel(wheel, rec, project)  # refuses test/proof flavours and unsafe wheels too
        out.append(rec)
    try:
        check_distinct([w.name for w in wheels], f"in {wheels_dir}")
    except UnsafeWheel as e:
        raise RecordError(str(e)) from None
    return out
