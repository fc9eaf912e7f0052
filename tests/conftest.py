import sys
from pathlib import Path

# the factory package (ci/) and test helpers import from the repository root / tests dir
ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
