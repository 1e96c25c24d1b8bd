"""The hostfile: passed to `mpirun --hostfile` and to DeepSpeed's launcher, so it is the
syntax both accept:

    # comment
    node1 slots=2
    node2 slots=2 max_slots=4

DeepSpeed's launcher matches every line against `^(\\S+)\\s+slots=(\\d+)`, so the bare `node3` or
`node3 max_slots=4 slots=2` that OpenMPI takes is refused here too. Every rejection names
FILE:LINE, the reason and the fix; `parse_hostfile` raises UsageError (exit 2).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from dscluster.errors import UsageError

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_KEYVAL_RE = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_-]*)=(?P<value>.*)$")
_KNOWN_KEYS = {"slots", "max_slots", "max-slots"}


@dataclass(frozen=True)
class Host:
    """One hostfile line: where mpirun starts `slots` ranks."""

    name: str
    slots: int
    max_slots: int | None
    line: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Hostfile:
    path: str
    hosts: tuple[Host, ...]

    @property
    def total_slots(self) -> int:
        return sum(h.slots for h in self.hosts)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "hosts": [h.to_dict() for h in self.hosts],
            "total_slots": self.total_slots,
        }


def is_valid_host(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if len(name) > 253 or name.replace(".", "").isdigit():
        return False
    return bool(_HOSTNAME_RE.match(name))


def _positive_int(text: str, where: str, key: str) -> int:
    if not re.fullmatch(r"[0-9]+", text):
        raise UsageError(f"{where}: {key}={text!r} is not a whole number (write e.g. '{key}=2')")
    value = int(text)
    if value <= 0:
        raise UsageError(f"{where}: {key} must be at least 1, got {value}")
    return value


def _deepspeed_order_problem(tokens: list[str]) -> str:
    """Why DeepSpeed's launcher would refuse a line that lacks `slots=N` right after the host,
    and the line that both launchers take."""
    name, keys = tokens[0], tokens[1:]
    slots = next((t for t in keys if t.startswith("slots=")), "slots=1")
    fixed = " ".join([name, slots, *(t for t in keys if t != slots)])
    if not keys:
        what = f"host {name!r} has no slots=N (OpenMPI reads one slot, DeepSpeed's launcher refuses the line)"
    elif slots not in keys:
        what = f"host {name!r} has no slots=N (DeepSpeed's launcher refuses the line)"
    else:
        what = "slots=N must come right after the host name (DeepSpeed's launcher refuses the line)"
    return f"{what}; write '{fixed}'"


def parse_hostfile_text(text: str, path: str = "<hostfile>") -> Hostfile:
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        where = f"{path}:{lineno}"
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tokens = line.split()
        name = tokens[0]
        if "=" in name:
            raise UsageError(f"{where}: line starts with {name!r}, expected a host name first ('node1 slots=2')")
        if not is_valid_host(name):
            raise UsageError(
                f"{where}: invalid host name {name!r} (letters, digits, '-' and '.', or an IP address)"
            )
        key = name.lower()
        if key in seen:
            raise UsageError(
                f"{where}: duplicate host {name!r} (first on line {seen[key]}); "
                "give one line per host and put the rank count in slots=N"
            )
        slots: int | None = None
        max_slots: int | None = None
        for tok in tokens[1:]:
            m = _KEYVAL_RE.match(tok)
            if not m:
                raise UsageError(f"{where}: unexpected {tok!r} after host {name!r}; expected key=value such as slots=2")
            k, v = m.group("key"), m.group("value")
            if k not in _KNOWN_KEYS:
                raise UsageError(f"{where}: unknown key {k!r}; OpenMPI hostfiles accept slots=N and max_slots=N")
            if k == "slots":
                if slots is not None:
                    raise UsageError(f"{where}: slots given twice (keep one slots=N on the line)")
                slots = _positive_int(v, where, k)
            else:
                if max_slots is not None:
                    raise UsageError(f"{where}: max_slots given twice (keep one max_slots=N on the line)")
                max_slots = _positive_int(v, where, "max_slots")
        if slots is None or not tokens[1].startswith("slots="):
            raise UsageError(f"{where}: {_deepspeed_order_problem(tokens)}")
        if max_slots is not None and max_slots < slots:
            raise UsageError(f"{where}: max_slots={max_slots} is below slots={slots} (raise max_slots or lower slots)")
        seen[key] = lineno
        hosts.append(Host(name=name, slots=slots, max_slots=max_slots, line=lineno))
    if not hosts:
        raise UsageError(f"{path}: no hosts (add one line per machine, e.g. 'node1 slots=1')")
    return Hostfile(path=path, hosts=tuple(hosts))


def hostfile_sha256(path: str | Path) -> str:
    """The hostfile's fingerprint: check records it (check.json, the env files) and launch and
    entry_cn.sh compare it, so a hostfile edited after `dscluster check` is noticed."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def parse_hostfile(path: str | Path) -> Hostfile:
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such hostfile (create one with a line per machine: 'node1 slots=1')") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory, expected a hostfile") from None
    except PermissionError:
        raise UsageError(f"{path}: cannot read hostfile (permission denied)") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
    return parse_hostfile_text(text, path)


def format_hostfile(hosts: list[tuple[str, int]]) -> str:
    """Render (name, slots) pairs as an OpenMPI hostfile."""
    return "".join(f"{name} slots={slots}\n" for name, slots in hosts)
