"""The tag stage: a repaired wheel checked against its target (variant label, abi3 tags, the
torch requirement, the build record inside it) and copied out with its build record beside it,
under its final name with its sha256."""

from __future__ import annotations

import shutil
from pathlib import Path

from packaging.metadata import Metadata
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

from ci.stages.record import BuildRecord, read_record_in_wheel, record_path, wheel_metadata
from ci.toolchain.targets import Target
from ci.runtime.errors import FactoryError


class TagError(FactoryError, RuntimeError):
    pass


def tag(repaired: Path, target: Target, out_dir: Path, *, flavour: str | None = None) -> BuildRecord:
    """Check the wheel says what the target says (variant label, torch requirement, abi3),
    then write the beside-record with the final name and sha256. ``flavour``: a non-release
    flavour's label suffix (``proof``), expected after the variant label."""
    name, version, _, tags = parse_wheel_filename(repaired.name)
    label = target.variant.label + (f".{flavour}" if flavour else "")
    if version.local != label:
        raise TagError(f"{repaired.name}: local label {version.local!r}, expected {label!r}")
    if not all(t.abi == "abi3" and t.interpreter == target.python_tag for t in tags):
        raise TagError(f"{repaired.name}: tags {sorted(map(str, tags))}, expected {target.python_tag}-abi3")
    meta = Metadata.from_email(wheel_metadata(repaired), validate=False)
    torch_reqs = [r for r in (meta.requires_dist or []) if r.name == "torch"]
    if [str(r.specifier) for r in torch_reqs] != [str(Requirement(target.requires_torch).specifier)]:
        raise TagError(f"{repaired.name}: Requires-Dist torch {torch_reqs}, expected {target.requires_torch}")
    inside = read_record_in_wheel(repaired)
    if inside.get("target") != target.id:
        raise TagError(f"{repaired.name}: its build record names {inside.get('target')!r}, not {target.id}")
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / repaired.name
    shutil.copy2(repaired, final)
    rec = BuildRecord.from_dict(inside).with_wheel(final)
    record_path(final).write_text(rec.to_json())
    return rec
