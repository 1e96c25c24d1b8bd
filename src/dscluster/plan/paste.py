"""What plan prints to paste, built as training and mpirun read it: a setting's overrides after
./entry_cn.sh, the README command for the fastest node alone (its one-line hostfile included), and the
command that measures an untested setting on the lab. Advice holds as printed: tests paste these.
"""

from __future__ import annotations

import shlex

from dscluster import core
from dscluster.launch.builders import display
from dscluster.launch.mpirun import App, mpirun_argv
from dscluster.node.hosts import format_hostfile
from dscluster.plan import recommend, wholerun


def overrides(cfg, current_global: int, option: recommend.Option | None, micro: int,
              start: int | None = None) -> list[str]:
    """key=value for `./entry_cn.sh` / `dscluster train`: all three batch keys, so the trainer's
    check micro × accum × world = global holds whatever the preset says, the compression, and
    PowerSGD's start step where the rule moves it (`wholerun.start_for`)."""
    out = []
    if option is not None and option.prediction.global_batch != current_global:
        out = [f"micro_batch={micro}", f"grad_accum={option.grad_accum}",
               f"global_batch={option.prediction.global_batch}"]
        if cfg.optim.lr_reference_batch is None:
            out.append(f"optim.lr_reference_batch={current_global}")  # linear LR scaling, as DeiT's recipe
    if option is not None and option.compression != core.sync_label(cfg):
        out += core.sync_paste_args(option.compression, core.sync_label(cfg))
    if option is not None and start is not None and start != wholerun.start_for(cfg, option.compression, 2,
                                                                               recommended=False):
        out.append(f"comm.powersgd_start_step={start}")
    return out


def lab_command(config: str, given: list[str], ranks: int, hostfile: str, pasted: list[str]) -> str:
    """The README command on `hostfile`'s `ranks` ranks with the overrides plan was given and `pasted`."""
    app = App(ranks, ["./entry_cn.sh", "--config", config, *given, *pasted])
    return display(mpirun_argv("mpirun", [app], hostfile=hostfile))


def alone_command(config: str, given: list[str], node: str, ranks: int) -> str:
    """The README command for `node` alone, as a user pastes it: its one-line hostfile, then mpirun."""
    hosts = f"hosts-{node}.txt"
    return (f"printf '%s\\n' {shlex.quote(format_hostfile([(node, ranks)]).strip())} > {shlex.quote(hosts)} && "
            + lab_command(config, given, ranks, hosts, []))
