"""`check.json`: what the last `dscluster check` found, as one typed record.

`dscluster check` writes it (and prints it with --json); `dscluster launch`, `dscluster plan` and
`dscluster env` read it, only through `load`. The schema, version `SCHEMA_VERSION`, is described in
one place: docs/schemas.md ("`dscluster check --json` and `check.json`"). Keys are only ever added
and a change in meaning bumps the version, so reading is lenient: a check.json from an older
dscluster, or one trimmed by hand, loads with the fields it lacks empty, and each reader decides
what an empty field means for it. A field that is present with the wrong type (`world_size: "4"`,
`busbw_GBps: "1.2"`) is a damaged file, validated like user input: CheckFileError naming the file, the
field and the fix, never a TypeError later in a reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dscluster.errors import UsageError
from dscluster.files import filemodel
from dscluster.files.filemodel import NUMBER
from dscluster.files.fsutil import atomic_write_json

SCHEMA_VERSION = 1


class CheckFileError(UsageError):
    """check.json exists but cannot be read as a check result (the message names the file)."""


@dataclass(kw_only=True, slots=True)
class NodeResult:
    """One hostfile line as the check saw it."""

    name: str
    """As in the hostfile."""
    reachable: bool = True
    hostname: str | None = None
    """What `hostname` prints there: the name of its env file."""
    checks: dict[str, str] = field(default_factory=dict)
    """Check (table column) -> "ok" | "warning" | "error"."""
    env: dict[str, str] = field(default_factory=dict)
    """What <state>/env/<hostname>.env exports."""
    facts: dict[str, Any] | None = None
    """NodeFacts.to_dict(); None when the node could not be probed."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "reachable": self.reachable, "hostname": self.hostname, "checks": self.checks,
                "env": self.env, "facts": self.facts}

    @classmethod
    def from_dict(cls, doc: Mapping) -> NodeResult:
        return cls(name=str(doc.get("name")), reachable=doc.get("reachable", True) is not False,
                   hostname=doc.get("hostname"), checks=_dict(doc.get("checks")), env=_dict(doc.get("env")),
                   facts=doc.get("facts") if isinstance(doc.get("facts"), dict) else None)


@dataclass(kw_only=True, slots=True)
class CheckFile:
    """The whole check result; field meanings are in docs/schemas.md."""

    ok: bool | None
    """No finding of severity "error"; None when the file does not say."""
    created: float | None = None
    """Unix time the probe started."""
    wall_s: float | None = None
    hostfile: str | None = None
    """The hostfile's path as given to check."""
    hostfile_sha256: str | None = None
    """`hostfile_sha256(hostfile)` when check ran: launch refuses a hostfile that changed since."""
    np: int | None = None
    head: str | None = None
    precision: dict[str, Any] = field(default_factory=dict)
    batching: dict[str, Any] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)
    master: dict[str, Any] = field(default_factory=dict)
    nodes: list[NodeResult] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    active: dict[str, Any] | None = None
    files: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    """Where each node's files are (check/layout.py): checkout shared or a copy and the same as the
    head's, run directory shared or its own, data present; {} in a file from before it."""
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema, "ok": self.ok, "created": self.created, "wall_s": self.wall_s,
            "hostfile": self.hostfile, "hostfile_sha256": self.hostfile_sha256, "np": self.np, "head": self.head,
            "precision": self.precision, "batching": self.batching, "network": self.network, "master": self.master,
            "nodes": [n.to_dict() for n in self.nodes], "findings": self.findings, "active": self.active,
            "files": self.files, "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, doc: Mapping) -> CheckFile:
        def number(key: str) -> float | None:
            value = doc.get(key)
            return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        return cls(
            schema=doc.get("schema", SCHEMA_VERSION),
            ok=doc.get("ok") if isinstance(doc.get("ok"), bool) else None,
            created=number("created"), wall_s=number("wall_s"),
            hostfile=doc.get("hostfile") if isinstance(doc.get("hostfile"), str) else None,
            hostfile_sha256=doc.get("hostfile_sha256") if isinstance(doc.get("hostfile_sha256"), str) else None,
            np=doc.get("np") if isinstance(doc.get("np"), int) else None,
            head=doc.get("head") if isinstance(doc.get("head"), str) else None,
            precision=_dict(doc.get("precision")), batching=_dict(doc.get("batching")),
            network=_dict(doc.get("network")), master=_dict(doc.get("master")),
            nodes=[NodeResult.from_dict(n) for n in doc.get("nodes") or [] if isinstance(n, Mapping)],
            findings=[dict(f) for f in doc.get("findings") or [] if isinstance(f, Mapping)],
            active=doc.get("active") if isinstance(doc.get("active"), dict) else None,
            files=_dict(doc.get("files")), layout=_dict(doc.get("layout")),
        )

    def has_gpus(self) -> bool | None:
        """Whether check found GPUs on the nodes it reached; None when it reached none (or the
        file predates facts)."""
        facts = [n.facts for n in self.nodes if n.facts is not None]
        if not facts:
            return None
        return any(f.get("gpus") for f in facts)

    def allreduce_result(self) -> dict[str, Any] | None:
        """The all-reduce test's result document (`dscluster.bench.allreduce --json`), if it ran and
        gave one."""
        result = ((self.active or {}).get("allreduce") or {}).get("result")
        return result if isinstance(result, dict) else None

    def slowest_link(self) -> dict[str, Any] | None:
        """The slowest pair of check's link tests, {"from", "to", "bps"} (check.netrules.links_summary),
        if they ran and measured one."""
        slowest = ((self.active or {}).get("links") or {}).get("slowest")
        return slowest if isinstance(slowest, dict) and slowest.get("bps") else None

    def shared_runs(self) -> bool | None:
        """Whether every node the check compared writes runs into the head's run directory; None
        when the file does not say."""
        nodes = [n for n in (self.layout.get("nodes") or {}).values() if isinstance(n, dict) and n.get("runs")]
        return all(n["runs"] == "shared" for n in nodes) if nodes else None


def _dict(value: object) -> dict:
    return dict(value) if isinstance(value, Mapping) else {}


def write(path: str | Path, doc: CheckFile) -> Path:
    """Write atomically: a reader never sees half a check.json."""
    return atomic_write_json(path, doc.to_dict())


# check.json's fields and their types (dscluster.files.filemodel: absent or null is "not known").
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "schema": (int,), "ok": (bool,), "created": NUMBER, "wall_s": NUMBER, "hostfile": (str,),
    "hostfile_sha256": (str,), "np": (int,), "head": (str,), "precision": (dict,), "batching": (dict,),
    "network": (dict,), "master": (dict,), "files": (dict,), "findings": (list,), "findings[]": (dict,),
    "active": (dict,), "nodes": (list,), "nodes[]": (dict,), "nodes[].name": (str,),
    "nodes[].reachable": (bool,), "nodes[].hostname": (str,), "nodes[].checks": (dict,),
    "nodes[].checks{}": (str,), "nodes[].env": (dict,), "nodes[].env{}": (str,), "nodes[].facts": (dict,),
    "active.allreduce": (dict,), "active.allreduce.result": (dict,), "active.allreduce.result.world_size": (int,),
    "active.allreduce.result.results": (list,), "active.allreduce.result.results[]": (dict,),
    "active.allreduce.result.results[].bytes": (int,), "active.allreduce.result.results[].busbw_GBps": NUMBER,
    "active.allreduce.result.results[].time_us": NUMBER, "active.allreduce.result.results[].algbw_GBps": NUMBER,
    "active.links": (dict,), "active.links.pairs": (list,), "active.links.slowest": (dict,),
    "active.links.slowest.from": (str,), "active.links.slowest.to": (str,), "active.links.slowest.bps": NUMBER,
    "active.nccl_socket": (dict,), "active.nccl_socket.link_bps": NUMBER, "active.nccl_socket.grid": (list,),
    "active.nccl_socket.grid[]": (dict,), "active.nccl_socket.grid[].busbw_GBps": NUMBER,
}


def load(path: str | Path) -> CheckFile:
    """The check.json at `path`. A missing file raises FileNotFoundError (each reader says what
    to do about it); one that is not a check result raises CheckFileError."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckFileError(f"{path}: unreadable check output ({e}); run `dscluster check` again") from None
    if not isinstance(doc, dict):
        raise CheckFileError(f"{path}: not a check result; run `dscluster check` again")
    try:
        filemodel.validate(doc, FIELD_TYPES)
    except ValueError as e:
        raise CheckFileError(f"{path}: damaged check output: {e}; re-run `dscluster check`") from None
    return CheckFile.from_dict(doc)
