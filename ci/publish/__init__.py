"""Publishing: GitHub Releases (``ci.publish.github``), the pip index on the GitHub Pages
branch (``ci.publish.pages``), and twine uploads to PyPI-compatible servers
(``ci.publish.pypi``). Command line: ``python -m ci.publish {github,pages,pypi} --help``.

Secrets come only from the environment (``GITHUB_TOKEN``/``GH_TOKEN``, ``TWINE_*``) and are
redacted from everything this package prints, logs or raises."""

from ci.publish._net import PublishError, RetryPolicy
from ci.publish.github import ReleaseOptions, Summary, publish_release

__all__ = ["PublishError", "ReleaseOptions", "RetryPolicy", "Summary", "publish_release"]
