"""The build record: what a wheel was built for and with. One JSON document travels inside
the wheel (``sageattn3/_build_record.json``, read by ``sageattn3.build_info()``) and a copy
with the wheel's final name and sha256 lies beside it (``<wheel>.json``). Index and
publishing read these records; they never re-derive facts from file names by hand."""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.utils import parse_wheel_filename

from ci.variant import Variant

RECORD_IN_WHEEL = "sageattn3/_build_record.json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def read_record_in_wheel(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        return json.loads(z.read(RECORD_IN_WHEEL))


def wheel_metadata(wheel: Path) -> bytes:
    """The METADATA file of a wheel (served as the PEP 658 .metadata file)."""
    name, version, _, _ = parse_wheel_filename(wheel.name)
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            if n.endswith(".dist-info/METADATA") and n.count("/") == 1:
                return z.read(n)
    raise ValueError(f"{wheel.name}: no .dist-info/METADATA")


def load_records(wheels_dir: Path) -> list[BuildRecord]:
    """Every wheel in a directory with its beside-record, checked against the file."""
    out = []
    for wheel in sorted(Path(wheels_dir).glob("*.whl")):
        rp = record_path(wheel)
        if not rp.exists():
            raise ValueError(f"{wheel.name}: no build record beside it ({rp.name}); rebuild it with nox -s build-wheels")
        rec = BuildRecord.load(rp)
        if rec.extra.get("mma_model"):
            raise ValueError(f"{wheel.name}: a test-flavour wheel (FP4 MMA software model); never indexed or published")
        if rec.wheel != wheel.name or rec.sha256 != sha256_of(wheel):
            raise ValueError(f"{wheel.name}: its build record does not match the file (name or sha256 differ)")
        out.append(rec)
    return out
