#!/usr/bin/env python3
"""One GPU workstation, no sshd: the user's own commands with a hostfile that names only localhost.

    .venv/bin/python bench/onehost_gpu.py [--work DIR] [--steps 400]

In a fresh working directory it runs `dscluster check`, the README command (with `dscluster top
--once --json` while it trains) and a plain DeepSpeed script that needs a JIT-built op, each as the
README says; what each step checks is in docs/performance.md. Writes
bench/results/<date>-<card>-onehost.json (or --out); exits 1 when a step did not do what the README says.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ADAM_SCRIPT = '''
import os, torch, deepspeed
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
cfg = {"train_micro_batch_size_per_gpu": 64, "fp16": {"enabled": True},
       "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
for step in range(20):
    x = torch.randn(64, 256, device=engine.device, dtype=torch.half)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
print("optimizer", type(opt).__name__, "loss", float(loss), flush=True)
'''


def sh(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def newest_run(runs: Path) -> Path | None:
    dirs = [p for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
    return max(dirs, key=lambda p: p.stat().st_mtime) if dirs else None


def readme_run_with_top(work: Path, env: dict, config: str, steps: int) -> dict:
    mpirun = shutil.which("mpirun", path=str(ROOT / ".venv" / "bin")) or "mpirun"
    cmd = [mpirun, "-np", "1", "--hostfile", "hosts.txt", str(ROOT / "entry_cn.sh"), "--config",
           str(ROOT / config), "precision=fp16", f"max_steps={steps}", "progress=false"]
    print("$", " ".join(cmd), flush=True)
    job = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    top, deadline = None, time.time() + 400
    while job.poll() is None and time.time() < deadline and top is None:
        run = newest_run(work / "runs")
        metrics = run / "metrics" / "rank-0.jsonl" if run else None
        if metrics and metrics.is_file() and '"kind": "step"' in metrics.read_text():
            t = sh([sys.executable, "-m", "dscluster", "top", "--hostfile", "hosts.txt", "--run-dir", str(run),
                    "--once", "--json"], work, env, timeout=120)
            top = {"rc": t.returncode, "doc": json.loads(t.stdout) if t.returncode == 0 else None,
                   "stderr": t.stderr[-2000:]}
        time.sleep(1)
    out, _ = job.communicate(timeout=600)
    run = newest_run(work / "runs")
    summary = json.loads((run / "summary.json").read_text()) if run and (run / "summary.json").is_file() else {}
    node = ((top or {}).get("doc") or {}).get("nodes", [{}])[0]
    return {"command": " ".join(cmd[1:]).replace(str(ROOT) + "/", "./"), "rc": job.returncode,
            "status": summary.get("status"), "images_per_s": summary.get("images_per_s"),
            "peak_mem_mb": summary.get("peak_mem_mb"), "top_node": node,
            "top_shows_gpu": bool(node.get("gpus")) and node.get("source") not in (None, "none"),
            "tail": out[-1500:] if job.returncode else ""}


def adam_through_entry(work: Path, env: dict) -> dict:
    script = work / "ds_adam.py"
    script.write_text(ADAM_SCRIPT)
    mpirun = shutil.which("mpirun", path=str(ROOT / ".venv" / "bin")) or "mpirun"
    before = {p.name for p in (work / "runs").iterdir()} if (work / "runs").is_dir() else set()
    r = sh([mpirun, "-np", "1", "--hostfile", "hosts.txt", str(ROOT / "entry_cn.sh"), "python", str(script)], work,
           env, timeout=900)
    new = sorted({p.name for p in (work / "runs").iterdir()} - before)
    summary = json.loads((work / "runs" / new[-1] / "summary.json").read_text()) if new else {}
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("optimizer ")), "")
    return {"rc": r.returncode, "status": summary.get("status"), "optimizer_line": line,
            "inherited_arch_list": env.get("TORCH_CUDA_ARCH_LIST"), "tail": (r.stdout + r.stderr)[-2500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/onehost"))
    ap.add_argument("--config", default="configs/vit_small_fractal.yaml")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    (args.work / "hosts.txt").write_text("localhost slots=1\n")
    env = {**os.environ, "DSCLUSTER_STATE": str(args.work / ".dscluster")}
    check = sh([sys.executable, "-m", "dscluster", "check", "--hostfile", "hosts.txt"], args.work, env, timeout=600)
    env_files = sorted((args.work / ".dscluster").rglob("*.env"))
    arch_lines = [ln for f in env_files for ln in f.read_text().splitlines() if "TORCH_CUDA_ARCH_LIST" in ln]
    import torch  # torch: only for the card's name, after check has run without it

    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    doc = {"what": "one machine, hostfile localhost, no sshd: check, the README command with top, a DeepSpeed-Adam "
                   "script through entry_cn.sh", "date": datetime.date.today().isoformat(), "card": card,
           "link": "none (one host)", "inherited_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
           "check": {"rc": check.returncode, "arch_lines": arch_lines, "tail": check.stdout[-2500:]}}
    doc["readme_run"] = readme_run_with_top(args.work, env, args.config, args.steps)
    doc["deepspeed_adam"] = adam_through_entry(args.work, env)
    ok = (check.returncode == 0 and doc["readme_run"]["status"] == "complete" and doc["readme_run"]["top_shows_gpu"]
          and doc["deepspeed_adam"]["status"] == "complete")
    doc["ok"] = ok
    out = args.out or ROOT / "bench" / "results" / f"{doc['date']}-{card.lower().replace(' ', '-')}-onehost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "check"}, indent=1)[:6000])
    print("wrote", out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
