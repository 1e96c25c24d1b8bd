"""A rank that died building one of DeepSpeed's JIT ops: what it printed, and the fix.

A DeepSpeed config whose optimizer is DeepSpeed's own Adam/Lamb (or ZeRO-Offload's CPUAdam) compiles
the op on first use. Where that cannot work the rank dies in `deepspeed.initialize`, and the run's
summary says no more than "exit 1 on rank 0". The text is in the rank's end record (`dscluster
train`), or in the tail of a user's program's stderr that entry_cn.sh keeps (process/rank-R.stderr).
The same causes `dscluster check` finds before a run (check/dsops.py), told from the other side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STDERR_TAIL_BYTES = 16384
"""How much of a program's stderr diagnose reads (its end: where the traceback is)."""


@dataclass(frozen=True)
class OpBuildCause:
    kind: str
    pattern: re.Pattern
    what: str
    fix: str


CAUSES = (
    OpBuildCause("arch_list", re.compile(r"invalid literal for int\(\) with base 10: '\d*[A-Za-z]+[^']*'"),
                 "TORCH_CUDA_ARCH_LIST has an entry DeepSpeed's op builder cannot parse (a letter suffix such as "
                 "9.0a)",
                 "run `dscluster check` (it writes a usable TORCH_CUDA_ARCH_LIST into each node's env file, which "
                 "entry_cn.sh exports), or export TORCH_CUDA_ARCH_LIST without the suffix (9.0 for 9.0a) to every "
                 "rank (`mpirun -x TORCH_CUDA_ARCH_LIST`)"),
    OpBuildCause("ninja", re.compile(r"Ninja is required to load C\+\+ extensions|ninja: (command )?not found"),
                 "no ninja, which DeepSpeed builds its ops with", "pip install ninja (into the environment the ranks "
                 "run: entry_cn.sh puts its bin/ first on PATH)"),
    OpBuildCause("cuda_mismatch", re.compile(r"[Ii]nstalled CUDA version (\S+) does not match the version torch was "
                                             r"compiled with (\S+?),?\s"),
                 "the CUDA toolkit (nvcc) and torch's CUDA differ in major version",
                 "point CUDA_HOME at a toolkit of torch's CUDA major version, or prebuild the ops "
                 "(DS_BUILD_FUSED_ADAM=1 pip install deepspeed --no-build-isolation)"),
    OpBuildCause("nvcc", re.compile(r"CUDA_HOME does not exist|nvcc: (command )?not found|No such file or directory: "
                                    r"'[^']*/bin/nvcc'|CUDA_HOME environment variable is not set"),
                 "no nvcc (CUDA toolkit) to build the op with", "install the CUDA toolkit of torch's CUDA version and "
                 "set CUDA_HOME on every node, or prebuild the ops (DS_BUILD_FUSED_ADAM=1 pip install deepspeed "
                 "--no-build-isolation)"),
)
_OP_BUILDER = re.compile(r"op_builder|cpp_extension|jit_load|FusedAdam|FusedLamb|CPUAdam|DeepSpeedCPUAdam")


def op_build_cause(text: str | None) -> tuple[OpBuildCause, str] | None:
    """(the cause, the line that shows it) where `text` (an error or a traceback) is a DeepSpeed op build's
    death, else None. The arch-list ValueError counts only with the op builder in the traceback, or alone
    as an end record's error (where no traceback was kept)."""
    if not text:
        return None
    for cause in CAUSES:
        m = cause.pattern.search(text)
        if m is None:
            continue
        if cause.kind == "arch_list" and "\n" in text.strip() and not _OP_BUILDER.search(text):
            continue  # another int() of a string with a letter, in a traceback that never built an op
        line = next((l.strip() for l in text.splitlines() if m.group(0) in l), m.group(0))
        return cause, line
    return None


def read_tail(path, limit: int = STDERR_TAIL_BYTES) -> str | None:
    """The end of a file as text (None where it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None
