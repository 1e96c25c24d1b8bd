"""remote.py against a real OpenSSH server started on 127.0.0.1 for this module.

The server runs as the current user with its own config, host key and authorized_keys in a
temporary directory, so nothing outside that directory is touched.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import paramiko
import pytest

from dscluster.bench.runner import free_port
from dscluster.ssh import hostkeys, remote
from dscluster.ssh.remote import RemoteError, Target

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(
    not os.path.exists(SSHD), reason="OpenSSH server not installed (apt-get install openssh-server)"
)


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


class Sshd:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.client_key = root / "client_key"
        _keygen(self.client_key)
        (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
        os.chmod(root / "authorized_keys", 0o600)
        self.new_host_key()

    def new_host_key(self) -> None:
        for p in self.root.glob("host_key*"):
            p.unlink()
        _keygen(self.root / "host_key")
        self.host_key = paramiko.Ed25519Key.from_private_key_file(str(self.root / "host_key"))

    def start(self) -> None:
        cfg = self.root / "sshd_config"
        cfg.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.root / 'host_key'}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\nStrictModes no\nUsePAM no\n"
            f"PidFile {self.root / 'sshd.pid'}\nPasswordAuthentication yes\nPermitRootLogin yes\n"
            "KbdInteractiveAuthentication no\nMaxAuthTries 10\n"
        )
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("sshd did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    @property
    def target(self) -> Target:
        return Target(name="local", host="127.0.0.1", port=self.port, user=getpass.getuser())


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    server.start()
    yield server
    server.stop()


def _pinned(sshd: Sshd, tmp_path: Path) -> Path:
    kh = tmp_path / "known_hosts"
    kh.write_text(hostkeys.known_hosts_line([f"[127.0.0.1]:{sshd.port}"], sshd.host_key) + "\n")
    return kh


def test_unknown_host_refused_with_fingerprint_and_nothing_pinned(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    with pytest.raises(RemoteError) as ei:
        remote.connect(sshd.target, known_hosts=kh, key_filename=str(sshd.client_key))
    assert ei.value.kind == "host_key_unknown"
    assert sshd.host_key.fingerprint in str(ei.value)
    assert "--trust-new-hosts" in str(ei.value)
    assert not kh.exists()


def test_trust_new_hosts_pins_then_key_login_runs_commands(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    client = remote.connect(sshd.target, known_hosts=kh, key_filename=str(sshd.client_key), trust_new_hosts=True)
    try:
        pinned = hostkeys.load_known_hosts(kh).lookup(f"[127.0.0.1]:{sshd.port}")
        assert pinned is not None and pinned["ssh-ed25519"] == sshd.host_key
        res = remote.run(client, "echo out; echo err >&2; exit 3")
        assert (res.rc, res.stdout, res.stderr) == (3, "out\n", "err\n")
        assert remote.run(client, "cat", input="fed via stdin").stdout == "fed via stdin"
        with pytest.raises(RemoteError) as ei:
            remote.run(client, "echo boom >&2; false", check=True)
        assert ei.value.kind == "command_failed" and "boom" in str(ei.value)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as ei:
            remote.run(client, "sleep 5", timeout=0.5)
        assert ei.value.kind == "timeout" and time.monotonic() - t0 < 3
    finally:
        client.close()
    # Second contact: the pinned key is accepted without --trust-new-hosts.
    remote.connect(sshd.target, known_hosts=kh, key_filename=str(sshd.client_key)).close()


def test_wrong_password_is_auth_failed_and_never_echoed(sshd, tmp_path):
    secret = "s3cret-Pa55word-xyz"
    with pytest.raises(RemoteError) as ei:
        remote.connect(sshd.target, known_hosts=_pinned(sshd, tmp_path), password=secret)
    assert ei.value.kind == "auth_failed"
    assert f"authentication failed for {getpass.getuser()}@127.0.0.1" in str(ei.value)
    assert secret not in str(ei.value) and secret not in repr(ei.value.args)


def test_refused_port(tmp_path):
    port = free_port()  # nothing listens there
    with pytest.raises(RemoteError) as ei:
        remote.connect(Target("gone", "127.0.0.1", port), known_hosts=tmp_path / "kh", password="x", timeout=3)
    assert ei.value.kind == "refused"
    assert str(port) in str(ei.value)


def test_changed_host_key_is_fatal_with_both_fingerprints(tmp_path_factory, tmp_path):
    server = Sshd(tmp_path_factory.mktemp("sshd_rotate"))
    server.start()
    kh = tmp_path / "known_hosts"
    try:
        remote.connect(server.target, known_hosts=kh, key_filename=str(server.client_key), trust_new_hosts=True).close()
        old = server.host_key
        server.stop()
        server.new_host_key()
        server.start()
        before = kh.read_text()
        for trust in (False, True):  # --trust-new-hosts never overrides a changed key
            with pytest.raises(RemoteError) as ei:
                remote.connect(server.target, known_hosts=kh, key_filename=str(server.client_key),
                               trust_new_hosts=trust)
            assert ei.value.kind == "host_key_changed"
            assert old.fingerprint in str(ei.value) and server.host_key.fingerprint in str(ei.value)
        assert kh.read_text() == before
    finally:
        server.stop()


def test_fan_out_over_real_sessions(sshd, tmp_path):
    kh = _pinned(sshd, tmp_path)
    good = sshd.target
    bad = Target("closed", "127.0.0.1", free_port(), getpass.getuser())

    def hostname(t: Target) -> str:
        c = remote.connect(t, known_hosts=kh, key_filename=str(sshd.client_key), timeout=3)
        try:
            return remote.run(c, "hostname", check=True).stdout.strip()
        finally:
            c.close()

    out = remote.fan_out([good, bad], hostname, timeout=10, description="hostname", show_progress=False)
    assert out["local"].ok and out["local"].value == socket.gethostname()
    assert not out["closed"].ok and out["closed"].error.kind == "refused"
