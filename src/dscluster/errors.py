"""Errors that map onto the command-line contract's exit codes.

0 ok, 1 the check found problems / the job failed, 2 bad input or usage.
"""


class DsclusterError(Exception):
    """Base class: carries the exit code the CLI should return."""

    exit_code = 1


class UsageError(DsclusterError):
    """Bad input: the message names the file/line/host and the fix. Exit 2."""

    exit_code = 2


class JobFailed(DsclusterError):
    """A check found problems or a job failed. Exit 1."""

    exit_code = 1
