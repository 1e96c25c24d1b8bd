"""Field-by-field validation of the files dscluster reads back (check.json, summary.json, plans.json,
checkpoint metadata): each file's model is a table FIELD -> the types the field may hold, and a
document is checked against it like user input, so a damaged file is reported by its field instead of
raising a TypeError in whichever reader touches the field first.

Table keys are dotted paths: `a.b` a nested field, `a[]` each element of the list `a`, `a{}` each value
of the mapping `a`. A field that is absent or null is "not known", never an error: readers decide what
that means, and files from older versions that lack a field still load. Fields not in the table are
not checked (keys are only ever added).
"""

from __future__ import annotations

import json
from typing import Mapping

NUMBER = (int, float)
"""A JSON number; true/false is not one here, as in JSON."""


def type_name(types: tuple[type, ...]) -> str:
    if float in types:
        return "a number"
    return " or ".join({"int": "a whole number", "bool": "true/false", "str": "a string", "dict": "a mapping",
                        "list": "a list"}[t.__name__] for t in types)


def validate(doc: Mapping, types: Mapping[str, tuple[type, ...]], prefix: str = "", shown: str = "") -> None:
    """Raise ValueError("field WHERE is VALUE, expected TYPE") for the first field of `types` that is
    present with the wrong type."""
    for key, value in doc.items():
        spec, where = f"{prefix}{key}", f"{shown}{key}"
        _check(types, spec, where, value)
        if isinstance(value, Mapping):
            if f"{spec}{{}}" in types:
                for k, v in value.items():
                    _check(types, f"{spec}{{}}", f"{where}.{k}", v)
                    if isinstance(v, Mapping):
                        validate(v, types, f"{spec}{{}}.", f"{where}.{k}.")
            else:
                validate(value, types, f"{spec}.", f"{where}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                _check(types, f"{spec}[]", f"{where}[{i}]", item)
                if isinstance(item, Mapping):
                    validate(item, types, f"{spec}[].", f"{where}[{i}].")


def _check(types: Mapping[str, tuple[type, ...]], spec: str, where: str, value: object) -> None:
    want = types.get(spec)
    if want is None or value is None:
        return
    if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
        raise ValueError(f"field {where} is {json.dumps(value)[:60]}, expected {type_name(want)}")


def load_state_file(path, types: Mapping[str, tuple[type, ...]], fix: str, error: type[Exception]) -> dict | None:
    """A state file read back like user input: its JSON object validated against `types`, None when
    there is none; `error("<path>: unreadable|damaged: <why>; <fix>")` when it is torn or damaged."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: unreadable ({type(e).__name__}: {e}); {fix}") from None
    try:
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        validate(doc, types)
    except ValueError as e:
        raise error(f"{path}: damaged: {e}; {fix}") from None
    return doc
