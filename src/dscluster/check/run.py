"""Running a check: probe every node, evaluate the rules, test reachability, run the active
tests, and write what launch needs. The rules themselves are pure (check/rules.py); this is
the part that talks to machines.

Order matters for the user's time: the passive probe of all nodes runs in parallel and
takes about one Python start per node; the mesh and master-port tests reuse the same SSH
sessions; the active tests (mpirun hello, all-reduce) run only when nothing found so far
would make them hang, because a hung mpirun teaches less than the finding that predicts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from dscluster.check.facts import NodeFacts
from dscluster.check.layout import layout_findings, probe_layout
from dscluster.check.nccltune import SOCKS, THREADS, decide_socket_tuning, grid_envs, grid_point, why_not_tuned
from dscluster.check.netprobe import run_pairs
from dscluster.check.netrules import evaluate_links, iface_mtus, links_summary
from dscluster.check.probe import (
    ProbeSettings,
    default_key,
    open_session,
    parse_reach,
    probe_node,
    reach_script,
    runs_dir_for_probe,
    start_listener,
    start_ready,
)
from dscluster.check.rules import Evaluation, Finding, evaluate, has_errors, node_envs
from dscluster.errors import UsageError
from dscluster.files import paths, state
from dscluster.launch.mcaparams import parse_writer, writer_command
from dscluster.launch.mpirun import App, mpirun_argv, mpirun_path
from dscluster.node.hosts import Hostfile, hostfile_sha256, parse_hostfile
from dscluster.ssh import remote, thishost

# Findings that make an mpirun across the cluster hang or fail for a known reason.
BLOCKING_CHECKS = {"reach", "hostname", "network", "mesh", "port", "mpi"}


@dataclass
class CheckOptions:
    hostfile: str = "hosts.txt"
    user: str | None = None
    timeout: float = 30.0
    skip_active: bool = False
    master_port: int = 29500
    allow_deprecated_fp16: bool = False
    show_progress: bool = True
    data_dir: str | None = None   # compare this folder on every node with the head's (file count, bytes)
    no_tune: bool = False          # skip NCCL's socket tuning grid (check.nccltune)


@dataclass
class CheckRun:
    hostfile: Hostfile
    hostfile_sha256: str
    created: float
    facts: dict[str, NodeFacts]
    unreachable: dict[str, str]
    evaluation: Evaluation
    findings: list[Finding]
    active: dict = field(default_factory=dict)
    wall_s: float = 0.0
    layout: dict = field(default_factory=dict)


def probe_all(hostfile: Hostfile, opts: CheckOptions, settings: ProbeSettings):
    """Probe every node in parallel; keep the sessions for the reachability phase."""
    targets = [remote.Target(name=h.name, host=h.name, user=opts.user) for h in hostfile.hosts]
    sessions: dict[str, object] = {}

    def work(t: remote.Target) -> NodeFacts:
        client = open_session(t, settings)
        sessions[t.name] = client
        return probe_node(client, t, settings)

    outcomes = remote.fan_out(targets, work, timeout=opts.timeout, description="probing nodes",
                              show_progress=opts.show_progress)
    facts, unreachable = {}, {}
    for name, o in outcomes.items():
        if o.ok:
            facts[name] = o.value
        else:
            unreachable[name] = _reason(o.error)
    return targets, sessions, facts, unreachable


def _reason(err: BaseException | None) -> str:
    if isinstance(err, remote.RemoteError):
        fix = {"host_key_unknown": " (run `dscluster setup` to pin host keys)",
               "auth_failed": " (run `dscluster setup` to install the key)"}.get(err.kind, "")
        return f"{err.kind}: {err}{fix}"
    return f"{type(err).__name__}: {err}"


def reach_phase(hostfile: Hostfile, targets, sessions, facts, ev: Evaluation, opts: CheckOptions,
                python: str) -> list[Finding]:
    """Passwordless mesh (every node to every other) and the master port, from every node."""
    findings: list[Finding] = []
    head = ev.head
    master_addr = ev.network.address.get(head)
    listener = None
    if head in sessions and master_addr:
        try:
            listener, why = start_listener(sessions[head], python, master_addr, opts.master_port,
                                           expected=len(facts), seconds=opts.timeout)
        except Exception as e:  # noqa: BLE001 - reported as a finding
            listener, why = None, f"{type(e).__name__}: {e}"
        if listener is None:
            findings.append(Finding("error", head, "port",
                                    f"cannot listen on {master_addr}:{opts.master_port} on the head: {why}",
                                    f"something already uses port {opts.master_port} (a previous run still alive?): "
                                    "stop it, or pass --master-port with a free port"))
            master_addr = None
    live = [h.name for h in hostfile.hosts if h.name in facts]

    def work(t: remote.Target):
        others = [n for n in live if n != t.name]
        script = reach_script(python, others, master_addr, opts.master_port, min(opts.timeout, 10))
        return parse_reach(remote.run(sessions[t.name], "bash -s", timeout=opts.timeout, input=script).stdout)

    outcomes = remote.fan_out([t for t in targets if t.name in facts], work, timeout=opts.timeout + 5,
                              description="mesh and master port", show_progress=opts.show_progress)
    if listener is not None:
        listener.close()
    for name, o in outcomes.items():
        if not o.ok:
            findings.append(Finding("error", name, "mesh", f"could not test: {_reason(o.error)}",
                                    "re-run check; if it persists, check the node by hand"))
            continue
        r = o.value
        for other, (ok, why) in r.mesh.items():
            if not ok:
                findings.append(Finding("error", name, "mesh",
                                        f"cannot ssh to {other} without a password ({why or 'failed'}): "
                                        "mpirun starts ranks from node to node and would stall",
                                        "run `dscluster setup` (installs keys and pins host keys on every node)"))
        if master_addr and r.port_ok is False:
            findings.append(Finding("error", name, "port",
                                    f"cannot reach master {master_addr}:{opts.master_port} ({r.port_error}): "
                                    "rendezvous would time out",
                                    f"open TCP {opts.master_port} (and the ephemeral range) between nodes, e.g. "
                                    f"`sudo ufw allow from {ev.network.subnet}` on {head}"))
    return findings


def link_phase(sessions, facts, ev: Evaluation, opts: CheckOptions, python: str) -> tuple[dict, list[Finding]]:
    """Every ordered pair of nodes: ephemeral ports, a don't-fragment frame of full size, a short
    TCP rate and the NIC its bytes left by (check.netprobe, check.netrules)."""
    address = {n: a for n, a in ev.network.address.items() if n in facts and n in sessions}
    if len(address) < 2:
        return links_summary([]), []
    records, failed = run_pairs(sessions, python, address, iface_mtus(facts, ev.network), min(opts.timeout, 20),
                                start_ready, show_progress=opts.show_progress)
    return links_summary(records), evaluate_links(records, facts, ev.network, failed)


def mca_phase(sessions, facts, ev: Evaluation, opts: CheckOptions, python: str) -> list[Finding]:
    """Pin a hand-typed mpirun's own traffic to the cluster subnet: OpenMPI's and PRRTE's parameter
    files in every node's home (launch.mcaparams). Not for a hostfile of one node: its ranks and mpirun's
    daemon meet on the machine itself, and the pin would bind every later mpirun of the account to the
    interface check chose, and PRRTE warns at each start on a machine where no interface matches it."""
    subnet = ev.network.subnet
    if not subnet or len(facts) < 2:
        return []

    def work(t: remote.Target) -> dict | None:
        return parse_writer(remote.run(sessions[t.name], writer_command(python, subnet), timeout=opts.timeout).stdout)

    outcomes = remote.fan_out([remote.Target(name=n, host=n) for n in facts if n in sessions], work,
                              timeout=opts.timeout + 5, description="mpirun's subnet", show_progress=opts.show_progress)
    out = []
    for name, o in sorted(outcomes.items()):
        failed = {".openmpi and ~/.prte parameter files": {"ok": False, "error": str(o.error)}}
        for rel, r in ((o.value or {}) if o.ok else failed).items():
            if not r.get("ok"):
                out.append(Finding("warning", name, "mpi", f"could not write ~/{rel}: {r.get('error')}: a "
                                   "hand-typed mpirun may send its own traffic through docker0 or a down interface",
                                   f"run mpirun with --mca btl_tcp_if_include {subnet} --mca oob_tcp_if_include "
                                   f"{subnet}, or use `dscluster launch`"))
            elif r.get("theirs"):
                out.append(Finding("warning", name, "mpi", f"~/{rel} already has '{r['theirs']}', which wins over "
                                   f"the cluster subnet {subnet} check wrote below it",
                                   f"on {name}: delete that line from ~/{rel}, or make it {subnet}"))
    return out


# ---------------------------------------------------------------------------- active tests

def active_mpirun_argv(mpirun: str, hostfile: str, np: int, cidr: str | None, program: list[str],
                       exports: list[str], as_root: bool, values: dict[str, str] | None = None) -> list[str]:
    """mpirun across the hostfile, pinned to the common subnet by CIDR (names differ per node);
    `exports` are passed on from this process's environment, `values` set for every rank."""
    env: dict[str, str | None] = {**dict.fromkeys(exports), **(values or {})}
    return mpirun_argv(mpirun, [App(np, program, env)], hostfile=hostfile, map_by="slot", cidr=cidr, as_root=as_root)


def hello_program(python: str) -> list[str]:
    hello = paths.assets_root() / "setup" / "hello_mpi.py"
    return [python, str(hello)] if hello.exists() else [python, "-m", "mpi4py.bench", "helloworld"]


def allreduce_program(python: str, timeout_s: float, nbytes: int | None = None) -> list[str]:
    """check's all-reduce (dscluster.bench.allreduce); `nbytes`: that one message size only."""
    sizes = ["--sizes", str(nbytes)] if nbytes else []
    return [python, "-m", "dscluster.bench.allreduce", "--json", "--iters", "10", "--warmup", "3",
            "--timeout", str(int(timeout_s)), *sizes]


def allreduce_result(output: str) -> dict | None:
    """The JSON document rank 0 of dscluster.bench.allreduce printed among mpirun's output."""
    result = None
    for line in output.splitlines():
        if line.startswith("{") and '"busbw_GBps"' in line:
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                pass
    return result


@dataclass
class ActiveLaunch:
    """How check's active tests start mpirun: one program across the hostfile, with MASTER_ADDR and
    MASTER_PORT passed on."""

    hostfile: Hostfile
    cidr: str | None
    mpirun: str
    env: dict
    exports: list[str]
    as_root: bool
    limit: float

    @classmethod
    def of(cls, hostfile: Hostfile, ev: Evaluation, opts: CheckOptions, python: str) -> ActiveLaunch:
        env, exports = dict(os.environ), []
        if ev.network.address.get(ev.head):
            env.update(MASTER_ADDR=ev.network.address[ev.head], MASTER_PORT=str(opts.master_port))
            exports = ["MASTER_ADDR", "MASTER_PORT"]
        return cls(hostfile=hostfile, cidr=ev.network.subnet, mpirun=mpirun_path(python), env=env, exports=exports,
                   as_root=os.geteuid() == 0, limit=max(60.0, opts.timeout * 2))

    def argv(self, program: list[str], values: dict[str, str] | None = None) -> list[str]:
        return active_mpirun_argv(self.mpirun, self.hostfile.path, self.hostfile.total_slots, self.cidr, program,
                                  self.exports, self.as_root, values)

    def run(self, argv: list[str], limit: float) -> tuple[bool, str, float]:
        return _run(argv, self.env, limit)


def run_active(launch: ActiveLaunch, python: str) -> tuple[dict, list[Finding]]:
    """The MPI hello, then the all-reduce bandwidth test."""
    findings: list[Finding] = []
    hostfile = launch.hostfile
    rank_count = hostfile.total_slots
    active: dict = {}

    argv = launch.argv(hello_program(python))
    ok, out, secs = launch.run(argv, launch.limit)
    lost_exit = (not ok and out.rstrip().endswith(TIMED_OUT.format(launch.limit))
                 and f"all {rank_count} ranks answered" in out)
    active["mpi_hello"] = {"ok": ok or lost_exit, "seconds": round(secs, 2), "argv": argv, "output": out[-2000:]}
    if lost_exit:
        findings.append(Finding(
            "warning", None, "mpi", f"MPI hello: all {rank_count} ranks answered and met at a barrier, but mpirun "
            f"did not return within {secs:.0f} s and was stopped",
            "nothing to fix for training: OpenMPI 5.0.11's runtime (PRRTE 3.0.14) can lose a process that ends "
            "within moments of starting, and then waits for it forever; "
            "training ranks live far longer. If it comes back on every check, run the printed mpirun by hand"))
    elif not ok:
        findings.append(Finding("error", None, "mpi", f"MPI hello over {hostfile.path} failed after {secs:.0f} s: "
                                f"{_tail(out)}", "fix the errors above first; then run the printed mpirun by hand"))
        return active, findings
    else:
        ranks = f"{rank_count} rank{'s' if rank_count != 1 else ''}"
        findings.append(Finding("info", None, "mpi", f"MPI hello: {ranks} answered in {secs:.1f} s", "nothing to do"))

    argv = launch.argv(allreduce_program(python, launch.limit))
    ok, out, secs = launch.run(argv, launch.limit * 2)
    result = allreduce_result(out)
    active["allreduce"] = {"ok": ok and result is not None, "seconds": round(secs, 2), "argv": argv,
                           "result": result, "output": None if result else out[-2000:]}
    if not ok or result is None:
        findings.append(Finding("error", None, "allreduce",
                                f"all-reduce across {rank_count} ranks failed: {_tail(out)}",
                                "check NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME and the firewall between nodes; "
                                "NCCL_DEBUG=INFO on a re-run shows where it stops"))
    elif result["world_size"] == 1:  # busbw = algbw × 2(n-1)/n: one rank moves nothing, 0.000 GB/s says nothing
        findings.append(Finding("info", None, "allreduce", f"all-reduce {result['backend']} ran on its one rank: "
                                "no link to measure", "nothing to do"))
    else:
        best = max(result["results"], key=lambda r: r["bytes"])
        findings.append(Finding("info", None, "allreduce",
                                f"all-reduce {result['backend']} over {result['world_size']} ranks: busbw "
                                f"{best['busbw_GBps']:.3f} GB/s at {best['bytes'] >> 20} MiB "
                                f"(peak {result['peak_busbw_GBps']:.3f} GB/s)", "nothing to do"))
    return active, findings


def tune_sockets(launch: ActiveLaunch, python: str, active: dict, no_tune: bool = False) -> tuple[dict, list[Finding]]:
    """NCCL's socket threading measured (check.nccltune): check's all-reduce again, its largest message
    only, once per grid point with the point's values passed to every rank by mpirun -x. Returns
    active.nccl_socket and what check says when the grid did not run or a point failed."""
    result = (active.get("allreduce") or {}).get("result")
    if not result or not result.get("results"):
        return {"skipped": "no all-reduce result (it failed or did not run)"}, []
    link = ((active.get("links") or {}).get("slowest") or {}).get("bps")
    why = why_not_tuned(result.get("backend"), link, no_tune)
    if why:
        return {"skipped": why}, [Finding("info", None, "allreduce", f"NCCL socket tuning not run: {why}",
                                          "nothing to do")]
    nbytes = max(r["bytes"] for r in result["results"])
    grid, findings = [], []
    for values in grid_envs():
        ok, out, secs = launch.run(launch.argv(allreduce_program(python, launch.limit, nbytes), values), launch.limit)
        got = allreduce_result(out) if ok else None
        grid.append(grid_point(values, got, secs, None if got else _tail(out)))
        if got is None:   # a hang costs the limit once, not once per point
            findings.append(Finding("warning", None, "allreduce", f"NCCL socket tuning stopped: the all-reduce with "
                                    f"{THREADS}={values[THREADS]} {SOCKS}={values[SOCKS]} failed after {secs:.0f} s: "
                                    f"{_tail(out)}", "re-run check; --no-tune skips the tuning"))
            break
    return {"link_bps": link, "grid": grid}, findings


TIMED_OUT = "(timed out after {:.0f} s)"  # the last line of a run that `_run` stopped at its limit


def _run(argv: list[str], env: dict, limit: float) -> tuple[bool, str, float]:
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=limit, stdin=subprocess.DEVNULL)
        return p.returncode == 0, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return False, out + "\n" + TIMED_OUT.format(limit), time.monotonic() - t0
    except OSError as e:
        return False, f"{argv[0]}: {e}", time.monotonic() - t0


def _tail(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return " | ".join(lines[-3:])[-400:] or "no output"


# ---------------------------------------------------------------------------- everything

def run_check(opts: CheckOptions) -> CheckRun:
    t0 = time.monotonic()
    hostfile = parse_hostfile(opts.hostfile)
    if opts.data_dir is not None and not os.path.isdir(opts.data_dir):
        raise UsageError(f"--data {opts.data_dir}: no such folder on this machine (the head)")
    if not 0 < opts.master_port < 65536:
        raise UsageError(f"--master-port {opts.master_port}: expected a TCP port 1-65535")
    known_hosts = state.known_hosts_path()
    if not known_hosts.exists() and not thishost.all_this_machine(h.name for h in hostfile.hosts):
        raise UsageError(f"{known_hosts}: no pinned host keys yet; "
                         f"run `dscluster setup --hostfile {opts.hostfile}` first "
                         "(or set DSCLUSTER_STATE to the state directory setup used)")
    python = sys.executable
    settings = ProbeSettings(known_hosts=known_hosts, key_filename=default_key(),
                             password=os.environ.get("DSCLUSTER_SSH_PASSWORD"), timeout=opts.timeout,
                             python=python, runs_dir=runs_dir_for_probe())
    created = time.time()
    targets, sessions, facts, unreachable = probe_all(hostfile, opts, settings)
    try:
        ev = evaluate(facts, hostfile, unreachable=unreachable, allow_deprecated_fp16=opts.allow_deprecated_fp16)
        findings = list(ev.findings) + [
            Finding("info", n, "reach", "this machine: probed here without SSH",
                    "nothing to do: no sshd or `dscluster setup` needed for it") for n in facts
            if thishost.is_this_machine(n)]
        layout: dict = {}
        links = links_summary([])
        if facts:
            findings += reach_phase(hostfile, targets, sessions, facts, ev, opts, python)
            links, more = link_phase(sessions, facts, ev, opts, python)
            findings += more + mca_phase(sessions, facts, ev, opts, python)
            layout = probe_layout(targets, sessions, facts, python, opts.timeout, settings.runs_dir,
                                  opts.data_dir, opts.show_progress)
            findings += layout_findings(layout, opts.hostfile)
    finally:
        for c in sessions.values():
            c.close()
    active: dict = {"mpi_hello": None, "allreduce": None, "skipped": None, "links": links, "nccl_socket": None}
    if opts.skip_active:
        active["skipped"] = "--skip-active"
    elif any(f.severity == "error" and f.check in BLOCKING_CHECKS for f in findings):
        active["skipped"] = "errors above would make mpirun hang"
        findings.append(Finding("info", None, "mpi", "active tests (MPI hello, all-reduce) skipped: the errors above "
                                "would make them hang", "fix the errors, then re-run check"))
    else:
        launch = ActiveLaunch.of(hostfile, ev, opts, python)
        got, more = run_active(launch, python)
        active.update(got)
        active["nccl_socket"], tuned = tune_sockets(launch, python, active, opts.no_tune)
        findings += more + tuned
        _, tuning = decide_socket_tuning(active.get("nccl_socket"))
        findings += [tuning] if tuning else []
    return CheckRun(hostfile=hostfile, hostfile_sha256=hostfile_sha256(hostfile.path), created=created, facts=facts,
                    unreachable=unreachable, evaluation=ev, findings=findings, active=active,
                    wall_s=time.monotonic() - t0, layout=layout)


def ok(run: CheckRun) -> bool:
    return not has_errors(run.findings)


def envs(run: CheckRun, master_port: int):
    tuned, _ = decide_socket_tuning((run.active or {}).get("nccl_socket"))
    return node_envs(run.evaluation, run.facts, master_port=master_port, created=run.created,
                     hostfile_sha256=run.hostfile_sha256, tuned=tuned)
