#!/usr/bin/env python3
"""One GPU, a first and a second plan against the runs after them, as a user pastes them
(dscluster.bench.onegpu): `dscluster plan`, the README command, `dscluster plan` again, the run again.

    .venv/bin/python bench/plan_onegpu.py              # on a GPU host: about 6 minutes on one H200
    .venv/bin/python bench/plan_onegpu.py --dry-run    # the commands in order, nothing run
"""
import sys

from dscluster.bench.onegpu import main

if __name__ == "__main__":
    sys.exit(main())
