"""RUN_DIR/traces/rank-R.txt: where a stuck or dying rank was, in Python stacks."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
import traceback
from pathlib import Path

from dscluster.rundir import layout


class StackTraces:
    """RUN_DIR/traces/rank-R.txt: Python stacks of every thread when the rank is stuck or dies.

    `kill -USR1 <pid>` writes them without stopping the rank (where does a hang wait?); a
    SIGTERM (mpirun tearing the job down) writes them and then terminates as before; an
    exception writes them plus its traceback. `dscluster diagnose` lists the files. Works on
    any backend (the flight recorder in nccl_trace/ covers the collectives themselves).
    """

    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / layout.TRACES_DIR / f"rank-{rank}.txt"
        self.file = None
        self.signals: list[int] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError:
            return
        if hasattr(faulthandler, "register"):
            faulthandler.register(signal.SIGUSR1, file=self.file, all_threads=True)
            faulthandler.register(signal.SIGTERM, file=self.file, all_threads=True, chain=True)
            self.signals = [signal.SIGUSR1, signal.SIGTERM]

    def exception(self) -> None:
        if self.file is None:
            return
        try:
            self.file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: exception, all threads\n")
            self.file.flush()
            faulthandler.dump_traceback(file=self.file, all_threads=True)
            traceback.print_exc(file=self.file)
            self.file.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        for sig in self.signals:
            faulthandler.unregister(sig)
        self.signals = []
        if self.file is not None:
            self.file.close()
            self.file = None
            try:
                if self.path.stat().st_size == 0:  # nothing happened: no empty files in a healthy run
                    self.path.unlink()
                    self.path.parent.rmdir()
            except OSError:
                pass
