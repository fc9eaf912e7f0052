"""CPU tests of the sageattn3 payload, imported from the source tree (no build needed)."""

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "sageattn3"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
