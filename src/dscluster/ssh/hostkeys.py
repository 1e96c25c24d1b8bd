"""The project's known_hosts: OpenSSH's format, host keys pinned by `dscluster setup` and checked
by every SSH session (`remote.PinningPolicy`), never ~/.ssh/known_hosts implicitly."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable

import paramiko

from dscluster.files.fsutil import atomic_write_text


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style fingerprint ("SHA256:..."), the form `ssh-keygen -lf` prints."""
    return key.fingerprint


def known_hosts_name(host: str, port: int = 22) -> str:
    """How OpenSSH and Paramiko name a host in known_hosts: bare on port 22, "[host]:port" otherwise."""
    return host if port == 22 else f"[{host}]:{port}"


def known_hosts_line(names: Iterable[str], key: paramiko.PKey) -> str:
    """One known_hosts line for a key: "name1,name2 ssh-ed25519 AAAA..." (`format_line`)."""
    return format_line(names, key.get_name(), key.get_base64())


def format_line(names: Iterable[str], ktype: str, blob: str) -> str:
    """The one known_hosts line format: "name1,name2 ssh-ed25519 AAAA...". Names keep their given
    order, each once."""
    uniq = list(dict.fromkeys(n for n in names if n))
    if not uniq:
        raise ValueError("known_hosts line needs at least one host name")
    return f"{','.join(uniq)} {ktype} {blob}"


def load_known_hosts(path: Path) -> paramiko.HostKeys:
    keys = paramiko.HostKeys()
    if Path(path).exists():
        keys.load(str(path))
    return keys


_known_hosts_lock = threading.Lock()


def pin_host_key(path: Path, names: Iterable[str], key: paramiko.PKey) -> None:
    """Add `key` for `names` to the project's known_hosts, atomically and thread-safely.

    Existing lines for other hosts are kept byte for byte; lines for these names with the
    same key type are replaced (a deliberate re-pin after the user removed the old entry).
    """
    names = [n for n in names if n]
    path = Path(path)
    with _known_hosts_lock:
        old = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        kept = []
        for line in old:
            fields = line.split()
            if (
                len(fields) >= 3
                and not line.lstrip().startswith("#")
                and fields[1] == key.get_name()
                and set(fields[0].split(",")) & set(names)
            ):
                continue
            kept.append(line)
        kept.append(known_hosts_line(names, key))
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "\n".join(kept) + "\n", mode=0o644)
