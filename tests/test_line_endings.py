"""Line endings: every text file is checked out with LF on every OS (.gitattributes), because
the patch pins are sha256 sums of LF files; a checkout that converted to CRLF anyway (an old
commit, a local clone) is refused with a message that names the cause."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from ci.toolchain import patches as patchmod

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not (shutil.which("git") and (REPO / ".git").exists()),
                                reason="needs git and a git checkout of the repository")


def _git(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, check=True, **kw)


def _pinned_and_patch_files() -> list[str]:
    """Every payload file a patch pins, and the patch files themselves (repository paths)."""
    out = []
    for p in patchmod.load_manifest():
        out.append(p.file.relative_to(REPO).as_posix())
        out += [f"sageattn3/{f.path}" for f in p.files if f.root == "src"]
    assert out, "the manifest pins no payload file"
    return out


def test_every_pinned_file_is_checked_out_with_lf():
    files = _pinned_and_patch_files()
    attrs = _git("check-attr", "eol", "--", *files, text=True).stdout.splitlines()
    assert attrs == [f"{f}: eol: lf" for f in files]


def test_a_windows_style_checkout_keeps_the_bytes(tmp_path):
    """What actions/checkout does on a Windows runner (git's core.autocrlf=true, the Git for
    Windows default): the checked-out bytes are the committed ones, for every tracked file."""
    _git("-c", "core.autocrlf=true", "-c", "core.eol=crlf", "checkout-index", "--all", f"--prefix={tmp_path}/")
    tracked = _git("ls-files", "-z").stdout.decode().split("\0")
    for rel in [t for t in tracked if t and (tmp_path / t).is_file()]:
        data = (tmp_path / rel).read_bytes()
        if b"\r\n" in data:
            blob = _git("cat-file", "blob", f":{rel}").stdout
            assert data == blob, f"{rel}: the checkout converted its line endings to CRLF"
    for rel in _pinned_and_patch_files():
        assert (tmp_path / rel).read_bytes() == _git("cat-file", "blob", f":{rel}").stdout, rel


def test_a_crlf_copy_of_a_pinned_file_is_refused_with_the_cause(tmp_path):
    src = tmp_path / "src"
    (src / "csrc").mkdir(parents=True)
    lf = b"int a;\nint b;\n"
    (src / "csrc" / "k.cu").write_bytes(lf.replace(b"\n", b"\r\n"))
    diff = tmp_path / "k.patch"
    diff.write_text("--- a/csrc/k.cu\n+++ b/csrc/k.cu\n@@ -1,2 +1,2 @@\n int a;\n-int b;\n+int c;\n")
    patch = patchmod.Patch("k", diff, (patchmod.PinnedFile("src", "csrc/k.cu", hashlib.sha256(lf).hexdigest()),),
                           patchmod.Predicate(), "test")
    with pytest.raises(patchmod.PatchDrift, match="CRLF line endings") as e:
        patchmod.apply(patch, {"src": src}, tmp_path / "overlay")
    assert "eol=lf" in str(e.value) and "core.autocrlf false" in str(e.value)
    problems = patchmod.check_patch(patch, {"src": src}, tmp_path / "work")
    assert len(problems) == 1 and "CRLF line endings" in problems[0]
    # another change is still reported as drift, without the line-ending story
    (src / "csrc" / "k.cu").write_bytes(b"int a;\r\nint z;\r\n")
    with pytest.raises(patchmod.PatchDrift, match="Refresh the patch") as e:
        patchmod.apply(patch, {"src": src}, tmp_path / "overlay")
    assert "CRLF" not in str(e.value)
    # the LF file applies
    (src / "csrc" / "k.cu").write_bytes(lf)
    patchmod.apply(patch, {"src": src}, tmp_path / "overlay")
    assert (src / "csrc" / "k.cu").read_bytes() == b"int a;\nint c;\n"
