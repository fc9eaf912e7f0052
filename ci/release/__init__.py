"""The release pipeline's own steps (``.github/workflows/release.yml``) and its local dry run.

    plan     the matrix JSON of ``nox -s matrix`` checked against ci/targets.toml (every target,
             nothing else), optionally narrowed to chosen target ids, as the build jobs' matrix
    (build)  one job per target: cibuildwheel -> the factory's build/repair/tag/verify (ci/release/cibw/__main__.py),
             uploading the wheel + its build record as the artifact ``wheel-<target id>``
    report   which planned targets produced their artifact and which did not (by name, with
             the command that re-runs them); the run's summary page
    gather   the publish job's gate: each planned target whose build job verified its wheel (the
             job output ``target_<id>``, ci.stages.provenance), its artifact holding exactly that
             wheel -> dist/wheels; the others named with their failing step
    (publish) attestations, ``nox -s publish`` (GitHub Release), ``nox -s index`` + ``pages``

Partial failure policy: **a partial release, stated.** The publish job runs once the build jobs
have finished and publishes every target whose job verified its wheel; the release notes name
the missing ones with their failing step, the report names them too, and "Re-run failed jobs"
rebuilds only them, after which publish adds their wheels without touching the rest. An artifact
that is not the wheel its job verified stops the publish (exit 2). A run of chosen targets
(``workflow_dispatch`` with ``targets``) builds them and never publishes.
The Release is uploaded as a draft and published only once complete, and the index is
updated in one commit after that, so a user never sees a half-updated release or index.

``python -m ci.release dry-run`` (``nox -s release -- --dry-run``) runs the same steps for the
targets this machine can build, each job run by the pinned cibuildwheel itself in a stand-in
manylinux container (ci/release/cibw_local), and publishes to a local
server speaking GitHub's REST contract (ci/release/github_standin.py).

One module per concern:

    ci.release.steps             plan, check-tag, report, gather, and the publish job's steps
    ci.release.workflow_lint     the workflows' pinned tools (cibuildwheel, actionlint, zizmor) and the lint
    ci.release.standin           a stand-in for PyTorch's index (HTTP on 127.0.0.1) serving PyPI's torch wheels
    ci.release.torch_resolution  the jobs' torch specs resolved by real pip against the stand-in
    ci.release.rehearsal         the dry run: every job planned and checked, those buildable here run
    ci.release.__main__          the command line (``python -m ci.release``)
"""

from __future__ import annotations

from pathlib import Path
from ci.runtime.errors import FactoryError, InputError

REPO = Path(__file__).resolve().parent.parent.parent


class ReleaseError(FactoryError, RuntimeError):
    """A step of the release cannot go on (exit status 1)."""


class ReleaseInputError(ReleaseError, InputError):
    """The step's input is refused before anything is copied or sent: an artifact whose wheel
    is unsafe, inconsistent, or not the one its build job verified (exit status 2)."""
