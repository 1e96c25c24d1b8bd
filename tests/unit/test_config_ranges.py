"""Every number and choice of the training config has a declared range, and every way in keeps it.

The keys come from the config model itself (dataclasses.fields, recursed into its sections), and
so do the values tried, from each field's declared rule: values just and far outside a bound
(and non-finite ones for floats), values of the wrong type, and the bounds themselves. Each goes
in through a `key=value` override and through a YAML file: a rejection must be a UsageError that
names the key and where it was set (the override, FILE:LINE); a boundary value must load.
Then the command line: exit 2, the message, no traceback, and nothing written.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
import typing

import pytest
from test_bad_input import ISOLATE, snapshot

from dscluster.core.config import ConfigValueError, TrainConfig, load_config
from dscluster.errors import UsageError

BOUNDS = ("ge", "gt", "le", "lt")

# Cross-field rules a lone boundary value would break (embed_dim=1 does not divide by 3 heads;
# cifar10 needs data.path): what each key needs beside it to load.
COMPANIONS = {
    "model.embed_dim": ["model.num_heads=1"],
    "data.img_size": ["model.patch_size=1"],
    "data.dataset": ["data.path=data"],
    "offload_optimizer": ["zero_stage=2"],
}


def leaves(cls, prefix: str = ""):
    """(dotted key, field, type) of every value of the config model, sections recursed."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from leaves(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, tp


FIELDS = {key: (f, tp) for key, f, tp in leaves(TrainConfig)}


def _types(tp) -> set:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return {a for a in typing.get_args(tp) if a is not type(None)}
    return {tp}


def _list_item(tp):
    """The entry type of a list field, else None."""
    lists = [a for a in _types(tp) if typing.get_origin(a) is list]
    return typing.get_args(lists[0])[0] if lists else None


def _number(tp):
    """int or float: what the field (or each entry of a list field) holds, if a number."""
    item = _list_item(tp)
    kinds = {item} if item else _types(tp)
    return float if float in kinds else int if int in kinds else None


def yaml_text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return {float("inf"): ".inf", float("-inf"): "-.inf"}.get(value, ".nan" if value != value else repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(map(yaml_text, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{name}: {yaml_text(item)}" for name, item in value.items()) + "}"
    return str(value)


def _as_field(key: str, value) -> object:
    """A value for one entry becomes a whole list on a list field (of the declared length)."""
    f, tp = FIELDS[key]
    if _list_item(tp) is None or isinstance(value, list):
        return value
    return [value] * f.metadata.get("length", 2)


def out_of_range(key: str) -> list:
    f, tp = FIELDS[key]
    rule, number = f.metadata, _number(tp)
    bad: list = []
    step = 1 if number is int else 1e-3
    if "ge" in rule:
        bad += [rule["ge"] - step, rule["ge"] - 10**6]
    if "gt" in rule:
        bad += [rule["gt"], rule["gt"] - 1]
    if "le" in rule:
        bad += [rule["le"] + step, rule["le"] + 10**6]
    if "lt" in rule:
        bad += [rule["lt"], rule["lt"] + 1]
    if number is float and any(b in rule for b in BOUNDS):
        bad += [float("nan"), float("inf"), float("-inf")]
    bad = [number(b) for b in bad] if number else bad
    if "words" in rule:
        bad.append("nonsense")
    if "choices" in rule:
        ints = [c for c in rule["choices"] if isinstance(c, int)]
        bad += [min(ints) - 1, max(ints) + 1] if ints else ["nonsense"]
    out = [_as_field(key, b) for b in bad]
    if "length" in rule:
        out.append([default_item(key)] * (rule["length"] + 1))
    return out


def default_item(key: str):
    f, _ = FIELDS[key]
    return f.default_factory()[0]


def boundaries(key: str) -> list:
    f, tp = FIELDS[key]
    rule, number = f.metadata, _number(tp)
    good: list = []
    if "ge" in rule:
        good.append(rule["ge"])
    if "gt" in rule:
        good.append(rule["gt"] + (1 if number is int else 1e-6))
    if "le" in rule:
        good.append(rule["le"])
    if "lt" in rule:
        good.append(rule["lt"] - (1 if number is int else 1e-6))
    good = [number(g) for g in good]
    good += list(rule.get("words", ())) + list(rule.get("choices", ()))
    return [_as_field(key, g) for g in good]


def wrong_types(key: str) -> list:
    _, tp = FIELDS[key]
    kinds = _types(tp)
    if _list_item(tp) is not None:
        return ["abc", "{a: 1}", "[x, y]" if _number(tp) else "[[1], [2]]"]
    if kinds == {bool}:
        return ["maybe", 2, "[true]"]
    if kinds <= {str}:
        return ["[a]", "{a: 1}"]
    wrong = ["[1]", "{a: 1}"]
    if str not in kinds:  # a word field turns these into strings its words then refuse
        wrong += ["abc", "true"] + ([2.5] if int in kinds else [])
    return wrong


def write_yaml(tmp_path, key: str, value) -> tuple:
    """A config setting only `key`, under a comment line so the line number is not 1."""
    *sections, name = key.split(".")
    lines = ["# the value under test is on the last line"]
    lines += ["  " * depth + f"{s}:" for depth, s in enumerate(sections)]
    lines.append("  " * len(sections) + f"{name}: {yaml_text(value)}")
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, len(lines)


def rejections(tmp_path, key: str, values: list) -> list[str]:
    """For each value and each way in, what went wrong (empty: all rejected as they should be)."""
    problems = []
    for value in values:
        override = f"{key}={yaml_text(value)}"
        path, line = write_yaml(tmp_path, key, value)
        for where, args in ((f"override {override!r}", (None, [override])), (f"{path}:{line}:", (path,))):
            try:
                load_config(*args)
                problems.append(f"{where} {value!r} was accepted")
            except UsageError as e:
                msg = str(e)
                if e.exit_code != 2 or where not in msg or key not in msg:
                    problems.append(f"{where} {value!r}: message lacks the place or the key: {msg}")
    return problems


# Switches and free text declare no range: nothing lies outside one, and no bound can be tried. They are cases
# of their own tests below; a case here with no value to try would pass having checked nothing.
UNRANGED = sorted(key for key in FIELDS if not out_of_range(key) and not boundaries(key))
RANGED = sorted(key for key in FIELDS if out_of_range(key))
BOUNDED = sorted(key for key in FIELDS if boundaries(key))


@pytest.mark.parametrize("key", RANGED)
def test_out_of_range_values_are_refused_naming_the_key_and_where(key, tmp_path):
    values = out_of_range(key)
    problems = rejections(tmp_path, key, values)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_wrong_types_are_refused_naming_the_key_and_where(key, tmp_path):
    problems = rejections(tmp_path, key, wrong_types(key))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("key", BOUNDED)
def test_boundary_values_load(key, tmp_path):
    companions = COMPANIONS.get(key, [])
    for value in boundaries(key):
        cfg = load_config(None, [f"{key}={yaml_text(value)}", *companions])
        assert _get(cfg, key) == value
        path, _ = write_yaml(tmp_path, key, value)
        assert _get(load_config(path, companions), key) == value


@pytest.mark.parametrize("key", UNRANGED)
def test_a_key_without_a_range_is_a_switch_or_text(key):
    # A number whose rule was lost would land here, with nothing outside its range tried: only a switch, free text
    # or DeepSpeed's own section may declare no range.
    f, tp = FIELDS[key]
    assert _types(tp) in ({bool}, {str}, {dict[str, typing.Any]}), f"{key}: {tp} declares no range"
    assert not f.metadata, f"{key}: {f.metadata} declares a rule the range tests do not try"


def own_type_values(key: str) -> list:
    """Values of the key's own type, not only its default: each must load and read back as given."""
    (kind,) = _types(FIELDS[key][1])
    return {bool: [True, False], str: ["vit_tiny_patch16_224", "/data/my-set"],
            dict[str, typing.Any]: [{"wall_clock_breakdown": True}]}.get(kind, [])


@pytest.mark.parametrize("key", UNRANGED)
def test_a_key_without_a_range_takes_values_of_its_type(key, tmp_path):
    for value in own_type_values(key):
        assert _get(load_config(None, [f"{key}={yaml_text(value)}", *COMPANIONS.get(key, [])]), key) == value
        path, _ = write_yaml(tmp_path, key, value)
        assert _get(load_config(path, COMPANIONS.get(key, [])), key) == value


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_number_and_choice_declares_its_range():
    for key, (f, tp) in FIELDS.items():
        if _number(tp):
            assert any(b in f.metadata for b in BOUNDS) or "choices" in f.metadata, f"{key} has no declared range"
        if "choices" in f.metadata:
            assert f.default in f.metadata["choices"], key
    assert {"optim.lr", "fp16.initial_scale_power", "checkpoint.every_steps", "optim.betas"} <= set(FIELDS)


def test_range_message_gives_the_range_and_a_value_that_works():
    with pytest.raises(ConfigValueError) as e:
        load_config(None, ["fp16.initial_scale_power=40"])
    assert str(e.value) == ("override 'fp16.initial_scale_power=40': fp16.initial_scale_power must be at least 0 "
                            "and at most 24, got 40; e.g. fp16.initial_scale_power=10 (the default)")
    with pytest.raises(ConfigValueError, match=r"data\.limit must be at least 1, got 0; .* or null \(the default\)"):
        load_config(None, ["data.limit=0"])
    with pytest.raises(ConfigValueError, match=r"optim\.lr must be a finite number, greater than 0, got nan"):
        load_config(None, ["optim.lr=.nan"])


def test_min_loss_scale_above_the_starting_scale_names_both_keys(tmp_path):
    path, line = write_yaml(tmp_path, "fp16.min_loss_scale", 4096)
    with pytest.raises(ConfigValueError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}:{line}: fp16.min_loss_scale=4096 is above the starting scale 2^10")
    assert load_config(path, ["fp16.initial_scale_power=12"]).fp16.min_loss_scale == 4096


# --- what the config points at: checked with world=True, before a run directory exists ------------

def _world_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigValueError) as e:
        load_config(None, overrides, world=True)
    assert e.value.exit_code == 2
    return str(e.value)


def test_data_path_must_exist_and_hold_the_data(tmp_path):
    missing = tmp_path / "nope"
    msg = _world_error(["data.dataset=cifar10", f"data.path={missing}"])
    assert msg.startswith(f"override 'data.path={missing}': data.path") and "does not exist" in msg
    (tmp_path / "file").write_text("x")
    assert "is a file" in _world_error(["data.dataset=imagefolder", f"data.path={tmp_path / 'file'}"])
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    (batches / "data_batch_1").write_text("")
    assert "lacks data_batch_2, data_batch_3" in _world_error(["data.dataset=cifar10", f"data.path={tmp_path}"])
    for name in ("data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"):
        (batches / name).write_text("")
    load_config(None, ["data.dataset=cifar10", f"data.path={tmp_path}"], world=True)
    assert "no class folders" in _world_error(["data.dataset=imagefolder", f"data.path={batches}"])
    (batches / "cat").mkdir()
    load_config(None, ["data.dataset=imagefolder", f"data.path={batches}"], world=True)
    # --print-config loads without world checks
    load_config(None, ["data.dataset=cifar10", f"data.path={missing}"])


def test_model_name_must_be_known_to_timm(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 1\nmodel:\n  name: vit_bse_patch16_224\n")
    with pytest.raises(ConfigValueError) as e:
        load_config(path, world=True)
    assert str(e.value).startswith(f"{path}:3: model.name 'vit_bse_patch16_224' is not a timm model; e.g. vit_")
    assert load_config(None, ["model.name=vit_tiny_patch16_224"], world=True).model.name == "vit_tiny_patch16_224"


def test_resume_true_needs_a_checkpoint_and_checkpoint_dir_a_folder(tmp_path):
    ckpt = tmp_path / "ckpt"
    msg = _world_error(["checkpoint.resume=true", f"checkpoint.dir={ckpt}"])
    assert msg.startswith("override 'checkpoint.resume=true': checkpoint.resume=true but") and "no complete" in msg
    (ckpt / "epoch0001-step000010").mkdir(parents=True)
    (ckpt / "latest").write_text("epoch0001-step000010\n")
    load_config(None, ["checkpoint.resume=true", f"checkpoint.dir={ckpt}"], world=True)
    (tmp_path / "file").write_text("x")
    assert "is a file" in _world_error([f"checkpoint.dir={tmp_path / 'file'}"])


# --- through the command line ------------------------------------------------------------------

@pytest.mark.parametrize("argv, files, expect", [
    (["train", "--config", "c.yaml", "optim.lr=-1"], {"c.yaml": "epochs: 1\noptim:\n  lr: 0.002\n"},
     ("override 'optim.lr=-1'", "optim.lr must be greater than 0, got -1.0", "e.g. optim.lr=")),
    (["train", "--config", "c.yaml"], {"c.yaml": "epochs: 1\nfp16:\n  initial_scale_power: 40\n"},
     ("c.yaml:3:", "fp16.initial_scale_power must be at least 0 and at most 24", "e.g. fp16.initial_scale_power=")),
    (["train", "--config", "c.yaml", "data.path=photos"], {"c.yaml": "data:\n  dataset: imagefolder\n"},
     ("override 'data.path=photos'", "data.path 'photos' does not exist", "point it at the folder")),
], ids=["override-negative-lr", "yaml-scale-power", "world-data-path"])
def test_cli_exits_2_with_the_message_and_writes_nothing(argv, files, expect, tmp_path):
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    (tmp_path / "home").mkdir()
    before = snapshot(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ISOLATE}
    env.update(HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "dscluster", *argv], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=240)
    out = p.stderr + p.stdout
    assert p.returncode == 2, out
    assert not [s for s in expect if s not in out], out
    assert "Traceback" not in out, out
    assert not (tmp_path / "runs").exists() and not (tmp_path / ".dscluster").exists()
    assert snapshot(tmp_path) == before
