"""The README's coverage table comes from the matrix and from evidence (ci/evidence.json: build
records of wheels built here), never from claims written by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from ci import coverage
from ci.targets import Matrix

REPO = Path(__file__).resolve().parent.parent
MATRIX = Matrix.load()


def test_readme_table_is_the_generated_one():
    readme = (REPO / "README.md").read_text()
    table = re.search(r"<!-- coverage:start -->\n(.*?)\n<!-- coverage:end -->", readme, re.S).group(1)
    assert table == coverage.coverage_table(MATRIX, coverage.load_evidence())


def test_every_evidence_entry_is_a_real_target_and_wheel():
    ev = coverage.load_evidence()
    targets = {t.id: t for t in MATRIX.targets}
    for tid, kinds in ev.items():
        assert tid in targets, f"evidence for {tid}, which the matrix does not have"
        t = targets[tid]
        for kind, e in kinds.items():
            assert kind in coverage.LEVELS
            _, version, _, tags = parse_wheel_filename(e["wheel"])
            want = t.variant.label + (".proof" if kind == "proof" else "")
            assert version.local == want, (tid, e["wheel"])
            assert all(tag.abi == "abi3" and tag.interpreter == t.python_tag for tag in tags)
            assert re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
            assert e["torch_build"].startswith(t.build_torch)


def _record(tmp: Path, target_id: str, wheel: str, extra: dict) -> None:
    rec = {"target": target_id, "wheel": wheel, "sha256": "ab" * 32, "torch_build": "2.8.0+cu128",
           "toolchain": {"nvcc": "13.0.88"}, "source_commit": "x", "extra": extra}
    (tmp / f"{wheel}.json").write_text(json.dumps(rec))


def test_record_evidence_and_levels(tmp_path):
    d = tmp_path / "proof"
    d.mkdir()
    _record(d, "linux-x86_64-cu128-torch2.8", "sageattn3-0.1.0+cu128.torch2.8.proof-cp39-abi3-linux_x86_64.whl",
            {"proof": "yes"})
    _record(d, "linux-x86_64-cu128-torch2.9", "sageattn3-0.1.0+cu128.torch2.9.mmamodel-cp310-abi3-linux_x86_64.whl",
            {"mma_model": True})
    ev_file = tmp_path / "evidence.json"
    added = coverage.record_evidence([d], MATRIX, ev_file)
    assert added == ["linux-x86_64-cu128-torch2.8: proof wheel built + imported here "
                     "(sageattn3-0.1.0+cu128.torch2.8.proof-cp39-abi3-linux_x86_64.whl)"]
    table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file))
    row28 = next(r for r in table.splitlines() if r.startswith("| 2.8 | 12.8 |"))
    assert "linux-x86_64: proof wheel built + imported here (torch 2.8.0+cu128, nvcc 13.0.88)" in row28
    assert "unit compiled vs torch 2.8.0 headers" in row28
    row29 = next(r for r in table.splitlines() if r.startswith("| 2.9 | 12.8 |"))
    assert "here (" not in row29 and row29.endswith("the rest: release pipeline only |")
    _record(d, "linux-x86_64-cu999-torch9.9", "sageattn3-0.1.0+cu128.torch2.8-cp39-abi3-linux_x86_64.whl", {})
    with pytest.raises(ValueError, match="not in the matrix"):
        coverage.record_evidence([d], MATRIX, ev_file)


def test_the_per_torch_lines_have_their_proof_on_record():
    """The torch 2.8 and 2.9 lines (classic bindings) were proven here with proof-flavour wheels."""
    ev = coverage.load_evidence()
    for tid in ("linux-x86_64-cu128-torch2.8", "linux-x86_64-cu128-torch2.9"):
        assert "proof" in ev.get(tid, {}), f"no proof-flavour evidence for {tid}"
