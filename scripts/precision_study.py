#!/usr/bin/env python3
"""What `evaluation.precision` does to diffmon's numbers: every checkpoint of a run evaluated in
fp32 and in another precision (same config, same draws), compared metric by metric.

    python scripts/precision_study.py --config config/demo.yaml [--precision bf16] [--every 2]

For each checkpoint it runs `diffmon eval --json` twice, the second time with
`evaluation.precision` set, and prints per metric the largest absolute difference, and for ICR
the difference in units of its standard error (`icr_stderr`; the bar for making a precision the
default is a quarter of it, docs/design.md §11, "Precision"), and the seconds per checkpoint of
each. Results are quoted in docs/guide/cost-and-gpu.md ("Precision"); rerun it on your own run.
Needs `diffmon` on PATH (`make setup`) or `--diffmon PATH`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

METRICS = ("icr", "icr_invariant_trace", "icr_residual_trace", "loss_train", "loss_heldout",
           "generalization_gap", "pfd_memorization", "memorization_ratio")


def evaluate(diffmon: str, config: Path, checkpoints: list[Path]) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    out = subprocess.run([diffmon, "eval", "--config", str(config), "--json", *map(str, checkpoints)],
                         check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines()], time.perf_counter() - t0


def with_precision(config: Path, precision: str) -> Path:
    """A copy of `config` beside it (its relative paths still hold) with the precision set."""
    text = config.read_text()
    if "\nevaluation:" in "\n" + text:
        sys.exit(f"{config}: has an evaluation section; set its precision by hand")
    out = config.parent / f".{config.stem}.precision-{precision}.yaml"
    out.write_text(text + f"\nevaluation:\n  precision: {precision}\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--precision", default="bf16", choices=["tf32", "bf16"])
    ap.add_argument("--every", type=int, default=1, help="every n-th checkpoint (by step)")
    ap.add_argument("--pattern", default="ckpt_*.pt")
    ap.add_argument("--diffmon", default="diffmon")
    args = ap.parse_args()
    import yaml

    conf = yaml.safe_load(args.config.read_text())
    run_dir = (args.config.parent / conf["run"]["dir"]).resolve()
    checkpoints = sorted(run_dir.glob(args.pattern))[:: args.every]
    if not checkpoints:
        sys.exit(f"no {args.pattern} in {run_dir}")
    other = with_precision(args.config, args.precision)
    try:
        base, t_base = evaluate(args.diffmon, args.config, checkpoints)
        low, t_low = evaluate(args.diffmon, other, checkpoints)
    finally:
        other.unlink(missing_ok=True)
    print(f"{len(checkpoints)} checkpoints of {run_dir.name}: fp32 against {args.precision}")
    print(f"{'metric':<22} {'max |diff|':>12} {'max |diff|/|fp32|':>18}")
    for m in METRICS:
        pairs = [(a[m], b[m]) for a, b in zip(base, low) if a.get(m) is not None and b.get(m) is not None]
        if not pairs:
            continue
        diff = max(abs(a - b) for a, b in pairs)
        rel = max(abs(a - b) / abs(a) for a, b in pairs if a != 0) if any(a != 0 for a, _ in pairs) else 0.0
        print(f"{m:<22} {diff:>12.3g} {rel:>18.3g}")
    z = [abs(a["icr"] - b["icr"]) / a["icr_stderr"] for a, b in zip(base, low) if a.get("icr_stderr")]
    if z:
        print(f"ICR difference in standard errors: median {sorted(z)[len(z) // 2]:.3f}, max {max(z):.3f}"
              f" (the bar for a default: 0.25)")
    print(f"seconds per checkpoint: fp32 {t_base / len(checkpoints):.2f}, "
          f"{args.precision} {t_low / len(checkpoints):.2f} (each call loads the data once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
