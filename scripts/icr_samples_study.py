#!/usr/bin/env python3
"""How ICR depends on the number of view pairs n, on one checkpoint (docs/design.md §2; the table
in docs/guide/formulas.md, "ICR and the number of view pairs").

    .venv/bin/python scripts/icr_samples_study.py OUT_DIR [--ns 256,512,...,16384]
        [--seeds 0,1,2,3,4] [--run-dir DIR --checkpoint CKPT] [--threads 2]

Without --run-dir it trains the toy model once (python/train_toy.py: 64 digits, 1000 steps, batch
64, EMA 0.995, seed 0) into OUT_DIR/toy and uses its last checkpoint. For every n and every
`icr.seed` it runs `diffmon eval --json` (n pairs; with 64 images each image is used n/64 times,
with new augmentations and noise each time) and keeps the record, plus the jackknife's mean of the
leave-one-group-out values from diffmon's debug log. Results are cached in OUT_DIR/results.json, so
a rerun only evaluates what is missing.

It prints, per n: the mean ICR over the seeds, the SD over the seeds, the mean jackknife standard
error (the two should agree), and three bias corrections, each as mean ± SD over the seeds:
- `jack`: the jackknife's bias correction G·θ − (G−1)·θ̄ (G groups, θ̄ the leave-out mean);
- `extrap`: the 1/n extrapolation 2·θ(2n) − θ(n) from n and 2n pairs of the same seed (the first
  n pairs of the 2n run are the n run's pairs: the views are drawn in the same order);
- `wishart`: the inverse-Wishart factor on the trace, mean λ · (n − d − 2)/(n − 1), which makes
  Tr(Σ_ξ⁻¹ Σ_s) unbiased for Gaussian features (E[S⁻¹] = Σ⁻¹ (n−1)/(n−d−2) for a sample
  covariance S on n − 1 degrees of freedom).
Last, for each estimator, how far its mean moves from the smallest to the largest n, against the
SD over seeds at the largest n.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "diffmon"
DEBUG = re.compile(r"ICR jackknife.*?jackknife_mean=([-+0-9.eE]+)")


def train_toy(run_dir: Path, threads: int) -> Path:
    ckpt = run_dir / "ckpt_001000.pt"
    if not ckpt.exists():
        subprocess.run([sys.executable, str(ROOT / "python" / "train_toy.py"), "--run-dir",
                        str(run_dir), "--train-size", "64", "--heldout-size", "256", "--steps",
                        "1000", "--ckpt-every", "500", "--batch-size", "64", "--ema", "0.995",
                        "--seed", "0", "--threads", str(threads)], check=True,
                       stdout=subprocess.DEVNULL)
    return ckpt


def evaluate(out: Path, run_dir: Path, ckpt: Path, n: int, seed: int, threads: int) -> dict:
    cfg = out / f"icr_n{n}_s{seed}.yaml"
    cfg.write_text(
        f"run: {{dir: {run_dir}}}\nmodel: {{architecture: {run_dir / 'model.ts'}}}\n"
        f"device: cpu\ncpu_threads: {threads}\ndata: {{path: {run_dir / 'train.h5'}}}\n"
        f"icr: {{samples: {n}, seed: {seed}, batch_size: 256}}\n"
    )
    env = {**os.environ, "DIFFMON_LOG": "warn,diffmon::icr=debug", "NO_COLOR": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run([str(BIN), "eval", "--config", str(cfg), str(ckpt), "--json"],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"diffmon eval failed (n = {n}, seed = {seed}):\n{p.stderr}")
    record = json.loads(p.stdout.splitlines()[0])
    means = DEBUG.findall(re.sub(r"\x1b\[[0-9;]*m", "", p.stderr))
    if len(means) != 1:
        sys.exit(f"expected one 'ICR jackknife' debug line, got {len(means)}:\n{p.stderr}")
    lam = record["icr_eigenvalues"]
    return {"icr": record["icr"], "stderr": record["icr_stderr"], "samples": record["icr_samples"],
            "d": len(lam), "mean_lambda": sum(lam) / len(lam), "jackknife_mean": float(means[0]),
            "seconds": record["seconds"]}


def groups(n: int, d: int) -> int:
    """The jackknife's group count (src/engine/icr.rs, jackknife_groups): 32 for d ≤ 724 and n ≥ 64."""
    by_memory = max(8, min(32, (256 << 20) // (16 * d * d)))
    return min(by_memory, n // 2)


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--ns", default="256,512,1024,2048,4096,8192,16384")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    if args.run_dir:
        run_dir = args.run_dir.resolve()
        ckpt = (args.checkpoint or sorted(run_dir.glob("ckpt_*.pt"))[-1]).resolve()
    else:
        run_dir = out / "toy"
        ckpt = train_toy(run_dir, args.threads)
    ns = [int(x) for x in args.ns.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    cache_path = out / "results.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    results: dict[tuple[int, int], dict] = {}
    for n in ns:
        for seed in seeds:
            key = f"{ckpt}|{n}|{seed}"
            if key not in cache:
                cache[key] = evaluate(out, run_dir, ckpt, n, seed, args.threads)
                cache_path.write_text(json.dumps(cache, indent=1))
                r = cache[key]
                print(f"  n = {n:>6}, seed {seed}: ICR {r['icr']:.5f} ± {r['stderr']:.5f} "
                      f"({r['seconds']:.1f} s)", file=sys.stderr)
            results[(n, seed)] = cache[key]

    def jack(r: dict) -> float:
        g = groups(r["samples"], r["d"])
        return g * r["icr"] - (g - 1) * r["jackknife_mean"]

    def wishart(r: dict) -> float:
        n, d = r["samples"], r["d"]
        return 1 / (1 + r["mean_lambda"] * (n - d - 2) / (n - 1))

    def extrap(n: int, seed: int) -> float | None:
        if (2 * n, seed) not in results:
            return None
        return 2 * results[(2 * n, seed)]["icr"] - results[(n, seed)]["icr"]

    d = results[(ns[0], seeds[0])]["d"]
    print(f"\nICR against the number of view pairs n: {ckpt.name} of {run_dir}, d = {d}, "
          f"{len(seeds)} seeds (icr.seed {args.seeds}); mean ± SD over the seeds\n")
    print("| n | ICR | SD over seeds | jackknife SE | jack | extrap (n, 2n) | wishart | s/eval |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary: dict[str, list[tuple[int, float, float]]] = {
        "raw": [], "jack": [], "extrap": [], "wishart": []}
    for n in ns:
        rs = [results[(n, s)] for s in seeds]
        raw, sd = mean_sd([r["icr"] for r in rs])
        se = statistics.fmean(r["stderr"] for r in rs)
        jm, js = mean_sd([jack(r) for r in rs])
        wm, ws = mean_sd([wishart(r) for r in rs])
        ex = [extrap(n, s) for s in seeds]
        ex_text = "–"
        if all(x is not None for x in ex):
            em, es = mean_sd(ex)  # type: ignore[arg-type]
            ex_text = f"{em:.4f} ± {es:.4f}"
            summary["extrap"].append((n, em, es))
        summary["raw"].append((n, raw, sd))
        summary["jack"].append((n, jm, js))
        summary["wishart"].append((n, wm, ws))
        secs = statistics.fmean(r["seconds"] for r in rs)
        print(f"| {n} | {raw:.4f} | {sd:.4f} | {se:.4f} | {jm:.4f} ± {js:.4f} | {ex_text} | "
              f"{wm:.4f} ± {ws:.4f} | {secs:.1f} |")
    print("\nHow far each estimator's mean moves over n (first to last n it has), against its SD "
          "over seeds at the last n:\n")
    print("| estimator | n range | mean at first n | mean at last n | change | SD at last n |")
    print("|---|---|---:|---:|---:|---:|")
    for name, rows in summary.items():
        if len(rows) < 2:
            continue
        (n0, m0, _), (n1, m1, s1) = rows[0], rows[-1]
        print(f"| {name} | {n0}–{n1} | {m0:.4f} | {m1:.4f} | {m1 - m0:+.4f} | {s1:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
