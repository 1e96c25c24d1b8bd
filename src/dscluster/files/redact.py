"""The one secret rule: what dscluster never writes or prints in clear.

A secret is an environment variable whose NAME contains one of SECRET_WORDS (case-insensitive) or is
one of KNOWN_NAMES, or any VALUE that looks like a private key (PRIVATE_KEY_RE). Everything that shows
or records an environment or a message that may quote one goes through here: `dscluster env` (and its
--json), the run directory's env/rank-R.json, summary.json and the metrics' error messages, the report
and diagnose. A secret shows only that it is set: HIDDEN.

Over-hiding is cheap (a bug report says `DSCLUSTER_ENV_KEYS=***`), under-hiding is not (run directories
are copied into bug reports and shared over NFS), so the words are matched anywhere in the name.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

SECRET_WORDS = ("PASSWORD", "PASSWD", "PASS", "SECRET", "TOKEN", "KEY", "CREDENTIAL", "AUTH")
KNOWN_NAMES = frozenset({"WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY",
                         "AWS_SESSION_TOKEN", "GITHUB_TOKEN", "DSCLUSTER_SSH_PASSWORD"})
PRIVATE_KEY_RE = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
                            re.DOTALL)
HIDDEN = "***"
ASSIGNMENT_RE = re.compile(r"(?<![A-Za-z0-9_])(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>'[^']*'|\"[^\"]*\"|[^\s'\"]+)")
"""NAME=VALUE in free text (a command line `-x WANDB_API_KEY=...`, an env prefix): hidden by NAME."""
MIN_SECRET_LEN = 4
"""Shorter values of secret-named variables ("1", "yes") are not searched for in free text."""


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return upper in KNOWN_NAMES or any(word in upper for word in SECRET_WORDS)


def looks_like_private_key(value: str) -> bool:
    return PRIVATE_KEY_RE.search(value) is not None


def is_secret(name: str, value: str = "") -> bool:
    """The rule: a secret name, or a value that looks like a private key."""
    return is_secret_name(name) or looks_like_private_key(str(value))


def redact_env(env: Mapping[str, object]) -> dict:
    """`env` with every secret's value replaced by HIDDEN (keys and order kept)."""
    return {k: HIDDEN if isinstance(v, str) and is_secret(k, v) else v for k, v in env.items()}


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of this environment's secrets, longest first (so a value inside another goes second)."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if is_secret(k, v) and len(v) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, environ: Mapping[str, str] | None = None) -> str:
    """Free text (an error message, a log line) with private keys and this environment's secret values
    replaced by HIDDEN."""
    return str(redact_doc(text, environ))


def redact_doc(doc: object, environ: Mapping[str, str] | None = None, values: list[str] | None = None) -> object:
    """A JSON-able document with every string in it redacted: private keys, this environment's secret
    values, and the value of any NAME=VALUE whose NAME is a secret (keys of a mapping are field names,
    not environment names: only values are searched). What --json outputs and run-directory
    records that may quote a message go through. `values`: `secret_values(environ)` computed once by a
    caller that redacts many records."""
    values = secret_values(environ) if values is None else values

    def walk(node: object) -> object:
        if isinstance(node, str):
            node = PRIVATE_KEY_RE.sub(HIDDEN, node)
            node = ASSIGNMENT_RE.sub(lambda m: f"{m['name']}={HIDDEN}" if is_secret_name(m["name"]) else m[0], node)
            for value in values:
                node = node.replace(value, HIDDEN)
            return node
        if isinstance(node, Mapping):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v) for v in node]
        return node

    return walk(doc)
