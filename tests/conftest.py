import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The tests import the packages from the checkout even when run outside the venv.
for p in (ROOT / "daemon", ROOT / "client", ROOT / "contract", ROOT / "testing"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

IN_CI = os.environ.get("CI") == "true"
