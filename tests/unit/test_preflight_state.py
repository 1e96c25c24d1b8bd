"""State files written by check and sourced by entry_cn.sh / read by launch."""

import subprocess

import pytest

from dscluster.errors import UsageError
from dscluster.files import state


def test_env_file_round_trips_and_bash_sources_it_without_running_anything(tmp_path):
    path = tmp_path / "env" / "node1.env"
    values = {"NCCL_SOCKET_IFNAME": "eth0", "WEIRD": "a b'c $(touch pwned)", "EMPTY": ""}
    state.write_env_file(path, values, header="test")
    assert state.read_env_file(path) == values
    out = subprocess.run(["bash", "-c", f"source {path} && printf %s \"$WEIRD\""], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.stdout == values["WEIRD"] and not (tmp_path / "pwned").exists()


def test_malformed_env_line_names_file_and_line(tmp_path):
    path = tmp_path / "cluster.env"
    path.write_text("# ok\nexport A='1'\nthis is not an assignment\n")
    with pytest.raises(UsageError, match=r"cluster.env:3:"):
        state.read_env_file(path)


def test_deepspeed_env_format(tmp_path):
    path = tmp_path / ".deepspeed_env"
    state.write_deepspeed_env(path, {"NCCL_P2P_DISABLE": "1", "MASTER_ADDR": "10.0.0.1"})
    assert path.read_text() == "MASTER_ADDR=10.0.0.1\nNCCL_P2P_DISABLE=1\n"
    assert state.read_deepspeed_env(path) == {"MASTER_ADDR": "10.0.0.1", "NCCL_P2P_DISABLE": "1"}
    path.write_text("A=1\nnonsense\n")
    with pytest.raises(UsageError, match=r"\.deepspeed_env:2:"):
        state.read_deepspeed_env(path)
    with pytest.raises(UsageError):
        state.write_deepspeed_env(path, {"A": "x\ny"})


def test_paths_follow_dscluster_state():
    env = {"DSCLUSTER_STATE": "/srv/st", "DS_ENV_FILE": "/srv/ds"}
    assert str(state.node_env_path("ws1", env)) == "/srv/st/env/ws1.env"
    assert str(state.check_json_path(env)) == "/srv/st/check.json"
    assert str(state.cluster_env_path(env)) == "/srv/st/cluster.env"
    assert str(state.known_hosts_path(env)) == "/srv/st/known_hosts"
    assert str(state.deepspeed_env_path(env)) == "/srv/ds"
    assert str(state.state_dir({})) == ".dscluster"
    with pytest.raises(UsageError):
        state.node_env_path("../x", env)
