#!/usr/bin/env python3
"""The references diffmon is timed against (`bench/bench.py` runs this file as its own process,
so its peak memory is its own): each subcommand does, in plain PyTorch or numpy, the work one
benchmark entry asks of diffmon, the way a researcher would write it from the papers, and prints
one JSON object with its per-item timings.

    reference.py icr ARCH DATA CKPT... --n N [--sigma S --batch B]
    reference.py pfd ARCH TEACHER CKPT... --m M --shape C,H,W [--batch B]
    reference.py load ARCH CKPT...
    reference.py empirical DATA --queries Q --evals K
    reference.py forward ARCH --shape C,H,W --batch B --evals K
    reference.py linalg FEATURES
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

THREADS = int(os.environ.get("DIFFMON_BENCH_THREADS", "2"))


def load_net(arch: str, ckpt: str | None = None):
    m = torch.jit.load(arch)
    if ckpt is not None:
        m.load_state_dict(read_state_dict(ckpt))
    m.eval()
    return m


def read_state_dict(ckpt: str) -> dict:
    if ckpt.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(ckpt)
    return torch.load(ckpt, weights_only=True)


def read_images(path: str, dataset: str = "images") -> torch.Tensor:
    import h5py

    x = np.asarray(h5py.File(path)[dataset])
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 127.5 - 1
    return torch.from_numpy(x)


def edm_sample(m, z: torch.Tensor, batch: int, steps: int = 18) -> torch.Tensor:
    """EDM's deterministic Heun sampler (Karras et al. 2022, Algorithm 1), float64 state."""
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


def icr(m, images: torch.Tensor, n: int, sigma: float, batch: int) -> float:
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
    return icr_of_features(torch.cat(h1s), torch.cat(h2s))


def icr_of_features(h1: torch.Tensor, h2: torch.Tensor, ridge: float = 1e-4) -> float:
    """ICR from the two views' pooled features (float64, on their device): the moments and the
    generalized eigenproblem."""
    t, u = (h1 + h2) / 2, h1 - h2
    cov_t, cov_u = torch.cov(t.T), torch.cov(u.T)
    xi, ss = cov_u / 2, cov_t - cov_u / 4
    d = xi.shape[0]
    xi = xi + ridge * torch.trace(xi) / d * torch.eye(d, dtype=torch.float64, device=xi.device)
    ell = torch.linalg.cholesky(xi)
    w = torch.linalg.solve_triangular(ell, torch.linalg.solve_triangular(ell, ss, upper=False).T, upper=False)
    lam = torch.linalg.eigvalsh((w + w.T) / 2)
    return float(1 / (1 + lam.mean()))


def icr_from_features(a: torch.Tensor, b: torch.Tensor, ridge: float = 1e-4) -> None:
    """ICR's float64 moments and generalized eigenproblem, and the traces on l2-normalized
    features that diffmon reports too."""
    d = a.shape[1]
    t, u = (a + b) / 2, a - b
    cov_t, cov_u = torch.cov(t.T), torch.cov(u.T)
    xi, ss = cov_u / 2, cov_t - cov_u / 4
    xi = xi + ridge * torch.trace(xi) / d * torch.eye(d, dtype=torch.float64)
    ell = torch.linalg.cholesky(xi)
    w = torch.linalg.solve_triangular(ell, torch.linalg.solve_triangular(ell, ss, upper=False).T, upper=False)
    torch.linalg.eigvalsh((w + w.T) / 2)
    n1, n2 = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(b, dim=1)
    torch.var((n1 + n2) / 2, dim=0).sum(), torch.var(n1 - n2, dim=0).sum()


def empirical_numpy(y: np.ndarray, x: np.ndarray, sigma: float) -> np.ndarray:
    """The naive empirical denoiser: per query, distances by subtraction, then a softmax."""
    out = np.empty_like(x)
    for i in range(len(x)):
        d2 = ((y - x[i]) ** 2).sum(axis=1)
        logits = -d2 / (2 * sigma * sigma)
        w = np.exp(logits - logits.max())
        out[i] = (w / w.sum()) @ y
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def shape(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(","))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("icr")
    p.add_argument("arch"), p.add_argument("data"), p.add_argument("ckpts", nargs="+")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--sigma", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=256)
    p = sub.add_parser("pfd")
    p.add_argument("arch"), p.add_argument("teacher"), p.add_argument("ckpts", nargs="+")
    p.add_argument("--m", type=int, required=True)
    p.add_argument("--shape", type=shape, required=True)
    p.add_argument("--batch", type=int, default=256)
    p = sub.add_parser("load")
    p.add_argument("arch"), p.add_argument("ckpts", nargs="+")
    p = sub.add_parser("empirical")
    p.add_argument("data")
    p.add_argument("--queries", type=int, required=True)
    p.add_argument("--evals", type=int, required=True)
    p = sub.add_parser("linalg")
    p.add_argument("features")
    p = sub.add_parser("forward")
    p.add_argument("arch")
    p.add_argument("--shape", type=shape, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--evals", type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)

    if args.cmd == "icr":
        images = read_images(args.data)
        seconds = [timed(lambda: icr(load_net(args.arch, c), images, args.n, args.sigma, args.batch))
                   for c in args.ckpts]
        print(json.dumps({"seconds": seconds}))
    elif args.cmd == "pfd":
        # The naive protocol: teacher and student integrated from the same latents for every
        # checkpoint, then the root mean squared distance of the two sample sets.
        z = torch.randn(args.m, *args.shape, generator=torch.Generator().manual_seed(0))

        def one(c):
            t_out = edm_sample(load_net(args.teacher), z, args.batch)
            s_out = edm_sample(load_net(args.arch, c), z, args.batch)
            float(((t_out - s_out) ** 2).flatten(1).sum(1).mean().sqrt())

        print(json.dumps({"seconds": [timed(lambda: one(c)) for c in args.ckpts]}))
    elif args.cmd == "load":
        m = load_net(args.arch)
        print(json.dumps({"seconds": [timed(lambda: m.load_state_dict(read_state_dict(c)))
                                      for c in args.ckpts]}))
    elif args.cmd == "empirical":
        y = read_images(args.data).double().flatten(1).numpy()
        rng = np.random.default_rng(0)
        x = rng.normal(size=(args.queries, y.shape[1])) * 2.0
        t = timed(lambda: [empirical_numpy(y, x, 2.0) for _ in range(args.evals)])
        print(json.dumps({"seconds": [t], "rate": args.queries * args.evals / t}))
    elif args.cmd == "linalg":
        import h5py

        with h5py.File(args.features) as f:
            a, b = torch.from_numpy(f["h1"][:]), torch.from_numpy(f["h2"][:])
        icr_from_features(a, b)  # warm: the first call pays for loading kernels
        print(json.dumps({"seconds": [timed(lambda: icr_from_features(a, b)) for _ in range(3)]}))
    elif args.cmd == "forward":
        # The machine's own limit for network evaluations: a bare forward loop, no sampler.
        m = load_net(args.arch)
        x = torch.randn(args.batch, *args.shape)
        s = torch.full([args.batch], 1.0)
        with torch.inference_mode():
            m(x, s)
            t = timed(lambda: [m(x, s) for _ in range(args.evals)])
        print(json.dumps({"seconds": [t], "rate": args.batch * args.evals / t}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
