"""DeepSpeed ops in the preflight: FusedAdam/FusedLamb (CPUAdam under ZeRO-Offload) prebuilt,
JIT-buildable or bound to fail, from a node's facts (pure rule), in check's findings and `dscluster env`."""

from __future__ import annotations

import json

from dscluster.check.dsops import arch_list_problem, ds_op_facts, ops_verdict
from dscluster.check.facts import Gpu, NodeFacts, PythonFacts
from dscluster.check.rules import rule_ds_ops
from dscluster.cli import main

NONE_BUILT = {"fused_adam": False, "fused_lamb": False, "cpu_adam": False}


def facts(**over) -> dict:
    return {"installed_ops": dict(NONE_BUILT), "ds_accelerator": "cuda", "ninja": True, "nvcc": "12.8",
            "torch_cuda_arch_list": None, **over}


def test_an_a_suffix_in_torch_cuda_arch_list_is_named_with_the_fix():
    assert arch_list_problem("8.0;8.6;9.0") is None and arch_list_problem("7.5 8.6+PTX") is None
    assert arch_list_problem(None) is None
    assert "'9.0a'" in arch_list_problem("8.0;9.0a") and "ValueError" in arch_list_problem("9.0a")
    verdict = ops_verdict(facts(torch_cuda_arch_list="9.0a"), "12.8", on_gpu=True)
    assert not verdict.ok and verdict.ops["FusedAdam"] == "cannot build"
    assert any("9.0a" in p for p in verdict.problems)
    assert any("without the suffix" in f for f in verdict.fixes)


def test_jit_buildable_with_ninja_and_a_matching_nvcc():
    verdict = ops_verdict(facts(nvcc="12.4"), "12.8", on_gpu=True)  # minor versions may differ
    assert verdict.ok and verdict.ops == {"FusedAdam": "JIT-buildable", "FusedLamb": "JIT-buildable",
                                          "CPUAdam": "JIT-buildable"}


def test_no_ninja_or_a_mismatched_nvcc_cannot_build():
    no_ninja = ops_verdict(facts(ninja=False), "12.8", on_gpu=True)
    assert no_ninja.ops["FusedAdam"] == "cannot build" and "pip install ninja" in no_ninja.fixes
    mismatch = ops_verdict(facts(nvcc="11.8"), "12.8", on_gpu=True)
    assert any("CUDA 11.8" in p and "12.8" in p for p in mismatch.problems)
    no_nvcc = ops_verdict(facts(nvcc=None), "12.8", on_gpu=True)
    assert any("no nvcc" in p for p in no_nvcc.problems)


def test_prebuilt_ops_need_nothing_and_no_deepspeed_says_nothing():
    built = facts(installed_ops={"fused_adam": True, "fused_lamb": True, "cpu_adam": True}, ninja=False, nvcc=None,
                  torch_cuda_arch_list="9.0a")
    assert ops_verdict(built, "12.8", on_gpu=True).ok
    assert ops_verdict({"installed_ops": None}, "12.8", on_gpu=True) is None
    assert ops_verdict(None, None, on_gpu=False) is None


def test_a_cpu_node_only_needs_ninja_for_cpu_adam():
    verdict = ops_verdict(facts(nvcc=None, ds_accelerator="cpu"), None, on_gpu=False)
    assert verdict.ok and verdict.ops["FusedAdam"] == "needs a GPU" and verdict.ops["CPUAdam"] == "JIT-buildable"


def test_check_warns_per_node_never_errors():
    gpu = Gpu(index=0, name="NVIDIA H100", uuid="GPU-1", compute_capability="9.0", memory_total_mb=81559,
              driver="580", ecc_uncorrected=0)
    good = NodeFacts(name="node1", python=PythonFacts(torch_cuda="12.8", ds_ops=facts()), gpus=[gpu])
    bad = NodeFacts(name="node2", python=PythonFacts(torch_cuda="12.8", ds_ops=facts(torch_cuda_arch_list="9.0a")),
                    gpus=[gpu])
    worse = NodeFacts(name="node3", python=PythonFacts(torch_cuda="12.8", ds_ops=facts(torch_cuda_arch_list="sm_90")),
                      gpus=[gpu])
    findings = rule_ds_ops({"node1": good, "node2": bad, "node3": worse})
    assert [(f.node, f.severity) for f in findings] == [("node2", "info"), ("node3", "warning")]
    assert "TORCH_CUDA_ARCH_LIST='9.0a' would crash" in findings[0].what and "'9.0'" in findings[0].what
    assert "FusedAdam cannot build" in findings[1].what and "sm_90" in findings[1].what
    assert "TORCH_CUDA_ARCH_LIST" in findings[1].fix


def test_check_writes_a_usable_arch_list_into_the_nodes_env_file_where_the_inherited_one_would_crash():
    from dscluster.check.rules import evaluate, node_envs
    from dscluster.node.hosts import parse_hostfile_text

    gpu = Gpu(index=0, name="NVIDIA H200", uuid="GPU-1", compute_capability="9.0", memory_total_mb=143771,
              driver="580", ecc_uncorrected=0)
    nodes = {n: NodeFacts(name=n, python=PythonFacts(torch_cuda="12.8", ds_ops=facts(torch_cuda_arch_list=arch)),
                          gpus=[gpu]) for n, arch in (("node1", "9.0a"), ("node2", "8.6;9.0"), ("node3", None))}
    ev = evaluate(nodes, parse_hostfile_text("node1 slots=1\nnode2 slots=1\nnode3 slots=1\n"))
    per_node, cluster = node_envs(ev, nodes, master_port=29500, created=0, hostfile_sha256="x")
    assert per_node["node1"]["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert "TORCH_CUDA_ARCH_LIST" not in per_node["node2"] and "TORCH_CUDA_ARCH_LIST" not in per_node["node3"]
    assert "TORCH_CUDA_ARCH_LIST" not in cluster  # one node's own value, never the whole cluster's


def test_usable_arch_list_drops_only_the_letter_suffix():
    from dscluster.check.dsops import usable_arch_list

    assert usable_arch_list("9.0a") == "9.0" and usable_arch_list("8.6;9.0a+PTX") == "8.6;9.0+PTX"
    assert usable_arch_list("7.5 9.0a 9.0") == "7.5;9.0" and usable_arch_list("10.0f;12.0a") == "10.0;12.0"
    assert usable_arch_list("9.0") is None and usable_arch_list("sm_90") is None and usable_arch_list(None) is None


def test_facts_of_this_machine_and_the_env_line(capsys, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    here = ds_op_facts()
    assert here["torch_cuda_arch_list"] == "9.0a" and isinstance(here["installed_ops"], dict)
    assert main(["env", "--json", "--no-ops"]) == 0
    needed = json.loads(capsys.readouterr().out)["deepspeed"]["ops_needed"]
    assert set(needed["ops"]) == {"FusedAdam", "FusedLamb", "CPUAdam"} and needed["line"].startswith("DeepSpeed ops:")
