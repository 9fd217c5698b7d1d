#!/usr/bin/env python3
"""diffmon's benchmarks (`make bench`). Every workload runs diffmon and a straightforward
reference (`bench/reference.py`: PyTorch or numpy, as a researcher would write it from the
papers) on the same TorchScript model and inputs, in the same run, each side in its own process
so that its peak memory (RSS) is its own. This machine is noisy: the two sides run interleaved,
per-checkpoint times are steady state (the first checkpoint a process evaluates is dropped on
both sides) and the best of --repeat runs, and only ratios are compared with targets.

    python bench/bench.py [--quick] [--only NAMES] [--repeat N] [--json OUT] [--markdown OUT]

Workloads (NAMES, comma-separated; all but the opt-in `slurm` by default, in this order):
  limits     the machine's own libtorch rates: matrix-multiply GFLOP/s (float32, float64) and the
             bare network-forward throughput of both models in PyTorch; each network-bound row
             below reports bare_forward_s, the time that loop needs for the row's evaluations.
  icr        ICR per checkpoint: toy model n = 1024 and 4096; wider U-Net (3×32×32) n = 1024;
             and ICR's linear algebra alone (d = 512, n = 4096).
  pfd        PFD per checkpoint: toy M = 1000 and 10 000, wider U-Net M = 128. diffmon integrates
             the student only (teacher flow cached); the reference runs the naive protocol
             (teacher and student integrated for every checkpoint).
  empirical  E_mem's empirical flow, N = 4096 and 16 384 training images of 3×32×32, M = 256,
             against a naive numpy float64 implementation (image·evaluations per second), and
             its GFLOP/s against libtorch's float64 matrix multiply on the same shapes.
  load       a 50 M-parameter checkpoint (torch.save zip and safetensors) read and swapped into
             the architecture, against torch.load/safetensors + load_state_dict.
  latency    `diffmon watch`: a checkpoint's final rename → its metrics on /metrics, the
             deciding evaluation → the webhook received by a local HTTP receiver, and the idle
             daemon's CPU share and RSS (before any checkpoint and after the evaluations).
  scaling    diffmon's time and peak RSS against n (ICR) and M (PFD), four points each.
  batch      diffmon's PFD time against its PF-ODE batch size (64, 256, 1024), M = 1000.
  http       `/metrics` and `/` under 200 requests/s (worker threads on loopback) while a
             `diffmon watch` evaluates checkpoints: latency p50/p99, errors, and the evaluation
             time with and without the load (phases alternate).
  compiled   the compiled network (`model.compiled`): each model's AOTInductor package for this
             CPU, fp32 and bf16 (`diffmon-export --compile`: compile seconds, package size),
             then ICR per checkpoint (toy and wider U-Net, n = 1024) with the package against
             TorchScript at the same precision, the two ICRs compared (identical draws), and the
             network GFLOP/s against this CPU's fp32 FMA peak (cores x base clock x SIMD lanes x
             2 x two FMA units).
  scale      how the daemon's own cost grows with the work (bench/scale.py): a sweep of 64 runs
             with 0 and 500 recorded evaluations each, one run with 0, 500 and 10 000: start-up
             and replay time, resident memory, the pages' answer time, the bookkeeping per
             checkpoint outside the network, `diffmon report`.
  slurm      (opt-in: about 11 min here, 2-3 with --quick; needs root, slurm-wlm and munge)
             scale-out: all of a toy run's checkpoints present when `diffmon watch` starts;
             checkpoints per minute with the local executor (the reference, first and last)
             and the Slurm executor on a real single-node cluster (munged, slurmctld, slurmd in a
             temporary folder; Debian's slurm-wlm and munge) at max_in_flight 1, 2, 4, the mean
             queue wait and run time per job from /metrics, and each Slurm history checked
             equal to the local one (numbers to 1e-12 relative).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import h5py
import numpy as np
import torch

import scale

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "diffmon"
REF = Path(__file__).resolve().parent / "reference.py"
sys.path.insert(0, str(ROOT / "python"))
THREADS = int(os.environ.get("DIFFMON_BENCH_THREADS", "2"))
STEPS = 18
EVALS = 2 * STEPS - 1  # network evaluations per PF-ODE trajectory (Heun, last step Euler)
# The machine's own bare-forward rate (images/s) per model, filled by the `limits` workload: what
# libtorch does on this hardware with nothing but the network to run.
FORWARD_RATE: dict[str, float] = {}
# FLOPs (two per multiply-add) of one forward pass per image (PyTorch's FLOP counter on the eager module).
FLOPS_PER_IMAGE: dict[str, float] = {}


def bound(model: str, images: int, seconds: float | None = None) -> dict:
    """What a bare PyTorch forward loop needs for the `images` forward passes of a workload, and
    the network GFLOP/s the workload reached (its own time, everything else included)."""
    out = {}
    if model in FORWARD_RATE:
        out["bare_forward_s"] = images / FORWARD_RATE[model]
    if model in FLOPS_PER_IMAGE and seconds:
        out["network_gflops"] = images * FLOPS_PER_IMAGE[model] / seconds / 1e9
    return out


# ----------------------------------------------------------------------------------------------
# Processes, timed and measured

class Proc:
    def __init__(self, wall: float, out: str, err: str, rss_mib: float):
        self.wall, self.out, self.err, self.rss_mib = wall, out, err, rss_mib

    def json_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.out.splitlines() if line.startswith("{")]


def measure(cmd: list[str], log: str = "warn") -> Proc:
    """Runs `cmd` to completion: wall time, output, and the process's own peak RSS.

    The peak comes from GNU time, not from this process's wait4: Linux starts a child's peak
    RSS at its parent's when it forks, and this process holds PyTorch (over 600 MiB)."""
    env = {**os.environ, "DIFFMON_LOG": log, "DIFFMON_BENCH_THREADS": str(THREADS)}
    with tempfile.NamedTemporaryFile("r") as rss:
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-o", rss.name, "-f", "%M", *map(str, cmd)],
                           capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stderr[-4000:]}")
        kib = int(rss.read().split()[-1])
    return Proc(wall, p.stdout, p.stderr, kib / 1024)


def diffmon(*args, log: str = "warn") -> Proc:
    return measure([str(BIN), *map(str, args)], log)


def reference(*args) -> Proc:
    return measure([sys.executable, str(REF), *map(str, args)])


def steady(times: list[float]) -> list[float]:
    """Per-checkpoint times in steady state: the first of a process (warm-up) dropped."""
    return times[1:] if len(times) > 1 else times


def write_config(path: Path, run_dir: Path, data: Path, extra: str, threads: int = THREADS,
                 model: str = "") -> Path:
    """A config watching `run_dir` with its architecture, or `model` (a `model:` mapping's inside)."""
    model = model or f"architecture: {run_dir / 'model.ts'}"
    path.write_text(
        f"run: {{dir: {run_dir}}}\nstate_dir: {path.parent / (path.stem + '.state')}\n"
        f"model: {{{model}}}\ndevice: cpu\ncpu_threads: {threads}\n"
        f"data: {{path: {data}}}\n{extra}"
    )
    return path


def row(workload: str, ours: float, ref: float, ours_rss: float, ref_rss: float, target: str,
        unit: str = "s", higher_is_better: bool = False, **extra) -> dict:
    ratio = ours / ref if higher_is_better else ref / ours
    return {"workload": workload, "unit": unit, "diffmon": ours, "reference": ref,
            "ratio": ratio, "diffmon_rss_mib": ours_rss, "reference_rss_mib": ref_rss,
            "target": target, **extra}


# ----------------------------------------------------------------------------------------------
# Fixtures: the toy run, a wider U-Net, a 50 M-parameter model, training sets

def toy_run(work: Path) -> Path:
    run_dir = work / "toy"
    if not (run_dir / "ckpt_000200.pt").exists():
        subprocess.run([sys.executable, str(ROOT / "python" / "train_toy.py"), "--run-dir", str(run_dir),
                        "--train-size", "64", "--steps", "200", "--ckpt-every", "50",
                        "--threads", str(THREADS)], check=True, capture_output=True)
    teacher = run_dir / "teacher.ts"  # the last checkpoint, as a TorchScript of the contract
    if not teacher.exists():
        m = torch.jit.load(str(run_dir / "model.ts"))
        m.load_state_dict(torch.load(str(run_dir / "ckpt_000200.pt"), weights_only=True))
        torch.jit.save(m, str(teacher))
    return run_dir


def _wide_unet(width: int):
    """A DDPM-style U-Net for 3×32×32: four resolutions (channel multipliers 1, 2, 4, 8; two
    blocks at 4×4, where most parameters sit), built from the toy model's blocks, with EDM
    preconditioning. Feature layer: `mid2`."""
    import torch.nn as nn
    import torch.nn.functional as F
    from train_toy import FourierEmbedding, ResBlock, _groups

    class WideDenoiser(nn.Module):
        def __init__(self, w: int):
            super().__init__()
            e = 4 * w
            self.embed = FourierEmbedding(w)
            self.emb_mlp = nn.Sequential(nn.Linear(w, e), nn.SiLU(), nn.Linear(e, e), nn.SiLU())
            self.conv_in = nn.Conv2d(3, w, 3, padding=1)
            self.enc = nn.ModuleList([ResBlock(w * k, w * k, e) for k in (1, 2, 4)])
            self.down = nn.ModuleList([nn.Conv2d(w * k, 2 * w * k, 3, stride=2, padding=1)
                                       for k in (1, 2, 4)])
            self.mid1 = ResBlock(8 * w, 8 * w, e)
            self.mid2 = ResBlock(8 * w, 8 * w, e)
            self.up = nn.ModuleList([nn.Conv2d(2 * w * k, w * k, 1) for k in (1, 2, 4)])
            self.dec = nn.ModuleList([ResBlock(w * k, w * k, e) for k in (1, 2, 4)])
            self.norm_out = nn.GroupNorm(_groups(w), w)
            self.conv_out = nn.Conv2d(w, 3, 3, padding=1)

        def forward(self, x, sigma):
            sd = 0.5
            s = sigma.to(x.dtype).reshape(-1, 1, 1, 1)
            c_skip, c_out = sd * sd / (s * s + sd * sd), s * sd / torch.sqrt(s * s + sd * sd)
            c_in, c_noise = 1 / torch.sqrt(s * s + sd * sd), torch.log(s).reshape(-1) / 4
            emb = self.emb_mlp(self.embed(c_noise))
            h = self.conv_in(c_in * x)
            skips = []
            for enc, down in zip(self.enc, self.down):
                h = enc(h, emb)
                skips.append(h)
                h = down(h)
            h = self.mid2(self.mid1(h, emb), emb)
            for k in (2, 1, 0):
                h = self.dec[k](self.up[k](F.interpolate(h, scale_factor=2.0)) + skips[k], emb)
            return c_skip * x + c_out * self.conv_out(F.silu(self.norm_out(h)))

    return WideDenoiser(width)


def model_run(work: Path, name: str, build, feature: str, shape: tuple, n_ckpts: int,
              suffixes=(".pt",)) -> Path:
    """An architecture exported to the model contract, a teacher, and `n_ckpts` checkpoints
    (state_dicts of independently initialized copies) per suffix."""
    from diffmon import export
    from safetensors.torch import save_file

    run_dir = work / name
    if (run_dir / "model.ts").exists():
        return run_dir
    run_dir.mkdir(parents=True)
    torch.manual_seed(0)
    m = build().eval()
    export(m, feature, run_dir / "model.ts", example_shape=(1, *shape))
    torch.jit.save(torch.jit.load(str(run_dir / "model.ts")), str(run_dir / "teacher.ts"))
    for k in range(1, n_ckpts + 1):
        torch.manual_seed(k)
        sd = build().state_dict()
        for suffix in suffixes:
            path = run_dir / f"ckpt_{k:06d}{suffix}"
            if suffix == ".safetensors":
                save_file({a: b.contiguous() for a, b in sd.items()}, str(path))
            else:
                torch.save(sd, path)
    return run_dir


def images_h5(path: Path, n: int, shape: tuple, seed: int = 1) -> Path:
    if not path.exists():
        rng = np.random.default_rng(seed)
        with h5py.File(path, "w") as f:
            f["images"] = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    return path


def wide_run(work: Path) -> Path:
    return model_run(work, "wide", lambda: _wide_unet(32), "mid2", (3, 32, 32), 3)


def params(run_dir: Path) -> int:
    return sum(p.numel() for p in torch.jit.load(str(run_dir / "model.ts")).parameters())


# ----------------------------------------------------------------------------------------------
# Workloads

# Points already measured in this run, so that `scaling` reuses the workloads' points.
MEASURED: dict[tuple, tuple] = {}


def memo(fn):
    def wrapped(work, run_dir, *args, with_ref: bool = True, **kw):
        key = (fn.__name__, run_dir.name, *args, *kw.items())
        done = MEASURED.get(key)
        if done is None or (with_ref and np.isnan(done[1])):
            MEASURED[key] = done = fn(work, run_dir, *args, with_ref=with_ref, **kw)
        return done
    return wrapped


@memo
def icr_point(work: Path, run_dir: Path, data: Path, n: int, repeat: int, with_ref: bool = True,
              precision: str = "fp32"):
    """Per-checkpoint ICR seconds (steady state, best of `repeat`) and peak RSS of each side
    (the reference always in float32)."""
    cfg = write_config(work / f"icr_{run_dir.name}_{n}_{precision}.yaml", run_dir, data,
                       f"icr: {{samples: {n}, batch_size: 256, sigma: 0.5}}\npfd: {{enabled: false}}\n"
                       # ICR alone: `confirm: auto` would add the memorization ratio's PF-ODE.
                       "early_stop: {confirm: none}\n"
                       f"evaluation: {{precision: {precision}}}\n")
    ckpts = sorted(run_dir.glob("ckpt_*.pt"))[-3:]
    ours, refs, ours_rss, ref_rss = [], [], 0.0, 0.0
    for _ in range(repeat):
        p = diffmon("eval", "--config", cfg, *ckpts, "--json")
        ours += steady([r["seconds"] for r in p.json_lines()])
        ours_rss = max(ours_rss, p.rss_mib)
        if with_ref:
            p = reference("icr", run_dir / "model.ts", data, *ckpts, "--n", n)
            refs += steady(p.json_lines()[0]["seconds"])
            ref_rss = max(ref_rss, p.rss_mib)
    return min(ours), (min(refs) if refs else float("nan")), ours_rss, ref_rss


def bench_icr(work: Path, repeat: int, quick: bool) -> list[dict]:
    toy = toy_run(work)
    wide = wide_run(work)
    wide_data = images_h5(work / "wide_train.h5", 1024, (3, 32, 32))
    rows = []
    for n in ((256,) if quick else (1024, 4096)):
        o, r, orss, rrss = icr_point(work, toy, toy / "train.h5", n, repeat if n <= 1024 else 1)
        rows.append(row(f"ICR per checkpoint, toy, n = {n}", o, r, orss, rrss, "ratio ≥ 1",
                        **bound("toy", 2 * n, o)))
    n = 128 if quick else 1024
    o, r, orss, rrss = icr_point(work, wide, wide_data, n, 1)
    rows.append(row(f"ICR per checkpoint, wider U-Net, n = {n}", o, r, orss, rrss, "ratio ≥ 1",
                    **bound("wide", 2 * n, o)))
    # evaluation.precision: bf16 on this CPU, against diffmon's own fp32 of the row above.
    b, _, brss, _ = icr_point(work, wide, wide_data, n, 1, with_ref=False, precision="bf16")
    rows.append(row(f"ICR per checkpoint, wider U-Net, n = {n}, bf16 (against diffmon fp32)", b, o,
                    brss, orss, "ratio ≥ 1", **bound("wide", 2 * n, b)))
    rows.append(icr_linalg(work, repeat))
    return rows


def icr_linalg(work: Path, repeat: int) -> dict:
    """ICR's moments and linear algebra alone, d = 512, n = 4096: `diffmon icr-features` (its
    `seconds` field, without reading the file) vs the same math in PyTorch float64."""
    n, d = 4096, 512
    feats = work / "feat512.h5"
    if not feats.exists():
        rng = np.random.default_rng(0)
        s = rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) / np.sqrt(d)
        with h5py.File(feats, "w") as f:
            f["h1"], f["h2"] = s + rng.normal(size=(n, d)), s + rng.normal(size=(n, d))
    ours, refs, orss, rrss = [], [], 0.0, 0.0
    for _ in range(repeat):
        p = diffmon("icr-features", "--input", feats)
        ours.append(json.loads(p.out)["seconds"])
        q = reference("linalg", feats)
        refs.append(min(q.json_lines()[0]["seconds"]))
        orss, rrss = max(orss, p.rss_mib), max(rrss, q.rss_mib)
    return row(f"ICR moments + linear algebra, d = {d}, n = {n}", min(ours), min(refs), orss, rrss,
               "< 0.2 s")


@memo
def pfd_point(work: Path, run_dir: Path, data: Path, m: int, shape: tuple, ckpts: tuple[Path, ...],
              with_ref: bool = True, batch: int = 256):
    """Per-checkpoint PFD seconds: diffmon evaluates ckpts[0] first (which builds the teacher and
    empirical caches; dropped), then the rest; the reference runs the naive protocol on the rest."""
    cfg = write_config(work / f"pfd_{run_dir.name}_{m}.yaml", run_dir, data,
                       f"icr: {{enabled: false}}\nearly_stop: {{metric: pfd_generalization}}\n"
                       f"pfd: {{enabled: true, teacher: {run_dir / 'teacher.ts'}, samples: {m}, "
                       f"batch_size: {batch}}}\n")
    p = diffmon("eval", "--config", cfg, *ckpts, "--json")
    ours = min(steady([r["seconds"] for r in p.json_lines()]))
    ref, ref_rss = float("nan"), 0.0
    if with_ref:
        q = reference("pfd", run_dir / "model.ts", run_dir / "teacher.ts", *ckpts[1:], "--m", m,
                      "--shape", ",".join(map(str, shape)), "--batch", batch)
        ref, ref_rss = min(q.json_lines()[0]["seconds"]), q.rss_mib
    return ours, ref, p.rss_mib, ref_rss


def bench_pfd(work: Path, repeat: int, quick: bool) -> list[dict]:
    toy, wide = toy_run(work), wide_run(work)
    toy_ckpts = tuple(toy / f"ckpt_{s:06d}.pt" for s in (100, 150))
    rows = []
    for m in ((256,) if quick else (1000, 10_000)):
        o, r, orss, rrss = pfd_point(work, toy, toy / "train.h5", m, (1, 16, 16), toy_ckpts)
        rows.append(row(f"PFD per checkpoint, toy, M = {m}", o, r, orss, rrss, "ratio ≥ 1.8",
                        **bound("toy", m * EVALS, o)))
    m = 16 if quick else 128
    wide_data = images_h5(work / "wide_train.h5", 1024, (3, 32, 32))
    o, r, orss, rrss = pfd_point(work, wide, wide_data, m, (3, 32, 32),
                                 tuple(sorted(wide.glob("ckpt_*.pt"))[:2]), batch=128)
    rows.append(row(f"PFD per checkpoint, wider U-Net, M = {m}", o, r, orss, rrss, "ratio ≥ 1.8",
                    **bound("wide", m * EVALS, o)))
    return rows


def bench_empirical(work: Path, repeat: int, quick: bool) -> list[dict]:
    shape, m_lat = (3, 32, 32), 256
    rows = []
    gflops_mm = matmul_gflops(torch.float64, m_lat, (1024 if quick else 4096), int(np.prod(shape)))
    for n in ((1024,) if quick else (4096, 16_384)):
        data = images_h5(work / f"emp_{n}.h5", n, shape)
        latents = work / "emp_latents.h5"
        if not latents.exists():
            with h5py.File(latents, "w") as f:
                f["latents"] = np.random.default_rng(2).normal(size=(m_lat, *shape)).astype(np.float32)
        args = ["sample", "--model", "empirical", "--data", data, "--latents", latents,
                "--out", work / "emp_out.h5", "--device", "cpu", "--batch-size", m_lat,
                "--steps", STEPS]
        best = min((diffmon(*args) for _ in range(max(1, repeat - 1))), key=lambda p: p.wall)
        rate = m_lat * EVALS / best.wall
        # The naive numpy denoiser: a few queries, one evaluation each (it is slow).
        q = reference("empirical", data, "--queries", 16 if n > 4096 else 32, "--evals", 1)
        d = int(np.prod(shape))
        gflops = 2 * (2 * m_lat * n * d) * EVALS / best.wall / 1e9  # two B·N·D products per eval
        rows.append(row(f"E_mem empirical flow, N = {n}, M = {m_lat}", rate, q.json_lines()[0]["rate"],
                        best.rss_mib, q.rss_mib, "ratio ≥ 5; ≥ 50% of mm GFLOP/s",
                        unit="img·eval/s", higher_is_better=True, gflops=gflops,
                        mm_gflops=gflops_mm, gflops_fraction=gflops / gflops_mm))
    return rows


def bench_load(work: Path, repeat: int, quick: bool) -> list[dict]:
    from train_toy import ToyDenoiser

    width = 64 if quick else 400  # 306·w² ≈ 49 M parameters at w = 400
    big = model_run(work, "big", lambda: ToyDenoiser(1, width), "mid", (1, 16, 16), 3,
                    suffixes=(".pt", ".safetensors"))
    data = images_h5(work / "big_train.h5", 8, (1, 16, 16))
    n_params = params(big)
    cfg = write_config(work / "load.yaml", big, data, "icr: {samples: 2, batch_size: 2}\npfd: {enabled: false}\n"
                       "early_stop: {confirm: none}\n")
    rows = []
    for suffix, what in ((".pt", "torch.save zip"), (".safetensors", "safetensors")):
        ckpts = sorted(big.glob(f"ckpt_*{suffix}"))
        ours, refs, orss, rrss = [], [], 0.0, 0.0
        for _ in range(repeat):
            # The `load` stage of each evaluation (read, check, copy into the architecture),
            # from the evaluator's debug log; ICR runs on two pairs only, to satisfy the config.
            p = diffmon("eval", "--config", cfg, *ckpts, "--json", log="diffmon::eval=debug")
            ours += steady([float(t) for t in re.findall(r'\("load", ([0-9.e-]+)\)', p.err)])
            q = reference("load", big / "model.ts", *ckpts)
            refs += steady(q.json_lines()[0]["seconds"])
            orss, rrss = max(orss, p.rss_mib), max(rrss, q.rss_mib)
        rows.append(row(f"checkpoint load + swap, {n_params / 1e6:.0f} M params, {what}",
                        min(ours), min(refs), orss, rrss, "—", params=n_params,
                        file_mib=ckpts[0].stat().st_size / 2**20))
    return rows


# ----------------------------------------------------------------------------------------------
# The daemon: latency and idle cost

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    """A webhook receiver on loopback that notes when each request arrived."""

    def __init__(self):
        self.arrivals: list[tuple[float, dict]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.arrivals.append((time.perf_counter(), json.loads(body or b"{}")))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


class Daemon:
    """`diffmon watch` over `run_dir`, with a fresh state folder."""

    def __init__(self, work: Path, run_dir: Path, extra: str, env: dict | None = None,
                 threads: int = THREADS):
        self.run_dir = run_dir
        self.port = free_port()
        self.cfg = write_config(work / f"watch-{run_dir.name}.yaml", run_dir, run_dir / "train.h5",
                                f"http: {{listen: '127.0.0.1:{self.port}'}}\n{extra}", threads)
        shutil.rmtree(self.cfg.with_suffix(".state"), ignore_errors=True)
        self.log = open(work / f"watch-{run_dir.name}.log", "w")
        self.proc = subprocess.Popen([str(BIN), "watch", "--config", str(self.cfg)],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "DIFFMON_LOG": "info", **(env or {})})
        deadline = time.time() + 120
        while self.get("/healthz") is None:
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"diffmon watch did not start: see {self.log.name}")
            time.sleep(0.05)

    def get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return None

    def metric(self, name: str, labels: str = "") -> float | None:
        text = self.get("/metrics") or ""
        m = re.search(rf"^{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> tuple[float, float]:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kib = lambda k: int(re.search(rf"^{k}:\s+(\d+) kB", status, re.M).group(1))
        return kib("VmRSS") / 1024, kib("VmHWM") / 1024

    def idle(self, seconds: float) -> float:
        c0, t0 = self.cpu_seconds(), time.perf_counter()
        time.sleep(seconds)
        return (self.cpu_seconds() - c0) / (time.perf_counter() - t0)

    def evaluate(self, src: Path, step: int, poll_s: float) -> tuple[float, float, float]:
        """Renames a copy of `src` into the run folder as step `step` and polls `/metrics` every
        `poll_s` until the step is evaluated: (rename time, visible time, the evaluation's own
        seconds from the duration histogram)."""
        total = lambda: self.metric("diffmon_evaluation_duration_seconds_sum", 'stage="total"') or 0.0
        before = total()
        t0 = place(src, self.run_dir / f"ckpt_{step}.pt")
        while (self.metric("diffmon_last_evaluated_step") or 0) < step:
            if time.perf_counter() > t0 + 120:
                raise SystemExit(f"step {step} not evaluated: see {self.log.name}")
            time.sleep(poll_s)
        return t0, time.perf_counter(), total() - before

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def place(src: Path, dst: Path) -> float:
    """Copies `src` to a temporary name beside `dst`, then renames it into place; the time of
    the rename."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copy(src, tmp)
    t = time.perf_counter()
    os.replace(tmp, dst)
    return t


def watched_run(work: Path, name: str) -> Path:
    """A fresh run folder holding the toy run's architecture and data, without checkpoints."""
    toy = toy_run(work)
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir()
    for f in ("model.ts", "train.h5"):
        shutil.copy(toy / f, run_dir / f)
    return run_dir


def bench_daemon(work: Path, repeat: int, quick: bool) -> list[dict]:
    """Latency (rename → /metrics; deciding evaluation → webhook) and idle cost, one daemon."""
    toy, run_dir = toy_run(work), watched_run(work, "watched")
    icr_cfg = "icr: {samples: 256, batch_size: 256, sigma: 0.5}\n"
    # Which toy checkpoint has the higher ICR, with the daemon's settings: five checkpoints
    # placed high, low, low, high, high make the detector (window 1, warmup 2, patience 2,
    # min_rise half the difference) fire on the fifth (as tests/integration/early_stop.rs).
    cfg = write_config(work / "probe.yaml", run_dir, run_dir / "train.h5", icr_cfg)
    a, b = toy / "ckpt_000050.pt", toy / "ckpt_000200.pt"
    ia, ib = (r["icr"] for r in diffmon("eval", "--config", cfg, a, b, "--json").json_lines())
    hi, lo = (a, b) if ia > ib else (b, a)
    rise = max(ia, ib) / min(ia, ib) - 1
    receiver = Receiver()
    daemon = Daemon(work, run_dir, icr_cfg + (
        f"early_stop: {{window: 1, warmup: 2, patience: 2, min_rise: {rise / 2}, confirm: none}}\n"
        f"alerts: {{webhooks: [{{url: 'http://127.0.0.1:{receiver.port}/hook'}}]}}\n"))
    try:
        time.sleep(2)
        idle_cpu_fresh = daemon.idle(5 if quick else 30)
        rss_fresh = daemon.rss_mib()[0]
        visible, webhook = [], None
        for step, src in enumerate((hi, lo, lo, hi, hi), start=1):
            t0, t1, eval_s = daemon.evaluate(src, step, poll_s=0.002)
            visible.append((t1 - t0, eval_s))
            if step == 5:
                while not receiver.arrivals and time.perf_counter() < t1 + 30:
                    time.sleep(0.001)
                if receiver.arrivals:
                    t2, event = receiver.arrivals[0]
                    webhook = (t2 - t0 - eval_s, t2 - t1, event.get("event"))
        idle_cpu_after = daemon.idle(5 if quick else 30)
        rss_after, rss_peak = daemon.rss_mib()
    finally:
        daemon.stop()
        receiver.close()
    if webhook is None or webhook[2] != "early_stop":
        raise SystemExit(f"the early-stop webhook did not arrive: see {daemon.log.name}")
    # Rename → visible, less the evaluation itself: the detection (inotify), queueing and
    # publication overhead, an upper bound on "visible after the evaluation ended".
    after_eval = [total - e for total, e in visible]
    return [
        {"workload": "metrics visible after the evaluation ends (rename → /metrics − evaluation)",
         "unit": "s", "diffmon": max(after_eval), "median": float(np.median(after_eval)),
         "samples": len(after_eval), "rename_to_visible": [round(t, 4) for t, _ in visible],
         "evaluation": [round(e, 4) for _, e in visible], "target": "≤ 1 s"},
        {"workload": "webhook received after the deciding evaluation ends",
         "unit": "s", "diffmon": webhook[0], "after_metrics_visible": webhook[1], "target": "—"},
        {"workload": "idle CPU share (no checkpoint yet)", "unit": "%", "diffmon": 100 * idle_cpu_fresh,
         "diffmon_rss_mib": rss_fresh, "target": "< 1%"},
        {"workload": "idle CPU share (after evaluations)", "unit": "%", "diffmon": 100 * idle_cpu_after,
         "diffmon_rss_mib": rss_after, "peak_rss_mib": rss_peak, "target": "< 1%"},
    ]


class Load:
    """A bounded load on loopback from worker threads of this process: `rate` GET requests per
    second spread over `paths`, until stopped. Notes each request's latency and outcome."""

    def __init__(self, port: int, paths: list[str], rate: float, workers: int = 8):
        import queue

        self.results: list[tuple[str, float, bool]] = []
        self.todo: queue.Queue = queue.Queue()
        self.stopped = threading.Event()
        self.port, self.paths, self.rate = port, paths, rate
        self.threads = [threading.Thread(target=self.worker, daemon=True) for _ in range(workers)]
        self.threads.append(threading.Thread(target=self.schedule, daemon=True))
        for t in self.threads:
            t.start()

    def schedule(self):
        start, k = time.perf_counter(), 0
        while not self.stopped.is_set():
            due = start + k / self.rate
            time.sleep(max(0.0, due - time.perf_counter()))
            self.todo.put(self.paths[k % len(self.paths)])
            k += 1

    def worker(self):
        while not self.stopped.is_set():
            try:
                path = self.todo.get(timeout=0.1)
            except Exception:
                continue
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                    ok = r.status == 200 and len(r.read()) > 0
            except OSError:
                ok = False
            self.results.append((path, time.perf_counter() - t0, ok))

    def stop(self) -> list[tuple[str, float, bool]]:
        self.stopped.set()
        for t in self.threads:
            t.join()
        return self.results


def latency_stats(results: list[tuple[str, float, bool]]) -> dict:
    """Per path: requests, errors, and p50/p99 latency (ms) of the successful ones."""
    out = {}
    for path in sorted({r[0] for r in results}):
        mine = [r for r in results if r[0] == path]
        lat = np.array([r[1] for r in mine if r[2]])
        out[path] = {"requests": len(mine), "errors": sum(1 for r in mine if not r[2]),
                     "p50_ms": 1e3 * float(np.percentile(lat, 50)) if len(lat) else None,
                     "p99_ms": 1e3 * float(np.percentile(lat, 99)) if len(lat) else None}
    return out


def bench_http_load(work: Path, repeat: int, quick: bool) -> list[dict]:
    """`/metrics` and `/` under 200 requests/s from worker threads while checkpoints are
    evaluated: latency percentiles, errors, and the evaluation time with and without the load."""
    toy, run_dir = toy_run(work), watched_run(work, "loaded")
    n, phase_s = (256, 1.0) if quick else (1024, 15.0)
    daemon = Daemon(work, run_dir, f"icr: {{samples: {n}, batch_size: 256, sigma: 0.5}}\n")
    ckpts = sorted(toy.glob("ckpt_*.pt"))
    step = 0

    def evaluate_one() -> float:
        nonlocal step
        step += 1
        return daemon.evaluate(ckpts[step % len(ckpts)], step, poll_s=0.01)[2]

    try:
        evaluate_one()  # warm-up
        quiet, loaded, load_s, results = [], [], 0.0, []
        # Two loaded phases of `phase_s` each (30 s in all), each followed by a quiet phase of
        # as many evaluations, so a slow spell of the machine hits both alike.
        for _ in range(2):
            load = Load(daemon.port, ["/metrics", "/"], 200.0)
            t0, k = time.perf_counter(), len(loaded)
            while time.perf_counter() - t0 < phase_s:
                loaded.append(evaluate_one())
            load_s += time.perf_counter() - t0
            results += load.stop()
            quiet += [evaluate_one() for _ in range(len(loaded) - k)]
        stats = latency_stats(results)
    finally:
        daemon.stop()
    rows = [{"workload": f"HTTP load: GET {path} at 100/s (200/s in all) during evaluations",
             "unit": "ms", "diffmon": st["p50_ms"], "p99_ms": st["p99_ms"],
             "requests": st["requests"], "errors": st["errors"], "target": "no errors"}
            for path, st in stats.items()]
    q, l = float(np.median(quiet)), float(np.median(loaded))
    rows.append({"workload": f"evaluation time (ICR n = {n}) under that load vs quiet", "unit": "s",
                 "diffmon": l, "reference": q, "ratio": q / l, "load_seconds": load_s,
                 "quiet": quiet, "loaded": loaded, "target": "≤ 10% slower"})
    return rows


# ----------------------------------------------------------------------------------------------
# Scale-out: the Slurm executor on a real single-node cluster

def _sbin(name: str) -> str | None:
    for d in ("/usr/sbin", "/sbin"):
        if os.path.isfile(f"{d}/{name}"):
            return f"{d}/{name}"
    return shutil.which(name)


class SlurmCluster:
    """A single-node Slurm cluster in a temporary folder, as tests/integration/slurm_cluster.rs
    starts it: `munged` with its own key and socket, `slurmctld` and `slurmd` from a generated
    slurm.conf (this host as the node with the CPUs `slurmd -C` reports, free ports, no
    accounting). Commands reach it through `SLURM_CONF` (`self.env`). `stop()` cancels its jobs
    and stops its daemons."""

    BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")

    def __init__(self):
        missing = [b for b in self.BINARIES if _sbin(b) is None]
        if missing:
            raise SystemExit(f"the slurm workload needs {missing} (Debian's slurm-wlm and munge)")
        self.dir = Path(tempfile.mkdtemp(prefix="diffmon-bench-slurm-"))
        self.dir.chmod(0o755)  # munged wants every folder above its socket searchable by all
        self.procs: list[subprocess.Popen] = []
        self.conf = self.dir / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self):
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        node = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
        hw = dict(w.split("=", 1) for w in subprocess.run([_sbin("slurmd"), "-C"], capture_output=True,
                                                           text=True).stdout.split() if "=" in w)
        self.cpus = int(hw.get("CPUs", "1"))
        self.conf.write_text(
            f"ClusterName=diffmonbench\nSlurmctldHost={node}\nSlurmctldPort={free_port()}\n"
            f"SlurmdPort={free_port()}\nSlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
            f"AuthInfo=socket={d / 'munge.sock'}\nCredType=cred/munge\nStateSaveLocation={d / 'state'}\n"
            f"SlurmdSpoolDir={d / 'spool'}\nSlurmctldPidFile={d / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={d / 'slurmd.pid'}\nSlurmctldLogFile={d / 'slurmctld.log'}\n"
            f"SlurmdLogFile={d / 'slurmd.log'}\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSchedulerType=sched/backfill\n"
            "MpiDefault=none\nReturnToService=2\nMinJobAge=60\nSlurmdTimeout=300\n"
            "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            f"NodeName={node} CPUs={self.cpus} RealMemory={hw.get('RealMemory', '1024')} State=UNKNOWN\n"
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP\n")
        self._spawn("munged", "-F", f"--key-file={key}", f"--socket={d / 'munge.sock'}",
                    f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                    f"--seed-file={d / 'munged.seed'}")
        self._wait(20, "munged's socket", lambda: (d / "munge.sock").exists())
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-f", str(self.conf))
        self._wait(60, "the node to be idle", lambda: self.command("sinfo", "-h", "-o", "%t") == "idle")

    def _spawn(self, name: str, *args: str):
        with open(self.dir / f"{name}.out", "w") as log:
            self.procs.append(subprocess.Popen([_sbin(name), *args], stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, env={**os.environ, **self.env}))

    def _wait(self, seconds: float, what: str, cond):
        deadline = time.time() + seconds
        while not cond():
            if time.time() > deadline or any(p.poll() is not None for p in self.procs):
                raise SystemExit(f"Slurm cluster: no {what}; logs in {self.dir}")
            time.sleep(0.25)

    def command(self, name: str, *args: str) -> str:
        p = subprocess.run([_sbin(name), *args], capture_output=True, text=True,
                           env={**os.environ, **self.env})
        return p.stdout.strip()

    def stop(self):
        """Cancels every job, waits for the queue to empty, then stops slurmd, slurmctld and
        munged (SIGTERM, SIGKILL after 10 s) and removes the folder."""
        if len(self.procs) == 3:
            self.command("scancel", "--full", "-u", "root")
            deadline = time.time() + 20
            while self.command("squeue", "-h") and time.time() < deadline:
                time.sleep(0.25)
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)


def history(state_dir: Path) -> list[dict]:
    path = state_dir / "history.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _numbers(value, skip=("seconds", "stages", "checkpoint")):
    """The numbers of a record, flattened, without its timings and its path."""
    if isinstance(value, dict):
        return [(f"{k}.{kk}", x) for k, v in sorted(value.items()) if k not in skip
                for kk, x in _numbers(v, ())]
    if isinstance(value, list):
        return [(f"{i}.{kk}", x) for i, v in enumerate(value) for kk, x in _numbers(v, ())]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return [("", value)]
    return [("", float(value))]


def same_records(a: list[dict], b: list[dict]) -> str | None:
    """None when the two histories hold the same outcomes in the same order (numbers to 1e-12
    relative, timings and paths aside); else the first difference."""
    if len(a) != len(b):
        return f"{len(a)} entries against {len(b)}"
    for i, (ea, eb) in enumerate(zip(a, b)):
        if ea.get("kind") != eb.get("kind"):
            return f"entry {i}: {ea.get('kind')} against {eb.get('kind')}"
        na, nb = _numbers(ea.get("record", {})), _numbers(eb.get("record", {}))
        if [k for k, _ in na] != [k for k, _ in nb]:
            return f"entry {i}: different fields"
        for (k, x), (_, y) in zip(na, nb):  # the record's step is among the numbers
            if isinstance(x, float) and isinstance(y, float):
                if not (x == y or (np.isnan(x) and np.isnan(y)) or abs(x - y) <= 1e-12 * max(abs(x), abs(y))):
                    return f"entry {i}: {k} = {x} against {y}"
            elif x != y:
                return f"entry {i}: {k} = {x!r} against {y!r}"
    return None


def bench_slurm(work: Path, repeat: int, quick: bool) -> list[dict]:
    """Checkpoints arriving faster than one evaluator can handle: all of a toy run's checkpoints
    are present when `diffmon watch` starts. Checkpoints per minute until every one is in the
    history, with the local executor (the reference, run first and last) and with the Slurm
    executor on a real single-node cluster at k = `evaluation.max_in_flight` in {1, 2, 4}; each
    Slurm history must equal the local one (numbers to 1e-12 relative)."""
    missing = [b for b in SlurmCluster.BINARIES if _sbin(b) is None]
    if missing or os.geteuid() != 0:
        print(f"SKIPPED slurm: it needs {missing or 'root'} (Debian's slurm-wlm and munge, as root)",
              file=sys.stderr)
        return []
    toy = toy_run(work)
    n_ckpts, n_icr, m_pfd = (6, 256, 64) if quick else (10, 512, 250)
    sources = sorted(toy.glob("ckpt_*.pt"))
    evals = (f"icr: {{samples: {n_icr}, batch_size: 256, sigma: 0.5}}\n"
             f"pfd: {{enabled: true, teacher: {toy / 'teacher.ts'}, samples: {m_pfd}}}\n"
             "checkpoints: {settle_secs: 0.2}\n")

    def measure_run(name: str, extra: str, env: dict | None = None) -> dict:
        run_dir = watched_run(work, name)
        for i in range(n_ckpts):  # the toy run's checkpoints, in turn, as steps 1..n
            shutil.copy(sources[i % len(sources)], run_dir / f"ckpt_{i + 1:06d}.pt")
        t0 = time.perf_counter()
        daemon = Daemon(work, run_dir, evals + extra, env=env, threads=1)
        state = daemon.cfg.with_suffix(".state")
        first = None
        try:
            while True:
                done = history(state)
                if done and first is None:
                    first = time.perf_counter()
                if len(done) >= n_ckpts:
                    break
                if daemon.proc.poll() is not None or time.perf_counter() > t0 + 900:
                    raise SystemExit(f"{name}: {len(done)} of {n_ckpts} recorded; see {daemon.log.name}")
                time.sleep(0.1)
            t1 = time.perf_counter()
            hist = history(state)
            metrics = {}
            for h in ("queue_wait", "run"):
                s = daemon.metric(f"diffmon_slurm_{h}_seconds_sum")
                c = daemon.metric(f"diffmon_slurm_{h}_seconds_count")
                metrics[f"mean_{h}_s"] = s / c if s is not None and c else None
        finally:
            daemon.stop()
        bad = [e for e in hist if e.get("kind") != "evaluation"]
        if bad:
            raise SystemExit(f"{name}: not evaluations: {bad[:2]}")
        return {"wall_s": t1 - t0, "per_min": 60 * n_ckpts / (t1 - t0),
                "after_first_per_min": 60 * (n_ckpts - 1) / (t1 - first) if t1 > first else None,
                "history": hist, **metrics}

    local = [measure_run("slurm-local", "")]
    cluster = SlurmCluster()
    slurm = {}
    try:
        for k in (1, 2, 4):
            slurm[k] = measure_run(f"slurm-k{k}", f"evaluation: {{executor: slurm, max_in_flight: {k}, "
                                                  f"slurm: {{poll_secs: 0.5}}}}\n", cluster.env)
            diff = same_records(slurm[k]["history"], local[0]["history"])
            if diff:
                raise SystemExit(f"Slurm k = {k}: the history differs from the local one: {diff}")
    finally:
        cluster.stop()
    if not quick:
        local.append(measure_run("slurm-local", ""))
    ref = float(np.mean([r["per_min"] for r in local]))
    load = os.getloadavg()[0]
    what = f"{n_ckpts} toy checkpoints, ICR n = {n_icr} + PFD M = {m_pfd}, cpu_threads 1"
    rows = [{"workload": f"local executor: checkpoints per minute ({what})", "unit": "ckpt/min",
             "diffmon": ref, "runs": [r["per_min"] for r in local],
             "after_first_per_min": [r["after_first_per_min"] for r in local],
             "wall_s": [r["wall_s"] for r in local], "target": "—"}]
    for k, r in slurm.items():
        rows.append({"workload": f"Slurm executor, max_in_flight = {k}: checkpoints per minute", "unit": "ckpt/min",
                     "diffmon": r["per_min"], "reference": ref, "ratio": r["per_min"] / ref,
                     "after_first_per_min": r["after_first_per_min"], "wall_s": r["wall_s"],
                     "mean_queue_wait_s": r["mean_queue_wait_s"], "mean_run_s": r["mean_run_s"],
                     "node_cpus": cluster.cpus, "loadavg_1min": load, "same_records": True,
                     "target": "ratio > 1 when k > 1"})
    return rows


# ----------------------------------------------------------------------------------------------
# Scaling and the machine's limits

def bench_scaling(work: Path, repeat: int, quick: bool) -> list[dict]:
    toy = toy_run(work)
    rows = []
    for n in ((128, 256) if quick else (512, 1024, 2048, 4096)):
        o, _, orss, _ = icr_point(work, toy, toy / "train.h5", n, repeat if n <= 1024 else 1,
                                     with_ref=False)
        rows.append({"workload": "scaling: ICR per checkpoint, toy", "n": n, "unit": "s",
                     "diffmon": o, "diffmon_rss_mib": orss, "per_pair_ms": 1e3 * o / n,
                     **bound("toy", 2 * n, o)})
    ckpts = tuple(toy / f"ckpt_{s:06d}.pt" for s in (100, 150))
    for m in ((64, 128) if quick else (250, 1000, 2500, 10_000)):
        o, _, orss, _ = pfd_point(work, toy, toy / "train.h5", m, (1, 16, 16), ckpts, with_ref=False)
        rows.append({"workload": "scaling: PFD per checkpoint, toy", "M": m, "unit": "s",
                     "diffmon": o, "diffmon_rss_mib": orss, "per_latent_ms": 1e3 * o / m,
                     **bound("toy", m * EVALS, o)})
    return rows


def bench_batch(work: Path, repeat: int, quick: bool) -> list[dict]:
    """diffmon's PF-ODE batch size (`pfd.batch_size`) against time per checkpoint, toy model."""
    toy = toy_run(work)
    ckpts = tuple(toy / f"ckpt_{s:06d}.pt" for s in (100, 150))
    m = 128 if quick else 1000
    rows = []
    for batch in (64, 256, 1024):
        o, _, orss, _ = pfd_point(work, toy, toy / "train.h5", m, (1, 16, 16), ckpts,
                                  with_ref=False, batch=batch)
        rows.append({"workload": f"PF-ODE batch size {batch}: PFD per checkpoint, toy", "M": m,
                     "unit": "s", "diffmon": o, "diffmon_rss_mib": orss,
                     **bound("toy", m * EVALS, o)})
    return rows


def matmul_gflops(dtype, m: int, n: int, d: int) -> float:
    """libtorch's own rate for the empirical flow's two products ([m,d]·[d,n] and [m,n]·[n,d])."""
    torch.set_num_threads(THREADS)
    a, b, w = torch.randn(m, d, dtype=dtype), torch.randn(n, d, dtype=dtype), torch.randn(m, n, dtype=dtype)
    a.mm(b.T), w.mm(b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a.mm(b.T), w.mm(b)
        best = min(best, time.perf_counter() - t0)
    return 2 * (2 * m * n * d) / best / 1e9


def bench_limits(work: Path, repeat: int, quick: bool) -> list[dict]:
    toy, wide = toy_run(work), wide_run(work)
    rows = [{"workload": f"libtorch matrix multiply, {name}", "unit": "GFLOP/s",
             "diffmon": matmul_gflops(dt, 256, 4096, 3072)}
            for name, dt in (("float32", torch.float32), ("float64", torch.float64))]
    from torch.utils.flop_counter import FlopCounterMode
    from train_toy import ToyDenoiser

    for name, module, shape in (("toy", ToyDenoiser(1, 32), (1, 16, 16)),
                                ("wide", _wide_unet(32), (3, 32, 32))):
        with FlopCounterMode(display=False) as counter:
            module.eval()(torch.randn(1, *shape), torch.ones(1))
        FLOPS_PER_IMAGE[name] = counter.get_total_flops()
    for run_dir, shape, batch in ((toy, "1,16,16", 256), (wide, "3,32,32", 128)):
        q = reference("forward", run_dir / "model.ts", "--shape", shape, "--batch", batch,
                      "--evals", 4 if quick else 20)
        rate = q.json_lines()[0]["rate"]
        FORWARD_RATE[run_dir.name] = rate
        gflop = FLOPS_PER_IMAGE[run_dir.name] / 1e9
        rows.append({"workload": f"bare forward, {run_dir.name} ({params(run_dir) / 1e6:.2f} M params, "
                                 f"{gflop:.3f} GFLOP/img), batch {batch} (PyTorch)", "unit": "img/s",
                     "diffmon": rate, "network_gflops": rate * gflop})
    return rows


# ----------------------------------------------------------------------------------------------
# The compiled network (model.compiled): an AOTInductor package beside TorchScript


def compiled_export(work: Path, name: str, build, feature: str, shape: tuple, precision: str) -> Path:
    """`build()`'s network (the same class and names as a run's architecture, so the run's
    checkpoints fit it) exported with `diffmon-export`'s compile step for this CPU at
    `precision`, into its own folder: model.ts, model.pt2 and its sidecar (compile seconds)."""
    from diffmon import export

    out = work / f"compiled-{name}-{precision}"
    if not (out / "model.pt2.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        export(build().eval(), feature, out / "model.ts", example_shape=(1, *shape),
               compile={"precision": precision}, verbose=False)
    return out


def bench_compiled(work: Path, repeat: int, quick: bool):
    """ICR per checkpoint with the compiled package (`model.compiled` naming it) against
    TorchScript at the same precision, on the same checkpoints and draws; the package's compile
    time and size; each network's GFLOP/s against this CPU's fp32 FMA peak. Rows come as they
    are measured; bf16 runs once, at n = 256 for the wider U-Net (TorchScript's bf16 autocast is
    slow on a CPU without AVX-512 BF16: minutes a checkpoint)."""
    from train_toy import FEATURE_LAYER, ToyDenoiser

    toy, wide = toy_run(work), wide_run(work)
    wide_data = images_h5(work / "wide_train.h5", 1024, (3, 32, 32))
    nets = [("toy", toy, toy / "train.h5", lambda: ToyDenoiser(1, 32), FEATURE_LAYER, (1, 16, 16)),
            ("wide", wide, wide_data, lambda: _wide_unet(32), "mid2", (3, 32, 32))]
    peak = fma_peak_gflops()
    for name, run_dir, data, build, feature, shape in nets:
        for precision in ("fp32", "bf16"):
            # The wider U-Net's bf16 TorchScript took over 13 min for 3 checkpoints at n = 1024.
            n = 128 if quick else 256 if (name, precision) == ("wide", "bf16") else 1024
            out = compiled_export(work, name, build, feature, shape, precision)
            side = json.loads((out / "model.pt2.json").read_text())
            yield {"workload": f"compile the package, {name}, {precision} (torch.export and "
                               "AOTInductor; the sidecar's compile_seconds)",
                   "unit": "s", "diffmon": side["compile_seconds"],
                   "package_mib": (out / "model.pt2").stat().st_size / 2**20,
                   "torchscript_mib": (out / "model.ts").stat().st_size / 2**20}
            times = repeat if precision == "fp32" else 1
            ts, _, ts_rss, _ = icr_point(work, run_dir, data, n, times, with_ref=False,
                                         precision=precision)
            c, c_rss, icrs = compiled_icr(work, run_dir, out, data, n, times, precision)
            extra = bound(name, 2 * n, c)
            if "network_gflops" in extra and peak:
                extra["of_fma_peak"] = extra["network_gflops"] / peak
            yield row(f"ICR per checkpoint, {name}, n = {n}, compiled {precision} (against "
                      f"TorchScript {precision})", c, ts, c_rss, ts_rss, "ratio ≥ 1",
                      fma_peak_gflops=peak, **icrs, **extra)


def compiled_icr(work: Path, run_dir: Path, out: Path, data: Path, n: int, repeat: int,
                 precision: str) -> tuple[float, float, dict]:
    """Steady-state seconds per checkpoint (best of `repeat`) and peak RSS of `diffmon eval` with
    the package, and its ICR against TorchScript's on the same checkpoints and draws."""
    extra = (f"icr: {{samples: {n}, batch_size: 256, sigma: 0.5}}\npfd: {{enabled: false}}\n"
             f"early_stop: {{confirm: none}}\nevaluation: {{precision: {precision}}}\n")
    cfgs = {}
    for fmt_, compiled in (("compiled", out / "model.pt2"), ("torchscript", "off")):
        cfgs[fmt_] = write_config(work / f"icr_{out.name}_{fmt_}_{n}.yaml", run_dir, data, extra,
                                  model=f"architecture: {out / 'model.ts'}, compiled: {compiled}")
    ckpts = sorted(run_dir.glob("ckpt_*.pt"))[-3:]
    times, rss, icr = [], 0.0, {}
    for _ in range(repeat):
        p = diffmon("eval", "--config", cfgs["compiled"], *ckpts, "--json", log="info")
        if "network=compiled package" not in p.err:
            raise RuntimeError(f"the package did not run:\n{p.err[-2000:]}")
        recs = p.json_lines()
        times += steady([r["seconds"] for r in recs])
        rss = max(rss, p.rss_mib)
        icr["compiled"] = recs[-1]["icr"]
    icr["torchscript"] = diffmon("eval", "--config", cfgs["torchscript"], *ckpts[-1:],
                                 "--json").json_lines()[-1]["icr"]
    rel = abs(icr["compiled"] - icr["torchscript"]) / abs(icr["torchscript"])
    return min(times), rss, {"icr_rel_diff": rel}


def fma_peak_gflops() -> float:
    """This CPU's fp32 peak in GFLOP/s: cores x base clock x SIMD lanes x 2 (multiply and add)
    x FMA units a core. The base clock is the TSC's (lscpu's BogoMIPS / 2 on x86, which a VM
    reports even where it hides the frequency); lanes from the widest vector flag (avx512f: 16,
    avx2 or fma: 8); two FMA units a core, as on the Zen and the Xeon Scalable cores this runs
    on. Turbo clocks exceed the base, so a rate above this peak is possible: it is a scale, not
    a bound."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return float("nan")
    flags, mips = (re.search(r"^flags\s*:(.*)$", info, re.M),
                   re.search(r"^bogomips\s*:\s*([\d.]+)", info, re.M))
    if not (flags and mips):  # not an x86 /proc/cpuinfo
        return float("nan")
    flags = set(flags.group(1).split())
    lanes = 16 if "avx512f" in flags else 8 if "fma" in flags else 4
    return THREADS * (float(mips.group(1)) / 2 / 1000) * lanes * 2 * 2



ENTRIES = {"limits": bench_limits, "icr": bench_icr, "pfd": bench_pfd, "empirical": bench_empirical,
           "load": bench_load, "latency": bench_daemon, "scaling": bench_scaling, "batch": bench_batch,
           "http": bench_http_load, "compiled": bench_compiled, "slurm": bench_slurm,
           "scale": lambda work, repeat, quick: scale.bench_scale(BIN, work, toy_run(work), quick)}
OPT_IN = {"slurm"}  # run only when named in --only


def fmt(v, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "—"
    if unit == "s":
        return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def table(rows: list[dict]) -> str:
    lines = ["| workload | diffmon | reference | ratio | RSS diffmon | RSS reference | target |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        unit = r.get("unit", "")
        sfx = "" if unit in ("s", "") else f" {unit}"
        size = "".join(f", {k} = {r[k]}" for k in ("n", "M") if k in r)
        lines.append(
            f"| {r['workload']}{size} | {fmt(r.get('diffmon'), unit)}{sfx} | "
            f"{fmt(r.get('reference'), unit)}{sfx if 'reference' in r else ''} | "
            f"{fmt(r.get('ratio'))}{'×' if 'ratio' in r else ''} | "
            f"{fmt(r.get('diffmon_rss_mib'))}{' MiB' if 'diffmon_rss_mib' in r else ''} | "
            f"{fmt(r.get('reference_rss_mib'))}{' MiB' if r.get('reference_rss_mib') else ''} | "
            f"{r.get('target', '')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--only", default=",".join(n for n in ENTRIES if n not in OPT_IN),
                    help="comma-separated workloads (slurm only when named)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write every result here")
    ap.add_argument("--markdown", type=Path, help="also write the table here")
    ap.add_argument("--work", type=Path, help="keep fixtures here (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    if not BIN.exists():
        raise SystemExit(f"{BIN} is missing: run `make build` first")
    results = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffmon-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.only.split(","):
            if name not in ENTRIES:
                raise SystemExit(f"unknown workload {name!r}: one of {', '.join(ENTRIES)}")
            t0 = time.perf_counter()
            for r in ENTRIES[name](work, args.repeat, args.quick):
                results.append(r)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()},
                                 ensure_ascii=False), flush=True)
            print(f"# {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    text = table(results)
    print(f"\n{text}\n\n{THREADS} threads a side; all of `make bench` took "
          f"{(time.perf_counter() - started) / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, ensure_ascii=False))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
