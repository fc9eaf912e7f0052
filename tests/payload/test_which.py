"""The user's "which wheel" answer (sageattn3._which, `python -m sageattn3 which`) and the ABI
guard's advice, which uses it: only pages the build record lists, the picker with a reason
otherwise, unlabelled torch versions take the running torch's CUDA, never "CPU" by assumption."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sageattn3 import _guard, _which

SRC = Path(__file__).resolve().parents[2] / "sageattn3"
ROOT_URL = "https://owner.github.io/sa3/"
PAGES = ["cu128/torch2.7", "cu128/torch2.8", "cu129/torch2.8", "cu130/torch2.13", "cu130/torch2.14",
         "cu132/torch2.13", "cu132/torch2.14"]
RECORD = {"version": "0.1.0+cu130.torch2.10.stable", "variant": "cu130.torch2.10.stable", "cuda": "13.0",
          "requires_torch": "torch>=2.10", "archs": ["sm_120a", "sm_121a"], "index_url": ROOT_URL,
          "extra": {"index_pages": PAGES}}


def ans(version, cuda=None, running=None, record=RECORD):
    return _which.answer(_which.torch_spec(version, cuda, running=running), record)


@pytest.mark.parametrize("version,cuda,running,page", [
    ("2.14.1+cu130", None, None, "cu130/torch2.14"),
    ("2.14.1+cu132", None, None, "cu132/torch2.14"),
    ("2.14.0+cu131", None, None, "cu130/torch2.14"),  # newest CUDA not newer than torch's
    ("2.13.0+cu130", None, None, "cu130/torch2.13"),
    ("2.8.0+cu129", None, None, "cu129/torch2.8"),
    ("2.8.0+cu128", None, None, "cu128/torch2.8"),
    ("2.14.1", "13.0", None, "cu130/torch2.14"),
    ("2.14.1", None, ("2.14.1", "13.0"), "cu130/torch2.14"),  # PyPI's unlabelled CUDA 13.0 build
    ("2.14.1", None, ("2.13.0+cu132", "13.2"), "cu132/torch2.14"),
    # newer than every line built: the newest stable-ABI page of torch's CUDA major
    ("2.15.0+cu130", None, None, "cu130/torch2.14"),
    ("2.15.0", "13.2", None, "cu132/torch2.14"),
    ("3.0.0+cu131", None, None, "cu130/torch2.14"),
])
def test_a_page_that_exists(version, cuda, running, page):
    a = ans(version, cuda, running)
    assert a.page == page and page in PAGES
    assert a.url == ROOT_URL + page + "/"
    flag = "" if a.installed_serves else "--force-reinstall "  # the installed cu130 wheel serves torch >= 2.10
    assert a.command == f"pip install {flag}--no-deps sageattn3 --index-url {ROOT_URL}{page}/"
    assert a.found


@pytest.mark.parametrize("version,cuda,running,why", [
    ("2.13.0+cpu", None, None, "CPU-only build (+cpu)"),
    ("2.14.1", None, ("2.14.1", None), "CPU-only build (torch.version.cuda is None)"),
    ("2.5.1+rocm6.2", None, None, "ROCm build"),
    ("2.14.1", None, None, "has no +cuXYZ label, so its CUDA is unknown here: pass --cuda"),
    ("2.14.1", None, ("2.13.0+cpu", None), "pass --cuda"),  # another torch's CPU build says nothing
    ("2.15.0+cu128", None, None, "no wheel for torch 2.15 with CUDA 12.x: torch 2.15 is newer than every torch line "
                                 "built, and the stable-ABI wheels that load into it are published for CUDA 13.0, CUDA 13.2"),
    ("2.9.0+cu130", None, None, "no wheel was published for torch 2.9"),
    ("2.14.1+cu128", None, None, "no wheel for torch 2.14 with CUDA 12.x (torch 2.14 has wheels for CUDA 13.0, CUDA 13.2)"),
])
def test_the_picker_and_why(version, cuda, running, why):
    a = ans(version, cuda, running)
    assert a.page is None and a.command is None and not a.found
    assert a.url == ROOT_URL
    assert why in a.reason, a.reason
    assert "picker" in a.text() and ROOT_URL in a.text()


def test_cuda_12_torch_uses_a_cuda_12_page():
    a = ans("2.8.0+cu126")
    assert a.page == "cu128/torch2.8"  # same CUDA major, no 12.6 page: the nearest newer CUDA
    assert "compiled with CUDA 12.8" in a.reason


def test_no_page_list_or_no_record_gives_the_picker():
    rec = {k: v for k, v in RECORD.items() if k != "extra"}
    a = ans("2.14.1+cu130", record=rec)
    assert a.page is None and "does not list the index's pages" in a.reason and a.url == ROOT_URL
    a = ans("2.14.1+cu130", record={})
    assert a.page is None and "no build record" in a.reason
    assert a.url == _which.DEFAULT_INDEX_URL


def test_installed_wheel_that_fits_needs_nothing():
    a = ans("2.12.0+cu130")  # no 2.12 page in this record's list, but the installed wheel serves 2.12
    assert a.page is None and a.installed_serves is True and "nothing needs installing" in a.reason
    a = ans("2.14.1+cu130")
    assert a.installed_serves and "already loads into this torch" in a.reason
    assert "--force-reinstall" not in a.command
    a = ans("2.8.0+cu128")
    assert a.installed_serves is False and "--force-reinstall" in a.command


@pytest.mark.parametrize("bad", ["", "torch", "latest", "2"])
def test_bad_versions_are_refused_clearly(bad):
    with pytest.raises(_which.TorchVersionError, match="not a torch version"):
        _which.torch_spec(bad)
    with pytest.raises(_which.TorchVersionError, match="--cuda 13.0"):
        _which.torch_spec("2.14.1", "thirteen")


# ---------------------------------------------------------------------------------------------
# The ABI guard names only pages that exist
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version,cuda", [
    ("2.13.0+cpu", None), ("2.14.1+cu128", "12.8"), ("2.9.0+cu130", "13.0"), ("2.8.0+cu128", "12.8"),
    ("2.8.0+cu129", "12.9"), ("2.14.1", "12.6"), ("2.7.1+cu128", "12.8"), ("2.5.1+rocm6.2", None),
])
def test_guard_message_names_only_existing_pages(version, cuda):
    with pytest.raises(_guard.TorchMismatchError) as ei:
        _guard.check_torch(version, cuda, RECORD)
    msg = str(ei.value)
    for must in (RECORD["variant"], version, "pip install", "--no-deps"):
        assert must in msg, (must, msg)
    assert type(ei.value).__name__ == "TorchMismatchError"
    named = [u for u in msg.split() if u.startswith(ROOT_URL)]
    assert named, msg
    for url in named:
        page = url.removeprefix(ROOT_URL).strip("/").rstrip(".:")
        assert page == "" or page in PAGES, (url, msg)


def test_guard_gives_the_exact_page_when_there_is_one():
    with pytest.raises(_guard.TorchMismatchError) as ei:
        _guard.check_torch("2.8.0+cu128", "12.8", RECORD)
    assert f"pip install --force-reinstall --no-deps sageattn3 --index-url {ROOT_URL}cu128/torch2.8/" in str(ei.value)


def test_a_torch_line_newer_than_the_index_gets_the_newest_stable_page_and_says_so():
    """torch 2.15 (PyPI serves it; the matrix ends at 2.14): the guard lets the stable-ABI wheel
    load, so `which` offers that wheel's newest page instead of "no page", untested."""
    a = ans("2.15.0+cu130")
    assert a.page == "cu130/torch2.14" and a.installed_serves is True and "--force-reinstall" not in a.command
    assert "stable-ABI wheels built against torch 2.14, not tested with torch 2.15" in a.reason
    assert "already loads into this torch" in a.reason
    _guard.check_torch("2.15.0+cu130", "13.0", RECORD)  # and the guard agrees: it loads
    # a per-torch wheel installed: the guard refuses it and names that same page
    classic = {**RECORD, "variant": "cu128.torch2.8", "version": "0.1.0+cu128.torch2.8", "cuda": "12.8",
               "requires_torch": "torch>=2.8,<2.9", "extra": {"index_pages": PAGES, "stable_abi_floor": "2.10"}}
    with pytest.raises(_guard.TorchMismatchError) as ei:
        _guard.check_torch("2.15.0+cu130", "13.0", classic)
    assert f"pip install --force-reinstall --no-deps sageattn3 --index-url {ROOT_URL}cu130/torch2.14/" in str(ei.value)
    # the floor comes from the record (extra.stable_abi_floor), else from a stable variant; without
    # either, nothing says which pages hold stable-ABI wheels: the picker, with the reason
    assert _which.stable_floor(classic) == (2, 10) and _which.stable_floor(RECORD) == (2, 10)
    unknown = {**classic, "extra": {"index_pages": PAGES}}
    assert _which.stable_floor(unknown) is None
    assert ans("2.15.0+cu130", record=unknown).page is None
    assert ans("2.15.0+cu130", record={**classic, "extra": {"index_pages": PAGES, "stable_abi_floor": "2.15"}}).page is None


def test_guard_accepts_what_the_wheel_serves():
    for version, cuda in (("2.10.0+cu130", "13.0"), ("2.14.1", "13.0"), ("2.15.0+cu132", "13.2")):
        _guard.check_torch(version, cuda, RECORD)
    assert _guard.torch_problems("2.14.1", "13.0", RECORD) == []


# ---------------------------------------------------------------------------------------------
# `python -m sageattn3 which` in an installed-like copy of the package
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package with a build record (no compiled extension: `which` needs none)."""
    root = tmp_path_factory.mktemp("site")
    dst = root / "sageattn3"
    shutil.copytree(SRC / "sageattn3", dst, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__",
                                                                           "_build_record.json", "_C*"))
    (dst / "_build_record.json").write_text(json.dumps(RECORD))
    return root


def run_which(root, *args):
    return subprocess.run([sys.executable, "-m", "sageattn3", "which", *args], cwd=root, capture_output=True,
                          text=True, env={"PYTHONPATH": str(root), "PATH": ""})


def test_which_cli_exact_command(installed):
    res = run_which(installed, "--torch", "2.14.1+cu130")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == f"pip install --no-deps sageattn3 --index-url {ROOT_URL}cu130/torch2.14/"


def test_which_cli_unlabelled_version_with_cuda(installed):
    res = run_which(installed, "--torch", "2.14.1", "--cuda", "13.0", "--json", "-")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["page"] == "cu130/torch2.14" and data["torch_cuda"] == "13.0"


def test_which_cli_this_torch(installed):
    res = run_which(installed)
    if torch.version.cuda is None:
        assert res.returncode == 3, res.stderr
        assert "CPU-only build" in res.stdout and ROOT_URL in res.stdout
    else:
        assert res.returncode in (0, 3) and ROOT_URL in res.stdout


def test_which_cli_no_page_and_bad_input(installed):
    res = run_which(installed, "--torch", "2.9.0+cu128")
    assert res.returncode == 3
    assert "no wheel was published for torch 2.9" in res.stdout and ROOT_URL in res.stdout
    res = run_which(installed, "--torch", "two")
    assert res.returncode == 2 and "is not a torch version" in res.stderr
    assert "Traceback" not in res.stderr


def test_which_module_uses_the_standard_library_only():
    """No `packaging` and no factory: the user has neither."""
    src = (SRC / "sageattn3" / "_which.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in src.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "re", "dataclasses"}, imports
