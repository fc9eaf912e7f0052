"""The coverage table (docs/coverage.md) and the README's brief matrix come from the matrix and
from evidence (ci/evidence.json: build records of wheels built here), never from claims written
by hand."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from ci.checks import coverage
from ci.toolchain.targets import Matrix, _v

REPO = Path(__file__).resolve().parent.parent
MATRIX = Matrix.load()


def test_docs_table_is_the_generated_one():
    doc = (REPO / "docs" / "coverage.md").read_text()
    table = re.search(r"<!-- coverage:start -->\n(.*?)\n<!-- coverage:end -->", doc, re.S).group(1)
    want = coverage.coverage_table(MATRIX, coverage.load_evidence())
    differ = [r.split(" | ")[0:2] for r in set(want.splitlines()) - set(table.splitlines())]
    assert table == want, (
        f"docs/coverage.md is not the generated table (rows {differ}); if evidence went stale (a commit changed "
        f"what it was made from), rebuild and re-record it, or show it as stale: python -m ci coverage --write-docs")


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
            assert kind in coverage.KINDS
            if kind == "classic_link":  # no wheel: a module linked against a CPU build's libraries
                assert e["elf_machine"] == t.os.machine and e["torch_libraries"].startswith(t.build_torch)
                assert e["objects"] and e["needed"]
                continue
            if kind in coverage.CHECK_KINDS:  # a compile of one unit per torch line: no wheel
                assert e["source_commit"] and t.os.key == "windows-amd64" and e["lines"]
                for line, one in e["lines"].items():
                    assert line in t.torch_lines and one["torch"].startswith(line) and one["unit"]["ok"]
                continue
            _, version, _, tags = parse_wheel_filename(e["wheel"])
            want = t.variant.label + (".proof" if kind == "proof" else "")
            assert version.local == want, (tid, e["wheel"])
            assert all(tag.abi == "abi3" and tag.interpreter == t.python_tag for tag in tags)
            assert re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
            assert e["torch_build"].startswith(t.build_torch)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.invalid",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", path)
    _git(repo, "commit", "-q", "-m", f"change {path}")
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def history(tmp_path) -> Path:
    """A repository of its own: evidence is judged against its history, not this checkout's."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    for path in ("sageattn3/csrc/k.cu", "patches/manifest.toml", "ci/toolchain/cross.py", "ci/stages/build.py"):
        _commit(repo, path, "1\n")
    return repo


def _record(tmp: Path, target_id: str, wheel: str, extra: dict, commit: str) -> None:
    rec = {"target": target_id, "wheel": wheel, "sha256": "ab" * 32, "torch_build": "2.8.0+cu128",
           "toolchain": {"nvcc": "13.0.88"}, "source_commit": commit, "extra": extra}
    (tmp / f"{wheel}.json").write_text(json.dumps(rec))


def test_record_evidence_and_levels(tmp_path, history):
    head = _git(history, "rev-parse", "HEAD")
    d = tmp_path / "proof"
    d.mkdir()
    _record(d, "linux-x86_64-cu128-torch2.8", "sageattn3-0.1.0+cu128.torch2.8.proof-cp39-abi3-linux_x86_64.whl",
            {"proof": "yes"}, head)
    _record(d, "linux-x86_64-cu128-torch2.9", "sageattn3-0.1.0+cu128.torch2.9.mmamodel-cp310-abi3-linux_x86_64.whl",
            {"mma_model": True}, head)
    ev_file = tmp_path / "evidence.json"
    added = coverage.record_evidence([d], MATRIX, ev_file, history)
    assert added == ["linux-x86_64-cu128-torch2.8: proof wheel built + imported here "
                     f"(sageattn3-0.1.0+cu128.torch2.8.proof-cp39-abi3-linux_x86_64.whl; from {head[:7]})"]
    table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history)
    row28 = next(r for r in table.splitlines() if r.startswith("| 2.8 | 12.8 |"))
    assert f"linux-x86_64 (from {head[:7]}): proof wheel built + imported here (torch 2.8.0+cu128, nvcc 13.0.88)" in row28
    assert "unit compiled vs torch 2.8.0 headers" in row28
    row29 = next(r for r in table.splitlines() if r.startswith("| 2.9 | 12.8 |"))
    assert "here (" not in row29 and row29.endswith("the rest: release pipeline only |")
    _record(d, "linux-x86_64-cu999-torch9.9", "sageattn3-0.1.0+cu128.torch2.8-cp39-abi3-linux_x86_64.whl", {}, head)
    with pytest.raises(ValueError, match="not in the matrix"):
        coverage.record_evidence([d], MATRIX, ev_file, history)


NATIVE = "linux-x86_64-cu130-torch2.10-stable"
NATIVE_WHEEL = "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-manylinux_2_34_x86_64.whl"


def _row(table: str, start: str, os_key: str) -> str:
    """The proven column's part for ``os_key`` in the row that starts with ``start``."""
    row = next(r for r in table.splitlines() if r.startswith(start))
    return next(p for p in row.rstrip(" |").split(" | ")[-1].split("; ") if p.startswith(os_key + " ("))


def _record_both(tmp_path: Path, repo: Path, commit: str) -> Path:
    """A native release record and a cross-built one (with its emulated verify), made from ``commit``."""
    d = tmp_path / f"dist-{commit[:7]}"
    d.mkdir()
    _record(d, NATIVE, NATIVE_WHEEL, {}, commit)
    _record(d, AARCH64, AARCH64_WHEEL, {"cross": CROSS}, commit)
    (d / f"{AARCH64}.verify.json").write_text(json.dumps(REPORT))
    ev_file = tmp_path / "evidence.json"
    coverage.record_evidence([d], MATRIX, ev_file, repo)
    return ev_file


def test_evidence_made_before_a_change_to_what_it_was_made_from_is_stale(tmp_path, history):
    made = _git(history, "rev-parse", "HEAD")
    ev_file = _record_both(tmp_path, history, made)

    def rows() -> tuple[str, str]:
        table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history)
        return _row(table, "| 2.14 | 13.0 |", "linux-x86_64"), _row(table, "| 2.14 | 13.0 |", "linux-aarch64")

    native, cross = rows()
    assert native.startswith(f"linux-x86_64 (from {made[:7]}): built + verified here")
    assert cross.startswith(f"linux-aarch64 (from {made[:7]}): cross-built on linux-x86_64")
    _commit(history, "docs/factory.md", "words\n")  # changes nothing a wheel is made from
    assert rows() == (native, cross)
    cross_change = _commit(history, "ci/toolchain/cross.py", "2\n")  # only the cross build's
    native2, cross2 = rows()
    assert native2 == native
    assert cross2.startswith(f"linux-aarch64 (**stale**: from {made[:7]}, what it was made from changed in "
                             f"{cross_change[:7]}): cross-built")
    payload_change = _commit(history, "sageattn3/csrc/k.cu", "2\n")
    native3, cross3 = rows()
    assert native3.startswith(f"linux-x86_64 (**stale**: from {made[:7]}, what it was made from changed in "
                              f"{payload_change[:7]}): built + verified here")
    assert cross3 == cross2  # named by the first change after it
    # Re-recorded from the new HEAD, both are current again.
    ev_file = _record_both(tmp_path, history, payload_change)
    assert all(r.split(": ", 1)[0].endswith(f"(from {payload_change[:7]})") for r in rows())


def test_a_change_merged_from_another_branch_makes_evidence_stale(tmp_path, history):
    """The change sits on a branch made before the evidence's commit; merged after it, it is
    not in that commit's history, whatever its date."""
    base = _git(history, "rev-parse", "HEAD")
    _git(history, "checkout", "-q", "-b", "side")
    side = _commit(history, "patches/manifest.toml", "2\n")
    _git(history, "checkout", "-q", "main")
    made = _commit(history, "docs/notes.md", "1\n")
    assert _git(history, "merge-base", "HEAD", "side") == base
    ev_file = _record_both(tmp_path, history, made)
    _git(history, "merge", "-q", "--no-edit", "side")
    merge = _git(history, "rev-parse", "HEAD")
    assert merge != side
    table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history)
    # named as the merge that brought it onto the first-parent line
    assert _row(table, "| 2.14 | 13.0 |", "linux-x86_64").startswith(
        f"linux-x86_64 (**stale**: from {made[:7]}, what it was made from changed in {merge[:7]})")
    # a later merge of another old branch that changes inputs too does not move "changed in"
    _git(history, "checkout", "-q", "-b", "old", base)
    _commit(history, "patches/manifest.toml", "3\n")
    _git(history, "checkout", "-q", "main")
    _git(history, "merge", "-q", "--no-edit", "-X", "theirs", "old")
    table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history)
    assert f"what it was made from changed in {merge[:7]})" in _row(table, "| 2.14 | 13.0 |", "linux-x86_64")


def test_a_record_names_a_commit_of_the_history_and_says_when_it_was_dirty(tmp_path, history):
    head = _git(history, "rev-parse", "HEAD")
    ev_file = tmp_path / "evidence.json"
    link = {**LINK, "source_commit": head + "-dirty"}
    coverage.record_classic_link(link, MATRIX, ev_file, history)
    stored = coverage.load_evidence(ev_file)["linux-aarch64-cu130-torch2.9"]["classic_link"]
    assert stored["source_commit"] == head
    assert stored["dirty"] == "uncommitted changes to sageattn3/ or patches/ when built"
    assert stored["ran_here"] == coverage.KINDS["classic_link"].ran_here
    row = next(r for r in coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history).splitlines()
               if r.startswith("| 2.9 | 13.0 |"))
    assert f"linux-aarch64 (from {head[:7]} + uncommitted changes): classic unit" in row
    # An input changed in the checkout at that commit: named, though the maker did not say so.
    (history / "ci" / "toolchain" / "cross.py").write_text("uncommitted\n")
    coverage.record_classic_link({**LINK, "source_commit": head}, MATRIX, ev_file, history)
    stored = coverage.load_evidence(ev_file)["linux-aarch64-cu130-torch2.9"]["classic_link"]
    assert stored["dirty"] == "uncommitted changes to ci/toolchain/cross.py"
    # A local build's wheel names its own dist/index: evidence holds no place of the machine that made it.
    guard = {**LINK, "source_commit": head, "needed": ["see file:///home/someone/dist/index/ for the index"]}
    with pytest.raises(coverage.EvidenceError, match=r"names file:///home/someone/dist/index/, .*SAGEATTN3_INDEX_URL"):
        coverage.record_classic_link(guard, MATRIX, ev_file, history)
    for bad, why in (("unknown", "is not a commit"), ("0123456789" * 4, "is not in this checkout's history"),
                     (None, "is not a commit")):
        with pytest.raises(coverage.EvidenceError, match=why):
            coverage.record_classic_link({**LINK, "source_commit": bad}, MATRIX, ev_file, history)


def test_a_commit_outside_the_history_is_shown_and_a_shallow_clone_is_refused(tmp_path, history):
    made = _git(history, "rev-parse", "HEAD")
    ev_file = _record_both(tmp_path, history, made)
    # History rewritten (a rebase, a squash-merge): the commit is no longer HEAD's ancestor.
    _git(history, "reset", "-q", "--hard", "HEAD~1")
    _commit(history, "ci/stages/build.py", "rewritten\n")
    table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history)
    assert _row(table, "| 2.14 | 13.0 |", "linux-x86_64").startswith(
        f"linux-x86_64 (**commit {made[:7]} is not in this repository's history**)")
    shallow = tmp_path / "shallow"
    _git(tmp_path, "clone", "-q", "--depth", "1", history.as_uri(), str(shallow))
    with pytest.raises(coverage.EvidenceError, match=r"is a shallow clone: .*\(git fetch --unshallow"):
        coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), shallow)


def test_every_evidence_record_names_a_commit_of_this_history():
    """ci/evidence.json: each record was made from a commit that is HEAD or one of its
    ancestors (a record made on a branch that was later rebased or squash-merged names a commit
    that no longer exists: rebuild it and record it again)."""
    try:
        coverage.check_history()
    except coverage.EvidenceError as e:
        pytest.fail(f"cannot check the evidence's commits: {e}")
    unknown = [f"{tid} {kind}: {e.get('source_commit')!r}" for tid, kinds in coverage.load_evidence().items()
               for kind, e in kinds.items()
               if not re.fullmatch(r"[0-9a-f]{40}", e.get("source_commit") or "")
               or not coverage.in_history(e["source_commit"])]
    assert not unknown, f"evidence made from commits not in this repository's history: {unknown}"


def test_the_per_torch_lines_have_their_proof_on_record():
    """The torch 2.8 and 2.9 lines (classic bindings) were proven here with proof-flavour wheels."""
    ev = coverage.load_evidence()
    for tid in ("linux-x86_64-cu128-torch2.8", "linux-x86_64-cu128-torch2.9"):
        assert "proof" in ev.get(tid, {}), f"no proof-flavour evidence for {tid}"


AARCH64 = "linux-aarch64-cu130-torch2.10-stable"
AARCH64_WHEEL = "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-manylinux_2_34_aarch64.whl"
CROSS = {"machine": "aarch64", "compiler": "aarch64-linux-gnu-g++ (Debian 12.2.0-14) 12.2.0", "built_on": "linux-x86_64",
         "torch": "2.14.1+cu130", "cuda_runtime": "13.0.96", "python_headers": "Debian python3.11 3.11.2"}
REPORT = {"target": AARCH64, "wheel": AARCH64_WHEEL, "machine": "aarch64", "python": "3.11.2",
          "torch": "2.14.1+cu130", "ops": ["a", "b"], "cubins": ["sm_120a", "sm_121a"],
          "abi_guard": "torch 2.9.1: TorchMismatchError", "timings": {"import": 1.0}}


def test_a_cross_built_wheel_needs_its_emulated_verify(tmp_path, history):
    head = _git(history, "rev-parse", "HEAD")
    wheels, verify = tmp_path / "wheels", tmp_path / "verify"
    wheels.mkdir()
    verify.mkdir()
    _record(wheels, AARCH64, AARCH64_WHEEL, {"cross": CROSS}, head)
    ev_file = tmp_path / "evidence.json"
    with pytest.raises(ValueError, match="without its emulated verify report"):
        coverage.record_evidence([wheels], MATRIX, ev_file, history)
    (verify / f"{AARCH64}.verify.json").write_text(json.dumps(REPORT))
    coverage.record_evidence([wheels, verify], MATRIX, ev_file, history)
    table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history)
    row = next(r for r in table.splitlines() if r.startswith("| 2.14 | 13.0 |"))
    assert (f"linux-aarch64 (from {head[:7]}): cross-built on linux-x86_64 (aarch64-linux-gnu-g++ 12.2.0, nvcc 13.0.88) "
            "+ verified under qemu-aarch64 (Python 3.11.2, torch 2.14.1+cu130, 2 ops, cubins sm_120a+sm_121a, "
            "ABI guard)") in row


LINK = {"target": "linux-aarch64-cu130-torch2.9", "torch_libraries": "2.9.1+cpu (PyPI, linux-aarch64, CPU build)",
        "torch_headers": "2.9.1", "objects": ["classic.o"], "needed": ["libc10.so"],
        "absent_libraries": ["libc10_cuda.so", "libtorch_cuda.so"], "elf_machine": "aarch64", "seconds": 1.0,
        "unresolved": {"libc10_cuda.so": ["c10::cuda::getCurrentCUDAStream(signed char)"],
                       "the Python interpreter (resolved when it imports the module)": ["PyModule_Create2"]}}


def test_classic_links_are_recorded_with_what_was_absent(tmp_path, history):
    head = _git(history, "rev-parse", "HEAD")
    ev_file = tmp_path / "evidence.json"
    link = {**LINK, "source_commit": head}
    assert coverage.record_classic_link(link, MATRIX, ev_file, history).startswith("linux-aarch64-cu130-torch2.9: ")
    row = next(r for r in coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history).splitlines()
               if r.startswith("| 2.9 | 13.0 |"))
    assert (f"linux-aarch64 (from {head[:7]}): classic unit cross-compiled + linked here vs torch 2.9.1+cpu (PyPI, "
            "linux-aarch64, CPU build); absent there: libc10_cuda.so, libtorch_cuda.so, whose 1 symbols the unit uses "
            "stay unresolved") in row
    with pytest.raises(ValueError, match="not in the matrix"):
        coverage.record_classic_link({**link, "target": "linux-aarch64-cu999-torch9.9"}, MATRIX, ev_file, history)


def test_a_new_kind_of_evidence_is_added_by_the_same_function(tmp_path, history, monkeypatch):
    """A kind with its own inputs (a Windows build under wine, say) is an entry of KINDS; its
    records say what ran here, and go stale when its own inputs change."""
    monkeypatch.setitem(coverage.KINDS, "wine_build", coverage.Kind(
        "built here under wine", "compile only", coverage.PAYLOAD_INPUTS + ("ci/toolchain/wine.py",)))
    head = _git(history, "rev-parse", "HEAD")
    ev_file = tmp_path / "evidence.json"
    tid = "windows-amd64-cu130-torch2.10-stable"
    coverage.add_evidence(tid, "wine_build", {"source_commit": head, "ran_here": "build + PE inspection + load under wine"},
                          MATRIX, ev_file, history)
    part = _row(coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history), "| 2.10 | 13.0 |",
                "windows-amd64")
    assert part == f"windows-amd64 (from {head[:7]}): built here under wine: build + PE inspection + load under wine"
    change = _commit(history, "ci/toolchain/wine.py", "1\n")
    part = _row(coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history), "| 2.10 | 13.0 |",
                "windows-amd64")
    assert part.startswith(f"windows-amd64 (**stale**: from {head[:7]}, what it was made from changed in {change[:7]})")
    with pytest.raises(coverage.EvidenceError, match=r"the kinds are release, proof, .*, wine_build"):
        coverage.add_evidence(tid, "compiled", {"source_commit": head}, MATRIX, ev_file, history)


WINDOWS = "windows-amd64-cu130-torch2.10-stable"
WINDOWS_WHEEL = "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-win_amd64.whl"
WINE_CROSS = {"built_on": "linux-x86_64 under wine", "wine": "wine-8.0 (Debian 8.0~repack-4)",
              "msvc": "Microsoft (R) C/C++ Optimizing Compiler Version 19.44.35229 for x64",
              "nvcc": "13.0.88 (PyPI win_amd64 wheels)", "torch": "2.14.1+cpu (PyPI win_amd64)",
              "standin_import_libraries": {"python3.lib": {"symbols": ["PyModule_Create2"]},
                                           "torch_cuda.lib": {"symbols": ["aoti_torch_get_current_cuda_stream"]}}}
WINE_REPORT = {"target": WINDOWS, "wheel": WINDOWS_WHEEL, "abi_guard": "not checked: no Windows CPython",
               "inspection": {"machine": "x64", "imports": ["python3.dll", "torch_cpu.dll"], "pyinit": True,
                              "cubins": ["sm_120a", "sm_121a"], "build_paths": [], "cuda_runtime": "linked in"},
               "load": {"ok": True, "output": "loaded; PyInit__C found", "standin_dlls": ["python3.dll"]}}


def test_a_windows_wheel_built_under_wine_needs_its_inspection_and_goes_stale_with_the_wine_code(tmp_path, history):
    head = _git(history, "rev-parse", "HEAD")
    wheels, verify = tmp_path / "wheels", tmp_path / "verify"
    wheels.mkdir()
    verify.mkdir()
    _record(wheels, WINDOWS, WINDOWS_WHEEL, {"cross": WINE_CROSS}, head)
    ev_file = tmp_path / "evidence.json"
    with pytest.raises(ValueError, match="without its inspection report"):
        coverage.record_evidence([wheels], MATRIX, ev_file, history)
    (verify / f"{WINDOWS}.verify.json").write_text(json.dumps(WINE_REPORT))
    added = coverage.record_evidence([wheels, verify], MATRIX, ev_file, history)
    assert added == [f"{WINDOWS}: built under wine here ({WINDOWS_WHEEL}; from {head[:7]})"]
    table = coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history)
    part = _row(table, "| 2.10 | 13.0 |", "windows-amd64")
    assert part.startswith(f"windows-amd64 (from {head[:7]}): built under wine here (MSVC 19.44.35229, nvcc.exe 13.0.88")
    assert "stand-in import libraries python3.lib+torch_cuda.lib" in part and "cubins sm_120a+sm_121a" in part
    assert "not imported (no Windows CPython" in part
    cu128 = next(r for r in table.splitlines() if r.startswith("| 2.10 | 12.8 |"))
    assert "windows-amd64: its build release pipeline only (CUDA 12.8 for Windows is not on PyPI in full" in cu128
    change = _commit(history, "ci/toolchain/wine.py", "2\n")
    part = _row(coverage.coverage_table(MATRIX, coverage.load_evidence(ev_file), history), "| 2.10 | 13.0 |",
                "windows-amd64")
    assert part.startswith(f"windows-amd64 (**stale**: from {head[:7]}, what it was made from changed in {change[:7]})")
