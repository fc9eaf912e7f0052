"""`python -m ci matrix --check-upstream` against local stand-ins of PyPI's simple index (PEP 503
HTML and PEP 691 JSON) and of PyTorch's per-CUDA index, served over HTTP on 127.0.0.1: a stand-in
made from the matrix itself is in step (exit 0); each kind of upstream change is reported with
what to edit (exit 1)."""

from __future__ import annotations

import functools
import http.server
import json
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from ci.toolchain.targets import Matrix
from ci.release.upstream import check_upstream
from ci.toolchain.variant import cuda_tag
from ci.stages.verify import serve, serve_handler

REPO = Path(__file__).resolve().parent.parent
PLATFORMS = {"linux-x86_64": "manylinux_2_28_x86_64", "linux-aarch64": "manylinux_2_28_aarch64",
             "windows-amd64": "win_amd64"}


def pypi_files(matrix: Matrix) -> set[str]:
    """What PyPI would list if it matched the matrix exactly (plus a macOS wheel and a
    free-threaded one, which the check ignores)."""
    out = set()
    for t in matrix.torch:
        for py in t.python:
            tag = f"cp{py.replace('.', '')}"
            for os_key in t.os:
                out.add(f"torch-{t.build_version}-{tag}-{tag}-{PLATFORMS[os_key]}.whl")
            out.add(f"torch-{t.build_version}-{tag}-{tag}-macosx_14_0_arm64.whl")
        out.add(f"torch-{t.build_version}-cp313-cp313t-manylinux_2_28_x86_64.whl")
    return out


def pytorch_files(matrix: Matrix) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for t in matrix.torch:
        for os_key in t.os:
            for cuda in t.published_on(os_key):
                tag = cuda_tag(cuda)
                py = f"cp{t.python[0].replace('.', '')}"
                out.setdefault(tag, set()).add(f"torch-{t.build_version}+{tag}-{py}-{py}-{PLATFORMS[os_key]}.whl")
    return out


def write_simple(root: Path, project_files: set[str]) -> None:
    page = root / "torch"
    page.mkdir(parents=True, exist_ok=True)
    anchors = "\n".join(f'<a href="../../files/{urllib.parse.quote(n)}#sha256={"0" * 64}">{n}</a><br/>'
                        for n in sorted(project_files))
    (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{anchors}\n</body></html>\n")


class _Bucket(http.server.SimpleHTTPRequestHandler):
    """A static index that answers a missing path as download.pytorch.org does: 403 (its files
    live in a storage bucket that refuses keys it does not hold), never 404. ``status`` other
    than 403 stands in for an index that fails."""

    status = 403

    def send_error(self, code, message=None, explain=None):
        super().send_error(self.status if code == 404 else code, message, explain)

    def log_message(self, *args):
        pass


def serve_bucket(root: Path, status: int = 403):
    return serve_handler(functools.partial(type("B", (_Bucket,), {"status": status}), directory=str(root)))


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ci", "matrix", "--check-upstream", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def matrix() -> Matrix:
    return Matrix.load()


def test_an_index_that_matches_the_matrix_is_in_step(tmp_path, matrix):
    write_simple(tmp_path / "pypi", pypi_files(matrix))
    for tag, names in pytorch_files(matrix).items():
        write_simple(tmp_path / "whl" / tag, names)
    with serve_bucket(tmp_path) as url:  # the CUDA directories the matrix does not name: 403
        proc = run_check("--index-url", f"{url}/pypi", "--pytorch-index", f"{url}/whl",
                         "--markdown", str(tmp_path / "drift.md"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matches" in proc.stdout and (tmp_path / "drift.md").read_text() == proc.stdout


def test_each_upstream_change_is_reported_with_what_to_edit(tmp_path, matrix):
    files = pypi_files(matrix)
    files |= {"torch-2.16.0-cp312-cp312-manylinux_2_28_x86_64.whl",  # a new line
              "torch-2.14.2-cp312-cp312-manylinux_2_28_x86_64.whl",  # a newer patch release
              "torch-2.14.1-cp315-cp315-manylinux_2_28_x86_64.whl",  # a Python the line lacks
              "torch-2.17.0rc1-cp312-cp312-manylinux_2_28_x86_64.whl"}  # a pre-release: ignored
    files = {f for f in files if not f.startswith("torch-2.13.0-cp314-")}  # a listed Python gone
    files = {f for f in files if not (f.startswith("torch-2.9.1-") and f.endswith("_aarch64.whl"))}  # an OS gone
    write_simple(tmp_path / "pypi", files)
    standin = pytorch_files(matrix)
    standin["cu128"].add("torch-2.8.0+cu128-cp39-cp39-manylinux_2_28_aarch64.whl")  # now published there
    standin["cu130"] = {f for f in standin["cu130"] if not f.startswith("torch-2.11.0+")}  # withdrawn
    for tag, names in standin.items():
        write_simple(tmp_path / "whl" / tag, names)
    with serve_bucket(tmp_path) as url:
        proc = run_check("--index-url", f"{url}/pypi", "--pytorch-index", f"{url}/whl")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "torch 2.16 is released (2.16.0, Pythons 3.12) and no line of ci/targets.toml names it" in out
    assert "torch 2.14: 2.14.2 is released; build_version is 2.14.1" in out
    assert "torch 2.14: torch 2.14.1 has cp315 wheels, python does not list 3.15" in out
    assert "torch 2.13: python lists 3.14, but torch 2.13.0 has no cp314 wheel: remove it" in out
    assert "torch 2.9: os lists linux-aarch64, but torch 2.9.1 has no wheel for it" in out
    assert "torch 2.8 on linux-aarch64: " in out and "cu128 serves torch 2.8.0, but CUDA 12.8 is not listed" in out
    for os_key in ("linux-x86_64", "linux-aarch64", "windows-amd64"):
        assert f"torch 2.11 on {os_key}: CUDA 13.0 is listed as published, but" in out
    assert "2.17" not in out and "macosx" not in out and "cp313t" not in out
    assert out.count("\n- ") == 9, out


class _Pep691(http.server.BaseHTTPRequestHandler):
    """A JSON-only simple index (PEP 691), as PyPI answers when asked for JSON."""

    files: list[str] = []

    def do_GET(self):
        if self.path.rstrip("/") != "/simple/torch":
            self.send_error(404)
            return
        assert "application/vnd.pypi.simple.v1+json" in self.headers.get("Accept", "")
        body = json.dumps({"meta": {"api-version": "1.1"}, "name": "torch",
                           "files": [{"filename": f, "url": f"/f/{f}", "hashes": {}} for f in self.files]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_json_index_is_read_too(matrix):
    handler = type("H", (_Pep691,), {"files": sorted(pypi_files(matrix)) + ["torch-2.15.1-cp311-cp311-win_amd64.whl"]})
    with serve_handler(handler) as url:
        drift = check_upstream(matrix, f"{url}/simple", log=lambda m: None)
    assert drift.lines == ["torch 2.15: 2.15.1 is released; build_version is 2.15.0"]


def test_an_unreachable_index_is_one_line_and_exit_2(tmp_path):
    with serve(tmp_path) as url:
        pass  # closed again: nothing listens there now
    proc = run_check("--index-url", f"{url}/simple")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and "Traceback" not in proc.stderr
    assert f"{url}/simple/torch/" in proc.stderr


def test_the_pytorch_stand_in_answers_missing_pages_with_403_as_the_real_index_does(tmp_path):
    """The premise of the tests above: a probed CUDA directory that is absent answers 403."""
    import urllib.error
    import urllib.request

    write_simple(tmp_path / "whl" / "cu130", {"torch-2.14.1+cu130-cp310-cp310-manylinux_2_28_x86_64.whl"})
    with serve_bucket(tmp_path) as url:
        urllib.request.urlopen(f"{url}/whl/cu130/torch/", timeout=30).read()
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"{url}/whl/cu117/torch/", timeout=30)
    assert ei.value.code == 403


@pytest.mark.parametrize("status", [401, 500, 503])
def test_an_index_that_answers_other_errors_is_exit_2_naming_the_url(tmp_path, matrix, status):
    write_simple(tmp_path / "pypi", pypi_files(matrix))
    for tag, names in pytorch_files(matrix).items():
        write_simple(tmp_path / "whl" / tag, names)
    with serve_bucket(tmp_path, status=status) as url:  # a missing CUDA directory answers `status`
        proc = run_check("--index-url", f"{url}/pypi", "--pytorch-index", f"{url}/whl")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(rf"^error: {re.escape(url)}/whl/cu\d+/torch/: HTTP {status} ", proc.stderr, re.M), proc.stderr
    assert "Traceback" not in proc.stderr
