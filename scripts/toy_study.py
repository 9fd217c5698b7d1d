#!/usr/bin/env python3
"""The toy study behind the measured curves of
docs/guide/early-stop.md, "What to expect on the toy runs": data-limited and data-rich runs of the
toy trainer, every checkpoint evaluated by `diffmon watch` with the default detector (ICR,
generalization gap, E_gen against a data-rich teacher, E_mem, memorization ratio).

    .venv/bin/python scripts/toy_study.py OUT_DIR [--seeds 0,1,2] [--rich-seeds 0] [--steps 1600]
        [--pfd-samples 128]

The runs use the settings of `make demo` (the integration test
`early_stop_training::default_detector_fires_on_data_limited_training` uses them at 8×8): batch
64, EMA 0.995, one thread for the trainer and one for diffmon, 2048 ICR view pairs.

Prints one table per run and a summary line per run (ICR minimum, the step the detector fired
at and the best step it named, the first step with a memorization ratio ≥ 5%); writes every
record and the event to OUT_DIR/<run>/study.json (a run studied before is not evaluated again).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "diffmon"
PY = sys.executable


def train(run_dir: Path, train_size: int, seed: int, steps: int, threads: int) -> None:
    if (run_dir / f"ckpt_{steps:06d}.pt").exists():
        return
    subprocess.run([PY, str(ROOT / "python" / "train_toy.py"), "--run-dir", str(run_dir),
                    "--train-size", str(train_size), "--heldout-size", "256", "--steps", str(steps),
                    "--ckpt-every", "50", "--batch-size", "64", "--ema", "0.995", "--seed", str(seed),
                    "--threads", str(threads)],
                   check=True, stdout=subprocess.DEVNULL)


def config(run_dir: Path, teacher: Path | None, pfd_samples: int, threads: int) -> Path:
    pfd = f"pfd: {{enabled: true, samples: {pfd_samples}, batch_size: 128"
    pfd += f", teacher: {teacher}}}\n" if teacher else "}\n"
    path = run_dir / "study.yaml"
    path.write_text(
        f"run: {{dir: {run_dir}}}\nstate_dir: {run_dir / 'state'}\n"
        f"model: {{architecture: {run_dir / 'model.ts'}}}\ndevice: cpu\ncpu_threads: {threads}\n"
        f"data: {{path: {run_dir / 'train.h5'}, heldout_path: {run_dir / 'heldout.h5'}}}\n"
        f"icr: {{samples: 2048}}\n{pfd}memorization: {{enabled: true}}\n"
        "checkpoints: {pattern: 'ckpt_*.pt'}\nhttp: {listen: '127.0.0.1:0'}\n"
    )
    return path


def watch(run_dir: Path, cfg: Path, n: int) -> tuple[list[dict], dict]:
    """Runs the daemon over the finished run (backlog `all`) until every checkpoint is
    evaluated; returns the records of its history and the early-stop event (empty if none)."""
    state = run_dir / "state"
    done = run_dir / "study.json"
    if done.exists():  # this run was studied already
        saved = json.loads(done.read_text())
        return saved["records"], saved["event"]
    for f in state.glob("*"):  # a fresh daemon state, but keep the flow caches
        if f.is_file():
            f.unlink()
    (run_dir / "EARLY_STOP").unlink(missing_ok=True)
    log = open(run_dir / "watch.log", "w")
    p = subprocess.Popen([str(BIN), "watch", "--config", str(cfg)], stderr=log,
                         env={**os.environ, "DIFFMON_LOG": "info"})
    try:
        deadline = time.time() + 60 * 30
        while time.time() < deadline:
            hist = state / "history.jsonl"
            if hist.exists() and len(hist.read_text().splitlines()) >= n:
                break
            time.sleep(1)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    stop = run_dir / "EARLY_STOP"
    lines = (state / "history.jsonl").read_text().splitlines()
    records = [e["record"] for e in map(json.loads, lines) if e["kind"] == "evaluation"]
    event = json.loads(stop.read_text()) if stop.exists() else {}
    done.write_text(json.dumps({"records": records, "event": event}))
    return records, event


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--rich-seeds", default="0")
    ap.add_argument("--pfd-samples", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # The teacher: the data-rich run's last checkpoint (seed 0), exported to TorchScript.
    rich = args.out / "rich-s0"
    train(rich, 1500, 0, args.steps, args.threads)
    teacher = args.out / "teacher.ts"
    if not teacher.exists():
        import torch
        m = torch.jit.load(str(rich / "model.ts"))
        m.load_state_dict(torch.load(str(rich / f"ckpt_{args.steps:06d}.pt")))
        torch.jit.save(m, str(teacher))
    runs = ([(f"rich-s{s}", 1500, int(s)) for s in args.rich_seeds.split(",")]
            + [(f"limited-s{s}", 64, int(s)) for s in args.seeds.split(",")])
    for name, size, seed in runs:
        run_dir = args.out / name
        train(run_dir, size, seed, args.steps, args.threads)
        cfg = config(run_dir, teacher, args.pfd_samples, args.threads)
        records, event = watch(run_dir, cfg, len(list(run_dir.glob("ckpt_*.pt"))))
        records.sort(key=lambda r: r["step"])
        print(f"\n## {name}: {size} training images, seed {seed}")
        print("| step | ICR | gap | E_gen | E_mem | mem. ratio |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in records:
            print(f"| {r['step']} | {r['icr']:.4f} | {r['generalization_gap']:.4f} | "
                  f"{r['pfd_generalization']:.3f} | {r['pfd_memorization']:.3f} | "
                  f"{r['memorization_ratio']:.3f} |")
        best = min(records, key=lambda r: r["icr"])
        mem5 = next((r["step"] for r in records if r["memorization_ratio"] >= 0.05), None)
        summary = {"run": name, "icr_min_step": best["step"], "icr_min": round(best["icr"], 4),
                   "first_step_memorization_ge_5pct": mem5}
        summary["fired_at_step"] = event.get("current_step")
        summary["best_step"] = event.get("best_step")
        print("summary:", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
