"""The index's model: a wheel's entry (its record, sha256, metadata), the pages it is listed on
(``<cu>/torch<X.Y>``, ``<cu>``, ``simple``), and the URL a user passes as ``--index-url``.
The layout itself is described in ci.index.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass


from ci.stages.record import BuildRecord, RecordError, record_from_dict
from ci.toolchain.variant import cuda_tag
from ci.runtime.errors import InputError


MANIFEST = "index.json"


MANIFEST_FORMAT = 1


DEFAULT_PROJECT = "sageattn3"


class IndexError_(InputError, ValueError):
    """The index cannot be written as asked (the message says what to change)."""


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _short(v: object) -> str:
    s = json.dumps(v) if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__
    return s if len(s) <= 40 else s[:37] + "..."


@dataclass(frozen=True)
class Entry:
    """One wheel in the index: its build record plus what the index derived from the file."""

    record: BuildRecord
    metadata_sha256: str
    yanked: str | None = None  # reason; None when not yanked

    @property
    def wheel(self) -> str:
        return self.record.wheel

    def to_dict(self) -> dict:
        d = dict(self.record.__dict__)  # what BuildRecord.to_json writes, without its round trip
        d["archs"], d["patches"] = list(d["archs"]), list(d["patches"])
        d["metadata_sha256"] = self.metadata_sha256
        if self.yanked is not None:
            d["yanked"] = self.yanked
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = MANIFEST) -> "Entry":
        """An entry of a manifest, every field checked: IndexError_ naming ``where`` (the
        manifest and the wheel) and the field."""
        try:
            rec = record_from_dict(d, where)
        except RecordError as e:
            raise IndexError_(str(e)) from None
        meta = d.get("metadata_sha256")
        if not isinstance(meta, str) or not _SHA256.fullmatch(meta):
            raise IndexError_(f"{where}: field metadata_sha256: {_short(meta)}, expected a sha256 (64 hex digits)")
        yanked = d.get("yanked")
        if yanked is not None and not isinstance(yanked, str):
            raise IndexError_(f"{where}: field yanked: {type(yanked).__name__}, expected a reason (str)")
        return cls(rec, meta, yanked)


@dataclass(frozen=True)
class Page:
    """One index location: its path under the root and the records it lists."""

    path: str  # "cu130/torch2.14"
    records: tuple[BuildRecord, ...]

    @property
    def flat_name(self) -> str:
        return "all" if self.path == "simple" else self.path.replace("/", "-")


def torch_lines_of(rec: BuildRecord) -> list[str]:
    lines = rec.extra.get("torch_lines") if isinstance(rec.extra, dict) else None
    if lines:
        return list(lines)
    return [rec.variant_value.torch]


def _line_key(line: str) -> tuple[int, ...]:
    return tuple(int(x) for x in line.split("."))


def pages_for(records: list[BuildRecord]) -> list[Page]:
    by_path: dict[str, list[BuildRecord]] = {"simple": list(records)}
    for rec in records:
        cu = cuda_tag(rec.cuda)
        by_path.setdefault(cu, []).append(rec)
        for line in torch_lines_of(rec):
            by_path.setdefault(f"{cu}/torch{line}", []).append(rec)
    return [Page(p, tuple(sorted(rs, key=lambda r: r.wheel))) for p, rs in sorted(by_path.items())]


def index_url(base: str, cuda: str, torch_line: str | None = None) -> str:
    """The --index-url a user with that torch passes."""
    base = base.rstrip("/")
    return f"{base}/{cuda_tag(cuda)}/" + (f"torch{torch_line}/" if torch_line else "")


def _manifest_json(manifest: dict) -> str:
    """Sorted JSON, one wheel per line (diffable), through the C encoder (fast at 5,000 wheels)."""
    dump = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    head = {k: v for k, v in manifest.items() if k != "wheels"}
    lines = [f"{dump(k)}:{dump(v)}" for k, v in sorted(head.items())]
    wheels = ",\n".join(f" {dump(k)}:{dump(v)}" for k, v in manifest["wheels"].items())
    return "{\n" + ",\n".join(lines) + ',\n"wheels":{\n' + wheels + "\n}}\n"
