#!/usr/bin/env python3
"""diffmon's benchmarks (`make bench`): each entry times diffmon and a straightforward reference
(PyTorch or numpy) on the same model and inputs in the same run, and prints the ratio. This
machine is noisy: the two sides run interleaved, every timing is the best of --repeat runs,
and only ratios are compared with targets.

    python bench/bench.py [--quick] [--only icr,pfd,empirical,linalg] [--json OUT]

Entries:
  icr        ICR of one checkpoint, n = 1024 view pairs, toy model: `diffmon eval` (ICR only)
             vs a PyTorch script doing the same 2n forward passes and the same math; per
             checkpoint in steady state (the first of three checkpoints dropped on both sides).
             Target: ratio ≥ 1 (diffmon no slower).
  linalg     ICR moments and linear algebra for d = 512, n = 4096 (`diffmon icr-features`, its
             `seconds` field: without reading the file) vs the same math in PyTorch float64.
             Target: < 0.2 s.
  pfd        per-checkpoint PFD time, teacher flow cached (`diffmon eval`, E_gen and E_mem) vs
             the naive protocol in PyTorch (teacher and student integrated every time, E_gen only).
             Target: ratio ≥ 1.8.
  empirical  empirical-denoiser throughput (image·evaluations per second) of `diffmon sample
             --model empirical` vs a naive numpy float64 implementation; and its GFLOP/s against
             libtorch's own float64 matrix-multiply rate on the same shapes. Target: ratio ≥ 5.
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

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "diffmon"
sys.path.insert(0, str(ROOT / "python"))
THREADS = int(os.environ.get("DIFFMON_BENCH_THREADS", "2"))


def run(args: list[str]) -> tuple[float, str]:
    """Wall time and stdout of a diffmon command."""
    t0 = time.perf_counter()
    out = subprocess.run([str(BIN), *args], capture_output=True, text=True,
                         env={**os.environ, "DIFFMON_LOG": "warn"})
    dt = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"diffmon {' '.join(args)} failed:\n{out.stderr}")
    return dt, out.stdout


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def write_config(path: Path, run_dir: Path, extra: str) -> Path:
    path.write_text(
        f"run: {{dir: {run_dir}}}\nstate_dir: {run_dir / 'state'}\n"
        f"model: {{architecture: {run_dir / 'model.ts'}}}\ndevice: cpu\ncpu_threads: {THREADS}\n"
        f"data: {{path: {run_dir / 'train.h5'}}}\n{extra}"
    )
    return path


def toy_run(dir: Path) -> Path:
    run_dir = dir / "run"
    if not (run_dir / "ckpt_000200.pt").exists():
        subprocess.run([sys.executable, str(ROOT / "python" / "train_toy.py"), "--run-dir", str(run_dir),
                        "--train-size", "64", "--steps", "200", "--ckpt-every", "50",
                        "--threads", str(THREADS)], check=True, capture_output=True)
    return run_dir


# ----------------------------------------------------------------------------------------------
# References (plain PyTorch / numpy)

def load_net(run_dir: Path, ckpt: Path | None):
    m = torch.jit.load(str(run_dir / "model.ts"))
    if ckpt is not None:
        m.load_state_dict(torch.load(str(ckpt)))
    m.eval()
    return m


def edm_sample(m, z: torch.Tensor, batch: int, steps: int = 18) -> torch.Tensor:
    i = torch.arange(steps, dtype=torch.float64)
    t = (80 ** (1 / 7) + i / (steps - 1) * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7
    t = torch.cat([t, torch.zeros(1, dtype=torch.float64)])
    out = []
    with torch.no_grad():
        for s in range(0, len(z), batch):
            x = z[s:s + batch].to(torch.float64) * t[0]
            b = len(x)
            net = lambda x, tt: m(x.float(), torch.full([b], float(tt)))[0].double()
            for k in range(steps):
                d = (x - net(x, t[k])) / t[k]
                xn = x + (t[k + 1] - t[k]) * d
                if k < steps - 1:
                    d2 = (xn - net(xn, t[k + 1])) / t[k + 1]
                    xn = x + (t[k + 1] - t[k]) * 0.5 * (d + d2)
                x = xn
            out.append(x)
    return torch.cat(out)


def icr_reference(m, images: torch.Tensor, n: int, sigma: float, batch: int) -> float:
    """Two augmented noisy views per image, pooled features, float64 moments, generalized eigh."""
    g = torch.Generator().manual_seed(0)
    h1s, h2s = [], []

    def aug(x):
        b, c, hh, ww = x.shape
        pad = round(0.125 * hh)
        p = torch.nn.functional.pad(x, (pad,) * 4, mode="reflect")
        oy = torch.randint(0, 2 * pad + 1, (b,), generator=g)
        ox = torch.randint(0, 2 * pad + 1, (b,), generator=g)
        y = torch.stack([p[k, :, oy[k]:oy[k] + hh, ox[k]:ox[k] + ww] for k in range(b)])
        flip = torch.rand(b, 1, 1, 1, generator=g) < 0.5
        y = torch.where(flip, y.flip(3), y)
        f = torch.rand(b, 1, 1, 1, generator=g) * 0.8 + 0.6
        z = ((y + 1) / 2 * f).clamp(0, 1)
        mean = z.mean(dim=(1, 2, 3), keepdim=True)
        f = torch.rand(b, 1, 1, 1, generator=g) * 0.8 + 0.6
        z = ((z - mean) * f + mean).clamp(0, 1)
        return z * 2 - 1

    with torch.no_grad():
        for s in range(0, n, batch // 2):
            idx = torch.arange(s, min(n, s + batch // 2)) % len(images)
            x0 = images[idx]
            v1 = aug(x0) + sigma * torch.randn(x0.shape, generator=g)
            v2 = aug(x0) + sigma * torch.randn(x0.shape, generator=g)
            x = torch.cat([v1, v2])
            _, f = m(x, torch.full([len(x)], sigma))
            h = f.mean(dim=(2, 3)) if f.dim() == 4 else f
            h1s.append(h[:len(idx)].double())
            h2s.append(h[len(idx):].double())
    h1, h2 = torch.cat(h1s), torch.cat(h2s)
    t, u = (h1 + h2) / 2, h1 - h2
    cov_t, cov_u = torch.cov(t.T), torch.cov(u.T)
    xi, ss = cov_u / 2, cov_t - cov_u / 4
    d = xi.shape[0]
    xi = xi + 1e-4 * torch.trace(xi) / d * torch.eye(d, dtype=torch.float64)
    ell = torch.linalg.cholesky(xi)
    w = torch.linalg.solve_triangular(ell, torch.linalg.solve_triangular(ell, ss, upper=False).T, upper=False)
    lam = torch.linalg.eigvalsh((w + w.T) / 2)
    return float(1 / (1 + lam.mean()))


def empirical_numpy(y: np.ndarray, x: np.ndarray, sigma: float) -> np.ndarray:
    """The naive empirical denoiser: per query, distances by subtraction, then a softmax."""
    out = np.empty_like(x)
    for i in range(len(x)):
        d2 = ((y - x[i]) ** 2).sum(axis=1)
        logits = -d2 / (2 * sigma * sigma)
        w = np.exp(logits - logits.max())
        out[i] = (w / w.sum()) @ y
    return out


# ----------------------------------------------------------------------------------------------
# Entries

def bench_icr(work: Path, repeat: int, quick: bool) -> dict:
    run_dir = toy_run(work)
    n = 256 if quick else 1024
    cfg = write_config(work / "icr.yaml", run_dir,
                       f"icr: {{samples: {n}, batch_size: 256, sigma: 0.5}}\n")
    ckpts = [run_dir / f"ckpt_{s:06d}.pt" for s in (100, 150, 200)]
    images = torch.from_numpy(np.asarray(h5py.File(run_dir / "train.h5")["images"]))

    def reference() -> list[float]:
        times = []
        for c in ckpts:
            t0 = time.perf_counter()
            icr_reference(load_net(run_dir, c), images, n, 0.5, 256)
            times.append(time.perf_counter() - t0)
        return times

    # Per checkpoint in steady state, as in the daemon: each side evaluates three checkpoints
    # in one process and the first (process warm-up: thread pools, oneDNN kernels) is dropped.
    # Interleaved, so a slow phase of this (shared, noisy) machine hits both sides alike.
    ours, refs = [], []
    for _ in range(repeat):
        out = run(["eval", "--config", str(cfg), *map(str, ckpts), "--json"])[1]
        ours.extend(json.loads(line)["seconds"] for line in out.splitlines()[1:])
        refs.extend(reference()[1:])
    ours, ref = min(ours), min(refs)
    return {"entry": "icr", "n": n, "diffmon_s": ours, "reference_s": ref, "ratio": ref / ours,
            "target": "ratio >= 1"}


def bench_linalg(work: Path, repeat: int, quick: bool) -> dict:
    rng = np.random.default_rng(0)
    n, d = 4096, 512
    big = work / "feat512.h5"
    s = rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) / np.sqrt(d)
    h1, h2 = s + rng.normal(size=(n, d)), s + rng.normal(size=(n, d))
    with h5py.File(big, "w") as f:
        f["h1"], f["h2"] = h1, h2

    def reference():  # the same math in PyTorch float64, from tensors in memory, warm process
        a, b = torch.from_numpy(h1), torch.from_numpy(h2)
        t, u = (a + b) / 2, a - b
        cov_t, cov_u = torch.cov(t.T), torch.cov(u.T)
        xi, ss = cov_u / 2, cov_t - cov_u / 4
        xi = xi + 1e-4 * torch.trace(xi) / d * torch.eye(d, dtype=torch.float64)
        ell = torch.linalg.cholesky(xi)
        w = torch.linalg.solve_triangular(ell, torch.linalg.solve_triangular(ell, ss, upper=False).T,
                                          upper=False)
        torch.linalg.eigvalsh((w + w.T) / 2)
        # The traces on l2-normalized features, which diffmon reports too.
        n1, n2 = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(b, dim=1)
        torch.var((n1 + n2) / 2, dim=0).sum(), torch.var(n1 - n2, dim=0).sum()

    ours, refs = [], []
    for _ in range(repeat):
        ours.append(json.loads(run(["icr-features", "--input", str(big)])[1])["seconds"])
        refs.append(best(reference, 1))
    return {"entry": "linalg", "n": n, "d": d, "diffmon_s": min(ours), "reference_s": min(refs),
            "ratio": min(refs) / min(ours), "target": "< 0.2 s"}


def bench_pfd(work: Path, repeat: int, quick: bool) -> dict:
    run_dir = toy_run(work)
    m_lat, batch = (64 if quick else 256), 64
    teacher = run_dir / "teacher.ts"
    if not teacher.exists():
        torch.jit.save(load_net(run_dir, run_dir / "ckpt_000200.pt"), str(teacher))
    cfg = write_config(work / "pfd.yaml", run_dir,
                       f"icr: {{enabled: false}}\nearly_stop: {{metric: pfd_generalization}}\n"
                       f"pfd: {{enabled: true, teacher: {teacher}, "
                       f"samples: {m_lat}, batch_size: {batch}}}\n")
    ckpts = [run_dir / f"ckpt_{s:06d}.pt" for s in (100, 150)]
    run(["eval", "--config", str(cfg), str(ckpts[0]), "--json"])  # builds the caches
    z = torch.randn(m_lat, 1, 16, 16, generator=torch.Generator().manual_seed(0))

    def naive():
        for c in ckpts:
            t_out = edm_sample(torch.jit.load(str(teacher)), z, batch)
            s_out = edm_sample(load_net(run_dir, c), z, batch)
            float(((t_out - s_out) ** 2).flatten(1).sum(1).mean().sqrt())

    # Interleaved, so a slow phase of this (shared, noisy) machine hits both sides alike.
    ours, refs = [], []
    for _ in range(repeat):
        out = run(["eval", "--config", str(cfg), *map(str, ckpts), "--json"])[1]
        ours.append(np.mean([json.loads(line)["seconds"] for line in out.splitlines()]))
        refs.append(best(naive, 1) / len(ckpts))
    ref = min(refs)
    return {"entry": "pfd", "samples": m_lat, "diffmon_s": min(ours), "reference_s": ref,
            "ratio": ref / min(ours), "target": "ratio >= 1.8"}


def bench_empirical(work: Path, repeat: int, quick: bool) -> dict:
    n, shape = (1024 if quick else 4096), (3, 32, 32)
    m_lat, steps = 64, 18
    rng = np.random.default_rng(1)
    data, latents = work / "emp_train.h5", work / "emp_latents.h5"
    with h5py.File(data, "w") as f:
        f["images"] = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    with h5py.File(latents, "w") as f:
        f["latents"] = rng.normal(size=(m_lat, *shape)).astype(np.float32)
    args = ["sample", "--model", "empirical", "--data", str(data), "--latents", str(latents),
            "--out", str(work / "emp_out.h5"), "--device", "cpu", "--batch-size", str(m_lat),
            "--steps", str(steps)]
    evals = 2 * steps - 1
    t_ours = min(run(args)[0] for _ in range(repeat))
    ours_rate = m_lat * evals / t_ours
    # The naive numpy denoiser on the same data, a few evaluations (it is slow).
    y = np.asarray(h5py.File(data)["images"], dtype=np.float64).reshape(n, -1) / 127.5 - 1
    x = rng.normal(size=(m_lat, y.shape[1])) * 2.0
    k = 2
    t_np = best(lambda: [empirical_numpy(y, x, 2.0) for _ in range(k)], 1)
    np_rate = m_lat * k / t_np
    # GFLOP/s: two matrix products of 2·B·N·D flops per evaluation.
    d = y.shape[1]
    flops = 2 * (2 * m_lat * n * d) * evals
    torch.set_num_threads(THREADS)
    a = torch.randn(m_lat, d, dtype=torch.float64)
    b = torch.randn(n, d, dtype=torch.float64)
    w = torch.randn(m_lat, n, dtype=torch.float64)

    def mm():
        a.mm(b.T)
        w.mm(b)

    mm()
    t_mm = best(mm, max(3, repeat))
    mm_gflops = 2 * (2 * m_lat * n * d) / t_mm / 1e9
    return {"entry": "empirical", "train_images": n, "image_shape": list(shape), "samples": m_lat,
            "diffmon_rate": ours_rate, "numpy_rate": np_rate, "ratio": ours_rate / np_rate,
            "diffmon_gflops": flops / t_ours / 1e9, "libtorch_mm_gflops": mm_gflops,
            "gflops_fraction": flops / t_ours / 1e9 / mm_gflops, "target": "ratio >= 5"}


ENTRIES = {"icr": bench_icr, "linalg": bench_linalg, "pfd": bench_pfd, "empirical": bench_empirical}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--only", default=",".join(ENTRIES), help="comma-separated entries")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    results = []
    with tempfile.TemporaryDirectory(prefix="diffmon-bench-") as tmp:
        for name in args.only.split(","):
            r = ENTRIES[name](Path(tmp), args.repeat, args.quick)
            results.append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
