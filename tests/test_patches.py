"""The patch stage: predicates, pins, apply/idempotence/reverse, drift stops the build."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci.toolchain import patches as P
from ci.stages.build import stage
from ci.stages.resolve import select_flags
from ci.stages.record import sha256_of
from ci.toolchain.targets import Matrix

REPO = Path(__file__).resolve().parent.parent
TARGET_FILE = "csrc/sageattn3.h"


def make_test_patch(tmp: Path, *, sha: str | None = None, when: str = "{}") -> Path:
    """A real patch against the payload's current header: inserts one line after line 1."""
    src = REPO / "sageattn3" / TARGET_FILE
    lines = src.read_text().splitlines(keepends=True)
    a, b = tmp / "a", tmp / "b"
    for root in (a, b):
        (root / "csrc").mkdir(parents=True, exist_ok=True)
    (a / TARGET_FILE).write_text("".join(lines))
    (b / TARGET_FILE).write_text("".join(lines[:1] + ["// patched-by-test\n"] + lines[1:]))
    diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "a/" + TARGET_FILE, "b/" + TARGET_FILE],
                          cwd=tmp, capture_output=True, text=True).stdout
    diff = diff.replace("--- a/a/", "--- a/").replace("+++ b/b/", "+++ b/").replace("a/a/", "a/").replace("b/b/", "b/")
    diff = diff.replace(f"--- a/{TARGET_FILE}", f"--- a/{TARGET_FILE}").replace(f"+++ b/{TARGET_FILE}", f"+++ b/{TARGET_FILE}")
    (tmp / "test.patch").write_text(diff)
    manifest = tmp / "manifest.toml"
    manifest.write_text(
        f'[[patch]]\nname = "test-comment"\nfile = "test.patch"\nreason = "exercise the patch stage"\n'
        f'files = [{{ path = "src:{TARGET_FILE}", sha256 = "{sha or sha256_of(src)}" }}]\nwhen = {when}\n'
    )
    return manifest


def test_predicates_select_by_os_compiler_cuda_torch(tmp_path):
    m = make_test_patch(tmp_path, when='{ os = ["windows-amd64"], compiler = ["msvc"], cuda = ">=12.8", torch = ">=2.7,<2.14" }')
    patches = P.load_manifest(m)
    sel = lambda **kw: [p.name for p in P.select(patches, **kw)]  # noqa: E731
    assert sel(os_key="windows-amd64", compiler="msvc", cuda="13.0", torch_version="2.13.0") == ["test-comment"]
    assert sel(os_key="linux-x86_64", compiler="gcc", cuda="13.0", torch_version="2.13.0") == []
    assert sel(os_key="windows-amd64", compiler="msvc", cuda="13.0", torch_version="2.14.1+cu130") == []
    assert sel(os_key="linux-x86_64", compiler="gcc", cuda="13.0", torch_version="2.14.1", force=("test-comment",)) == ["test-comment"]
    with pytest.raises(P.PatchError, match="no such patch"):
        P.select(patches, os_key="x", compiler="gcc", cuda="13.0", torch_version="2.14.1", force=("nope",))


def test_apply_is_idempotent_and_reversible(tmp_path):
    m = make_test_patch(tmp_path / "p")
    (patch,) = P.load_manifest(m)
    work = tmp_path / "src"
    shutil.copytree(REPO / "sageattn3" / "csrc", work / "csrc")
    assert P.state(patch.file, work) == "applies"
    P.apply(patch, {"src": work}, tmp_path / "overlay")
    assert "// patched-by-test" in (work / TARGET_FILE).read_text()
    assert P.state(patch.file, work) == "applied"
    # applying again is a no-op, not a double edit... except that the pin no longer matches
    # the now-patched file, which is exactly the drift check:
    with pytest.raises(P.PatchDrift):
        P.apply(patch, {"src": work}, tmp_path / "overlay")
    assert P._git_apply(patch.file, work, "--reverse").returncode == 0
    assert (work / TARGET_FILE).read_text() == (REPO / "sageattn3" / TARGET_FILE).read_text()


def test_staging_gets_the_patch_and_the_checkout_does_not(tmp_path, monkeypatch):
    m = make_test_patch(tmp_path / "p")
    monkeypatch.setenv("SAGEATTN3_PATCH_MANIFEST", str(m))
    matrix = Matrix.load()
    t = matrix.target("linux-x86_64-cu130-torch2.10-stable")
    profile, chosen = select_flags(t, matrix, force_patches=("test-comment",))
    staging = stage(t, profile, chosen, build_root=tmp_path / "b")
    assert [p.name for p in chosen] == ["test-comment"]
    (patch,) = chosen
    P.apply(patch, {"src": staging}, staging / "build" / "include-overlay")
    assert "// patched-by-test" in (staging / TARGET_FILE).read_text()
    assert "// patched-by-test" not in (REPO / "sageattn3" / TARGET_FILE).read_text()


def test_drift_message_names_patch_file_and_hashes(tmp_path):
    m = make_test_patch(tmp_path / "p", sha="0" * 64)
    (patch,) = P.load_manifest(m)
    work = tmp_path / "src"
    shutil.copytree(REPO / "sageattn3" / "csrc", work / "csrc")
    with pytest.raises(P.PatchDrift) as e:
        P.apply(patch, {"src": work}, tmp_path / "overlay")
    msg = str(e.value)
    assert "test-comment" in msg and f"src:{TARGET_FILE}" in msg and "0" * 64 in msg
    assert sha256_of(work / TARGET_FILE) in msg and "Refresh the patch" in msg
    assert "// patched-by-test" not in (work / TARGET_FILE).read_text()


def test_manifest_errors_are_clear(tmp_path):
    (tmp_path / "m.toml").write_text('[[patch]]\nname = "x"\nfile = "missing.patch"\nreason = "r"\nfiles = [{ path = "src:a", sha256 = "0" }]\n')
    with pytest.raises(P.PatchError, match="patch file missing.patch not found"):
        P.load_manifest(tmp_path / "m.toml")
    (tmp_path / "n.toml").write_text('[[patch]]\nname = "x"\nfile = "m.toml"\nreason = "r"\nfiles = [{ path = "usr:a", sha256 = "0" }]\n')
    with pytest.raises(P.PatchError, match="must be '<root>:<path>'"):
        P.load_manifest(tmp_path / "n.toml")


def test_shipped_manifest_loads():
    assert isinstance(P.load_manifest(P.MANIFEST), list)


def test_patches_check_command_on_a_real_patch(tmp_path):
    m = make_test_patch(tmp_path / "p")
    env = {**__import__("os").environ, "SAGEATTN3_PATCH_MANIFEST": str(m)}
    out = subprocess.run([sys.executable, "-m", "ci.toolchain.patches", "check"], cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "1 passed, 0 failed" in out.stdout, out.stdout + out.stderr
    drifted = make_test_patch(tmp_path / "q", sha="e" * 64)
    env["SAGEATTN3_PATCH_MANIFEST"] = str(drifted)
    out = subprocess.run([sys.executable, "-m", "ci.toolchain.patches", "check"], cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "drifted" in out.stdout and "0 passed, 1 failed" in out.stdout


def test_torch_msvc_header_fix_against_real_torch_headers():
    """Every torch installed in the factory's cache: the compiled_autograd.h C2872 needs no
    patch because the profile defines USE_CUDA (and stable builds cannot include it)."""
    import glob

    from ci.toolchain.flags import profile_for
    from ci.toolchain.tools import cache_root
    from ci.toolchain.torch_msvc import status

    includes = sorted(glob.glob(str(cache_root() / "envs" / "*" / "lib" / "python3.*" / "site-packages" / "torch" / "include")))
    if not includes:
        pytest.skip("no torch environment in the factory cache yet (run nox -s build-wheels)")
    for inc in includes:
        assert status(Path(inc)) in ("fenced-off", "guarded"), inc
    m = Matrix.load()
    for t in m.targets:
        if t.os.platform == "windows":
            assert "USE_CUDA" in profile_for(t, m.stable_abi_floor)["defines"]


def test_torch_msvc_status_detects_an_unguarded_header(tmp_path):
    from ci.toolchain.torch_msvc import HEADER, status

    h = tmp_path / HEADER
    h.parent.mkdir(parents=True)
    h.write_text("#pragma once\nif constexpr (::std::is_same_v<T, int>) {}\n")
    assert status(tmp_path) == "needs-patch"
    h.write_text("#if defined(_WIN32) && (defined(USE_CUDA) || defined(USE_ROCM))\n#else\nif constexpr (x) {}\n#endif\n")
    assert status(tmp_path) == "guarded"
    h.write_text("#ifdef _WIN32\n  TORCH_INTERNAL_ASSERT(false);\n#else\nif constexpr (x) {}\n#endif\n")
    assert status(tmp_path) == "guarded"  # torch 2.7/2.8's form
    assert status(tmp_path / "nothing") == "absent"


def test_the_test_flavour_takes_forced_patches(monkeypatch, tmp_path):
    """`build-wheels --test-flavour --force-patch NAME`, the command tests/gpu/test_msvc_patch_gpu.py
    names for its wheel, resolves the test flavour's toolchain with that patch forced (it once
    dropped the option and built an unpatched wheel)."""
    from ci.__main__ import main
    from ci.stages import pipeline

    seen = {}

    class Stop(Exception):
        pass

    def resolve_toolchain(target, matrix, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(pipeline.resolve, "resolve_toolchain", resolve_toolchain)
    with pytest.raises(Stop):
        main(["build-wheels", "--test-flavour", "--force-patch", "msvc-pointer-params", "--dist", str(tmp_path)])
    assert seen == {"force_patches": ("msvc-pointer-params",), "mma_model": True}
    # the proof flavour too (a per-torch target whose torch installs here, built with the local CUDA 13)
    from ci.toolchain.targets import Matrix

    matrix = Matrix.load()
    per_torch = next((t for t in matrix.targets if not t.variant.stable and t.os.key == "linux-x86_64"), None)
    if per_torch is None:
        pytest.skip("no per-torch linux-x86_64 target in the matrix")
    seen.clear()
    with pytest.raises(Stop):
        pipeline.build_proof_wheel(per_torch, matrix, tmp_path, force_patches=("msvc-pointer-params",))
    assert seen == {"force_patches": ("msvc-pointer-params",), "proof": True}
