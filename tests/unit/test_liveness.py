"""Noticing a vanished node: PRTE's lost-daemon text, the reachability probe, the keepalive file."""

import socket

import pytest

from dscluster.bringup import files as bf
from dscluster.node import liveness

# What mpirun (OpenMPI 5.0.11) printed on the lab when node3's cable was pulled.
PRTE_LOST = """--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-node1-32753@0,0] on node node1
  Remote daemon: [prterun-node1-32753@0,2] on node node3

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------
"""


def test_prte_lost_daemon_text_names_the_remote_node_not_the_head():
    named = [liveness.lost_daemon_host(line) for line in PRTE_LOST.splitlines()]
    assert [n for n in named if n] == ["node3"]
    assert liveness.lost_daemon_host("  Remote daemon: [[64112,0],1] on node 10.126.10.10") == "10.126.10.10"  # ORTE
    assert liveness.lost_daemon_host("epoch 3/5 step 40: on node node1") is None


def test_a_refused_connection_is_a_machine_that_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connect is refused
        assert liveness.answers("127.0.0.1", port, timeout=2) is True


def test_an_unresolvable_name_is_unknown_not_vanished():
    assert liveness.answers("no-such-host.invalid", timeout=2) is None


@pytest.mark.parametrize("up, me, expected", [
    ({"node2": True, "node3": False}, "node1", ["node3"]),
    ({"node2": True, "node3": True}, "node1", []),
    ({"node2": False, "node3": False}, "node1", ["node1"]),   # nobody answers me: I am the one cut off
    ({"node2": False}, "node1", ["node2"]),                   # two nodes: cannot tell, name the other
    ({"node2": None, "node3": False}, "node1", ["node3"]),    # unresolvable is not counted as gone
])
def test_vanished_hosts_from_one_ranks_view(monkeypatch, up, me, expected):
    monkeypatch.setattr(liveness, "answers", lambda host, timeout=3.0: up[host])
    assert liveness.vanished_hosts(me, [me, *up, me]) == expected


def test_keepalive_settings_reach_mpirun_by_file_and_by_environment():
    mine = "# my own tuning\nbtl_tcp_links = 2\n"
    once = bf.update_prte_params(mine)
    assert bf.update_prte_params(once) == once  # setup run twice changes nothing
    assert once.startswith(mine) and bf.BEGIN in once  # the user's own lines stay as they were
    for key, value in liveness.PRTE_KEEPALIVE.items():
        assert f"\n{key} = {value}\n" in once
        assert liveness.prte_env()[f"PRTE_MCA_{key}"] == value
    t, intvl, probes = (int(liveness.PRTE_KEEPALIVE[k]) for k in
                        ("oob_tcp_keepalive_time", "oob_tcp_keepalive_intvl", "oob_tcp_keepalive_probes"))
    assert liveness.KEEPALIVE_DETECT_S == t + intvl * probes < 120  # inside the preset's process-group timeout


def test_a_failing_ranks_words_for_what_it_found():
    assert liveness.vanished_text(["node3"], "node1") == "; node3 did not answer from node1"
    assert "node3 reaches none of the other nodes" in liveness.vanished_text(["node3"], "node3")
    assert liveness.vanished_text([], "node1") == ""
