"""This machine without SSH: the one rule for "is this host this machine", and the local session that
`remote.connect` hands it (no sshd, no pinned host key), read by `remote.run` like a Paramiko one."""

from __future__ import annotations

import socket

import pytest

from dscluster.ssh import remote, thishost


@pytest.mark.parametrize("name", ["localhost", "LOCALHOST", "127.0.0.1", "127.0.1.1", socket.gethostname()])
def test_this_machines_names_are_this_machine(name):
    assert thishost.is_this_machine(name)


@pytest.mark.parametrize("name", ["192.0.2.7", "node2.invalid", ""])
def test_other_machines_are_not(name):
    assert not thishost.is_this_machine(name)


def test_a_hostfile_of_this_machine_only_needs_no_ssh_and_one_other_node_does():
    assert thishost.all_this_machine(["localhost", socket.gethostname()])
    assert not thishost.all_this_machine(["localhost", "192.0.2.7"])
    assert not thishost.all_this_machine([])


def test_connect_to_localhost_needs_no_sshd_and_no_known_hosts(tmp_path):
    kh = tmp_path / "known_hosts"  # never created: nothing was pinned
    client = remote.connect(remote.Target("localhost", "localhost"), known_hosts=kh)
    try:
        r = remote.run(client, "echo out; echo err >&2; exit 3", timeout=10)
        assert (r.rc, r.stdout, r.stderr) == (3, "out\n", "err\n")
        assert remote.run(client, "tr a-z A-Z", timeout=10, input="probe script\n").stdout == "PROBE SCRIPT\n"
        with pytest.raises(remote.RemoteError) as failed:
            remote.run(client, "echo broken >&2; exit 1", timeout=10, check=True)
        assert failed.value.kind == "command_failed" and "broken" in str(failed.value)
        with pytest.raises(remote.RemoteError) as slow:
            remote.run(client, "sleep 30", timeout=0.3)
        assert slow.value.kind == "timeout"
        # as launch's per-node pump reads a session (torchrun): with a pty, stderr comes on stdout
        chan = client.get_transport().open_session()
        chan.get_pty()
        chan.exec_command("echo out; echo err >&2; exit 4")
        got = b""
        while data := chan.recv(65536):
            got += data
        assert sorted(got.decode().split()) == ["err", "out"] and chan.recv_exit_status() == 4
    finally:
        client.close()
    assert not kh.exists()


def test_another_port_or_account_on_this_machine_still_goes_over_ssh(tmp_path):
    """An sshd on another port is asked for by name: the user wants SSH there (refused here: none listens)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(remote.RemoteError) as e:
        remote.connect(remote.Target("local", "127.0.0.1", port=port), known_hosts=tmp_path / "kh", timeout=2)
    assert e.value.kind == "refused"
    assert not thishost.runs_here("localhost", "someone-else-entirely")
