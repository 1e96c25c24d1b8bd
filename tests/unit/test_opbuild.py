"""analysis/opbuild.py: a DeepSpeed op build's death told apart from other errors, each cause with its fix."""

from __future__ import annotations

from pathlib import Path

from dscluster.analysis.opbuild import op_build_cause

RECORDED = Path(__file__).resolve().parents[1] / "data" / "opbuild" / "fused_adam_arch_9.0a.txt"


def test_the_recorded_arch_list_traceback_is_the_arch_list():
    cause, line = op_build_cause(RECORDED.read_text())
    assert cause.kind == "arch_list" and line == "ValueError: invalid literal for int() with base 10: '0a'"


def test_ninja_nvcc_and_a_cuda_mismatch_each_name_their_fix():
    ninja, _ = op_build_cause("RuntimeError: Ninja is required to load C++ extensions")
    assert ninja.kind == "ninja" and "pip install ninja" in ninja.fix
    mismatch, _ = op_build_cause("deepspeed.ops.op_builder.builder.CUDAMismatchException: >- DeepSpeed Op Builder: "
                                 "Installed CUDA version 11.8 does not match the version torch was compiled with "
                                 "12.8, unable to compile cuda/cpp extensions without a matching cuda version.")
    assert mismatch.kind == "cuda_mismatch" and "CUDA_HOME" in mismatch.fix
    nvcc, _ = op_build_cause("OSError: CUDA_HOME environment variable is not set. Please set it to your CUDA install")
    assert nvcc.kind == "nvcc"


def test_other_errors_are_not_an_op_build():
    assert op_build_cause(None) is None and op_build_cause("RuntimeError: CUDA out of memory") is None
    other = "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: invalid literal for int() " \
            "with base 10: 'abc'\n"
    assert op_build_cause(other) is None  # no op builder in that traceback
