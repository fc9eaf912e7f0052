"""nox sessions of the sageattn3 wheel factory: each a few lines that call into ci/.

Exit status: nox reports any failure of a session as 1. The ``python -m ci ...`` commands the
sessions run keep their own codes (2: bad input, 1: a stage failed); docs/factory.md lists them.
"""

import logging
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["build-wheels"]

# nox says on every session that it looked for uv; the venv backend never uses it.
logging.getLogger("nox").addFilter(lambda record: record.getMessage() != "uv binary not found.")



def _factory(session: nox.Session) -> None:
    session.install("-r", "ci/requirements.txt")


@nox.session(name="build-wheels")
def build_wheels(session: nox.Session) -> None:
    """Build, repair, tag and verify wheels into dist/ (default: this machine's target)."""
    _factory(session)
    session.run("python", "-m", "ci", "build-wheels", *session.posargs)


@nox.session
def matrix(session: nox.Session) -> None:
    """Print the GitHub Actions matrix JSON (one job per build unit)."""
    session.install("packaging")
    session.run("python", "-m", "ci", "matrix", *session.posargs, silent=False)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (CPU; GPU tests skip without a GPU)."""
    _factory(session)
    # A CPU torch for the payload's reference tests; builds use their own envs.
    session.install("pytest", "numpy")
    _install_cpu_torch(session)
    if Path("ci/requirements-test.txt").exists():
        session.install("-r", "ci/requirements-test.txt")
    # nox itself (the release's hashed pin): the tests run sessions of this file (--no-venv).
    session.install("-r", "ci/requirements-nox.txt")
    session.run("python", "-m", "pytest", *(session.posargs or ["tests", "-q"]))


def _install_cpu_torch(session: nox.Session) -> None:
    """The CPU torch (ci/toolchain/cpu_torch/: the +cpu build from pip's index, else PyTorch's CPU
    index, else the plain release with a warning), checked to be a CPU build."""
    session.run("python", "-m", "ci.toolchain.cpu_torch", "install")


@nox.session(venv_backend="none")
def clean(session: nox.Session) -> None:
    """Remove what the factory keeps between runs: its cache (torch environments, CUDA toolkits,
    compiler cache), build/ and .nox/; `-- --dist` also dist/. Prints what each held."""
    session.run(sys.executable, "-m", "ci.checks.clean", *session.posargs, external=True)


@nox.session(name="bench-build")
def bench_build(session: nox.Session) -> None:
    """Cold/warm build time, peak memory and wheel size of the host target (prints figures)."""
    _factory(session)
    session.run("python", "-m", "ci.checks.bench", *session.posargs)


def _publisher(session: nox.Session) -> None:
    _factory(session)
    if Path("ci/requirements-test.txt").exists():
        session.install("-r", "ci/requirements-test.txt")


PUBLISH_LOCK = "ci/requirements-publish.txt"


def _publish_tools(session: nox.Session) -> None:
    """Only what publishing imports (PyGithub, requests, twine, packaging), every file pinned
    by hash: these sessions hold the release token."""
    session.install("--require-hashes", "--only-binary", ":all:", "-r", PUBLISH_LOCK)


@nox.session
def publish(session: nox.Session) -> None:
    """Publish dist/wheels to a GitHub Release (token from GITHUB_TOKEN/GH_TOKEN)."""
    _publish_tools(session)
    session.run("python", "-m", "ci.release.publish", "github", *session.posargs)


@nox.session
def index(session: nox.Session) -> None:
    """Write or merge the pip index (PEP 503 per variant + find-links pages)."""
    _publish_tools(session)
    session.run("python", "-m", "ci.index", *session.posargs)


@nox.session
def gather(session: nox.Session) -> None:
    """The publish job's gate: every planned target's wheel + record into dist/wheels, or nothing
    (python -m ci.release gather)."""
    _publish_tools(session)
    session.run("python", "-m", "ci.release", "gather", *session.posargs)


@nox.session
def pages(session: nox.Session) -> None:
    """Merge the built index into the GitHub Pages branch, one commit (token from GITHUB_TOKEN/GH_TOKEN)."""
    _publish_tools(session)
    session.run("python", "-m", "ci.release.publish", "pages", *session.posargs)


@nox.session(name="upload-index")
def upload_index(session: nox.Session) -> None:
    """twine upload (skip-existing) to a PyPI-compatible server; credentials from the environment."""
    _publish_tools(session)
    session.run("python", "-m", "ci.release.publish", "pypi", *session.posargs)


@nox.session
def patches(session: nox.Session) -> None:
    """`-- check`: every patch applies/reverses cleanly against its pins; `-- list --target ID`."""
    _factory(session)
    session.run("python", "-m", "ci.toolchain.patches", *(session.posargs or ["check"]))


@nox.session
def release(session: nox.Session) -> None:
    """Release pipeline steps (`-- plan|report|check-tag|lint-workflows`; the publish job runs the
    lock-only sessions gather, publish, index and pages instead); `-- --dry-run` runs the whole
    pipeline for the targets buildable here, publishing to a local GitHub-REST server."""
    _publisher(session)
    session.run("python", "-m", "ci.release", *(session.posargs or ["--help"]))


@nox.session
def cibuildwheel(session: nox.Session) -> None:
    """The pinned cibuildwheel, for real, with ci/cibuildwheel.toml on a Linux target: podman
    (Debian's; installed when missing, as root) and a manylinux stand-in image built here
    (ci/release/standin_image/). `-- --target ID` (default: the host's stable-ABI target),
    `-- --payload-dir tests/cibw_probe` (a one-file extension through the same hooks, with its
    own stages from tests/cibw_probe/cibw_stages.py, in minutes)."""
    _factory(session)
    session.run("python", "-m", "ci.release.cibw_local", *session.posargs)


def _has_gpu() -> bool:
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def _option(args: list[str], name: str) -> str | None:
    """The value of ``name VALUE`` or ``name=VALUE`` among a session's arguments (the last one)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


@nox.session(name="bench-kernels")
def bench_kernels(session: nox.Session) -> None:
    """Registers, shared memory and spills per kernel for sm_120a/sm_121a/sm_90a-model (CPU:
    compiles the sources; `-- --wheel W.whl` reads a wheel's cubins instead); with a GPU, also
    tests/bench/bench_kernels.py against that wheel (installed here with torch), or whatever
    sageattn3 this session already has."""
    _factory(session)
    session.run("python", "-m", "ci.checks.kernel_report", *session.posargs)
    if not _has_gpu():
        session.log("no GPU: kernel benchmark skipped")
        return
    session.install("torch", "numpy")
    wheel = _option(session.posargs, "--wheel")
    if wheel:
        session.install("--no-deps", "--force-reinstall", wheel)
    session.run("python", "tests/bench/bench_kernels.py")
    session.run("python", "tests/bench/attention_standin.py")  # Hopper only: the attention's timing stand-in
