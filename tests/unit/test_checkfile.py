"""check.json through its one model: what check writes is what launch, plan and env read back."""

import json

import pytest

from dscluster.check import checkfile
from dscluster.check.checkfile import CheckFile, CheckFileError, NodeResult


def _doc(**over):
    doc = CheckFile(ok=False, created=1795658000.0, wall_s=3.2, hostfile="hosts.txt", hostfile_sha256="ab", np=3,
                    head="node1", master={"addr": "10.0.0.1", "port": 29500},
                    nodes=[NodeResult(name="node1", hostname="ws1", checks={"reach": "ok"}, facts={"gpus": []}),
                           NodeResult(name="node2", reachable=False)],
                    active={"allreduce": {"ok": True, "result": {"world_size": 3, "results": []}}})
    for key, value in over.items():
        setattr(doc, key, value)
    return doc


def test_what_check_writes_loads_back_the_same(tmp_path):
    path = checkfile.write(tmp_path / "check.json", _doc())
    raw = json.loads(path.read_text())
    assert raw["schema"] == checkfile.SCHEMA_VERSION == 1 and raw["nodes"][1]["reachable"] is False
    assert checkfile.load(path) == _doc()


def test_an_older_or_trimmed_file_loads_with_empty_fields(tmp_path):
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"hostfile": "h.txt", "hostfile_sha256": "cd", "created": None,
                                "nodes": [{"name": "n1", "facts": {"gpus": [{"index": 0}]}}]}))
    doc = checkfile.load(path)
    assert (doc.ok, doc.created, doc.hostfile, doc.np) == (None, None, "h.txt", None)
    assert [n.name for n in doc.nodes] == ["n1"] and doc.has_gpus() is True
    assert doc.allreduce_result() is None


def test_gpus_are_unknown_when_no_node_was_probed():
    assert _doc(nodes=[NodeResult(name="n", reachable=False)]).has_gpus() is None
    assert _doc().has_gpus() is False
    assert _doc().allreduce_result() == {"world_size": 3, "results": []}


def test_a_missing_file_is_the_readers_to_explain_and_a_broken_one_names_itself(tmp_path):
    with pytest.raises(FileNotFoundError):
        checkfile.load(tmp_path / "check.json")
    (tmp_path / "check.json").write_text("{not json")
    with pytest.raises(CheckFileError, match=r"check.json: unreadable check output .*dscluster check"):
        checkfile.load(tmp_path / "check.json")
    (tmp_path / "check.json").write_text("[1, 2]")
    with pytest.raises(CheckFileError, match="not a check result"):
        checkfile.load(tmp_path / "check.json")


@pytest.mark.parametrize("doc, field", [
    ({"active": {"allreduce": {"result": {"world_size": 4, "results": [{"bytes": 8, "busbw_GBps": "1.2"}]}}}},
     "active.allreduce.result.results[0].busbw_GBps is \"1.2\", expected a number"),
    ({"active": {"allreduce": {"result": {"world_size": "4", "results": []}}}},
     "active.allreduce.result.world_size is \"4\", expected a whole number"),
    ({"created": "yesterday"}, "created is \"yesterday\", expected a number"),
    ({"np": True}, "np is true, expected a whole number"),
    ({"nodes": [{"name": "n1"}, "junk"]}, "nodes[1] is \"junk\", expected a mapping"),
    ({"nodes": [{"name": "n1", "env": {"NCCL_SOCKET_IFNAME": 3}}]}, "nodes[0].env.NCCL_SOCKET_IFNAME is 3"),
    ({"nodes": [{"name": "n1", "reachable": "yes"}]}, "nodes[0].reachable is \"yes\", expected true/false"),
], ids=["busbw-string", "world-size-string", "created-string", "np-bool", "node-not-mapping", "env-value-int",
        "reachable-string"])
def test_a_field_of_the_wrong_type_names_the_file_the_field_and_the_fix(tmp_path, doc, field):
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"ok": True, **doc}))
    with pytest.raises(CheckFileError) as e:
        checkfile.load(path)
    assert str(path) in str(e.value) and field in str(e.value) and "re-run `dscluster check`" in str(e.value)
