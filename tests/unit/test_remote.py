"""remote.py pure parts: error kinds, known_hosts lines and pinning, fan-out timeouts."""

from __future__ import annotations

import base64
import errno
import socket
import time

import paramiko
import pytest

from dscluster.ssh import hostkeys, remote
from dscluster.ssh.remote import RemoteError, Target

T = Target("node2", "10.77.1.12", 22, "lab")


def _key() -> paramiko.PKey:
    # A fixed public ed25519 key (content does not matter, only that it parses).
    return paramiko.PKey.from_type_string(
        "ssh-ed25519",
        base64.b64decode("AAAAC3NzaC1lZDI1NTE5AAAAICAjRvKu7c4Nxn72KvJQOSTrU8RMon23VafsjsNbU0LS"),
    )


def _other_key() -> paramiko.PKey:
    return paramiko.PKey.from_type_string(
        "ssh-ed25519",
        base64.b64decode("AAAAC3NzaC1lZDI1NTE5AAAAIAvteXs5Q6Lg7Z7whDVVXFZhIFJYeqnT7e51hF7AsbV2"),
    )


@pytest.mark.parametrize(
    "exc, kind",
    [
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "refused"),
        (paramiko.ssh_exception.NoValidConnectionsError({("10.77.1.12", 22): ConnectionRefusedError()}), "refused"),
        (paramiko.ssh_exception.NoValidConnectionsError(
            {("10.77.1.12", 22): OSError(errno.EHOSTUNREACH, "No route to host")}), "unreachable"),
        (OSError(errno.ENETUNREACH, "Network is unreachable"), "unreachable"),
        (socket.timeout("timed out"), "timeout"),
        (socket.gaierror(-2, "Name or service not known"), "unreachable"),
        (paramiko.AuthenticationException("Authentication failed."), "auth_failed"),
        (paramiko.BadAuthenticationType("Bad authentication type", ["publickey"]), "auth_failed"),
        (paramiko.SSHException("Error reading SSH protocol banner"), "timeout"),
        (EOFError(), "unreachable"),
    ],
)
def test_exceptions_map_to_one_kind(exc, kind):
    err = remote.classify(exc, T, timeout=10)
    assert err.kind == kind and err.host == "10.77.1.12"
    assert str(err).startswith("node2: ")


def test_auth_failed_names_user_at_host():
    err = remote.classify(paramiko.AuthenticationException("x"), T)
    assert "authentication failed for lab@10.77.1.12" in str(err)


def test_changed_key_message_shows_both_fingerprints():
    err = remote.classify(paramiko.BadHostKeyException("node2", _other_key(), _key()), T)
    assert err.kind == "host_key_changed"
    assert _key().fingerprint in str(err) and _other_key().fingerprint in str(err)
    assert _key().fingerprint.startswith("SHA256:")


def test_unknown_kind_rejected():
    with pytest.raises(ValueError):
        RemoteError("flaky", "h", "m")


def test_known_hosts_line_and_port_naming():
    assert hostkeys.known_hosts_name("node2") == "node2"
    assert hostkeys.known_hosts_name("10.0.0.2", 2222) == "[10.0.0.2]:2222"
    line = hostkeys.known_hosts_line(["node2", "10.77.1.12", "node2"], _key())
    assert line == f"node2,10.77.1.12 ssh-ed25519 {_key().get_base64()}"


def test_pin_keeps_other_hosts_and_replaces_own_entry(tmp_path):
    kh = tmp_path / "state" / "known_hosts"
    kh.parent.mkdir()
    kh.write_text("# my notes\n"
                  "node9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAvteXs5Q6Lg7Z7whDVVXFZhIFJYeqnT7e51hF7AsbV2\n")
    hostkeys.pin_host_key(kh, ["node2", "10.77.1.12"], _other_key())
    hostkeys.pin_host_key(kh, ["node2", "10.77.1.12"], _key())
    lines = kh.read_text().splitlines()
    assert lines[0] == "# my notes" and lines[1].startswith("node9 ")
    assert len([ln for ln in lines if ln.startswith("node2,")]) == 1
    hk = hostkeys.load_known_hosts(kh)
    assert hk.lookup("node2")["ssh-ed25519"] == _key()
    assert hk.lookup("10.77.1.12")["ssh-ed25519"] == _key()


def test_fan_out_slow_node_times_out_while_others_finish():
    targets = [Target(f"node{i}", f"h{i}") for i in (1, 2, 3)]

    def fn(t: Target) -> str:
        if t.name == "node2":
            time.sleep(30)
        if t.name == "node3":
            raise RemoteError("auth_failed", t.host, f"{t.name}: authentication failed for x@{t.host}")
        return t.name.upper()

    t0 = time.monotonic()
    out = remote.fan_out(targets, fn, timeout=1.0, description="probe", show_progress=False)
    assert time.monotonic() - t0 < 5
    assert list(out) == ["node1", "node2", "node3"]
    assert out["node1"].ok and out["node1"].value == "NODE1"
    assert not out["node2"].ok and out["node2"].error.kind == "timeout"
    assert not out["node3"].ok and out["node3"].error.kind == "auth_failed"


def test_fan_out_runs_in_parallel_and_maps_raw_socket_errors():
    targets = [Target(f"n{i}", f"h{i}") for i in range(6)]

    def fn(t: Target):
        time.sleep(0.5)
        if t.name == "n5":
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
        return 1

    t0 = time.monotonic()
    out = remote.fan_out(targets, fn, timeout=10, description="x", max_workers=16, show_progress=False)
    assert time.monotonic() - t0 < 2.5
    assert sum(o.ok for o in out.values()) == 5
    assert isinstance(out["n5"].error, RemoteError) and out["n5"].error.kind == "refused"
