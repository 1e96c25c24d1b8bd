"""One `dscluster top` refresh: the nodes of a hostfile and the job in a run directory, now.

A `Watcher` keeps its SSH sessions between refreshes (one connection per node, not one a second)
and samples over SSH only the nodes whose job sampler has no fresh sample in the head's copy of the run
directory (top/live.py). That sample also reads the node's own copy of the run directory (a lab
without a shared filesystem): its ranks join the head's, and the head's files win where both have one.
Each node's name on disk and the interface to watch come from check.json (`dscluster check`):
its hostname and NCCL/GLOO_SOCKET_IFNAME; without check.json, the hostfile name and every interface.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dscluster.check import checkfile
from dscluster.check.probe import default_key
from dscluster.files import state
from dscluster.node.hosts import Hostfile
from dscluster.ssh import remote, thishost
from dscluster.telemetry.sampler import job_interface
from dscluster.top.live import (
    NodeNow,
    RankRecords,
    Snapshot,
    find_running_run,
    merge_rank_records,
    once_command,
    parse_once,
    rank_views,
    read_rank_records,
    telemetry_nodes,
)

SSH_TIMEOUT_S = 10.0


@dataclass
class NodePlace:
    name: str
    host: str
    iface: str | None


def node_places(hostfile: Hostfile, check_json: Path | None = None) -> list[NodePlace]:
    """Each hostfile node's hostname and job interface as `dscluster check` recorded them."""
    path = state.check_json_path() if check_json is None else check_json
    recorded = {}
    if path.exists():
        try:
            recorded = {n.name: n for n in checkfile.load(path).nodes}
        except checkfile.CheckFileError:
            recorded = {}  # an unreadable check.json: hostfile names and every interface still work
    out = []
    for h in hostfile.hosts:
        node = recorded.get(h.name)
        # A sampler names its file by the hostname: `localhost` reads this machine's own.
        here = socket.gethostname() if thishost.is_this_machine(h.name) else h.name
        out.append(NodePlace(h.name, (node.hostname if node and node.hostname else here),
                             job_interface(node.env) if node else None))
    return out


class Watcher:
    def __init__(self, places: list[NodePlace], run_dir: Path | None = None, *, ssh: bool = True,
                 python: str = sys.executable):
        self.places = places
        self.fixed_run_dir = run_dir
        self.ssh = ssh
        self.python = python
        self._sessions: dict[str, object] = {}

    def run_dir(self) -> Path | None:
        return self.fixed_run_dir if self.fixed_run_dir is not None else find_running_run()

    def snapshot(self, now: float | None = None) -> Snapshot:
        """The nodes and ranks now; `now` in the past shows a recorded run as it was then."""
        recorded = now is not None
        now = time.time() if now is None else now
        run_dir = self.run_dir()
        nodes = telemetry_nodes(run_dir, {p.name: p.host for p in self.places}, now)
        missing = [p for p in self.places if p.name not in nodes]
        node_ranks: list[dict[int, RankRecords]] = []
        if missing and self.ssh:
            for name, (node, ranks) in self._sample_over_ssh(missing, run_dir).items():
                nodes[name] = node
                node_ranks.append(ranks)
        for p in missing:
            nodes.setdefault(p.name, NodeNow(name=p.name, host=p.host, source="none",
                                             error="no fresh telemetry from a running job (SSH sampling off)"))
        records = merge_rank_records(read_rank_records(run_dir), node_ranks)
        return Snapshot(t=now, run_dir=str(run_dir) if run_dir else None,
                        nodes=[nodes[p.name] for p in self.places],
                        ranks=rank_views(records, now if recorded else time.time()))

    def _session(self, place: NodePlace):
        client = self._sessions.get(place.name)
        transport = client.get_transport() if client is not None else None
        if transport is None or not transport.is_active():
            client = remote.connect(remote.Target(place.name, place.name), known_hosts=state.known_hosts_path(),
                                    key_filename=default_key(), password=os.environ.get("DSCLUSTER_SSH_PASSWORD"),
                                    timeout=SSH_TIMEOUT_S)
            self._sessions[place.name] = client
        return client

    def _sample_over_ssh(self, places: list[NodePlace], run_dir: Path | None
                         ) -> dict[str, tuple[NodeNow, dict[int, RankRecords]]]:
        """Each node now, and its ranks' records in its own copy of `run_dir` (the same path there)."""
        command_dir = run_dir.absolute() if run_dir is not None else None

        def sample(target: remote.Target) -> tuple[NodeNow, dict[int, RankRecords]]:
            place = next(p for p in places if p.name == target.name)
            res = remote.run(self._session(place), once_command(self.python, place.iface, command_dir),
                             timeout=SSH_TIMEOUT_S, check=True)
            return parse_once(place.name, place.host, res.stdout, time.time())

        outcomes = remote.fan_out([remote.Target(p.name, p.name) for p in places], sample,
                                  timeout=SSH_TIMEOUT_S + 2, description="sampling nodes", show_progress=False)
        out: dict[str, tuple[NodeNow, dict[int, RankRecords]]] = {}
        for p in places:
            o = outcomes[p.name]
            out[p.name] = o.value if o.ok else (NodeNow(name=p.name, host=p.host, source="none", error=str(o.error)),
                                                {})
            if not o.ok:
                self._sessions.pop(p.name, None)
        return out

    def close(self) -> None:
        for client in self._sessions.values():
            try:
                client.close()
            except Exception:
                pass
        self._sessions.clear()
