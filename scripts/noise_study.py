#!/usr/bin/env python3
"""The early-stop study (docs/guide/early-stop.md, "The detector study"): does the default
detector fire on every data-limited toy run, before the model memorizes, and never on a data-rich one?

    .venv/bin/python scripts/noise_study.py OUT_DIR [--sizes 32,64,128,256,full] [--seeds 0,1,2]
        [--weights ema,raw] [--lanes 2] [--phase train|evaluate|decide|all] [--bin DIFFMON]

Three phases, each cached in OUT_DIR so an interrupted study goes on where it stopped:
1. train: the toy trainer (`python/train_toy.py`, batch 64, EMA 0.995, a checkpoint every 50
   steps holding both the EMA and the raw weights) on 32, 64, 128 and 256 training images for 3000
   steps and on the full digits set less 256 held-out images (1541) for 6000 steps, per seed;
2. evaluate: `diffmon watch` evaluates every checkpoint of a run once per weights variant (the
   `ema` or the `model` entry), with the held-out set configured so that every record has ICR with
   its standard error, the generalization gap and the memorization ratio;
3. decide: `diffmon replay` runs the detector with its default settings over each recorded
   history, once as a user without a held-out set has it (`confirm: auto` is the memorization
   ratio) and once with the held-out set (`confirm: auto` is the gap).

Prints one table row per run and variant: fired or not, the best step, the firing step, the first
step with a memorization ratio ≥ 5%, and the lead time (that step minus the best step); writes
them to OUT_DIR/study.json. `--lanes` runs that many trainers or daemons side by side, each on one
thread.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
FULL = 1797 - 256  # the digits set less the held-out images
ARGS: argparse.Namespace  # the command line, set by main()
WEIGHTS = {"ema": "ema", "raw": "model"}  # variant -> checkpoint entry (train_toy --format ema_dict)


def runs(sizes: list[str], seeds: list[int]) -> list[tuple[str, int, int, int]]:
    """(name, training images, seed, steps) of every run of the study."""
    out = []
    for size in sizes:
        n, steps = (FULL, 6000) if size == "full" else (int(size), 3000)
        out += [(f"{'full' if size == 'full' else 'n' + size}-s{seed}", n, seed, steps)
                for seed in seeds]
    return out


def train(out: Path, name: str, size: int, seed: int, steps: int) -> None:
    run_dir = out / name
    if (run_dir / f"ckpt_{steps:06d}.pt").exists():
        return
    with open(out / f"{name}.log", "w") as log:
        subprocess.run([PY, str(ROOT / "python" / "train_toy.py"), "--run-dir", str(run_dir),
                        "--train-size", str(size), "--heldout-size", "256", "--steps", str(steps),
                        "--ckpt-every", "50", "--batch-size", "64", "--ema", "0.995",
                        "--seed", str(seed), "--threads", "1", "--format", "ema_dict"],
                       check=True, stdout=log, stderr=subprocess.STDOUT)


def config(run_dir: Path, variant: str, heldout: bool) -> Path:
    """The daemon's config for one variant; without `heldout`, the same minus the held-out set
    (what `decide` replays as a user without one)."""
    path = run_dir / f"study-{variant}{'' if heldout else '-noheldout'}.yaml"
    data = f"data: {{path: {run_dir / 'train.h5'}"
    data += f", heldout_path: {run_dir / 'heldout.h5'}}}\n" if heldout else "}\n"
    path.write_text(
        f"run: {{dir: {run_dir}, name: {run_dir.name}-{variant}}}\n"
        f"state_dir: {run_dir / ('state-' + variant)}\n"
        f"model: {{architecture: {run_dir / 'model.ts'}}}\ndevice: cpu\ncpu_threads: 1\n"
        f"{data}icr: {{samples: 2048}}\n"
        "pfd: {enabled: true, samples: 128, batch_size: 128}\nmemorization: {enabled: true}\n"
        f"checkpoints: {{pattern: 'ckpt_*.pt', weights_key: {WEIGHTS[variant]}}}\n"
        f"alerts: {{stop_file: EARLY_STOP_{variant}}}\nhttp: {{listen: '127.0.0.1:0'}}\n"
    )
    return path


def evaluate(run_dir: Path, variant: str) -> None:
    """Every checkpoint of the run evaluated once by `diffmon watch` (cached in the state folder)."""
    cfg = config(run_dir, variant, heldout=True)
    n = len(list(run_dir.glob("ckpt_*.pt")))
    journal = run_dir / f"state-{variant}" / "history.jsonl"

    def recorded() -> int:
        return len(journal.read_text().splitlines()) if journal.exists() else 0

    if recorded() >= n:
        return
    with open(run_dir / f"watch-{variant}.log", "a") as log:
        p = subprocess.Popen([str(ARGS.bin), "watch", "--config", str(cfg)], stdout=log, stderr=log,
                             env={**os.environ, "DIFFMON_LOG": "info"})
        try:
            while recorded() < n:
                if p.poll() is not None:
                    raise RuntimeError(f"diffmon watch stopped (status {p.returncode}); see {log.name}")
                time.sleep(2)
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=300)


def records(run_dir: Path, variant: str) -> list[dict]:
    lines = (run_dir / f"state-{variant}" / "history.jsonl").read_text().splitlines()
    out = [e["record"] for e in map(json.loads, lines) if e["kind"] == "evaluation"]
    return sorted(out, key=lambda r: r["step"])


def decide(run_dir: Path, variant: str, heldout: bool) -> dict:
    """What the default detector decides over the recorded history (`diffmon replay --json`)."""
    cfg = config(run_dir, variant, heldout)
    out = subprocess.run([str(ARGS.bin), "replay", "--config", str(cfg), "--json"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sizes", default="32,64,128,256,full")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--weights", default="ema,raw")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--phase", default="all", choices=("train", "evaluate", "decide", "all"))
    ap.add_argument("--bin", type=Path, default=ROOT / "target" / "release" / "diffmon",
                    help="the diffmon binary to run (default: this checkout's release build)")
    global ARGS
    ARGS = args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plan = runs(args.sizes.split(","), [int(s) for s in args.seeds.split(",")])
    variants = args.weights.split(",")
    with ThreadPoolExecutor(args.lanes) as pool:
        if args.phase in ("train", "all"):
            list(pool.map(lambda r: train(args.out, *r), plan))
        if args.phase in ("evaluate", "all"):
            jobs = [(args.out / name, v) for name, *_ in plan for v in variants]
            list(pool.map(lambda j: evaluate(*j), jobs))
    if args.phase not in ("decide", "all"):
        return 0
    rows = []
    print("| run | weights | held-out set | fired (trigger) | best step | fired at | memorization ≥ 5% from | lead (steps) |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for name, size, seed, steps in plan:
        for v in variants:
            if not (args.out / name / f"state-{v}" / "history.jsonl").exists():
                print(f"| {name} | {v} | not evaluated yet (--phase evaluate) | | | | | |")
                continue
            recs = records(args.out / name, v)
            mem5 = next((r["step"] for r in recs if r.get("memorization_ratio", 0) >= 0.05), None)
            for heldout in (False, True):
                d = decide(args.out / name, v, heldout)
                best = d.get("best_step")
                lead = mem5 - best if (mem5 is not None and best is not None) else None
                row = {"run": name, "images": size, "seed": seed, "steps": steps, "weights": v,
                       "heldout": heldout, "fired": d.get("fired_at_step") is not None,
                       "best_step": best, "fired_at_step": d.get("fired_at_step"),
                       "trigger": d.get("trigger"), "memorization_5pct_step": mem5,
                       "lead_steps": lead}
                rows.append(row)
                print(f"| {name} | {v} | {'yes' if heldout else 'no'} | "
                      f"{'yes (' + row['trigger'] + ')' if row['fired'] else 'no'} | "
                      f"{best if best is not None else '–'} | "
                      f"{row['fired_at_step'] if row['fired'] else '–'} | "
                      f"{mem5 if mem5 is not None else 'never'} | "
                      f"{lead if (lead is not None and row['fired']) else '–'} |")
    (args.out / "study.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
