"""The rehearsal's hooks get their commands and environments from the pinned cibuildwheel
(ci/release/cibw_rehearsal.py): a setting changed in a copy of ci/cibuildwheel.toml reaches the hook
that runs, with nothing in ci/ reading the file. Real cibuildwheel option resolution, real
hooks run as `sh -c`, a real venv and pip installing a real (tiny) wheel."""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

import pytest

from ci.release import cibw_job
from ci.release.cibw_job import RehearsalError, resolve
from ci.release.cibw_rehearsal import HostLayout, JobRehearsal, job_environ
from ci.toolchain.targets import Matrix
from other_pythons import skip_without_python

MATRIX = Matrix.load()
TARGET = MATRIX.target("linux-x86_64-cu130-torch2.10-stable")
DUMP = "import json, os, sys; json.dump(dict(os.environ, PYTHON=sys.executable), open(sys.argv[1], 'w'))"


def _toml_copy(tmp_path: Path, edit) -> Path:
    text = cibw_job.CONFIG_FILE.read_text()
    new = edit(text)
    assert new != text, "the edit changed nothing"
    path = tmp_path / "cibuildwheel.toml"
    path.write_text(new)
    return path


@pytest.fixture(scope="module")
def pythons(tmp_path_factory) -> Path:
    """Where the venvs standing in for the image's /opt/python/* live (made once per module)."""
    return tmp_path_factory.mktemp("pythons")


def _rehearsal(tmp_path: Path, config: Path | None, pythons: Path) -> JobRehearsal:
    env = job_environ(TARGET, pytorch_index="http://127.0.0.1:9/whl", cache=tmp_path / "cache",
                      log_dir=tmp_path / "logs")
    job = resolve(TARGET, env, config_file=config)
    return JobRehearsal(job, HostLayout(venv_root=pythons), tmp_path / "work",
                        overlay={"SAGEATTN3_DIST": str(tmp_path / "dist")})


def _tiny_wheel(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "probe-1.0-py3-none-any.whl"
    files = {"probe/__init__.py": b"",
             "probe-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: probe\nVersion: 1.0\nRequires-Dist: torch\n",
             "probe-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("probe-1.0.dist-info/RECORD", "".join(f"{n},,\n" for n in files) + "probe-1.0.dist-info/RECORD,,\n")
    return wheel


def test_the_real_toml_resolves_to_its_hooks_with_container_paths_made_local(tmp_path, pythons):
    with skip_without_python("the venvs standing in for the image's /opt/python/*"):
        r = _rehearsal(tmp_path, None, pythons)
        assert r.job.identifier == cibw_job.identifier(TARGET) == "cp310-manylinux_x86_64"
        before = r.job.command("before_all", project="/P", package="/P/ci/release/cibw_project")
        assert before == ("$SAGEATTN3_FACTORY_PYTHON -m pip install -r /P/ci/requirements.txt && "
                          "$SAGEATTN3_FACTORY_PYTHON /P/ci/release/cibw/__main__.py install-cuda")
        assert r.job.command("test_command", project="/P", wheel="/w/x.whl") == (
            "$SAGEATTN3_FACTORY_PYTHON /P/ci/release/cibw/__main__.py verify --wheel /w/x.whl --python-exe python")
        assert r.job.build_flags() == ["--no-build-isolation", "-v"]
        build = r._env(r._python_bin())
        # the toml's environment, its /host and /opt/python paths made this machine's
        assert build["SAGEATTN3_CACHE"] == str(tmp_path / "cache") and build["SAGEATTN3_LOG_DIR"] == str(tmp_path / "logs")
        assert build["SAGEATTN3_FACTORY_PYTHON"] == str(pythons / "cp312-cp312" / "bin" / "python")
        assert build["PATH"].startswith(str(pythons / "cp310-cp310" / "bin") + ":")
        assert build["SCCACHE_CACHE_SIZE"] == "2G" and build["SAGEATTN3_TARGET"] == TARGET.id
        # environment-pass carries only what it names: the job's SAGEATTN3_CUDA and CIBW_BUILD stay outside
        assert "SAGEATTN3_CUDA" not in build and "CIBW_BUILD" not in build
        assert "PIP_NO_DEPS" not in build
        test = r._env(r._python_bin(), test_venv=tmp_path / "venv")
        assert test["PIP_NO_DEPS"] == "1" and test["VIRTUAL_ENV"] == str(tmp_path / "venv")


def test_a_test_environment_variable_added_to_a_copy_of_the_toml_reaches_the_test_hook(tmp_path, pythons):
    with skip_without_python("the venvs standing in for the image's /opt/python/*"):
        out = tmp_path / "test-hook.json"

        def edit(text: str) -> str:
            text = text.replace('test-environment = { PIP_NO_DEPS = "1" }',
                                'test-environment = { PIP_NO_DEPS = "1", SAGEATTN3_PROBE = "from the toml copy" }')
            return re.sub(r'(\[tool\.cibuildwheel\.linux\][\s\S]*?)\ntest-command = "[^\n]*"',
                          lambda m: m.group(1) + f"\ntest-command = {json.dumps(f'python -c {json.dumps(DUMP)} {out}')}",
                          text, count=1)

        r = _rehearsal(tmp_path, _toml_copy(tmp_path, edit), pythons)
        run = r.test(_tiny_wheel(tmp_path / "wheels"))
        assert run is not None and run.name == "test"
        got = json.loads(out.read_text())
        assert got["SAGEATTN3_PROBE"] == "from the toml copy"
        # and the rest as cibuildwheel applies it: the toml's environment, then test-environment,
        # in a fresh venv of the target's floor Python that holds the wheel without its torch
        assert got["PIP_NO_DEPS"] == "1" and got["SAGEATTN3_FACTORY_PYTHON"].endswith("cp312-cp312/bin/python")
        assert got["PYTHON"] == str(tmp_path / "work" / "test" / "venv" / "bin" / "python")
        site = list((tmp_path / "work" / "test" / "venv").glob("lib/python3.10/site-packages"))
        assert site and (site[0] / "probe").is_dir() and not list(site[0].glob("torch*"))
        assert (site[0] / "packaging").is_dir()  # the toml's test-requires


def test_before_all_and_environment_pass_follow_the_toml_copy(tmp_path, pythons):
    with skip_without_python("the venvs standing in for the image's /opt/python/*"):
        out = tmp_path / "before-all.json"

        def edit(text: str) -> str:
            text = text.replace('environment-pass = ["SAGEATTN3_TARGET", "SAGEATTN3_PYTORCH_INDEX", ',
                                'environment-pass = ["SAGEATTN3_TARGET", ')
            return re.sub(r'\nbefore-all = "[^\n]*"',
                          lambda m: f"\nbefore-all = {json.dumps(f'$SAGEATTN3_FACTORY_PYTHON -c {json.dumps(DUMP)} {out}')}",
                          text, count=1)

        r = _rehearsal(tmp_path, _toml_copy(tmp_path, edit), pythons)
        r.before_all(log=lambda m: None)
        got = json.loads(out.read_text())
        assert "SAGEATTN3_PYTORCH_INDEX" not in got  # no longer passed into the "container"
        assert got["SAGEATTN3_TARGET"] == TARGET.id and got["SAGEATTN3_CACHE"] == str(tmp_path / "cache")
        assert got["PYTHON"] == str(pythons / "cp312-cp312" / "bin" / "python")
        assert got["PIP_DISABLE_PIP_VERSION_CHECK"] == "1" and got["CIBUILDWHEEL"] == "1"
        assert r.timings()["before-all"] > 0


def test_a_toml_that_selects_another_build_is_refused_by_name(tmp_path, pythons):
    config = _toml_copy(tmp_path, lambda t: t.replace('skip = ["*t-*"', 'skip = ["cp310-*", "*t-*"'))
    with pytest.raises(RehearsalError, match=r"cibuildwheel selects \[\] with cibuildwheel.toml.*cp310-manylinux_x86_64"):
        _rehearsal(tmp_path, config, pythons)


def test_the_release_module_holds_no_second_copy_of_cibuildwheel():
    import ci.release

    package = Path(ci.release.__file__).parent
    for f in package.glob("*.py"):
        text = f.read_text()
        assert "build_target_like_cibuildwheel" not in text and "def _run_hook" not in text, f.name
    # nothing in ci/ reads ci/cibuildwheel.toml but cibuildwheel (its options module)
    for f in package.parent.rglob("*.py"):
        src = f.read_text()
        assert '["tool"]["cibuildwheel"]' not in src and "CONFIG_FILE.read" not in src, f.name
    assert sys.modules["ci.release.cibw_job"].cibuildwheel_modules()[0].__name__ == "cibuildwheel.options"
