"""The project state directory and the environment files that `check` writes for launch.

Files, not a database: every rank's entry_cn.sh must pick up its own node's settings with nothing
but a POSIX shell, so each node's environment is a file of `export KEY='value'` lines it can
`source`, keyed by what `hostname` prints there. `<state>` is $DSCLUSTER_STATE, else ./.dscluster
(a rank that finds none uses the checkout's, `rank_state_dir`); it holds known_hosts (pinned by
setup), check.json (the last full check), env/<hostname>.env and cluster.env (the cluster-wide
subset). check also merges its keys into .deepspeed_env (cwd, or $DS_ENV_FILE), which DeepSpeed's
launcher exports to every rank (docs/file-layouts.md, docs/env-files.md).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Mapping

from dscluster.errors import UsageError
from dscluster.files.fsutil import atomic_write_text

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_EXPORT_RE = re.compile(r"^(?:export\s+)?(?P<key>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)$")


STATE_DIR_NAME = ".dscluster"


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the commands keep their state: $DSCLUSTER_STATE, else ./.dscluster."""
    env = os.environ if env is None else env
    return Path(env.get("DSCLUSTER_STATE") or STATE_DIR_NAME)


def rank_state_dir(checkout: str | Path, env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> Path:
    """The state directory as a rank finds it (entry_cn.sh): `state_dir`, made absolute, except that
    without $DSCLUSTER_STATE and without ./.dscluster the checkout's .dscluster is used when it has
    one. Ranks start in the launch directory, which need not be where `dscluster check` ran."""
    env = os.environ if env is None else env
    here = Path(cwd) if cwd is not None else Path.cwd()
    if env.get("DSCLUSTER_STATE"):
        return here / env["DSCLUSTER_STATE"]
    local, theirs = here / STATE_DIR_NAME, Path(checkout) / STATE_DIR_NAME
    return theirs if not local.is_dir() and theirs.is_dir() else local


def known_hosts_path(env: Mapping[str, str] | None = None) -> Path:
    return state_dir(env) / "known_hosts"


def check_json_path(env: Mapping[str, str] | None = None) -> Path:
    return state_dir(env) / "check.json"


def node_env_dir(env: Mapping[str, str] | None = None) -> Path:
    return state_dir(env) / "env"


def node_env_path(hostname: str, env: Mapping[str, str] | None = None) -> Path:
    """Per-node env file, named after the output of `hostname` on that node."""
    if not hostname or "/" in hostname or hostname.startswith("."):
        raise UsageError(f"cannot name an env file after hostname {hostname!r}")
    return node_env_dir(env) / f"{hostname}.env"


def cluster_env_path(env: Mapping[str, str] | None = None) -> Path:
    return state_dir(env) / "cluster.env"


def deepspeed_env_path(env: Mapping[str, str] | None = None) -> Path:
    """DeepSpeed's launcher reads `.deepspeed_env` from the cwd (or $DS_ENV_FILE)."""
    env = os.environ if env is None else env
    return Path(env.get("DS_ENV_FILE") or ".deepspeed_env")


def home_deepspeed_env_path(env: Mapping[str, str] | None = None, home: str | None = None) -> Path | None:
    """The file DeepSpeed's launcher reads before the cwd's: ~/<DS_ENV_FILE or .deepspeed_env>
    (runner.py joins the name to both; an absolute DS_ENV_FILE names one file, so no home file)."""
    name = deepspeed_env_path(env)
    if name.is_absolute():
        return None
    return Path(home or os.path.expanduser("~")) / name


def _check_key(key: str) -> None:
    if not _KEY_RE.match(key):
        raise UsageError(f"invalid environment variable name {key!r} (letters, digits, '_')")


def format_env_file(values: Mapping[str, object], header: str = "") -> str:
    """`export KEY='value'` lines, values shell-quoted so `source` cannot run anything."""
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    for key in sorted(values):
        _check_key(key)
        lines.append(f"export {key}={shlex.quote(str(values[key]))}")
    return "\n".join(lines) + "\n"


def write_env_file(path: str | os.PathLike, values: Mapping[str, object], header: str = "") -> Path:
    return atomic_write_text(path, format_env_file(values, header))


def parse_env_text(text: str, path: str = "<env>") -> dict[str, str]:
    """Parse `export KEY='value'` (or `KEY=value`) lines; '#' comments and blanks skipped."""
    out: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _EXPORT_RE.match(line)
        if not m:
            raise UsageError(f"{path}:{lineno}: expected \"export KEY='value'\", got {raw.strip()!r}")
        try:
            parts = shlex.split(m.group("value"), posix=True)
        except ValueError as e:
            raise UsageError(f"{path}:{lineno}: cannot parse value of {m.group('key')} ({e}); "
                             "quote it with '...'") from None
        if len(parts) > 1:
            raise UsageError(f"{path}:{lineno}: value of {m.group('key')} has unquoted spaces; quote it with '...'")
        out[m.group("key")] = parts[0] if parts else ""
    return out


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such env file (run `dscluster check` to write it)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: unreadable env file ({e}); re-run `dscluster check` to write it again") from None
    return parse_env_text(text, str(path))


def format_deepspeed_env(values: Mapping[str, object]) -> str:
    """DeepSpeed's launcher splits each line at the first '=' and exports the rest verbatim,
    so values must not contain newlines; quotes would be kept literally, so none are added."""
    lines = []
    for key in sorted(values):
        _check_key(key)
        value = str(values[key])
        if "\n" in value or "\r" in value:
            raise UsageError(f"value of {key} contains a newline; .deepspeed_env is one KEY=VALUE per line")
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


def write_deepspeed_env(path: str | os.PathLike, values: Mapping[str, object]) -> Path:
    return atomic_write_text(path, format_deepspeed_env(values))


# DeepSpeed's launcher (0.19, runner.py) splits every line of .deepspeed_env at its first '=' with
# no comment or blank-line handling: a `# dscluster` comment would crash it. So check marks its
# own keys with one more KEY=VALUE line, which the next check reads to tell its keys from yours.
DEEPSPEED_ENV_MARK = "DSCLUSTER_ENV_KEYS"


def split_deepspeed_env(text: str) -> tuple[dict[str, str], set[str], list[str]]:
    """(every KEY=VALUE in file order, the keys check marked as its own, lines DeepSpeed cannot read)."""
    values: dict[str, str] = {}
    unreadable = []
    for raw in text.splitlines():
        key, sep, value = raw.strip().partition("=")
        if sep and _KEY_RE.match(key):
            values[key] = value
        else:
            unreadable.append(raw)
    ours = set(filter(None, values.pop(DEEPSPEED_ENV_MARK, "").split(",")))
    return values, ours, unreadable


def merge_deepspeed_env(existing: str, ours: Mapping[str, object], name: str = ".deepspeed_env"
                        ) -> tuple[str, list[str]]:
    """Check's keys merged into a .deepspeed_env that may hold yours: your keys first, as they were,
    then the mark and check's keys. Where you set a key check also writes, yours is kept and a note
    says what check found; DSCLUSTER_* keys are always check's (nobody else writes them, and a
    file from before the mark holds stale ones). Returns (text, notes)."""
    values, previous, unreadable = split_deepspeed_env(existing)
    notes = [f"{name}: dropped {line.strip() or 'a blank line'!r}: DeepSpeed's launcher reads only "
             "KEY=VALUE lines" for line in unreadable]
    user = {k: v for k, v in values.items() if k not in previous and not k.startswith("DSCLUSTER_")}
    mine = {k: str(v) for k, v in ours.items() if k not in user}
    for key in sorted(set(user) & set(ours)):
        if user[key] != str(ours[key]):
            notes.append(f"{name}: kept your {key}={user[key]} (check found {ours[key]}; delete the line "
                         "to take check's)")
    text = "".join(f"{k}={v}\n" for k, v in user.items())
    return text + format_deepspeed_env({DEEPSPEED_ENV_MARK: ",".join(sorted(mine)), **mine}), notes


def update_deepspeed_env(path: str | os.PathLike, ours: Mapping[str, object]) -> tuple[Path, list[str]]:
    """`check`'s writer: merge into the file instead of replacing it; the old file goes to
    <path>.bak when a line of it had to be dropped."""
    path = Path(path)
    try:
        existing = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        existing = ""
    text, notes = merge_deepspeed_env(existing, ours, str(path))
    if any("dropped" in n for n in notes):
        atomic_write_text(path.with_name(path.name + ".bak"), existing)
        notes.append(f"{path}: the previous file is {path.name}.bak")
    return atomic_write_text(path, text), notes


def parse_deepspeed_env_text(text: str, path: str = ".deepspeed_env") -> dict[str, str]:
    out: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not _KEY_RE.match(key):
            raise UsageError(f"{path}:{lineno}: expected KEY=VALUE (DeepSpeed's launcher format), got {line!r}")
        out[key] = value
    return out


def read_deepspeed_env(path: str | os.PathLike) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file (run `dscluster check` to write it)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: unreadable ({e}); re-run `dscluster check` to write it again") from None
    return parse_deepspeed_env_text(text, str(path))
