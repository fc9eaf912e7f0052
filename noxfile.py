"""nox sessions of the sageattn3 wheel factory: each a few lines that call into ci/."""

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["build-wheels"]


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
    session.install("-r", "ci/requirements-test.txt")
    session.run("python", "-m", "pytest", *(session.posargs or ["tests", "-q", "-rs"]))
