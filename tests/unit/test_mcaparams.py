"""The subnet check writes where a hand-typed mpirun reads it (~/.openmpi and ~/.prte parameter files)."""

from __future__ import annotations

import subprocess
import sys

from dscluster.launch.mcaparams import MARK, PARAM_FILES, parse_writer, set_marked_param, writer_command

SETUP_BLOCK = "# >>> dscluster >>>\noob_tcp_keepalive_time = 10\n# <<< dscluster <<<\n"


def test_our_line_is_added_then_replaced_and_every_other_line_stays():
    once, theirs = set_marked_param(SETUP_BLOCK, "oob_tcp_if_include", "10.0.0.0/24")
    assert theirs is None and once == SETUP_BLOCK + f"{MARK}\noob_tcp_if_include = 10.0.0.0/24\n"
    twice, _ = set_marked_param(once, "oob_tcp_if_include", "10.9.0.0/24")
    assert twice == SETUP_BLOCK + f"{MARK}\noob_tcp_if_include = 10.9.0.0/24\n"


def test_a_users_own_setting_is_kept_and_reported():
    mine = "# my lab\nbtl_tcp_if_include = eth1\n"
    text, theirs = set_marked_param(mine, "btl_tcp_if_include", "10.0.0.0/24")
    assert theirs == "btl_tcp_if_include = eth1" and text.startswith(mine)
    assert set_marked_param("# btl_tcp_if_include = eth1\n", "btl_tcp_if_include", "x")[1] is None


def test_the_node_side_writer_writes_both_files_atomically_in_the_home(tmp_path):
    (tmp_path / ".prte").mkdir()
    (tmp_path / ".prte" / "mca-params.conf").write_text(SETUP_BLOCK)
    for cidr in ("10.0.0.0/24", "10.77.1.0/24"):
        res = subprocess.run(["bash", "-c", writer_command(sys.executable, cidr)], env={"HOME": str(tmp_path)},
                             capture_output=True, text=True, timeout=60)
        assert parse_writer(res.stdout) == {rel: {"ok": True, "theirs": None} for rel in PARAM_FILES}, res.stderr
    assert (tmp_path / ".openmpi" / "mca-params.conf").read_text() == f"{MARK}\nbtl_tcp_if_include = 10.77.1.0/24\n"
    prte = (tmp_path / ".prte" / "mca-params.conf").read_text()
    assert prte == SETUP_BLOCK + f"{MARK}\noob_tcp_if_include = 10.77.1.0/24\n"
    assert sorted(p.name for p in (tmp_path / ".openmpi").iterdir()) == ["mca-params.conf"]
