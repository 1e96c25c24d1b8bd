"""`sim up`'s options, checked before anything is built: lab name, size, GPUs per node, link
rate, extra environment. Pure (no root, no processes): every mistake is exit 2 and writes nothing.
"""

from __future__ import annotations

import re

from dscluster.errors import UsageError

MAX_NODES = 32

_LAB_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,22}[a-z0-9])?$")


def validate_lab_name(name: str) -> str:
    """Lab names become directory and namespace names: keep them short and plain."""
    if not _LAB_NAME_RE.match(name):
        raise UsageError(
            f"invalid lab name {name!r}: use 1-24 lowercase letters, digits and inner '-' (e.g. 'dslab')"
        )
    return name


def validate_node_count(nodes: int) -> int:
    if not 1 <= nodes <= MAX_NODES:
        raise UsageError(f"--nodes {nodes}: a simulated lab has 1 to {MAX_NODES} nodes")
    return nodes


def validate_slots(slots: int) -> int:
    if slots < 1:
        raise UsageError(f"--slots {slots}: each node needs at least one slot")
    return slots


# ---- GPUs per node --------------------------------------------------------------------------

def parse_gpus(text: str) -> list[int]:
    """`--gpus 1,1,2`: how many GPUs each node gets, in node order (so also how many nodes)."""
    parts = text.split(",")
    counts = []
    for i, part in enumerate(parts, 1):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise UsageError(
                f"--gpus {text!r}: entry {i} ({part!r}) is not a whole number >= 1; "
                "give the GPUs of each node, e.g. --gpus 1,1,2 for three nodes"
            )
        counts.append(int(part))
    if len(counts) > MAX_NODES:
        raise UsageError(f"--gpus {text!r}: {len(counts)} nodes; a simulated lab has 1 to {MAX_NODES} nodes")
    return counts


def assign_gpus(counts: list[int]) -> list[list[int]]:
    """Consecutive physical GPU indices: [1, 1, 2] -> [[0], [1], [2, 3]]."""
    out, nxt = [], 0
    for c in counts:
        out.append(list(range(nxt, nxt + c)))
        nxt += c
    return out


def resolve_size(nodes: int | None, slots: int | None, gpus: list[int] | None) -> tuple[int, int]:
    """(nodes, slots) from the flags: --gpus implies both (one slot per GPU), so a --nodes or
    --slots that says otherwise is a contradiction, not something to guess about."""
    if gpus is None:
        return validate_node_count(3 if nodes is None else nodes), validate_slots(1 if slots is None else slots)
    if nodes is not None and nodes != len(gpus):
        raise UsageError(
            f"--nodes {nodes} but --gpus {','.join(map(str, gpus))} lists {len(gpus)} nodes: "
            "--gpus sets the node count, leave out --nodes"
        )
    if slots is not None:
        raise UsageError("--slots with --gpus: each node's slots are its GPU count; leave out --slots")
    return len(gpus), 1


def count_listed_gpus(nvidia_smi_list: str) -> int:
    """GPUs in `nvidia-smi -L` output (lines 'GPU 0: ...'; MIG lines under them are not GPUs)."""
    return sum(1 for line in nvidia_smi_list.splitlines() if re.match(r"^GPU \d+:", line))


def check_gpu_supply(counts: list[int], available: int) -> None:
    wanted = sum(counts)
    if wanted > available:
        raise UsageError(
            f"--gpus {','.join(map(str, counts))} asks for {wanted} GPUs but `nvidia-smi -L` lists "
            f"{available} on this host: ask for at most {available} in total"
            + (f" (e.g. --gpus {','.join(['1'] * available)})" if available else "")
        )


# ---- link shaping ---------------------------------------------------------------------------

LINK_NONE = "none"
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(mbit|gbit)$")
_RATE_UNIT = {"mbit": 10**6, "gbit": 10**9}
MIN_RATE_BPS, MAX_RATE_BPS = 10**6, 400 * 10**9
# tbf's bucket must hold what arrives between two timer ticks (man tc-tbf: at least rate/HZ;
# 250 is the common HZ) and at least two 64 KiB GSO packets, or a fast link runs below its rate.
TBF_HZ = 250
TBF_MIN_BURST = 2 * 65536
# How long a packet may queue before tbf drops it: a switch port's buffer, not a WAN's.
TBF_LATENCY = "50ms"


def parse_link(text: str) -> str:
    """`--link 1gbit|10gbit|<n>mbit|none`: the canonical spelling, stored in the lab state."""
    text = text.strip().lower()
    if text == LINK_NONE:
        return LINK_NONE
    m = _RATE_RE.match(text)
    if m is None:
        raise UsageError(f"--link {text!r}: give a rate such as 1gbit, 10gbit or 100mbit, or 'none'")
    if not MIN_RATE_BPS <= link_rate_bps(text) <= MAX_RATE_BPS:
        raise UsageError(f"--link {text!r}: the rate must lie between 1mbit and 400gbit")
    return text


def link_rate_bps(link: str) -> int:
    m = _RATE_RE.match(link)
    if m is None:
        raise ValueError(f"not a link rate: {link!r}")
    return round(float(m.group(1)) * _RATE_UNIT[m.group(2)])


def tbf_burst_bytes(rate_bps: int) -> int:
    return max(rate_bps // 8 // TBF_HZ, TBF_MIN_BURST)


def tbf_argv(netns: str, dev: str, link: str) -> list[str]:
    """`tc` command that shapes the egress of `dev` (inside namespace `netns`) to the link rate."""
    bps = link_rate_bps(link)
    return ["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{bps}bit", "burst", str(tbf_burst_bytes(bps)), "latency", TBF_LATENCY]


_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env(items: list[str]) -> dict[str, str]:
    """`--env NAME=VALUE` (repeatable): set in every process of every node."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--env {item!r}: write NAME=VALUE, e.g. --env NCCL_DEBUG=INFO")
        out[name] = value
    return validate_env(out)


def validate_env(env: dict[str, str]) -> dict[str, str]:
    """Names a shell accepts; plain values, since sshd's SetEnv splits on blanks and reads quotes."""
    for name, value in env.items():
        if not _ENV_NAME_RE.match(name):
            raise UsageError(f"--env {name}={value}: write NAME=VALUE, e.g. --env NCCL_DEBUG=INFO")
        if re.search(r"[\s\"'\\]", value):
            raise UsageError(f"--env {name}={value}: the value may not contain blanks, quotes or backslashes")
    return dict(env)
