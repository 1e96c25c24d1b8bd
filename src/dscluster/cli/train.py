"""`dscluster train`: what every rank runs (DeepSpeed ViT training, or fp16 loss-scale calibration)."""

from __future__ import annotations

import argparse
import json
import sys

from dscluster import core, train
from dscluster.errors import DsclusterError, UsageError
from dscluster.node import ranks


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="DeepSpeed ViT training on this rank (run it under mpirun/deepspeed/torchrun/srun)",
        description="Train a ViT with DeepSpeed. Every rank of the job runs this same command; ranks are found "
        "from RANK/LOCAL_RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*/PMIX_* or SLURM_*. Writes runs/<id>/ "
        "(metrics/rank-R.jsonl, summary.json, config.yaml, ds_config.json, checkpoints/). "
        "Exit 0 done, 1 the job failed (a guard stopped it), 2 bad config.",
        epilog="examples:\n"
        "  dscluster train --config configs/digits.yaml\n"
        "  mpirun -np 2 dscluster train --config configs/digits.yaml epochs=5 optim.lr=0.002\n"
        "  dscluster train --config configs/vit_tiny.yaml precision=fp16 --calibrate-loss-scale --write-config\n"
        "  dscluster train --config configs/digits.yaml --print-config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="YAML", help="training preset (configs/*.yaml); defaults when omitted")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="override a config key, dotted for sections: epochs=5 optim.lr=3e-4 data.limit=300")
    p.add_argument("--calibrate-loss-scale", action="store_true",
                   help="short fp16 run from 2^16 that records overflows and recommends fp16.initial_scale_power")
    p.add_argument("--write-config", action="store_true",
                   help="with --calibrate-loss-scale: write the recommendation into --config (atomically)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--json", action="store_true", help="print the outcome as one JSON object on rank 0")
    p.set_defaults(func=train_command)


def check_batch_arithmetic(cfg, world_size: int) -> None:
    """micro_batch × grad_accum × world must make global_batch: known from the config and the
    launcher's variables alone, so a mismatch stops every rank before a run directory is
    written or the process group waits for peers. (auto micro-batches and balanced shares are
    only known on the devices; setup_engine checks those.)"""
    if cfg.batching == "uniform" and isinstance(cfg.micro_batch, int):
        core.resolve_shape(cfg, world_size)


def preflight(argv: list[str]) -> int:
    """entry_cn.sh, before it starts the node's telemetry sampler or the run directory: do these train
    arguments parse and does the config load (with what it points at)? 0 yes (or help asked for), 2 no,
    with train's own message. `python -c 'from dscluster.cli.train import preflight; ...' ARGS`."""
    parser = argparse.ArgumentParser(prog="dscluster")
    register(parser.add_subparsers())
    try:
        args = parser.parse_args(["train", *argv])
    except SystemExit as e:  # -h (0) or a usage error argparse has already printed (2)
        return 0 if e.code in (0, None) else 2
    try:
        core.load_config(args.config, args.overrides, world=not args.print_config)
    except DsclusterError as e:
        print(f"dscluster train: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def throughput_words(outcome) -> str:
    """The end line's img/s: the steady figure named so, the whole run's beside it (core/timing.py)."""
    if outcome.images_per_s is None:
        return "images/s n/a"
    if outcome.steps_this_run and not core.warmup_left_out(outcome.steps_this_run):
        words = (f"{outcome.images_per_s:,.0f} images/s over all {outcome.steps_this_run} steps (too few to leave "
                 f"out {core.WARMUP_STEPS} warm-up steps: the first steps' compilation and allocation are in)")
    else:
        words = f"{outcome.images_per_s:,.0f} images/s steady (after {core.WARMUP_STEPS} warm-up steps)"
    if outcome.run_images_per_s is not None:
        words += f", {outcome.run_images_per_s:,.0f} over the whole run (first step to end)"
    return words


def train_command(args: argparse.Namespace) -> int:
    with core.start_up_gc():  # the collector off until the engine is built (core/startgc.py)
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    # What the config points at (data folder, timm model, checkpoint to resume) is checked here,
    # before train() creates the run directory; printing the config needs none of it.
    cfg = core.load_config(args.config, args.overrides, world=not args.print_config)
    cfg.batching = core.resolve_batching(cfg.batching)
    if args.write_config and not (args.calibrate_loss_scale or cfg.calibrate_loss_scale):
        raise UsageError("--write-config goes with --calibrate-loss-scale")
    if args.write_config and not args.config:
        raise UsageError("--write-config needs --config FILE to write into")
    if args.print_config:
        sys.stdout.write(core.to_yaml(cfg))
        return 0
    calibrate = args.calibrate_loss_scale or cfg.calibrate_loss_scale
    check_batch_arithmetic(cfg, ranks.detect_ranks().world_size)
    outcome = train.train(cfg, calibrate=calibrate)  # torch loads here, when training starts
    if not core.is_primary():
        return 0
    result = {"status": outcome.status, "run_dir": str(outcome.run_dir), "steps": outcome.steps,
              "accuracy": outcome.accuracy, "images_per_s": outcome.images_per_s,
              "run_images_per_s": outcome.run_images_per_s}
    if calibrate:
        points = [(s, o) for s, o in outcome.scale_history if s is not None]
        power = core.recommend_initial_scale_power(points)
        result.update(recommended_initial_scale_power=power, overflow_steps=sum(o for _, o in points),
                      scale_history=[s for s, _ in points])
        if args.write_config:
            core.write_initial_scale_power(args.config, power)
            result["written_to"] = args.config
    if args.json:
        print(json.dumps(result, sort_keys=True))
    elif calibrate:
        print(f"loss-scale calibration: {result['overflow_steps']} of {len(points)} steps overflowed from 2^16; "
              f"recommended fp16.initial_scale_power: {result['recommended_initial_scale_power']}"
              + (f" (written to {args.config})" if args.write_config else
                 f" (add --write-config to put it into {args.config})" if args.config else ""))
    else:
        acc = "n/a" if outcome.accuracy is None else f"{outcome.accuracy:.1%}"
        print(f"train {outcome.status}: {outcome.steps} steps, held-out accuracy {acc}, "
              f"{throughput_words(outcome)}; run directory {outcome.run_dir}")
    return 0
