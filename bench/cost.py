#!/usr/bin/env python3
"""What one checkpoint costs on a real-sized network: the table of real-sized networks in
docs/guide/cost-and-gpu.md, "Cost per checkpoint".

    .venv/bin/python bench/cost.py [--models cifar,ddpm64] [--device cpu] [--threads N]

For each model (diffusers ``UNet2DModel`` with the configurations of well-known pixel-space
models, random weights: the cost does not depend on the values), it exports the architecture,
writes a checkpoint and a training set of random images, and times ``diffmon eval --json`` with
ICR (``icr.samples`` n, batch 64) and with PFD's E_mem (``pfd.samples`` M, batch 32). Each
configuration evaluates two checkpoints in one process and keeps the second (the first pays for
thread pools and, for PFD, the empirical flow's cache). It prints the seconds per checkpoint, the
seconds per network call (one image through the network) and the process's peak RSS, and scales
the per-call time to the defaults (ICR n = 4096: 8192 calls; PFD M = 10 000: 350 000 calls).

  cifar    DDPM's CIFAR-10 network: 3x32x32, channels 128-256-256-256, 2 blocks per level,
           attention at 16x16 (35.7 M parameters)
  ddpm64   diffusers' train_unconditional.py default: 3x64x64, channels 128-128-256-256-512-512,
           2 blocks per level, attention at 16x16 (113.7 M parameters)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
BINARY = ROOT / "target" / "release" / "diffmon"

MODELS = {
    "cifar": dict(
        shape=(3, 32, 32), n=256, m=8,
        config=dict(sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
                    block_out_channels=(128, 256, 256, 256),
                    down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"))),
    "ddpm64": dict(
        shape=(3, 64, 64), n=64, m=4,
        config=dict(sample_size=64, in_channels=3, out_channels=3, layers_per_block=2,
                    block_out_channels=(128, 128, 256, 256, 512, 512),
                    down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D",
                                      "AttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D",
                                    "UpBlock2D", "UpBlock2D"))),
}


def run_eval(config: Path, checkpoints: list[Path]) -> tuple[list[dict], float, int]:
    """`diffmon eval --json`: the records, the wall time and the peak RSS in KiB."""
    with tempfile.NamedTemporaryFile() as rss:
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-o", rss.name, "-f", "%M", str(BINARY), "eval",
                            "--config", str(config), "--json", *map(str, checkpoints)],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"diffmon eval failed:\n{p.stderr}")
        peak = int(Path(rss.name).read_text().split()[-1])
    return [json.loads(line) for line in p.stdout.splitlines()], wall, peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cifar,ddpm64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    from diffusers import UNet2DModel
    from safetensors.torch import save_file

    from diffmon.export import export

    rows = []
    for name in args.models.split(","):
        spec = MODELS[name]
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            torch.manual_seed(0)
            net = UNet2DModel(**spec["config"]).eval()
            params = sum(p.numel() for p in net.parameters())
            export(net, "mid_block", d / "model.ts", parameterization="eps",
                   example_shape=(1, *spec["shape"]), schedule="linear")
            ckpts = []
            for step in (1, 2):
                ckpts.append(d / f"ckpt_{step}.safetensors")
                save_file(net.state_dict(), str(ckpts[-1]))
            rng = np.random.default_rng(0)
            with h5py.File(d / "train.h5", "w") as f:
                f.create_dataset("images", data=rng.integers(0, 256, (512, *spec["shape"][1:], 3),
                                                             dtype=np.uint8))
            base = (f"run: {{dir: {d}}}\nmodel: {{architecture: {d / 'model.ts'}}}\n"
                    f"data: {{path: {d / 'train.h5'}}}\ndevice: {args.device}\n"
                    f"cpu_threads: {args.threads}\n")
            for metric, calls in (("icr", 2 * spec["n"]), ("pfd", 35 * spec["m"])):
                cfg = d / f"{metric}.yaml"
                if metric == "icr":
                    cfg.write_text(base + f"icr: {{samples: {spec['n']}, batch_size: 64}}\n")
                else:
                    # ICR on 2 pairs (4 network calls) only because the early stop needs it.
                    cfg.write_text(base + "icr: {samples: 2, batch_size: 2}\n"
                                   f"pfd: {{enabled: true, samples: {spec['m']}, batch_size: 32}}\n")
                records, wall, peak = run_eval(cfg, ckpts)
                secs = records[-1]["seconds"]
                per_call = secs / calls
                default_calls = 8192 if metric == "icr" else 350_000
                rows.append(dict(model=name, params_m=params / 1e6, metric=metric,
                                 size=spec["n"] if metric == "icr" else spec["m"],
                                 seconds=secs, per_call_ms=1e3 * per_call,
                                 default_s=per_call * default_calls, peak_mib=peak / 1024,
                                 wall=wall))
                print(json.dumps(rows[-1]), flush=True)
    print()
    print("| model | params | metric | size | s per checkpoint | ms per network call | "
          "at the default size | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        size = f"n = {r['size']}" if r["metric"] == "icr" else f"M = {r['size']}"
        default = "n = 4096" if r["metric"] == "icr" else "M = 10 000"
        print(f"| {r['model']} | {r['params_m']:.1f} M | {r['metric'].upper()} | {size} | "
              f"{r['seconds']:.1f} | {r['per_call_ms']:.0f} | {default}: {r['default_s'] / 60:.0f} min | "
              f"{r['peak_mib']:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
