#!/usr/bin/env python3
"""Plots and report.html for dscluster run directories: python analysis/plot.py runs/<id> [...]

Thin entry point: `dscluster.cli.plot.main`, the work in dscluster.analysis (works from a checkout
without install).
"""

import sys
from pathlib import Path

try:
    import dscluster  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dscluster.cli.plot import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
