"""End to end: `python -m ci build-wheels` builds this machine's target for real (nvcc,
auditwheel), verifies it with real pip from the index over HTTP in two Pythons, checks the
ABI guard, and fails cleanly on bad input without writing to dist/wheels."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ci.stages.record import BuildRecord, sha256_of
from ci.toolchain.tools import cuobjdump

REPO = Path(__file__).resolve().parent.parent
TARGET = "linux-x86_64-cu130-torch2.10-stable"
needs_nvcc = pytest.mark.skipif(not shutil.which("nvcc"), reason="needs a CUDA 13.0 toolkit")


def factory(*args, env=None, timeout=3600):
    return subprocess.run([sys.executable, "-m", "ci", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


HERE_PY = "%d.%d" % sys.version_info[:2]


@functools.cache
def second_python() -> tuple[str | None, str]:
    """Another Python the wheel's verify torch (2.14.1) has builds for, found or provisioned the
    way the factory does it (ci.toolchain.tools.find_python); None and why when none can be had."""
    from ci.toolchain.tools import ToolchainError, find_python

    problems = []
    for v in ("3.12", "3.13", "3.10", "3.11"):
        if v == HERE_PY:
            continue
        try:
            find_python(v, log=lambda m: None)
            return v, ""
        except ToolchainError as e:
            problems.append(str(e))
    return None, problems[0] if problems else "no other version to try"



@pytest.fixture(scope="module")
def built(tmp_path_factory):
    dist = tmp_path_factory.mktemp("e2e") / "dist"
    second, _ = second_python()
    pythons = [HERE_PY] + ([second] if second else [])
    proc = factory("build-wheels", *[a for py in pythons for a in ("--verify-python", py)], "--dist", str(dist))
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return dist, proc.stdout


@needs_nvcc
def test_default_target_is_built_repaired_tagged_and_recorded(built):
    dist, out = built
    (wheel,) = (dist / "wheels").glob("*.whl")
    assert wheel.name == "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-manylinux_2_34_x86_64.whl"
    rec = BuildRecord.load(wheel.with_name(wheel.name + ".json"))
    assert rec.sha256 == sha256_of(wheel) and rec.size == wheel.stat().st_size
    assert rec.target == TARGET and rec.archs == ("sm_120a", "sm_121a") and rec.requires_torch == "torch>=2.10"
    assert rec.toolchain["nvcc"].startswith("13.0") and rec.toolchain["torch"].startswith("2.14.1")
    assert "-gencode=arch=compute_121a,code=sm_121a" in rec.flags["nvcc_flags"] and rec.patches == ()
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", rec.source_commit)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        inside = json.loads(z.read("sageattn3/_build_record.json"))
        meta = z.read("sageattn3-0.1.0+cu130.torch2.10.stable.dist-info/METADATA").decode()
    assert inside["target"] == TARGET and "sha256" not in inside or inside.get("sha256") == ""
    assert "Requires-Dist: torch>=2.10" in meta
    assert not [n for n in names if "libtorch" in n or "libcudart" in n or n.startswith("sageattn3.libs/")]
    # the summary table and the install command
    assert re.search(rf"{TARGET}\s+sageattn3-.*manylinux_2_34_x86_64\.whl\s+[\d.]+ MB(\s+[\d.]+s){{6}}\s+ok", out)
    assert "pip install --no-deps sageattn3 --index-url file://" in out and "/cu130/torch2.14/" in out
    # a local build points users at the index it wrote (which, the ImportError), not a site
    assert rec.index_url == (dist / "index").resolve().as_uri() + "/" and inside["index_url"] == rec.index_url
    # progress while compiling (units n/m, elapsed), and where the full log is
    units = re.findall(r"^\[build\] compiled (\d+)/(\d+) \S+ \(\d+ s\)$", out, re.M)
    assert units and units[-1][0] == units[-1][1] and len(units) == int(units[-1][1]), out[-3000:]
    log_path = dist / "raw" / f"{TARGET}.build.log"
    assert f"full build log of {TARGET}: {log_path}" in out and "compiled 1/" in log_path.read_text()


@needs_nvcc
def test_wheel_carries_real_kernels_for_both_archs(built, tmp_path):
    dist, _ = built
    (wheel,) = (dist / "wheels").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        so = tmp_path / "_C.abi3.so"
        so.write_bytes(z.read("sageattn3/_C.abi3.so"))
    # kernel functions per arch (shipped cubins have no line info naming their source files)
    elves = subprocess.run([str(cuobjdump()), "--list-text", str(so)], capture_output=True, text=True, check=True).stdout
    for arch in ("sm_120a", "sm_121a"):  # the attention and quantization kernels for every arch
        for kernel in ("fp4_attn_fwd_kernel", "_quant_rows_cu_", "_quant_cols_cu_"):
            assert re.search(rf"{kernel}\S*\.{arch}\.elf\.bin", elves), (kernel, arch, elves)
    assert "sm_90" not in elves  # the model flavour's Hopper code never ships
    needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert "libtorch_cpu.so" in needed and "libcudart.so.13" in needed and "libtorch_python" not in needed


@needs_nvcc
def test_verified_in_two_pythons_with_the_abi_guard(built):
    second, why_not = second_python()
    if not second:
        pytest.skip(f"needs a second Python beside {HERE_PY} for the multi-Python verify: {why_not}")
    _, out = built
    assert f"on Python {HERE_PY}, {second}; ABI guard: torch 2.13.0+cpu: ImportError as expected" in out
    assert "ABI guard with torch 2.13.0+cpu: sageattn3._guard.TorchMismatchError: sageattn3 0.1.0+cu130.torch2.10.stable" in out


@needs_nvcc
def test_index_pages_list_the_wheel_with_its_sha256(built):
    dist, _ = built
    (wheel,) = (dist / "wheels").glob("*.whl")
    page = (dist / "index" / "cu130" / "torch2.14" / "sageattn3" / "index.html").read_text()
    assert f"#sha256={sha256_of(wheel)}" in page and 'data-requires-python="&gt;=3.10"' in page


def test_unknown_target_is_a_clear_error(tmp_path):
    proc = factory("build-wheels", "--target", "linux-x86_64-cu999", "--dist", str(tmp_path / "dist"))
    assert proc.returncode == 2 and "unknown target 'linux-x86_64-cu999'" in proc.stderr and "--list-targets" in proc.stderr
    assert not (tmp_path / "dist" / "wheels").exists()


def test_target_that_cannot_be_built_here(tmp_path):
    # linux-aarch64 CUDA 13.x is cross-built here (tests/test_cross_aarch64.py); CUDA 12.x is not on PyPI for it.
    proc = factory("build-wheels", "--target", "linux-aarch64-cu128-torch2.10-stable", "--target",
                   "linux-x86_64-cu128-torch2.10-stable", "--dist", str(tmp_path / "dist"))
    assert proc.returncode == 1
    assert "CUDA 12.8 for linux-aarch64 is not on PyPI" in proc.stdout
    assert "needs a CUDA 12.8 toolkit" in proc.stdout
    assert not list((tmp_path / "dist").glob("wheels/*"))


def test_bad_matrix_entry_fails_naming_it(tmp_path):
    text = (REPO / "ci" / "targets.toml").read_text().replace('cuda = ["12.8", "12.9"]', 'cuda = ["12.8", "13.0"]', 1)
    bad = tmp_path / "targets.toml"
    bad.write_text(text)
    proc = factory("build-wheels", "--dist", str(tmp_path / "dist"), env={"SAGEATTN3_TARGETS_FILE": str(bad)})
    assert proc.returncode == 2 and "torch 2.8 + CUDA 13.0: PyTorch never published this combination" in proc.stderr
    assert not (tmp_path / "dist").exists()


@needs_nvcc
def test_drifted_patch_stops_before_compiling(tmp_path):
    from test_patches import make_test_patch

    manifest = make_test_patch(tmp_path / "p", sha="f" * 64)
    proc = factory("build-wheels", "--force-patch", "test-comment", "--no-verify", "--torch", "2.14.1",
                   "--dist", str(tmp_path / "dist"), env={"SAGEATTN3_PATCH_MANIFEST": str(manifest)})
    assert proc.returncode == 1 and "PatchDrift: patch test-comment: src:csrc/sageattn3.h has changed" in proc.stdout
    assert "f" * 64 in proc.stdout and "Nothing was built" in proc.stdout
    assert not list((tmp_path / "dist").glob("wheels/*")) and not list((tmp_path / "dist").glob("raw/*/*.whl"))


def _sccache_stats() -> dict:
    from ci.toolchain.tools import compiler_launcher, sccache_env

    (exe,) = compiler_launcher()
    out = subprocess.run([exe, "--show-stats", "--stats-format", "json"], capture_output=True, text=True, check=True,
                         env={**os.environ, **sccache_env()})
    s = json.loads(out.stdout)["stats"]
    total = lambda d: sum(d.get("counts", {}).values())  # noqa: E731
    return {"requests": s["compile_requests"], "hits": total(s["cache_hits"]), "misses": total(s["cache_misses"])}


@needs_nvcc
def test_python_only_change_recompiles_nothing(built, tmp_path):
    """The compiler cache is keyed by what is compiled: adding a Python file to the payload
    changes the wheel but every C++/CUDA translation unit comes from the cache."""
    probe = REPO / "sageattn3" / "sageattn3" / "_cache_probe.py"
    from ci.toolchain.tools import compiler_launcher, sccache_env

    (exe,) = compiler_launcher()
    env = {**os.environ, **sccache_env()}
    # a server running before the build: the build leaves it up (it stops only one it started),
    # so its statistics span the build
    subprocess.run([exe, "--start-server"], env=env, capture_output=True)
    probe.write_text("# a Python-only change\n")
    try:
        before = _sccache_stats()
        proc = factory("build-wheels", "--no-verify", "--dist", str(tmp_path / "dist"))
        after = _sccache_stats()
    finally:
        probe.unlink()
        subprocess.run([exe, "--stop-server"], env=env, capture_output=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert after["requests"] > before["requests"]
    assert after["misses"] == before["misses"], (before, after)
    assert after["hits"] > before["hits"]
    (wheel,) = (tmp_path / "dist" / "wheels").glob("*.whl")
    assert "sageattn3/_cache_probe.py" in zipfile.ZipFile(wheel).namelist()


VERIFY_UNDER = r"""
import json, sys
from pathlib import Path
from ci.stages.record import BuildRecord
from ci.stages.resolve import verify_envs
from ci.stages.verify import verify
rec = BuildRecord.load(Path(sys.argv[1])).with_wheel(Path(sys.argv[1][:-5]))
report = verify(rec, Path(sys.argv[2]), verify_envs(rec, ["3.11"]))
print(json.dumps({"pythons": report.pythons, "guard": report.abi_guard}))
"""


@needs_nvcc
def test_verify_passes_with_pip_settings_that_change_what_gets_installed(built, tmp_path):
    """cibuildwheel runs the release's test command with the toml's test-environment
    (PIP_NO_DEPS=1); users have PIP_TARGET, PIP_USER, constraints. None of it reaches verify's
    own pip and venv calls: the wheel installs from the local index into fresh venvs, the ABI
    guard fires, and nothing lands in the caller's target or prefix."""
    from test_pip_env import hostile_pip_settings

    dist, _ = built
    (wheel,) = (dist / "wheels").glob("*.whl")
    proc = subprocess.run([sys.executable, "-c", VERIFY_UNDER, str(wheel) + ".json", str(dist / "index")],
                          cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **hostile_pip_settings(tmp_path), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["pythons"] == ["3.11"] and got["guard"].endswith("ImportError as expected"), got
    assert not (tmp_path / "pip-target").exists() and not (tmp_path / "pip-prefix").exists()


def test_a_target_replaces_only_its_own_earlier_wheel(tmp_path):
    """The x86_64, aarch64 and Windows wheels of one variant live side by side in dist/wheels: a
    new build of one target replaces that target's earlier wheel, never another OS's."""
    from ci.stages.pipeline import replaced_wheels
    from ci.toolchain.targets import Matrix

    m = Matrix.load()
    names = {"linux-x86_64-cu130-torch2.10-stable": "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-manylinux_2_34_x86_64.whl",
             "linux-aarch64-cu130-torch2.10-stable": "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-manylinux_2_34_aarch64.whl",
             "windows-amd64-cu130-torch2.10-stable": "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-win_amd64.whl"}
    for tid, name in names.items():
        (tmp_path / name).write_bytes(b"w")
        (tmp_path / f"{name}.json").write_text(json.dumps({"target": tid, "wheel": name}))
    x86 = m.target("linux-x86_64-cu130-torch2.10-stable")
    assert replaced_wheels(tmp_path, x86, names[x86.id]) == []
    newer = names[x86.id].replace("0.1.0", "0.1.1")
    assert replaced_wheels(tmp_path, x86, newer) == [tmp_path / names[x86.id]]
