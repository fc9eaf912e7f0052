"""The coverage table (docs/coverage.md) and the README's brief matrix come from the matrix and
from evidence (ci/evidence.json: build records of wheels built here), never from claims written
by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from ci import coverage
from ci.targets import Matrix, _v

REPO = Path(__file__).resolve().parent.parent
MATRIX = Matrix.load()


def test_docs_table_is_the_generated_one():
    doc = (REPO / "docs" / "coverage.md").read_text()
    table = re.search(r"<!-- coverage:start -->\n(.*?)\n<!-- coverage:end -->", doc, re.S).group(1)
    assert table == coverage.coverage_table(MATRIX, coverage.load_evidence()), \
        "docs/coverage.md is stale: run python -m ci coverage --write-docs"


def test_readme_matrix_is_the_generated_one():
    readme = (REPO / "README.md").read_text()
    table = re.search(r"<!-- matrix:start -->\n(.*?)\n<!-- matrix:end -->", readme, re.S).group(1)
    assert table == coverage.matrix_brief(MATRIX), "README's matrix is stale: run python -m ci coverage --write-docs"
    rows = table.splitlines()[2:]
    # every wheel variant of the matrix once, and every torch line x CUDA of the matrix in some row
    assert sorted(r.split("`")[1] for r in rows) == sorted({t.variant.label for t in MATRIX.targets})
    served = set()
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        lo, _, hi = cells[1].partition("–")
        served |= {(t.line, cells[2]) for t in MATRIX.torch if _v(lo) <= _v(t.line) <= _v(hi or lo)}
    assert served == {(t.line, c) for t in MATRIX.torch for c in t.cuda}


def test_write_block_replaces_only_its_block_and_names_a_missing_one(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- matrix:start -->\nold\n<!-- matrix:end -->\noutro\n")
    assert coverage.write_block(page, "matrix", "| new |") is True
    assert page.read_text() == "intro\n<!-- matrix:start -->\n| new |\n<!-- matrix:end -->\noutro\n"
    assert coverage.write_block(page, "matrix", "| new |") is False
    with pytest.raises(ValueError, match=r"page.md: no <!-- coverage:start --> \.\.\. <!-- coverage:end --> block"):
        coverage.write_block(page, "coverage", "x")


def test_every_evidence_entry_is_a_real_target_and_wheel():
    ev = coverage.load_evidence()
    targets = {t.id: t for t in MATRIX.targets}
    for tid, kinds in ev.items():
        assert tid in targets, f"evidence for {tid}, which the matrix does not have"
        t = targets[tid]
        for kind, e in kinds.items():
            assert kind in coverage.LEVELS
            if kind == "classic_link":  # no wheel: a module linked against a CPU build's libraries
                assert e["elf_machine"] == t.os.machine and e["torch_libraries"].startswith(t.build_torch)
                assert e["objects"] and e["needed"]
                continue
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


AARCH64 = "linux-aarch64-cu130-torch2.10-stable"
AARCH64_WHEEL = "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-manylinux_2_34_aarch64.whl"
CROSS = {"machine": "aarch64", "compiler": "aarch64-linux-gnu-g++ (Debian 12.2.0-14) 12.2.0", "built_on": "linux-x86_64",
         "torch": "2.14.1+cu130", "cuda_runtime": "13.0.96", "python_headers": "Debian python3.11 3.11.2"}


def test_a_cross_built_wheel_needs_its_emulated_verify(tmp_path):
    wheels, verify = tmp_path / "wheels", tmp_path / "verify"
    wheels.mkdir()
    verify.mkdir()
    _record(wheels, AARCH64, AARCH64_WHEEL, {"cross": CROSS})
    ev_file = tmp_path / "evidence.json"
    with pytest.raises(ValueError, match="without its emulated verify report"):
        coverage.record_evidence([wheels], MATRIX, ev_file)
    report = {"target": AARCH64, "wheel": AARCH64_WHEEL, "machine": "aarch64", "python": "3.11.2",
              "torch": "2.14.1+cu130", "ops": ["a", "b"], "cubins": ["sm_120a", "sm_121a"],
              "abi_guard": "torch 2.9.1: TorchMismatchError", "timings": {"import": 1.0}}
    (verify / f"{AARCH64}.verify.json").write_text(json.dumps(report))
    coverage.record_evidence([wheels, verify], MATRIX, ev_file)
    table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file))
    row = next(r for r in table.splitlines() if r.startswith("| 2.14 | 13.0 |"))
    assert ("linux-aarch64: cross-built on linux-x86_64 (aarch64-linux-gnu-g++ 12.2.0, nvcc 13.0.88) + verified "
            "under qemu-aarch64 (Python 3.11.2, torch 2.14.1+cu130, 2 ops, cubins sm_120a+sm_121a, ABI guard)") in row


def test_classic_links_are_recorded_with_what_was_absent(tmp_path):
    ev_file = tmp_path / "evidence.json"
    link = {"target": "linux-aarch64-cu130-torch2.9", "torch_libraries": "2.9.1+cpu (PyPI, linux-aarch64, CPU build)",
            "torch_headers": "2.9.1", "objects": ["classic.o"], "needed": ["libc10.so"],
            "absent_libraries": ["libc10_cuda.so", "libtorch_cuda.so"], "elf_machine": "aarch64", "seconds": 1.0,
            "unresolved": {"libc10_cuda.so": ["c10::cuda::getCurrentCUDAStream(signed char)"],
                           "the Python interpreter (resolved when it imports the module)": ["PyModule_Create2"]}}
    assert coverage.record_classic_link(link, MATRIX, ev_file).startswith("linux-aarch64-cu130-torch2.9: ")
    row = next(r for r in coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file)).splitlines()
               if r.startswith("| 2.9 | 13.0 |"))
    assert ("linux-aarch64: classic unit cross-compiled + linked here vs torch 2.9.1+cpu (PyPI, linux-aarch64, CPU "
            "build); absent there: libc10_cuda.so, libtorch_cuda.so, whose 1 symbols the unit uses stay unresolved") in row
    with pytest.raises(ValueError, match="not in the matrix"):
        coverage.record_classic_link({**link, "target": "linux-aarch64-cu999-torch9.9"}, MATRIX, ev_file)
