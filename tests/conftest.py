import sys
from collections import Counter
from pathlib import Path

# the factory package (ci/) and test helpers import from the repository root / tests dir
ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def skip_reasons(reports) -> Counter:
    """Skipped tests counted by reason (pytest's "Skipped: " prefix dropped)."""
    counts: Counter = Counter()
    for rep in reports:
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        counts[reason.removeprefix("Skipped: ").strip()] += 1
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per skip reason, most frequent first: hundreds of skips read as a few causes."""
    counts = skip_reasons(terminalreporter.stats.get("skipped", []))
    if not counts:
        return
    terminalreporter.section(f"{sum(counts.values())} skipped, by reason")
    for reason, n in counts.most_common():
        terminalreporter.write_line(f"{n:5d}  {reason}")
