"""``python -m ci.release.publish github|pages|pypi ...`` (the nox sessions publish and
upload-index call these). ``github`` is the default when the first argument is an option."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ci.release.publish._net import (InputError, LineLog, PublishError, Redactor, RetryPolicy, check_api_url, check_repo, refusal,
                             token_from_env)
from ci.runtime import errors
from ci.runtime.env import FactoryEnv
from ci.stages.provenance import FAILED_STEPS_HELP


def _retry_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--retry-budget", type=float, default=900.0, metavar="SECONDS",
                    help="wall-clock time one request may spend waiting out rate limits (Retry-After, "
                         "X-RateLimit-Reset) and failures before the publish stops (default 900 s; a re-run resumes)")
    ap.add_argument("--retries", type=int, default=None,
                    help="also stop a request after this many attempts (default: no count, only --retry-budget)")
    ap.add_argument("--backoff", type=float, default=1.0, help="first backoff in seconds, doubling (default 1)")
    ap.add_argument("--max-wait", type=float, default=600.0,
                    help="longest single wait the server may ask for (default 600 s)")
    ap.add_argument("--write-interval", type=float, default=FactoryEnv.from_environ().write_interval,
                    help="seconds between mutating requests (GitHub asks for >= 1)")


def _policy(a) -> RetryPolicy:
    if a.retry_budget <= 0:
        raise InputError(f"--retry-budget {a.retry_budget:g}: must be more than 0 seconds")
    return RetryPolicy(attempts=None if a.retries is None else max(1, a.retries), backoff=a.backoff,
                       max_wait=a.max_wait, budget=a.retry_budget)


def with_failed_steps(outputs, folder):
    from ci.stages.provenance import with_failed_steps as fold

    return fold(outputs, folder)


def _json_arg(value: str | None, option: str):
    from ci.stages.provenance import json_argument

    return json_argument(value, option, InputError)


def _api_url() -> str:
    """``--api-url``'s default: ``$GITHUB_API_URL``, else GitHub's."""
    from ci.release.publish.github import DEFAULT_API

    given = FactoryEnv.from_environ().github_api_url
    return DEFAULT_API if given is None else given


def _github(argv: list[str], out) -> int:
    from ci.release.publish.github import ReleaseOptions, publish_release

    ap = argparse.ArgumentParser(prog="python -m ci.release.publish github",
                                 description="Upload wheels, build records and SHA256SUMS to a GitHub Release; "
                                             "publish it once complete. Token: $GITHUB_TOKEN or $GH_TOKEN.")
    ap.add_argument("--tag", required=True, help="vX.Y.Z")
    ap.add_argument("--repo", required=True, help="OWNER/NAME")
    ap.add_argument("--api-url", default=_api_url())
    ap.add_argument("--wheels", type=Path, default=Path("dist/wheels"))
    ap.add_argument("--dry-run", action="store_true", help="print the plan; write nothing")
    ap.add_argument("--replace", action="store_true",
                    help="overwrite assets whose content differs (a draft release; see --replace-published)")
    ap.add_argument("--replace-published", action="store_true",
                    help="with --replace: also overwrite assets of a release that is already published (each is logged)")
    ap.add_argument("--prune", action="store_true", help="delete assets of the release that this run does not have")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--name", default=None, help="release title (default: the tag)")
    ap.add_argument("--notes", default="", help="release body, for a release this run creates")
    ap.add_argument("--prerelease", action="store_true")
    ap.add_argument("--target-commitish", default=FactoryEnv.from_environ().github_sha)
    ap.add_argument("--build-outputs", default=None, metavar="JSON",
                    help="the build jobs' outputs (toJSON(needs.build.outputs), or @file): every wheel must be the one "
                         "its build job verified (ci/stages/provenance.py)")
    ap.add_argument("--plan", default=None, metavar="JSON",
                    help="the planned targets (or @file): those without a wheel are named in the release notes")
    ap.add_argument("--failed-steps", default=None, metavar="DIR",
                    help=FAILED_STEPS_HELP)
    ap.add_argument("--allow-local-build", action="store_true",
                    help="publish wheels that no build job vouches for: without --build-outputs, or whose build record "
                         "names a local index (built outside the release pipeline)")
    _retry_args(ap)
    a = ap.parse_args(argv)
    check_api_url(a.api_url)
    if a.replace_published and not (a.replace or a.prune):
        raise InputError("--replace-published only widens --replace: pass both to overwrite assets of a published release")
    opts = ReleaseOptions(repo=a.repo, tag=a.tag, wheels=a.wheels, api_url=a.api_url, dry_run=a.dry_run,
                          replace=a.replace, replace_published=a.replace_published, prune=a.prune, concurrency=a.concurrency, name=a.name, notes=a.notes,
                          prerelease=a.prerelease, target_commitish=a.target_commitish, retry=_policy(a),
                          write_interval=a.write_interval, build_outputs=with_failed_steps(_json_arg(a.build_outputs, "--build-outputs"), a.failed_steps),
                          plan=_json_arg(a.plan, "--plan"), allow_local_build=a.allow_local_build)
    # The token is required only once the input has been checked (publish_release does both).
    s = publish_release(opts, token_from_env(required=False), log=out)
    if a.dry_run:
        out(f"plan for release {a.tag} of {a.repo} (dry run: nothing written):")
        for line in s.plan:
            out(f"  {line}")
        return 0
    out(s.line())
    return 0


def _pages(argv: list[str], out) -> int:
    from ci.release.publish.pages import PagesOptions, publish_pages

    ap = argparse.ArgumentParser(prog="python -m ci.release.publish pages",
                                 description="Merge a built index (python -m ci.index) into the GitHub Pages branch: "
                                             "one commit per run, earlier releases kept.")
    ap.add_argument("--repo", required=True)
    ap.add_argument("--index", type=Path, default=Path("dist/index"), help="the built index directory")
    ap.add_argument("--branch", default="gh-pages")
    ap.add_argument("--prefix", default="", help="directory of the branch the index lives in (default: its root)")
    ap.add_argument("--base-url", default=None, help="the URL the index is served at, e.g. https://OWNER.github.io/NAME/")
    ap.add_argument("--message", default=None, help="commit message (default: 'index: <tag>')")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--remove", action="append", default=[], metavar="WHEEL_OR_VERSION")
    ap.add_argument("--api-url", default=_api_url())
    ap.add_argument("--dry-run", action="store_true")
    _retry_args(ap)
    a = ap.parse_args(argv)
    check_repo(a.repo)
    check_api_url(a.api_url)
    if not (a.index / "index.json").is_file():
        raise InputError(f"--index {a.index}: no index.json there; build the index first (nox -s index)")
    token = token_from_env(required=not a.dry_run)
    opts = PagesOptions(repo=a.repo, index=a.index, branch=a.branch, prefix=a.prefix, base_url=a.base_url,
                        message=a.message or f"index: {a.tag or 'update'}", remove=tuple(a.remove), api_url=a.api_url,
                        dry_run=a.dry_run, retry=_policy(a), write_interval=a.write_interval)
    s = publish_pages(opts, token, log=out)
    out(s.line())
    return 0


def _pypi(argv: list[str], out) -> int:
    from ci.release.publish.pypi import UploadOptions, upload_index

    ap = argparse.ArgumentParser(prog="python -m ci.release.publish pypi",
                                 description="twine upload (skipping files the server has) to a PyPI-compatible server. Credentials: "
                                             "TWINE_USERNAME/TWINE_PASSWORD (or a __token__ password) in the environment.")
    ap.add_argument("--repository-url", required=True)
    ap.add_argument("--wheels", type=Path, default=Path("dist/wheels"))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--pypi", dest="pypi", action="store_true", default=None,
                      help="PyPI mode: only the default variant, without its local label (automatic for *.pypi.org)")
    mode.add_argument("--all-variants", dest="pypi", action="store_false",
                      help="upload every labelled wheel (servers that accept local versions)")
    ap.add_argument("--default-variant", default=None, help="variant label to publish unlabelled (default: from ci/targets.toml)")
    ap.add_argument("--out", type=Path, default=Path("dist/pypi"), help="where PyPI-mode wheels are written")
    ap.add_argument("--simple-url", default=None,
                    help="the server's PEP 503 root, read to skip files it has (default: pypi.org/simple or <repository-url>/simple/)")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    opts = UploadOptions(repository_url=a.repository_url, wheels=a.wheels, pypi=a.pypi, default_variant=a.default_variant,
                         out=a.out, dry_run=a.dry_run, simple_url=a.simple_url)
    return upload_index(opts, log=out)


def _is_missing_token(e: PublishError) -> bool:
    """Is ``e`` token_from_env's refusal (no token in the environment)? That is the caller's
    to fix, like any bad input: exit status 2."""
    try:
        token_from_env(required=True)
    except PublishError as missing:
        return str(missing) == str(e)
    return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in ("github", "pages", "pypi") else "github"
    redact = Redactor.from_env()
    redact.install()
    logging.basicConfig(level=FactoryEnv.from_environ().publish_log)
    for h in logging.getLogger().handlers:
        h.addFilter(redact)

    def write(msg: str) -> None:
        sys.stdout.write(redact(msg) + "\n")  # one write per event: lines of two threads never mix
        sys.stdout.flush()

    out = LineLog(write)
    # every message is redacted and names itself ("publish github: ...", "interrupted: ...")
    return errors.run_main(lambda: _cli(cmd, argv, out, redact), prefix=None)


class Interrupted(errors.FactoryError):
    """Ctrl-C: a re-run resumes (exit status 130, as a shell reports SIGINT)."""

    exit_code = 130


def _cli(cmd: str, argv: list[str], out: LineLog, redact: Redactor) -> int:
    """The subcommand ``cmd``; what it raises becomes one redacted line and an exit status: 2 for
    bad input (a token missing from the environment included), 1 for a failure, 130 for Ctrl-C."""
    try:
        return {"github": _github, "pages": _pages, "pypi": _pypi}[cmd](argv, out)
    except InputError as e:
        raise errors.InputError(redact(f"publish {cmd}: {e}")) from e
    except PublishError as e:
        bad_input = _is_missing_token(e)
        raise (errors.InputError if bad_input else errors.FactoryError)(redact(f"publish {cmd}: {e}")) from e
    except KeyboardInterrupt as e:
        raise Interrupted("interrupted: re-run the same command to resume") from e
    except Exception as e:  # noqa: BLE001 - never let a traceback carry a secret out unredacted
        r = refusal(e, cmd) if type(e).__module__.startswith("github") else None
        if r is not None:  # an HTTP refusal raised outside the retry loop: still say what to check
            raise errors.FactoryError(redact(f"publish {r}")) from e
        message = redact(f"publish {cmd}: unexpected {type(e).__name__}: {e}")
        if FactoryEnv.from_environ().publish_traceback:
            import traceback

            message += "\n" + redact(traceback.format_exc())
        raise errors.FactoryError(message) from e


if __name__ == "__main__":
    sys.exit(main())
