"""CPU seconds per test, the processes of simulated lab nodes included: `make test-cpu` (root).

The suite is CPU-bound on two cores, and `--durations` shows wall clock only; `time` on pytest misses
every process a lab node starts (children of the node's sshd, not of pytest). Each pytest worker moves
itself into a control group of its own before its first test, so everything it starts (sshd daemons,
mpirun, ranks, their children) is counted there, and each test's CPU is the group's usage before and
after it (fixtures included: a module's lab lands on its first test, its teardown on its last).

    DSCLUSTER_TEST_CPU=cpu.jsonl python -m pytest -p _cpuaccount -n 2 --dist loadfile ...
    python tests/_cpuaccount.py cpu.jsonl          # per file and per test, most CPU first

Needs root and the cgroup v1 `cpuacct` hierarchy or cgroup v2; without them it says so and counts
nothing. The groups it made are removed at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

ENV = "DSCLUSTER_TEST_CPU"
_group: tuple[Path, str] | None = None   # (the worker's group, the file that reads its usage)


def _hierarchy() -> tuple[Path, str, float] | None:
    """(where groups are made, usage file, seconds per unit): cgroup v1 cpuacct, else v2."""
    v1 = Path("/sys/fs/cgroup/cpuacct")
    if (v1 / "cpuacct.usage").exists():
        return v1, "cpuacct.usage", 1e-9
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            own = Path("/proc/self/cgroup").read_text().splitlines()
            rel = next((ln.split("::", 1)[1] for ln in own if ln.startswith("0::")), "/")
            return Path(fields[1]) / rel.lstrip("/"), "cpu.stat", 1e-6
    return None


def _usage() -> float:
    assert _group is not None
    group, name = _group
    text = (group / name).read_text()
    if name == "cpu.stat":
        return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("usage_usec"))) * 1e-6
    return float(text) * 1e-9


def pytest_configure(config):
    global _group
    if not os.environ.get(ENV):
        return
    found = _hierarchy()
    if found is None or os.geteuid() != 0:
        print(f"{ENV}: needs root and cgroup v1 cpuacct or cgroup v2; counting nothing", file=sys.stderr)
        return
    root, name, _ = found
    group = root / f"dscluster-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        print(f"{ENV}: cannot make {group} ({e}); counting nothing", file=sys.stderr)
        return
    _group = (group, name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _group is None:
        yield
        return
    cpu0, t0 = _usage(), time.monotonic()
    yield
    row = {"test": item.nodeid, "cpu_s": round(_usage() - cpu0, 2), "wall_s": round(time.monotonic() - t0, 2),
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(os.environ[ENV], "a", encoding="utf-8") as f:   # one short line an append: workers' lines stay whole
        f.write(json.dumps(row) + "\n")


def pytest_unconfigure(config):
    if _group is None:
        return
    group = _group[0]
    try:   # back to the parent group, so that this one is empty and can go
        (group.parent / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()
    except OSError:
        pass   # a process started by a test still lives in it: the group stays, empty groups cost nothing


def report(path: Path, top: int = 30) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    files: dict[str, list[float]] = {}
    for r in rows:
        f = files.setdefault(r["test"].split("::")[0], [0.0, 0.0, 0])
        f[0] += r["cpu_s"]
        f[1] += r["wall_s"]
        f[2] += 1
    cpu = sum(r["cpu_s"] for r in rows)
    out = [f"{len(rows)} tests, {cpu:,.0f} CPU-s in all ({sum(r['wall_s'] for r in rows):,.0f} s of tests' wall clock)",
           "", "CPU-s  wall-s  tests  file"]
    by_cpu = sorted(files.items(), key=lambda kv: -kv[1][0])[:top]
    out += [f"{c:6.0f} {w:7.0f} {n:6d}  {name}" for name, (c, w, n) in by_cpu]
    out += ["", "CPU-s  wall-s  test"]
    out += [f"{r['cpu_s']:6.1f} {r['wall_s']:7.1f}  {r['test']}" for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]]
    return "\n".join(out)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
