#!/usr/bin/env bash
# What every rank runs:  mpirun -np 5 --hostfile hosts.txt ./entry_cn.sh [train args]
#
# 1. finds its python from its own path: a checkout's .venv, or the prefix it was installed
#    into (<prefix>/share/dscluster/entry_cn.sh runs <prefix>/bin/python); same path on every node;
# 2. loads this node's environment from `dscluster check` (<state>/env/$(hostname).env:
#    the node's own interface for NCCL/GLOO, P2P, precision) — without it a multi-rank job
#    would pick a wrong interface and hang, so a missing file stops the rank (exit 2);
# 3. leaves the node's GPUs visible to every rank (train picks the local rank's own);
# 4. checks what it will run (the program exists and is executable, or train's arguments parse and
#    the config loads) and that every rank has one run directory (dscluster.rundir.agree): either
#    failing stops the rank (exit 2) before the sampler or the run directory start;
#    then local rank 0 starts this node's one telemetry sampler and stops it when training ends;
# 5. runs `dscluster train "$@"` (default: --config configs/digits.yaml), or a user's program
#    (`./entry_cn.sh python my_train.py`), recording each rank's exit in process/rank-R.json.
# Run by hand (no launcher) it trains as a single process and says so.
set -uo pipefail

say() { echo "entry_cn[$(hostname)${RANK_LABEL:+ rank $RANK_LABEL}]: $*" >&2; }

REPO="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"

# --- the python: DSCLUSTER_VENV, else the checkout's .venv, else the prefix of an installed copy ---
# `pip install .` puts this script in <prefix>/share/dscluster, so <prefix>/bin holds the python and
# the dscluster of that install. Ranks must not depend on what each node's login PATH happens to hold.
VENV="${DSCLUSTER_VENV:-}"
if [ -z "$VENV" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then
    VENV="$REPO/.venv"
  elif [ "$(basename "$(dirname "$REPO")")/$(basename "$REPO")" = share/dscluster ] && [ -x "$REPO/../../bin/python" ]; then
    VENV="$(cd "$REPO/../.." && pwd)"
  fi
fi
if [ -n "$VENV" ] && [ -x "$VENV/bin/python" ]; then
  export VIRTUAL_ENV="$VENV"
  export PATH="$VENV/bin:$PATH"
fi
if ! command -v dscluster >/dev/null 2>&1; then
  say "no dscluster command: run 'make venv' in a checkout, or 'pip install' dscluster into an environment" \
      "(its <prefix>/bin/python is used), or set DSCLUSTER_VENV to the environment dscluster is installed in"
  exit 2
fi

# --- who am I, and where is the state: dscluster.node.ranks and dscluster.files.state own the rules -------
# Sets GLOBAL_RANK (empty without a launcher), LOCAL_RANK_ID, WORLD, LOCAL_WORLD, STATE.
where="$(python - "$REPO" <<'PY'
import shlex, sys
from dscluster.errors import UsageError
from dscluster.node.ranks import detect_ranks, shell_assignments
from dscluster.files.state import rank_state_dir
try:
    print(shell_assignments(detect_ranks()), end="")
except UsageError as e:
    sys.exit(f"{e}")
print(f"STATE={shlex.quote(str(rank_state_dir(sys.argv[1])))}")
PY
)" || { say "cannot tell this rank's place in the job (above) with $(command -v python)"; exit 2; }
eval "$where"
RANK_LABEL="$GLOBAL_RANK"
HOST="$(hostname)"

# --- this node's environment from `dscluster check` ----------------------------------------
NODE_ENV="$STATE/env/$HOST.env"

if [ -z "$GLOBAL_RANK" ]; then
  say "not under mpirun: training as a single process"
  if [ -r "$NODE_ENV" ]; then
    # shellcheck disable=SC1090
    source "$NODE_ENV"
  fi
else
  if [ ! -r "$NODE_ENV" ] && [ -n "$WORLD" ] && [ "$WORLD" = "$LOCAL_WORLD" ]; then
    # Every rank on this one machine: they meet over loopback, no interface to choose.
    [ "$LOCAL_RANK_ID" != 0 ] || say "no check output ($NODE_ENV), but all $WORLD ranks are on this host: using loopback"
    NODE_ENV=/dev/null
  fi
  if [ ! -r "$NODE_ENV" ]; then
    say "no check output for this node ($NODE_ENV): run 'dscluster check --hostfile HOSTFILE' on the head first"
    exit 2
  fi
  # A launcher that hands out its own rendezvous (torchrun, srun, DeepSpeed) must win over
  # the check's values, or the workers would look for the store in the wrong place.
  keep_addr="${MASTER_ADDR:-}"; keep_port="${MASTER_PORT:-}"
  # shellcheck disable=SC1090
  source "$NODE_ENV"
  [ -z "$keep_addr" ] || export MASTER_ADDR="$keep_addr"
  [ -z "$keep_port" ] || export MASTER_PORT="$keep_port"
fi
export DSCLUSTER_LOCAL_RANK="$LOCAL_RANK_ID"

# --- GPUs: every rank sees all of this node's GPUs (or the user's CUDA_VISIBLE_DEVICES), as under
# torchrun and DeepSpeed's launcher; `dscluster train` takes the local-rank-th visible one. Narrowing
# CUDA_VISIBLE_DEVICES per rank here broke DeepSpeed, which binds the process group to
# cuda:$LOCAL_RANK, on every node with two GPUs.

# --- one run directory for every rank: mpirun passes DSCLUSTER_RUN_ID/DSCLUSTER_RUNS only to the ranks on
# its own node; a job whose ranks would write apart stops here (exit 2, rank 0 names the fix), before
# this script exports the id it resolves.
# Rank 0 then sets an earlier run's summary.json aside (summary.previous-N.json).
python -m dscluster.rundir.agree || exit 2
export DSCLUSTER_RUN_AGREED=1

# --- run id and run directory: every rank of a job must agree without talking ----------------
# resolve_run_id's rule (DSCLUSTER_RUN_ID > PMIX_NAMESPACE > ... > timestamp) in one python start,
# with the hostfile's fingerprint (hosts.hostfile_sha256) to compare with the one check recorded.
eval "$(python - <<'PY'
import os, shlex
from dscluster.node.hosts import hostfile_sha256
from dscluster.rundir.layout import resolve_run_id, runs_root
rid = resolve_run_id()
print(f"export DSCLUSTER_RUN_ID={shlex.quote(rid)}")
print(f"RUN_DIR={shlex.quote(str(runs_root() / rid))}")
hostfile = os.environ.get("DSCLUSTER_HOSTFILE")
known = hostfile and os.access(hostfile, os.R_OK) and os.environ.get("DSCLUSTER_HOSTFILE_SHA256")
print(f"NOW_SHA={hostfile_sha256(hostfile) if known else ''}")
PY
)" || { say "cannot import dscluster from $(command -v python)"; exit 2; }
if [ -n "$GLOBAL_RANK" ] && [ -n "${NOW_SHA:-}" ] && [ "$NOW_SHA" != "$DSCLUSTER_HOSTFILE_SHA256" ] && [ "$LOCAL_RANK_ID" = 0 ]; then
  say "warning: $DSCLUSTER_HOSTFILE changed since 'dscluster check' wrote $NODE_ENV; run 'dscluster check' again"
fi

# --- telemetry: exactly one sampler per node, owned by local rank 0 --------------------------
SAMPLER_PID=""
TRAIN_PID=""
PROGRAM_RECORD=""  # set while a user's program runs: its rank's record (process/rank-R.json) awaits an end
record_end() {
  [ -n "$PROGRAM_RECORD" ] || return 0
  PROGRAM_RECORD=""
  python -m dscluster.rundir.rankrecord end "$1" || true
}
cleanup() {
  trap - EXIT TERM INT HUP
  if [ -n "$TRAIN_PID" ]; then
    # The launcher's SIGTERM may have reached the program too and ended it already: its own code then.
    kill -0 "$TRAIN_PID" 2>/dev/null && kill -TERM "$TRAIN_PID" 2>/dev/null
    wait "$TRAIN_PID" 2>/dev/null
    local code=$?
    # 127, or -1 from bash when the interrupted wait had reaped it: no code to read, the signal's then.
    case "$code" in 127|-*|'') code="${1:-143}" ;; esac
    record_end "$code"
  fi
  if [ -n "$SAMPLER_PID" ]; then
    kill -TERM "$SAMPLER_PID" 2>/dev/null
    wait "$SAMPLER_PID" 2>/dev/null
  fi
  # No shared filesystem (check.json says so): this node's part of the run goes to rank 0's node.
  if [ "$LOCAL_RANK_ID" = 0 ] && [ -n "$GLOBAL_RANK" ] && [ "$GLOBAL_RANK" != 0 ] && [ -n "${RUN_DIR:-}" ] \
     && [ -n "${MASTER_ADDR:-}" ] && [ -d "$RUN_DIR" ]; then
    dscluster collect --push "$MASTER_ADDR" --check-json "$STATE/check.json" "$RUN_DIR" \
      || say "could not send this node's part of $RUN_DIR to $MASTER_ADDR: run 'dscluster collect $RUN_DIR' on the head"
  fi
}
on_signal() {
  say "received $1: stopping training"
  cleanup "$2"
  exit "$2"
}
trap cleanup EXIT
trap 'on_signal TERM 143' TERM
trap 'on_signal INT 130' INT
trap 'on_signal HUP 129' HUP

# --- what this rank runs, checked before the sampler or the run directory start: bad input writes nothing
if [ "$#" -eq 0 ]; then
  if [ -f configs/digits.yaml ]; then set -- --config configs/digits.yaml
  else set -- --config "$REPO/configs/digits.yaml"; fi
fi
if [ "${1#-}" = "$1" ] && ! [[ "$1" =~ ^[A-Za-z_][A-Za-z0-9_.]*= ]]; then
  if [ -d "$1" ] || ! command -v "$1" >/dev/null 2>&1; then
    say "cannot run '$1': no such program, or not executable (give a path like ./my_train.sh with chmod +x, or a command on PATH such as python)"
    exit 2
  fi
else
  python -c 'import sys; from dscluster.cli.train import preflight; sys.exit(preflight(sys.argv[1:]))' "$@" >/dev/null || exit 2
fi

if [ "$LOCAL_RANK_ID" = 0 ]; then
  mkdir -p "$RUN_DIR" 2>/dev/null || true
  dscluster telemetry --run-dir "$RUN_DIR" --parent-pid $$ &
  SAMPLER_PID=$!
fi

# --- training, or the user's own program --------------------------------------------------------
# `./entry_cn.sh python my_train.py ...` runs that program instead of `dscluster train`: the
# first argument names a program unless it is an option (-x, --config) or a key=value override,
# which are train's. It gets the same node env, GPUs, sampler and run directory, plus its place
# in the job (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*: core/dist.py's rule) and DSCLUSTER_RUN_DIR.
if [ "${1#-}" = "$1" ] && ! [[ "$1" =~ ^[A-Za-z_][A-Za-z0-9_.]*= ]]; then
  exports="$(python -m dscluster.userlog --exports)" || exit 2
  eval "$exports"
  # Each rank's start, end, exit code, host and GPU, so a script without userlog still says how it ended.
  python -m dscluster.rundir.rankrecord start -- "$@" && PROGRAM_RECORD=1
  # Its stderr also goes to process/rank-R.stderr, so diagnose can read how it died (a DeepSpeed op build).
  ERR_FILE="$RUN_DIR/process/rank-${GLOBAL_RANK:-0}.stderr"
  mkdir -p "$RUN_DIR/process" 2>/dev/null && : > "$ERR_FILE" 2>/dev/null || ERR_FILE=/dev/null
  # Not exec: the traps above must outlive the program to stop the sampler.
  "$@" 2> >(tee -a "$ERR_FILE" >&2) &
  TRAIN_PID=$!
else
  # Not exec: the traps above must outlive training to stop the sampler.
  dscluster train "$@" &
  TRAIN_PID=$!
fi
wait "$TRAIN_PID"
rc=$?
TRAIN_PID=""
record_end "$rc"
exit "$rc"
