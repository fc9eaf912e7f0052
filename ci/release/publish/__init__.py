"""Publishing: GitHub Releases (``ci.release.publish.github``), the pip index on the GitHub Pages
branch (``ci.release.publish.pages``), and twine uploads to PyPI-compatible servers
(``ci.release.publish.pypi``). Command line: ``python -m ci.release.publish {github,pages,pypi} --help``.

Secrets come only from the environment (``GITHUB_TOKEN``/``GH_TOKEN``, ``TWINE_*``) and are
redacted from everything this package prints, logs or raises."""

from ci.release.publish._net import PublishError, RetryPolicy
from ci.release.publish.github import ReleaseOptions, Summary, publish_release

__all__ = ["PublishError", "ReleaseOptions", "RetryPolicy", "Summary", "publish_release"]
