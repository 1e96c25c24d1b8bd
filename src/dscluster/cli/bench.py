"""`dscluster bench vit` and `dscluster bench balanced`: measured, with the card, in bench/results."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from dscluster import console
from dscluster.bench import mixed, vit
from dscluster.errors import JobFailed, UsageError


def _gpu_counts(text: str) -> list[int]:
    """'4' → 1, 2, 3, 4 (the scaling curve); '1,4' → exactly those (fewer runs, same efficiency figure)."""
    try:
        counts = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N (runs 1..N) or a list such as 1,4") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU counts must be 1 or more")
    return list(range(1, counts[0] + 1)) if len(counts) == 1 else counts


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against plain PyTorch; results in bench/results",
                       description="Benchmarks that run dscluster's own training path on this host and write "
                       "bench/results/<date>-<device>.json with the card name and versions.")
    bs = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    v = bs.add_parser(
        "vit", help="DeepSpeed ViT path vs plain DDP (bf16, compile, fused AdamW), 1..N GPUs",
        description="Train a ViT on synthetic data with `dscluster train` and with a plain PyTorch DDP "
        "baseline, on 1 and N GPUs, in one invocation. Reports img/s, img/s per GPU, scaling efficiency, MFU, "
        "peak memory and the dscluster/baseline ratio.",
        epilog="examples:\n"
        "  dscluster bench vit --gpus 4 --precision bf16 --compile   # 1, 2, 3 and 4 GPUs, both paths\n"
        "  dscluster bench vit --gpus 1,2 --compile --micro-batch 256 --steps 100 --repeat 3\n"
        "  dscluster bench vit --gpus 1 --memory-cap-gb 8 --micro-batch auto\n"
        "  dscluster bench vit --device cpu --model tiny --steps 3 --gpus 2   # smoke test without a GPU",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument("--model", default="vit_base_patch16_224", help="timm ViT name, or 'tiny' (CPU smoke test)")
    v.add_argument("--gpus", type=_gpu_counts, default=[1], metavar="N|1,4",
                   help="N runs 1..N GPUs; a list such as 1,4 runs those; on --device cpu, processes")
    v.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default bf16 on GPU, fp32 on CPU")
    v.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="DeepSpeed ZeRO stage")
    v.add_argument("--compile", action="store_true", help="compile the model in dscluster's path")
    v.add_argument("--micro-batch", default="auto", help="'auto' (largest that fits) or N images per GPU")
    v.add_argument("--memory-cap-gb", type=float, default=None, help="cap each process's GPU memory (e.g. 8)")
    v.add_argument("--steps", type=int, default=30, help="timed steps per run")
    v.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    v.add_argument("--repeat", type=int, default=1,
                   help="run both paths N times, alternating, and report each one's median run "
                        "(hosts drift by a few %%)")
    v.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    v.add_argument("--launcher", choices=["torchrun", "mpirun"], default="torchrun",
                   help="how dscluster's path is started (the baseline always uses torchrun)")
    v.add_argument("--config", default=None, help="training preset the overrides apply to")
    v.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the DDP baseline")
    v.add_argument("--baseline-no-compile", dest="baseline_compile", action="store_false",
                   help="run the baseline eager (default: torch.compile on GPU)")
    v.add_argument("--peak-tflops", type=float, default=None, help="card's dense bf16 peak when not in the table")
    v.add_argument("--out", default="bench/results", help="folder for the result JSON")
    v.add_argument("--work-dir", default=None, help="run directories and logs (default runs/bench-vit-<time>)")
    v.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed")
    v.add_argument("--json", action="store_true", help="print the result document instead of a table")
    v.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="extra `dscluster train` overrides")
    v.set_defaults(func=vit_command)

    b = bs.add_parser(
        "balanced", help="uniform vs balanced batches on ranks of unequal speed",
        description="Run `dscluster train` twice per scenario, batching=uniform and batching=balanced, with "
        "the same global batch. busy-gpu: one rank per GPU, one GPU also busy with another process (that rank "
        "at about half speed). share-gpu: more ranks than devices (CPU only: NCCL refuses two ranks on one "
        "GPU). memory-cap: one rank capped to --memory-cap-gb beside full-memory ranks.",
        epilog="examples:\n  dscluster bench balanced --gpus 4                  # GPU 3 shared with a busy neighbour\n"
        "  dscluster bench balanced --gpus 4 --scenario memory-cap --memory-cap-gb 8\n"
        "  dscluster bench balanced --device cpu --model tiny --ranks 3 --steps 3   # smoke test",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--model", default="vit_base_patch16_224")
    b.add_argument("--ranks", type=int, default=5, help="processes in the share-gpu scenario (CPU)")
    b.add_argument("--gpus", type=int, default=4, help="GPUs they share")
    b.add_argument("--micro-batch", type=int, default=64, help="uniform per-rank batch; balanced keeps ranks × it")
    b.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None)
    b.add_argument("--steps", type=int, default=60)
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    b.add_argument("--scenario", dest="scenarios", action="append", choices=["busy-gpu", "share-gpu", "memory-cap"],
                   help="repeatable; default busy-gpu on GPU, share-gpu on CPU")
    b.add_argument("--busy-gpu", type=int, default=None, help="GPU given the busy neighbour (default the last)")
    b.add_argument("--memory-cap-gb", type=float, default=None)
    b.add_argument("--capped-rank", type=int, default=0)
    b.add_argument("--target-loss", type=float, default=None, help="default: the loss both runs reach")
    b.add_argument("--config", default=None)
    b.add_argument("--out", default="bench/results")
    b.add_argument("--work-dir", default=None)
    b.add_argument("--timeout", type=float, default=1800.0)
    b.add_argument("--json", action="store_true")
    b.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    b.set_defaults(func=balanced_command)


def _default_precision(args) -> str:
    return args.precision or ("bf16" if args.device == "cuda" else "fp32")


def _print(doc: dict, path, header: list[str], rows: list[list[str]], title: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="left" if h in ("path", "status", "scenario", "batching") else "right")
    for r in rows:
        table.add_row(*r)
    # Piped or logged output keeps whole numbers and names instead of shrinking columns to 80 chars.
    out = console.out if console.out.is_terminal else Console(highlight=False, width=200)
    out.print(table)
    out.print(f"result: {path}")


def vit_command(args: argparse.Namespace) -> int:
    opts = vit.VitBenchOptions(
        model=args.model, gpu_counts=args.gpus, precision=_default_precision(args), zero=args.zero,
        compile=args.compile, micro_batch=str(args.micro_batch), memory_cap_gb=args.memory_cap_gb,
        steps=args.steps, warmup=args.warmup, repeat=args.repeat, device=args.device, launcher=args.launcher,
        config=args.config, baseline=args.baseline, baseline_compile=args.baseline_compile and args.device == "cuda",
        peak_tflops=args.peak_tflops, out=args.out, work_dir=args.work_dir, timeout_s=args.timeout,
        train_overrides=list(args.overrides),
    )
    _check_overrides(args.overrides)
    doc, path = vit.run(opts)
    device = doc.get("device_name") or doc.get("device")
    _print(doc, path, vit.TABLE_HEADER, vit.table_rows(doc), f"bench vit: {args.model} on {device}", args.json)
    if vit.failed(doc):
        raise JobFailed(f"a run failed; logs in {doc['work_dir']}")
    return 0


def balanced_command(args: argparse.Namespace) -> int:
    opts = mixed.MixedBenchOptions(
        model=args.model, ranks=args.ranks, gpus=args.gpus, micro_batch=args.micro_batch,
        precision=_default_precision(args), steps=args.steps, warmup=args.warmup, device=args.device,
        memory_cap_gb=args.memory_cap_gb, capped_rank=args.capped_rank,
        scenarios=args.scenarios or (["busy-gpu"] if args.device == "cuda" else ["share-gpu"]),
        busy_gpu=args.busy_gpu, target_loss=args.target_loss, config=args.config,
        out=args.out, work_dir=args.work_dir, timeout_s=args.timeout, train_overrides=list(args.overrides),
    )
    _check_overrides(args.overrides)
    doc, path = mixed.run(opts)
    device = doc.get("device_name") or doc.get("device")
    _print(doc, path, mixed.TABLE_HEADER, mixed.table_rows(doc), f"bench balanced: {args.model} on {device}",
           args.json)
    if mixed.failed(doc):
        raise JobFailed(f"a run failed; logs in {doc['work_dir']}")
    return 0


def _check_overrides(overrides: list[str]) -> None:
    for ov in overrides:
        if "=" not in ov:
            raise UsageError(f"override {ov!r}: expected key=value (a `dscluster train` key, e.g. optim.lr=0.001)")
