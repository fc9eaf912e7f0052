"""The release notes' section on targets a partial release lacks: each planned target without a
wheel, with why (its build job's failing step), between markers so that a later run (after the
failed jobs were re-run) rewrites or removes it and leaves the rest of the notes alone."""

from __future__ import annotations

import re

BEGIN, END = "<!-- sageattn3: missing targets -->", "<!-- /sageattn3: missing targets -->"
_SECTION = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.S)


def missing_section(missing: dict[str, str]) -> str:
    if not missing:
        return ""
    items = "\n".join(f"- `{t}`: {why}" for t, why in sorted(missing.items()))
    return (f"{BEGIN}\n### Not in this release yet ({len(missing)} target{'s' * (len(missing) != 1)})\n\n{items}\n\n"
            "Re-running the failed build jobs of the release run (`gh run rerun RUN_ID --failed`), then its publish "
            f"job, adds their wheels without touching the others.\n{END}\n")


def with_missing(body: str, missing: dict[str, str]) -> str:
    """``body`` with its missing-targets section replaced by the current one (removed when
    nothing is missing)."""
    rest = _SECTION.sub("", body or "").rstrip("\n")
    section = missing_section(missing)
    if not section:
        return rest + ("\n" if rest else "")
    return (rest + "\n\n" if rest else "") + section
