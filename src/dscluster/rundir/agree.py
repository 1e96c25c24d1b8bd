"""One run identity for every rank: the ranks agree on the run directory before anything is trained.

mpirun passes its own environment only to the ranks on its node, so a run id set by hand can split
a run in two directories. entry_cn.sh runs `python -m dscluster.rundir.agree` on every rank: rank 0
listens at the job's rendezvous address, every rank tells it its run id, runs folder and host, and
rank 0 answers one verdict (a split: exit 2 and the fix). `dscluster train` asks the same
(`require_one_run_dir`). Once agreed, rank 0 sets an earlier summary.json aside (`begin`).
How the port is chosen and left free for training: docs/run-directory.md."""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from dscluster.errors import UsageError
from dscluster.node.ranks import detect_ranks, export_env
from dscluster.rundir.layout import resolve_run_id, runs_root
from dscluster.rundir.writer import set_aside_summary

RUN_VARS = ("DSCLUSTER_RUN_ID", "DSCLUSTER_RUNS")
AGREE_TIMEOUT_S = 120.0
"""How long rank 0 waits for every rank's answer; past it the job goes on unchecked (with a warning),
and the launcher's own rendezvous decides, as it did before."""
MAGIC = "dscluster-run-agree/1"
AGREED_ENV = "DSCLUSTER_RUN_AGREED"
"""Set by entry_cn.sh once its ranks agreed, so `dscluster train` does not ask again."""


def identity(rank: int, env: dict | None = None) -> dict:
    """What this rank would write: its run id and runs folder (absolute), host, and which of
    RUN_VARS it was given."""
    env = os.environ if env is None else env
    return {"rank": rank, "host": socket.gethostname(), "run_id": resolve_run_id(env),
            "runs": os.path.abspath(runs_root(env)), "given": [k for k in RUN_VARS if env.get(k)]}


def _where(e: dict, names: tuple[str, ...] = RUN_VARS) -> str:
    given = ", ".join(f"{k} {'set' if k in (e.get('given') or []) else 'not set'}" for k in names)
    return f"{os.path.join(e['runs'], e['run_id'])} ({given})"


def disagreement(entries: list[dict]) -> str | None:
    """None when every rank writes the same run directory, else the message that stops the job:
    which ranks write where, which variable differs, and the fix."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for e in sorted(entries, key=lambda e: e["rank"]):
        groups.setdefault((e["run_id"], e["runs"]), []).append(e)
    if len(groups) <= 1:
        return None
    differ = tuple(k for k, i in (("DSCLUSTER_RUN_ID", 0), ("DSCLUSTER_RUNS", 1)) if len({g[i] for g in groups}) > 1)
    parts = []
    for members in list(groups.values())[:4]:
        names = ", ".join(f"{m['rank']} ({m['host']})" for m in members[:6]) + (" …" if len(members) > 6 else "")
        parts.append(f"rank{'s' if len(members) > 1 else ''} {names} → {_where(members[0], differ)}")
    first = sorted(entries, key=lambda e: e["rank"])[0]
    flags = " ".join(f"-x {k}" for k in differ)
    return ("the ranks of this job would write different run directories, each missing the others' ranks: "
            + "; ".join(parts) + f". mpirun passes {' and '.join(differ)} only to the ranks on its own node. "
            f"Fix: export it to every rank (`mpirun {flags} ...`), or start the job with "
            f"`dscluster launch --run-id {first['run_id']}` (it exports both). Nothing was trained")


def _readline(sock: socket.socket, limit: int = 65536) -> bytes:
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf


def _line(doc: dict) -> bytes:
    return (json.dumps({"magic": MAGIC, **doc}) + "\n").encode()


def _accept_hellos(srv: socket.socket, world: int, job: str, deadline: float) -> dict[int, tuple]:
    """{rank: (connection, its identity)} of the job's other ranks, as they arrive until the deadline."""
    got: dict[int, tuple] = {}
    srv.settimeout(0.2)
    while len(got) < world - 1 and time.monotonic() < deadline:
        try:
            conn, _ = srv.accept()
        except (socket.timeout, TimeoutError):
            continue
        conn.settimeout(10)
        try:
            hello = json.loads(_readline(conn))
            ok = hello.get("magic") == MAGIC and hello.get("job") == job and 0 < int(hello["rank"]) < world
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:  # another job's rank, or not one of ours at all
            conn.close()
            continue
        got[int(hello["rank"])] = (conn, hello)
    return got


def serve(addr: str, port: int, world: int, me: dict, job: str, deadline: float) -> tuple[str | None, list[int]]:
    """Rank 0: collect every rank's identity, answer each with the verdict; (message or None, ranks missing).
    An agreed run directory is opened (`begin`) before any rank hears so."""
    with socket.create_server((addr, port)) as srv:  # SO_REUSEADDR: training binds the port next
        got = _accept_hellos(srv, world, job, deadline)
    missing = [r for r in range(1, world) if r not in got]
    message = disagreement([me, *(hello for _, hello in got.values())])
    if message is None:
        begin(me)
    for conn, _ in got.values():
        try:
            conn.sendall(_line({"ok": message is None, "message": message or ""}))
            conn.settimeout(5)
            conn.recv(1)  # the rank closes first
        except OSError:
            pass
        finally:
            conn.close()
    return message, missing


def ask(addr: str, port: int, me: dict, job: str, deadline: float) -> dict | None:
    """Any other rank: tell rank 0 who we are and return its verdict (None: no answer in time)."""
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((addr, port), timeout=5)
        except OSError:
            time.sleep(0.2)
            continue
        try:
            sock.sendall(_line({**me, "job": job}))
            sock.settimeout(max(1.0, deadline - time.monotonic()) + 15)
            reply = json.loads(_readline(sock))
            return reply if isinstance(reply, dict) and reply.get("magic") == MAGIC else None
        except (OSError, ValueError):
            return None
        finally:
            sock.close()
    return None


def rendezvous(info, env: dict) -> tuple[str, int, str] | None:
    """(address, port, the launcher's job id) to agree at, by node/ranks.py's rule with the launcher's
    id in place of the run id; None where there is nothing to ask (one rank, no live OpenMPI launcher,
    no address to reach)."""

    if info.world_size <= 1 or info.source not in ("openmpi", "pmix"):
        return None  # torchrun and Slurm hand every rank the same id; torchrun's agent holds MASTER_PORT
    if not any(k.startswith("PMIX_SERVER_URI") for k in env):
        return None  # no live launcher (its PMIx server): a rank started by hand would wait for no one
    job = resolve_run_id({k: v for k, v in env.items() if k != "DSCLUSTER_RUN_ID"})
    probe = dict(env)
    export_env(info, job, probe, warn=lambda _w: None)
    if not probe.get("MASTER_ADDR"):
        return None
    return probe["MASTER_ADDR"], int(probe["MASTER_PORT"]), job


def begin(me: dict) -> None:
    """Rank 0, the run directory agreed: an earlier run's summary there is set aside, and said so."""

    run_dir = os.path.join(me["runs"], me["run_id"])
    if (aside := set_aside_summary(Path(run_dir))) is not None:
        print(f"dscluster: {run_dir} held an earlier run: its summary is kept as {aside.name}; summary.json "
              "will tell this run's story", file=sys.stderr)


def settle(env: dict | None = None, timeout_s: float = AGREE_TIMEOUT_S) -> str | None:
    """Ask (rank 0: answer) whether every rank has this run directory: None when they agree or there is
    nothing to ask, else the message that stops this rank. Warnings go to stderr. Raises UsageError where
    the rendezvous itself is wrong (node/ranks.py's rule)."""

    env = dict(os.environ if env is None else env)
    info = detect_ranks(env)
    where = rendezvous(info, env)
    me, deadline = identity(info.rank, env), time.monotonic() + timeout_s
    if where is None:
        if info.rank == 0:
            begin(me)
        return None
    addr, port, job = where
    if info.rank != 0:
        reply = ask(addr, port, me, job, deadline)
        if reply is None:
            _warn(f"rank 0 at {addr}:{port} did not confirm the run directory; going on")
            return None
        return f"stopping: {_where(me)} is not rank 0's run directory (rank 0 says why)" if reply.get("message") \
            else None
    try:
        message, missing = serve(addr, port, info.world_size, me, job, deadline)
    except OSError as e:
        _warn(f"could not check that the ranks share one run directory ({addr}:{port}: {e}); going on")
        return None
    if missing:
        _warn(f"rank(s) {missing} did not report their run directory within {timeout_s:g} s; going on unchecked")
    return message


def _warn(text: str) -> None:
    print(f"dscluster: warning: {text}", file=sys.stderr)


def require_one_run_dir(env: dict | None = None) -> None:
    """`dscluster train`'s guard, before it writes anything: UsageError (exit 2) when the ranks would
    write apart. Skipped where entry_cn.sh has settled it already (AGREED_ENV)."""

    env = os.environ if env is None else env
    if env.get(AGREED_ENV) != "1" and (message := settle(env)):
        raise UsageError(message)


def main() -> int:
    """entry_cn.sh's step: 0 when the ranks agree (or there is nothing to check), 2 when they do not."""

    try:
        message = settle()
    except UsageError as e:
        message = str(e)
    if message:
        print(f"dscluster: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --------------------------------------------------------------------------- a split run, after the fact
# Ranks started without the agreement (no live PMIx server, an older run) may still have written apart.
# Every rank's records name the launcher's job (env/rank-R.json PMIX_NAMESPACE, process/rank-R.json
# launcher_job): a sibling directory whose records name this run's job holds its missing ranks.

def run_job(run_dir: Path) -> str | None:
    """The launcher's job id this run's records name, or None."""
    for sub, key in (("env", "PMIX_NAMESPACE"), ("process", "launcher_job")):
        for f in sorted((Path(run_dir) / sub).glob("rank-*.json")):
            try:
                value = json.loads(f.read_text()).get(key)
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(value, str) and value:
                return value
    return None


def split_command(run_dir: Path, job: str) -> str:
    """Shell command for a node: the run directories beside `run_dir` whose records name `job`."""

    root = shlex.quote(str(Path(run_dir).absolute().parent))
    return (f"cd {root} 2>/dev/null && grep -l -F -- {shlex.quote(job)} */env/rank-*.json */process/rank-*.json "
            "2>/dev/null | cut -d/ -f1 | sort -u")


def split_dirs(run_dir: Path, listing: str) -> list[str]:
    """`split_command`'s output as absolute directories other than `run_dir` itself."""
    parent, name = Path(run_dir).absolute().parent, Path(run_dir).name
    return [str(parent / d) for d in listing.split() if d and d != name]


def split_here(run_dir: Path) -> list[str]:
    """Sibling run directories on this machine holding ranks of the same job as `run_dir`."""
    job = run_job(run_dir)
    if not job:
        return []
    parent = Path(run_dir).absolute().parent
    found = sorted({f.parts[-3] for sub in ("env", "process") for f in parent.glob(f"*/{sub}/rank-*.json")
                    if job in f.read_text(errors="replace")})
    return split_dirs(run_dir, " ".join(found))


def split_message(node: str, dirs: list[str], run_dir: Path) -> str:
    """What `collect` and `diagnose` say of a node whose ranks of this job wrote elsewhere."""
    return (f"{node}: a split run: its ranks of this job wrote under {', '.join(dirs)}, not {run_dir} "
            "(DSCLUSTER_RUN_ID or DSCLUSTER_RUNS did not reach them: mpirun passes them only to the ranks "
            "on its own node). Its files are there, not lost (on another node "
            f"`dscluster collect {dirs[0]}` brings them). Next time export them to every rank "
            "(`mpirun -x DSCLUSTER_RUN_ID -x DSCLUSTER_RUNS`) or use `dscluster launch --run-id`; "
            "entry_cn.sh now stops such a job before training")
