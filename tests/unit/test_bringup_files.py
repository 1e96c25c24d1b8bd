"""The edits `dscluster setup` makes in users' files: kept lines, one line per key, one block."""

from __future__ import annotations

import pytest

from dscluster.bringup import files as bf
from dscluster.bringup import node as setup_node
from dscluster.bringup import setup as bringup

K1 = bf.PublicKey("ssh-ed25519", "AAAAC3NzaC1lZDI1NTE5AAAAICAjRvKu7c4Nxn72KvJQOSTrU8RMon23VafsjsNbU0LS",
                  "dscluster lab@node1")
K2 = bf.PublicKey("ssh-ed25519", "AAAAC3NzaC1lZDI1NTE5AAAAIAvteXs5Q6Lg7Z7whDVVXFZhIFJYeqnT7e51hF7AsbV2",
                  "dscluster lab@node2")


def test_authorized_keys_keeps_user_lines_and_adds_each_key_once():
    existing = (
        "# laptop\n"
        "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 me@laptop\n"
        f'from="10.0.0.0/8",no-pty {K1.type} {K1.blob} old comment\n'
    )
    once = bf.merge_authorized_keys(existing, [K1, K2])
    assert once.startswith(existing)  # user's lines untouched, K1 (with options) not re-added
    assert once.count(K1.blob) == 1 and once.count(K2.blob) == 1
    assert bf.merge_authorized_keys(once, [K1, K2]) == once  # idempotent


def test_authorized_keys_collapses_duplicates_of_our_keys():
    dup = f"{K2.line}\n{K2.line}\nssh-ed25519 AAAAother x\n{K2.line}\n"
    merged = bf.merge_authorized_keys(dup, [K2])
    assert merged.count(K2.blob) == 1 and "AAAAother" in merged


def test_parse_public_key_skips_options_and_comments():
    assert bf.parse_public_key("# nope") is None
    assert bf.parse_public_key("garbage") is None
    k = bf.parse_public_key(f'command="echo hi",no-pty {K1.type} {K1.blob} a b')
    assert (k.type, k.blob, k.comment) == (K1.type, K1.blob, "a b")


HOSTS = [bf.HostEntry("node1", "node1", "lab"), bf.HostEntry("node2", "10.77.1.12", "lab", 2222)]


def test_ssh_config_block_goes_first_and_is_replaced_not_duplicated():
    user = "Host *\n    StrictHostKeyChecking no\n    ServerAliveInterval 30\n"
    once = bf.update_ssh_config(user, HOSTS)
    assert once.index(bf.BEGIN) < once.index("Host *")  # ssh takes the first value it finds
    assert "Host node2\n    HostName 10.77.1.12\n    User lab\n    Port 2222\n" in once
    assert "StrictHostKeyChecking yes" in once and "IdentityFile ~/.ssh/id_ed25519" in once
    assert bf.update_ssh_config(once, HOSTS) == once
    fewer = bf.update_ssh_config(once, HOSTS[:1])
    assert fewer.count(bf.BEGIN) == 1 and "Host node2" not in fewer and user in fewer


def test_block_replaced_in_place_and_extra_copies_removed():
    text = f"a\n{bf.BEGIN}\nold\n{bf.END}\nb\n{bf.BEGIN}\nolder\n{bf.END}\nc\n"
    out = bf.replace_managed_block(text, "new\n")
    assert out == f"a\n{bf.BEGIN}\n{bf.NOTE}\nnew\n{bf.END}\nb\nc\n"


def test_damaged_block_is_refused_with_file_and_line():
    with pytest.raises(bf.BlockError, match=r"~/.ssh/config:2: .* has no matching"):
        bf.replace_managed_block(f"x\n{bf.BEGIN}\nHost a\n", "y", path="~/.ssh/config")


def test_known_hosts_replaces_stale_entry_keeps_others():
    existing = (
        "node2,10.77.1.12 ssh-ed25519 AAAAstale\n"
        "node2 ssh-rsa AAAArsa\n"
        "|1|hashed= ssh-ed25519 AAAAhashed\n"
        "gitlab.example.org ssh-ed25519 AAAAgit\n"
    )
    out = bf.merge_known_hosts(existing, [(["node2", "10.77.1.12"], K2.type, K2.blob)])
    assert "AAAAstale" not in out
    assert "node2 ssh-rsa AAAArsa" in out and "AAAAhashed" in out and "AAAAgit" in out
    assert f"node2,10.77.1.12 ssh-ed25519 {K2.blob}" in out
    assert bf.merge_known_hosts(out, [(["node2", "10.77.1.12"], K2.type, K2.blob)]) == out


def test_known_hosts_lines_ssh_appends_after_the_pins_do_not_make_the_next_setup_a_change():
    # ssh's UpdateHostKeys appends a host's other key types after a login verified by the pin;
    # the next setup must see nothing to change (it once re-wrote node1's file on every rerun).
    pins = [(["node1", "10.77.1.11"], K2.type, K2.blob), (["node2", "10.77.1.12"], K2.type, "AAAAtwo")]
    first = bf.merge_known_hosts("", pins)
    learned = first + "node2 ecdsa-sha2-nistp256 AAAAecdsa\nnode1 ssh-rsa AAAArsa\n"
    assert bf.merge_known_hosts(learned, pins) == learned
    # A stale pin is replaced where it stands; the learned lines stay.
    stale = learned.replace("AAAAtwo", "AAAAold")
    assert bf.merge_known_hosts(stale, pins) == learned


@pytest.mark.parametrize(
    "shell, path, syntax",
    [("/bin/bash", ".bashrc", "sh"), ("/usr/bin/zsh", ".zshenv", "sh"), ("/bin/tcsh", ".tcshrc", "csh"),
     ("/bin/csh", ".cshrc", "csh"), ("/usr/bin/fish", ".config/fish/config.fish", "fish")],
)
def test_startup_file_per_login_shell(shell, path, syntax):
    sf = bf.startup_file(shell)
    assert (sf.path, sf.syntax) == (path, syntax)


def test_sh_and_dash_have_no_startup_file_for_ssh_commands():
    assert bf.startup_file("/bin/sh") is None and bf.startup_file("/bin/dash") is None


DEBIAN_BASHRC = """# ~/.bashrc: executed by bash(1) for non-login shells.
export PATH=/opt/old/bin:$PATH

# If not running interactively, don't do anything
case $- in
    *i*) ;;
      *) return;;
esac

HISTCONTROL=ignoreboth
"""


def test_bash_path_block_goes_before_the_interactive_early_return():
    out = bf.update_startup_file(DEBIAN_BASHRC, "/opt/venv/bin", bf.startup_file("/bin/bash"))
    lines = out.splitlines()
    block = lines.index('export PATH="/opt/venv/bin:$PATH"')
    assert lines.index("export PATH=/opt/old/bin:$PATH") < block < lines.index("case $- in")
    assert bf.update_startup_file(out, "/opt/venv/bin", bf.startup_file("/bin/bash")) == out
    assert out.replace("\n".join(lines[block - 2:block + 2]) + "\n", "") == DEBIAN_BASHRC


def test_bash_block_moved_before_guard_if_it_sat_after_it():
    late = DEBIAN_BASHRC + f"{bf.BEGIN}\nexport PATH=\"/x:$PATH\"\n{bf.END}\n"
    out = bf.update_startup_file(late, "/opt/venv/bin", bf.startup_file("/bin/bash"))
    assert out.count(bf.BEGIN) == 1 and out.index(bf.BEGIN) < out.index("case $- in") and "/x:" not in out


def test_tcsh_block_uses_setenv_and_zsh_appends():
    tcsh = bf.update_startup_file("set prompt='%m> '\n", "/v/bin", bf.startup_file("/bin/tcsh"))
    assert 'setenv PATH "/v/bin:$PATH"' in tcsh
    zsh = bf.update_startup_file("typeset -U path\n", "/v/bin", bf.startup_file("/bin/zsh"))
    assert zsh.startswith("typeset -U path\n") and 'export PATH="/v/bin:$PATH"' in zsh


def test_loose_modes_are_reported_for_fixing():
    node = setup_node.NodeState(target=None, home="/home/lab")
    node.modes = {"": 0o775, ".ssh": 0o755, ".ssh/authorized_keys": 0o644, ".ssh/config": 0o600,
                  ".ssh/id_ed25519": 0o600, ".ssh/known_hosts": 0o644}
    fixes = {rel: (cur, want) for rel, cur, want in setup_node.mode_fixes(node)}
    assert fixes == {"": (0o775, 0o755), ".ssh": (0o755, 0o700), ".ssh/authorized_keys": (0o644, 0o600)}


def test_mesh_script_output_parses():
    script = bringup.mesh_script(["node1", "node2"])
    assert "BatchMode=yes" in script and "ConnectTimeout=5" in script
    got = bringup.parse_mesh("mesh node1 0 \nmesh node2 255 Host key verification failed. \nnoise\n")
    assert got == {"node1": (True, ""), "node2": (False, "Host key verification failed.")}


def _node(name, py, mpi):
    n = setup_node.NodeState(target=setup_node.Target(name, name))
    n.toolchain = {"python_path": "/v/bin/python" if py else "", "mpirun_path": "/v/bin/mpirun",
                   "python_version": py, "mpirun_version": mpi, "PATH": "/usr/bin:/bin"}
    return n


def test_toolchain_problems_name_node_and_fix():
    same = [_node("node1", "Python 3.11.7", "mpirun (Open MPI) 5.0.11"),
            _node("node2", "Python 3.11.7", "mpirun (Open MPI) 5.0.11")]
    assert bringup.toolchain_problems(same, "/v/bin") == []
    mixed = [same[0], _node("node3", "Python 3.9.2", "mpirun (Open MPI) 4.1.4"),
             _node("node4", "", "mpirun (Open MPI) 5.0.11")]
    probs = bringup.toolchain_problems(mixed, "/v/bin")
    assert any(p.startswith("node4: `ssh node4 python` finds no python") for p in probs)
    assert any("python differs" in p and "Python 3.9.2 on node3" in p for p in probs)
    assert any("mpirun differs" in p for p in probs)
    assert all("--fix-path" in p for p in probs)
