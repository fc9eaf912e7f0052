"""The release rehearsal's cheap parts (part of `nox -s tests`): every one of the matrix's jobs
resolved and checked without building, the stand-in for PyTorch's index answering real pip
over HTTP on 127.0.0.1, and the tag check of the plan job. The full rehearsal, which builds,
is tests/test_release_dry_run.py."""

from __future__ import annotations

import hashlib
import http.client
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ci.release import ReleaseError
from ci.release.rehearsal import dry_run
from ci.release.standin import pytorch_index_standin, standin_dir, standin_serves
from ci.release.steps import check_tag, package_version
from ci.toolchain.targets import Matrix

MATRIX = Matrix.load()


# -- the tag -----------------------------------------------------------------------------------

def test_the_tag_must_be_v_plus_the_package_version(tmp_path):
    assert check_tag(f"v{package_version()}") == package_version()
    f = tmp_path / "_version.py"
    f.write_text('"""v"""\n__version__ = "1.0.0-rc.1"\n')
    assert check_tag("v1.0.0rc1", f) == "1.0.0rc1"  # PEP 440 normalised
    for wrong in ("1.0.0rc1", "v1.0.0-rc.1", "v1.0.0", "v1.0.0rc1.post1"):
        with pytest.raises(ReleaseError, match="does not match the package version 1.0.0rc1"):
            check_tag(wrong, f)
    f.write_text("__version__ = 'banana'\n")
    with pytest.raises(ReleaseError, match="not a PEP 440 version"):
        check_tag("vbanana", f)


def test_check_tag_cli_fails_with_one_line():
    ok = subprocess.run([sys.executable, "-m", "ci.release", "check-tag", "--tag", f"v{package_version()}"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "ci.release", "check-tag", "--tag", "v99.0.0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tag v" in bad.stderr  # bad input


# -- the stand-in for PyTorch's index ----------------------------------------------------------

def _torch_wheel(folder: Path, version: str = "9.9.9", requires: list[str] = ()) -> Path:
    """A real (tiny) wheel named torch with the given version and Requires-Dist lines, so pip can
    resolve and hash-check it."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version.split('+')[0]}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {"torch/__init__.py": b"", f"{info}/METADATA": meta.encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return wheel


def test_the_standin_serves_torch_under_its_cuda_directory_to_real_pip(tmp_path):
    wheel = _torch_wheel(tmp_path / "root" / "cu130")
    env = {"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "HOME": str(tmp_path)}
    with pytorch_index_standin(tmp_path / "root") as url:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/whl")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                               "torch==9.9.9", "--index-url", f"{url}/cu130", "-d", str(tmp_path / "got")],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (tmp_path / "got" / wheel.name).read_bytes() == wheel.read_bytes()
        # not under another CUDA's directory
        miss = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                               "torch==9.9.9", "--index-url", f"{url}/cu128", "-d", str(tmp_path / "no")],
                              capture_output=True, text=True, env=env)
        assert miss.returncode != 0 and "No matching distribution" in miss.stderr
        host = url.split("/")[2]
        page = http.client.HTTPConnection(host)
        page.request("GET", "/whl/cu130/torch/")
        body = page.getresponse().read().decode()
        assert f"#sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}" in body
        for path, status, location in (("/whl/cu130/Jinja2/", 302, "https://pypi.org/simple/jinja2/"),
                                       ("/whl/cu130/nvidia_cublas/", 302, "https://pypi.org/simple/nvidia-cublas/"),
                                       ("/whl/cu130/torch/..%2F..%2Fsecret", 404, None),
                                       ("/whl/rocm6.4/torch/", 404, None), ("/simple/torch/", 404, None)):
            c = http.client.HTTPConnection(host)
            c.request("GET", path)
            r = c.getresponse()
            assert (r.status, r.getheader("Location")) == (status, location), path


def test_the_standin_puts_pypis_torch_in_the_directory_of_its_cuda_build():
    assert standin_dir("2.8.0", MATRIX) == "cu128" and standin_dir("2.10.0", MATRIX) == "cu128"
    assert standin_dir("2.11.0", MATRIX) == "cu130" and standin_dir("2.14.1", MATRIX) == "cu130"
    assert standin_dir("2.7.1", MATRIX) == "cu126"
    served = [t.id for t in MATRIX.targets if not standin_serves(t, MATRIX)]
    # PyPI's torch 2.15.0 is its cu132 build (ci/targets.toml's pypi_default for the 2.15 line)
    assert standin_dir("2.15.0", MATRIX) == "cu132"
    assert served == ["linux-x86_64-cu128-torch2.8", "linux-x86_64-cu128-torch2.9", "linux-x86_64-cu130-torch2.10-stable",
                      "linux-x86_64-cu132-torch2.10-stable"]
    assert "CPU" not in (standin_serves(MATRIX.target("windows-amd64-cu128-torch2.8"), MATRIX) or "")


# -- every job planned and checked ----------------------------------------------------------------

def test_the_rehearsal_plans_and_checks_all_23_jobs(tmp_path):
    dr = dry_run(tmp_path / "dist", plan_only=True, compile_gate=False, log=lambda m: None)
    assert len(dr.jobs) == len(MATRIX.targets) == 23
    assert all(not r.problems for r in dr.jobs), [(r.id, r.problems) for r in dr.jobs if r.problems]
    summary = (tmp_path / "dist" / "summary.md").read_text()
    for t in MATRIX.targets:
        assert f"`{t.id}`" in summary
    by_id = {r.id: r for r in dr.jobs}
    for r in dr.jobs:
        if not r.id.startswith("linux-x86_64"):
            assert not r.runs_here and "release pipeline builds it" in r.why_not
    # what can run here needs PyPI's torch to be the target's CUDA build and a CUDA 13 toolkit
    assert {i for i, r in by_id.items() if r.runs_here} <= {"linux-x86_64-cu130-torch2.10-stable",
                                                           "linux-x86_64-cu132-torch2.10-stable"}
    assert "stand-in index cannot serve its torch" in by_id["linux-x86_64-cu130-torch2.9"].why_not
    assert not dr.timings and not dr.wheels  # nothing built or published


def test_an_unknown_failing_target_is_a_usage_error_before_anything_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ci.release", "--dry-run", "--dist", str(tmp_path / "dist"),
                           "--plan-only", "--fail-target", "linux-x86_64-cu999-torch9.9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--fail-target linux-x86_64-cu999-torch9.9: not a target of ci/targets.toml" in proc.stderr
    assert not (tmp_path / "dist").exists()


def test_rehearsing_a_target_that_cannot_run_here_says_why(tmp_path):
    with pytest.raises(ReleaseError, match="windows-amd64-cu130-torch2.10-stable: needs a windows-amd64 machine"):
        dry_run(tmp_path / "dist", only=["windows-amd64-cu130-torch2.10-stable"], compile_gate=False,
                log=lambda m: None)


def test_windows_jobs_get_msvc_commands_from_the_payloads_own_builder(monkeypatch):
    from ci.toolchain import flags
    from ci.release.rehearsal import _windows_commands_problems

    windows = [t for t in MATRIX.targets if t.os.platform == "windows"]
    assert len(windows) == 8
    for t in windows:
        assert _windows_commands_problems(t, MATRIX) == [], t.id
    real = flags.profile_for

    def gcc_on_windows(target, floor, **kw):  # a profile that would compile Windows GCC-style
        return {**real(target, floor, **kw), "compiler": "gcc"}

    monkeypatch.setattr(flags, "profile_for", gcc_on_windows)
    problems = _windows_commands_problems(windows[0], MATRIX)
    assert any("not MSVC's" in p for p in problems) and any(".pyd" in p for p in problems)


# -- torch specs resolved by real pip against the stand-in ----------------------------------------

def test_pip_resolves_each_torch_spec_to_its_build_and_the_check_sees_a_wrong_one(tmp_path):
    """Real pip (--dry-run --report) against the stand-in: the resolved version, the CUDA of the
    build (its +cuXYZ/+cpu label, or for PyPI's unlabelled builds the CUDA runtime it pins for
    this interpreter) and where it comes from; the stand-in serves torch's core metadata."""
    from ci.release.torch_resolution import TorchResolution, check_resolution, resolve_torch
    from ci.toolchain.torch_source import TorchSource

    root = tmp_path / "root"
    _torch_wheel(root / "cu128", "8.8.0+cu128")
    _torch_wheel(root / "cpu", "8.7.0+cpu")
    _torch_wheel(root / "cu130", "8.9.0", ['nvidia-cuda-runtime==13.0.96; platform_system == "Linux"',
                                           'nvidia-cuda-runtime-cu12==12.8.90; platform_system == "Windows"',
                                           "filelock"])
    with pytorch_index_standin(root) as url:
        host = url.split("/")[2]
        c = http.client.HTTPConnection(host)
        c.request("GET", "/whl/cu130/torch/")
        page = c.getresponse().read().decode()
        c = http.client.HTTPConnection(host)
        c.request("GET", "/whl/cu130/torch/torch-8.9.0-py3-none-any.whl.metadata")
        meta = c.getresponse().read()
        assert f'data-core-metadata="sha256={hashlib.sha256(meta).hexdigest()}"' in page
        assert meta.startswith(b"Metadata-Version: 2.1\nName: torch\nVersion: 8.9.0\n")

        labelled = TorchSource("torch==8.8.0", f"{url}/cu128", "12.8")
        version, cuda, where = resolve_torch(sys.executable, labelled)
        assert (version, cuda) == ("8.8.0+cu128", "12.8") and where.startswith(f"{url}/cu128/torch/")
        assert resolve_torch(sys.executable, TorchSource("torch==8.7.0", f"{url}/cpu", None))[:2] == ("8.7.0+cpu", None)
        pypi_style = TorchSource("torch==8.9.0", f"{url}/cu130", "13.0")
        got = resolve_torch(sys.executable, pypi_style)
        expected_cuda = "13.0" if sys.platform.startswith("linux") else None
        assert got[:2] == ("8.9.0", expected_cuda)

        def checked(source, result):
            return check_resolution(TorchResolution("t", "build", "3.x", sys.executable, source, *result))

        assert checked(labelled, (version, cuda, where)) is None
        assert "CUDA 12.8 build of torch 8.8.0+cu128, the job needs CUDA 13.0" in checked(
            TorchSource("torch==8.8.0", f"{url}/cu128", "13.0"), (version, cuda, where))
        assert "the job asks for torch==8.9.0" in checked(pypi_style, (version, cuda, where))
        assert "not from" in checked(TorchSource("torch==8.8.0", f"{url}/cu126", "12.8"), (version, cuda, where))
        with pytest.raises(ReleaseError, match="could not resolve torch==8.8.0"):
            resolve_torch(sys.executable, TorchSource("torch==8.8.0", f"{url}/cu130", "13.0"))


def test_the_rehearsal_resolves_every_served_target_it_does_not_build():
    """Which specs the rehearsal resolves: each target whose torch the stand-in serves, both its
    build torch and its guard's, as its job asks for them, in the target's floor Python."""
    from ci.release.standin import standin_needs
    from ci.release.torch_resolution import standin_resolutions
    from ci.toolchain.torch_source import foreign_line

    url = "http://127.0.0.1:1/whl"
    got = {(t.id, role): src for t, role, src in standin_resolutions(MATRIX, url)}
    served = [t for t in MATRIX.targets if not standin_serves(t, MATRIX)]
    assert {t for t, _ in got} == {t.id for t in served} and len(got) == 2 * len(served)
    t28 = MATRIX.target("linux-x86_64-cu128-torch2.8")
    assert t28.python == "3.9"
    assert got[(t28.id, "build")].pip_args() == ["torch==2.8.0", "--index-url", f"{url}/cu128"]
    guard = got[(t28.id, "guard")]
    assert guard.version == foreign_line(t28, MATRIX, "3.9") == "2.7.1"
    assert guard.index_url == f"{url}/cu126" and guard.cuda == "12.6"  # PyPI's 2.7.1 is the cu126 build
    assert not any(t.id == t28.id for t, _, _ in standin_resolutions(MATRIX, url, skip=[t28.id]))
    assert ("2.8.0", "3.9") in standin_needs(MATRIX) and ("2.7.1", "3.9") in standin_needs(MATRIX)


def test_a_jobs_requires_python_is_what_setup_py_writes_from_the_build_config(monkeypatch):
    """check_job compares the target's Python floor (ci/targets.toml) with the Requires-Python
    the payload's setup.py rule derives from the build config the factory writes, so a config
    that drifts from the floor is a problem of the plan, not a surprise at verify."""
    import ci.stages.build
    from ci.release import cibw_job

    t = MATRIX.target("linux-x86_64-cu128-torch2.8")
    job = cibw_job.plan_job(t, MATRIX)
    assert job.requires_python == ">=3.9" and not cibw_job.check_job(job, MATRIX)
    real = ci.stages.build.build_config

    def drifted(tc, matrix, overlay, jobs=None):  # a record floor the abi3 tag does not have
        cfg = real(tc, matrix, overlay, jobs)
        cfg["record"]["requires_python"] = ">=3.10"
        return cfg

    monkeypatch.setattr(ci.stages.build, "build_config", drifted)
    problems = cibw_job.check_job(cibw_job.plan_job(t, MATRIX), MATRIX)
    assert any("setup.py refuses the build config" in p and "target's Python floor in ci/targets.toml is 3.9" in p
               for p in problems), problems

    def both_drifted(tc, matrix, overlay, jobs=None):  # consistent, but not the target's floor
        cfg = drifted(tc, matrix, overlay, jobs)
        cfg["limited_api"] = "cp310"
        return cfg

    monkeypatch.setattr(ci.stages.build, "build_config", both_drifted)
    problems = cibw_job.check_job(cibw_job.plan_job(t, MATRIX), MATRIX)
    assert any("Requires-Python would be >=3.10" in p for p in problems), problems
