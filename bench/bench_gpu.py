#!/usr/bin/env python3
"""diffmon on a GPU (`make bench-gpu`; docs/guide/cost-and-gpu.md, BENCHMARKS.md "GPU"): in one
run on one GPU, for one network, what the GPU does for the network alone and what diffmon gets
out of it, against a researcher's PyTorch script of each protocol, and what a training job on
the same GPU keeps of its speed while diffmon evaluates its checkpoints.

    python bench/bench_gpu.py [--net ddpm|uncond64] [--only PARTS] [--out DIR] [--device cpu]

PARTS (comma-separated; all by default, in this order):
  forward  images/s of the exported TorchScript at batch 256: fp32 (TF32 off), TF32, bf16
           autocast, bf16 autocast with channels-last inputs and weights
  icr      `diffmon eval` ICR at n = 4096 and 512 (fp32 and bf16, gpu_share 1), the steady-state
           second checkpoint of a process, as images/s (two views per sample), against the
           researcher's script (views and noise on the GPU, float64 moments, the generalized
           eigenproblem) on the same network, data and batch
  pfd      `diffmon eval` PFD at M = 1000 (the teacher's flow cached), network evaluations/s,
           against the researcher's Heun integration of the student on the GPU (float64 state)
  share    a training job (the same network, bf16 autocast, batch 128, AdamW, a checkpoint every
           100 steps) alone, then with `diffmon watch` evaluating each of its checkpoints (ICR
           n = 4096) at the default gpu_share and at gpu_share 1: its steps/s in each phase
  compile  the eager network under torch.compile (bf16 autocast, channels-last): the rate the
           targets are stated against; the icr and pfd rows as shares of it
  aoti     diffmon's compiled network: `diffmon-export --compile` for this GPU (bf16, then
           fp32; compile time, package size), then the icr rows (and the pfd row in fp32) with
           `model.compiled` naming the package: against diffmon's TorchScript rows (speed, ICR and
           E_gen on identical draws), the torch.compile rate and the researcher's script

The binary is DIFFMON_BIN, else target/release/diffmon (as the GPU tier finds it). Results go to
DIR/bench-gpu.json and DIR/bench-gpu.md (default: the working directory), and a line per
measurement to the console. `--device cpu` is a dry run of the script on a CPU machine (a small
network, small counts, no compile): it checks the harness, not the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
# ICR's moments and generalized eigenproblem, the researcher's code make bench runs too.
from reference import icr_of_features  # noqa: E402

from bench import free_port  # noqa: E402

NETS = {
    # DDPM's CIFAR-10 network (35.7 M parameters), diffusers' configuration of it.
    "ddpm": dict(sample_size=32, in_channels=3, out_channels=3,
                 block_out_channels=(128, 256, 256, 256), layers_per_block=2,
                 down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D")),
    # diffusers' train_unconditional default (113.7 M parameters, 3x64x64).
    "uncond64": dict(sample_size=64, in_channels=3, out_channels=3,
                     block_out_channels=(128, 128, 256, 256, 512, 512), layers_per_block=2,
                     down_block_types=("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D"),
                     up_block_types=("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4),
    # The CPU dry run's.
    "tiny": dict(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(16, 32, 32),
                 layers_per_block=1, norm_num_groups=8,
                 down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D")),
}
BATCH = 256
SIGMA = 0.29  # icr.sigma's default
RESULTS: list[dict] = []
# Where results go as they come (main sets it): a run cut short keeps every row it measured.
WRITE_TO: list = []


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def result(part: str, what: str, **values) -> None:
    RESULTS.append({"part": part, "what": what, **values})
    if WRITE_TO:
        write(*WRITE_TO)
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
    say(f"{part}: {what}: {shown}")


def binary() -> str:
    b = os.environ.get("DIFFMON_BIN") or str(ROOT / "target" / "release" / "diffmon")
    if not Path(b).exists():
        sys.exit(f"no diffmon binary at {b}: build it, or set DIFFMON_BIN")
    return b


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- the assets


def smooth_images(n: int, size: int, seed: int) -> np.ndarray:
    """`n` smooth 3 x size x size images in [-1, 1] (blurred noise through tanh), float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
    k = (k[:, None] * k[None, :] / 256.0).expand(3, 1, 5, 5)
    x = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (2,) * 4, mode="reflect"), k, groups=3)
    return np.ascontiguousarray(torch.tanh(2.5 * x / x.std()).numpy())


def assets(work: Path, net: str, n_train: int):
    """The network (random weights), its export, two checkpoints (weights moved a little), a
    teacher export, the training images."""
    import h5py
    from diffusers import UNet2DModel

    from diffmon.export import export

    config = NETS[net]
    torch.manual_seed(0)
    unet = UNet2DModel(**config).eval()
    params = sum(p.numel() for p in unet.parameters())
    size = config["sample_size"]
    t0 = time.perf_counter()
    export(unet, "mid_block", work / "model.ts", "eps", (1, 3, size, size), schedule="linear",
           verbose=False)
    torch.manual_seed(1)
    export(UNet2DModel(**config).eval(), "mid_block", work / "teacher.ts", "eps",
           (1, 3, size, size), schedule="linear", verbose=False)
    say(f"{net}: {params / 1e6:.1f} M parameters, exported in {time.perf_counter() - t0:.1f} s")
    g = torch.Generator().manual_seed(2)
    ckpts = []
    for k in (1, 2):
        state = {n: (v + 0.02 * v.std() * torch.randn(v.shape, generator=g)
                     if v.is_floating_point() and v.numel() > 1 else v).clone()
                 for n, v in unet.state_dict().items()}
        path = work / f"ckpt_{k:06d}.pt"
        torch.save(state, path)
        ckpts.append(path)
    with h5py.File(work / "train.h5", "w") as f:
        f.create_dataset("images", data=smooth_images(n_train, size, 10))
    return unet, params, size, ckpts


def write_config(path: Path, work: Path, device: str, body: str, model: str = "") -> Path:
    """A config evaluating `work`'s export, or `model`'s (a `model:` mapping's inside)."""
    model = model or f"architecture: '{work / 'model.ts'}'"
    path.write_text(
        f"run: {{dir: '{work / 'run'}', name: bench}}\n"
        f"state_dir: '{path.with_suffix('.state')}'\n"
        f"model: {{{model}}}\n"
        f"device: '{device}'\n"
        f"data: {{path: '{work / 'train.h5'}'}}\n" + body)
    return path


def diffmon_eval(config: Path, ckpts, network: str = "TorchScript") -> list[dict]:
    """`diffmon eval`'s records; `network` must start the log's `network` (which format ran)."""
    out = subprocess.run([binary(), "eval", "--config", str(config), *map(str, ckpts), "--json"],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"diffmon eval exited {out.returncode}:\n{out.stderr[-3000:]}")
    if not re.search(r"network[=: \"]+" + re.escape(network), out.stderr):
        raise RuntimeError(f"diffmon eval ran another network than {network}:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- forward rates


def rate(fn, device: str, images: int, min_seconds: float) -> float:
    """Images per second of `fn()` (a forward of `images` images), after two warm-up calls."""
    with torch.no_grad():
        for _ in range(2):
            fn()
        sync(device)
        t0, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            if calls >= 3 and time.perf_counter() - t0 >= min_seconds:
                sync(device)
                if time.perf_counter() - t0 >= min_seconds:
                    break
        return images * calls / (time.perf_counter() - t0)


def tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def bench_forward(work: Path, size: int, device: str, quick: bool) -> dict:
    ts = torch.jit.load(str(work / "model.ts"), map_location=device).eval()
    x = torch.randn(BATCH, 3, size, size, device=device)
    sigma = torch.full((BATCH,), SIGMA, device=device)
    seconds = 0.5 if quick else 2.0
    autocast = lambda: torch.autocast(device.split(":")[0], dtype=torch.bfloat16)  # noqa: E731
    rates = {}
    tf32(False)
    rates["torchscript_fp32"] = rate(lambda: ts(x, sigma), device, BATCH, seconds)
    tf32(True)
    rates["torchscript_tf32"] = rate(lambda: ts(x, sigma), device, BATCH, seconds)
    tf32(False)

    def bf16():
        with autocast():
            return ts(x, sigma)
    rates["torchscript_bf16"] = rate(bf16, device, BATCH, seconds)
    xc = x.contiguous(memory_format=torch.channels_last)
    ts_cl = torch.jit.load(str(work / "model.ts"), map_location=device).eval()
    with torch.no_grad():
        for p in list(ts_cl.parameters()):
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)

    def bf16_cl():
        with autocast():
            return ts_cl(xc, sigma)
    rates["torchscript_bf16_channels_last"] = rate(bf16_cl, device, BATCH, seconds)
    for k, v in rates.items():
        result("forward", k, images_per_s=v)
    return rates


def bench_compiled(unet, size: int, device: str, rates: dict) -> None:
    """The eager network under torch.compile, bf16 autocast, channels-last: the rate the targets
    are stated against; then diffmon's ICR and PFD rows as shares of it."""
    x = torch.randn(BATCH, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    net = unet.to(device).to(memory_format=torch.channels_last).eval()
    t = torch.full((BATCH,), 500.0, device=device)
    compiled = torch.compile(net)

    def run():
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            return compiled(x, t).sample
    t0 = time.perf_counter()
    with torch.no_grad():
        run()
    sync(device)
    compile_s = time.perf_counter() - t0
    best = rate(run, device, BATCH, 2.0)
    rates["compiled_bf16_channels_last"] = best
    result("forward", "compiled_bf16_channels_last", images_per_s=best, compile_s=compile_s)
    for r in list(RESULTS):
        if r["part"] in ("icr", "pfd") and r["what"] != "FAILED":
            got = r.get("images_per_s", r.get("network_evals_per_s"))
            result(r["part"], f"{r['what']} against the compiled bf16 rate", share=got / best)


def bench_aoti(work: Path, unet, size: int, ckpts, device: str, ns, m: int, rates: dict) -> None:
    """diffmon's compiled network: the same network exported with `diffmon-export`'s compile step
    for this device (AOTInductor, batch 64 and up: diffusers' `Upsample2D` guards smaller
    batches), bf16 then fp32; its compile time and size, then `diffmon eval` with
    `model.compiled` naming the package: ICR at each n, and PFD at M (fp32: the student's PF-ODE
    runs the package, the teacher TorchScript), against TorchScript's rows of the same run, the
    torch.compile rate and the researcher's script."""
    from diffmon.export import export

    by_what = {(r["part"], r["what"]): r for r in RESULTS}
    best = rates.get("compiled_bf16_channels_last")
    for precision in ("bf16", "fp32"):
        d = work / f"aoti-{precision}"
        d.mkdir()
        t0 = time.perf_counter()
        export(unet, "mid_block", d / "model.ts", "eps", (1, 3, size, size), schedule="linear",
               device=device, verbose=False,
               compile={"device": device, "precision": precision, "min_batch": 64})
        side = json.loads((d / "model.pt2.json").read_text())
        result("aoti", f"package {precision}", export_and_compile_s=time.perf_counter() - t0,
               compile_s=side["compile_seconds"], package_mib=(d / "model.pt2").stat().st_size / 2**20,
               weights=len(side["weights"]))
        model = f"architecture: '{d / 'model.ts'}', compiled: '{d / 'model.pt2'}'"
        runs = [(f"n {n} {precision}", "icr", 2 * n,
                 f"icr: {{samples: {n}, batch_size: {BATCH}, seed: 0}}\n"
                 "pfd: {enabled: false}\nearly_stop: {confirm: none}\n") for n in ns]
        if precision == "fp32":
            runs.append((f"M {m} fp32", "pfd", m * (2 * 18 - 1),
                         "icr: {enabled: false}\n"
                         f"pfd: {{enabled: true, teacher: '{work / 'teacher.ts'}', samples: {m}, "
                         f"batch_size: {BATCH}, seed: 0}}\n"
                         "early_stop: {metric: pfd_generalization, confirm: none}\n"))
        for what, part, images, body in runs:
            cfg = write_config(work / f"aoti-{part}-{what.replace(' ', '-')}.yaml", work, device,
                               body + f"evaluation: {{precision: {precision}, gpu_share: 1}}\n",
                               model=model)
            rec = diffmon_eval(cfg, ckpts, network="compiled package")[-1]
            got = images / rec["seconds"]
            script = by_what.get((part, what), {})
            ref = script.get("researcher_fp32_s", script.get("researcher_student_s", float("nan")))
            values = dict(seconds=rec["seconds"], images_per_s=got,
                          speedup_vs_torchscript=script.get("seconds", float("nan")) / rec["seconds"],
                          of_compiled_bf16=got / best if best else float("nan"),
                          speedup_vs_researcher=ref / rec["seconds"])
            for key in ("icr", "pfd_generalization"):
                if rec.get(key) is not None and script.get(key) is not None:
                    values[f"{key}_rel_diff_vs_torchscript"] = abs(rec[key] - script[key]) / abs(script[key])
            result(part, f"{what} compiled", **values)


# ----------------------------------------------------------------------------- ICR


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The paper's views, batched on the GPU: a reflect-padded random crop (1/8 of the side), a
    horizontal flip, brightness and contrast in [0.6, 1.4]."""
    b, c, h, w = x.shape
    pad = round(0.125 * h)
    p = torch.nn.functional.pad(x, (pad,) * 4, mode="reflect")
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=g, device=x.device)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=g, device=x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, None, :, None].expand(b, c, h, w + 2 * pad)
    p = p.gather(2, rows)
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, None, :].expand(b, c, h, w)
    y = p.gather(3, cols)
    flip = torch.rand(b, 1, 1, 1, generator=g, device=x.device) < 0.5
    y = torch.where(flip, y.flip(3), y)
    z = ((y + 1) / 2 * (torch.rand(b, 1, 1, 1, generator=g, device=x.device) * 0.8 + 0.6)).clamp(0, 1)
    mean = z.mean(dim=(1, 2, 3), keepdim=True)
    z = ((z - mean) * (torch.rand(b, 1, 1, 1, generator=g, device=x.device) * 0.8 + 0.6) + mean).clamp(0, 1)
    return z * 2 - 1


def researcher_icr(work: Path, ckpt: Path, device: str, n: int) -> float:
    """The ICR protocol as a researcher writes it in PyTorch on the GPU; its seconds, the
    network and images loaded before (as diffmon's record leaves its start-up out) but the
    checkpoint's weights read in (as diffmon's record counts them)."""
    import h5py

    m = torch.jit.load(str(work / "model.ts"), map_location=device).eval()
    images = torch.from_numpy(np.asarray(h5py.File(work / "train.h5")["images"][:n])).to(device)
    sync(device)
    t0 = time.perf_counter()
    m.load_state_dict(torch.load(ckpt, map_location=device, weights_only=True))
    g = torch.Generator(device=device).manual_seed(0)
    h1s, h2s = [], []
    with torch.no_grad():
        for s in range(0, n, BATCH // 2):
            x0 = images[s:s + BATCH // 2]
            v1 = augment(x0, g) + SIGMA * torch.randn(x0.shape, generator=g, device=device)
            v2 = augment(x0, g) + SIGMA * torch.randn(x0.shape, generator=g, device=device)
            _, f = m(torch.cat([v1, v2]), torch.full((2 * len(x0),), SIGMA, device=device))
            h = f.mean(dim=(2, 3)) if f.dim() == 4 else f
            h1s.append(h[:len(x0)].double())
            h2s.append(h[len(x0):].double())
    icr_of_features(torch.cat(h1s), torch.cat(h2s))
    sync(device)
    return time.perf_counter() - t0


def bench_icr(work: Path, ckpts, device: str, ns, rates: dict) -> None:
    for n in ns:
        ref = min(researcher_icr(work, c, device, n) for c in ckpts)
        for precision in ("fp32", "bf16"):
            cfg = write_config(work / f"icr-{n}-{precision}.yaml", work, device,
                               f"icr: {{samples: {n}, batch_size: {BATCH}, seed: 0}}\n"
                               "pfd: {enabled: false}\nearly_stop: {confirm: none}\n"
                               f"evaluation: {{precision: {precision}, gpu_share: 1}}\n")
            rec = diffmon_eval(cfg, ckpts)[-1]
            images = 2 * n / rec["seconds"]
            forward = rates.get("torchscript_" + precision)
            result("icr", f"n {n} {precision}", seconds=rec["seconds"],
                   gpu_seconds=rec.get("gpu_seconds", float("nan")), images_per_s=images,
                   of_torchscript=images / forward if forward else float("nan"),
                   researcher_fp32_s=ref, speedup_vs_researcher=ref / rec["seconds"],
                   gpu_memory_peak_gib=rec.get("gpu_memory_peak_bytes", 0) / 2**30,
                   icr=rec["icr"])


# ----------------------------------------------------------------------------- PFD


def researcher_pfd(work: Path, ckpt: Path, device: str, m: int, size: int, steps: int = 18) -> float:
    """The student's PF-ODE from M latents with EDM's Heun sampler, float64 state on the GPU."""
    net = torch.jit.load(str(work / "model.ts"), map_location=device).eval()
    sync(device)
    t0 = time.perf_counter()
    net.load_state_dict(torch.load(ckpt, map_location=device, weights_only=True))
    i = torch.arange(steps, dtype=torch.float64, device=device)
    t = (80 ** (1 / 7) + i / (steps - 1) * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7
    t = torch.cat([t, torch.zeros(1, dtype=torch.float64, device=device)])
    g = torch.Generator(device=device).manual_seed(0)
    z = torch.randn(m, 3, size, size, generator=g, device=device, dtype=torch.float64)

    def d(x, s):
        return net(x.float(), torch.full((len(x),), float(s), device=device))[0].double()
    with torch.no_grad():
        for b in range(0, m, BATCH):
            x = z[b:b + BATCH] * t[0]
            for k in range(steps):
                dx = (x - d(x, t[k])) / t[k]
                x1 = x + (t[k + 1] - t[k]) * dx
                if t[k + 1] > 0:
                    x1 = x + (t[k + 1] - t[k]) * (dx + (x1 - d(x1, t[k + 1])) / t[k + 1]) / 2
                x = x1
    sync(device)
    return time.perf_counter() - t0


def bench_pfd(work: Path, ckpts, device: str, m: int, size: int, rates: dict) -> None:
    cfg = write_config(work / "pfd.yaml", work, device,
                       "icr: {enabled: false}\n"
                       f"pfd: {{enabled: true, teacher: '{work / 'teacher.ts'}', samples: {m}, "
                       f"batch_size: {BATCH}, seed: 0}}\n"
                       "early_stop: {metric: pfd_generalization, confirm: none}\n"
                       "evaluation: {gpu_share: 1}\n")
    t0 = time.perf_counter()
    rec = diffmon_eval(cfg, ckpts)[-1]
    process = time.perf_counter() - t0
    evals = m * (2 * 18 - 1)
    ref = researcher_pfd(work, ckpts[-1], device, m, size)
    forward = rates.get("torchscript_fp32")
    result("pfd", f"M {m} fp32", seconds=rec["seconds"], process_s=process,
           gpu_seconds=rec.get("gpu_seconds", float("nan")),
           network_evals_per_s=evals / rec["seconds"],
           of_torchscript=evals / rec["seconds"] / forward if forward else float("nan"),
           researcher_student_s=ref, speedup_vs_researcher=ref / rec["seconds"],
           pfd_generalization=rec["pfd_generalization"])


# ----------------------------------------------------------------------------- sharing


TRAINER = r"""
import json, os, sys, time, torch
from diffusers import UNet2DModel
config, run, seconds, every, device = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
net = UNet2DModel(**config).to(device).train()
opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
size = config["sample_size"]
x0 = torch.randn(128, 3, size, size, device=device)
kind = device.split(":")[0]
step, t0, last = 0, time.perf_counter(), 0.0
while time.perf_counter() - t0 < seconds:
    noise = torch.randn_like(x0)
    t = torch.randint(0, 1000, (len(x0),), device=device)
    with torch.autocast(kind, dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(net(x0 + noise, t).sample.float(), noise)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    step += 1
    if step % every == 0:
        tmp = os.path.join(run, "partial.tmp")
        torch.save(net.state_dict(), tmp)
        os.replace(tmp, os.path.join(run, "ckpt_%06d.pt" % step))
    now = time.perf_counter() - t0
    if now - last >= 1.0 or step == 1:
        if kind == "cuda":
            torch.cuda.synchronize()
        print(json.dumps({"t": time.perf_counter() - t0, "step": step}), flush=True)
        last = now
"""


def train(net: str, device: str, seconds: float, every: int, run: Path) -> float:
    """The trainer for `seconds`; its steps/s after the first 5 s (warm-up)."""
    out = subprocess.run([sys.executable, "-c", TRAINER, json.dumps(NETS[net]), str(run),
                          str(seconds), str(every), device], capture_output=True, text=True,
                         timeout=seconds + 300)
    if out.returncode != 0:
        raise RuntimeError(f"trainer exited {out.returncode}:\n{out.stderr[-3000:]}")
    points = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    start = next(p for p in points if p["t"] >= min(5.0, seconds / 3))
    end = points[-1]
    return (end["step"] - start["step"]) / (end["t"] - start["t"])


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def bench_share(work: Path, net: str, device: str, seconds: float, n: int, every: int) -> None:
    alone_run = work / "train-alone"
    alone_run.mkdir()
    alone = train(net, device, seconds, every, alone_run)
    result("share", "training alone", steps_per_s=alone)
    for share in (None, 1.0):
        run = work / f"train-{share or 'default'}"
        run.mkdir()
        port = free_port()
        extra = f", gpu_share: {share}" if share else ""
        cfg = work / f"watch-{share or 'default'}.yaml"
        cfg.write_text(
            f"run: {{dir: '{run}', name: share}}\n"
            f"state_dir: '{cfg.with_suffix('.state')}'\n"
            f"model: {{architecture: '{work / 'model.ts'}'}}\n"
            f"device: '{device}'\n"
            f"data: {{path: '{work / 'train.h5'}'}}\n"
            f"http: {{listen: '127.0.0.1:{port}'}}\n"
            "checkpoints: {pattern: 'ckpt_*.pt', step_regex: 'ckpt_(\\d+)', settle_secs: 0.5, "
            "poll_secs: 0.5, backlog: latest}\n"
            f"icr: {{samples: {n}, batch_size: {BATCH}, seed: 0}}\n"
            "pfd: {enabled: false}\n"
            "early_stop: {confirm: none}\n"
            f"evaluation: {{precision: fp32{extra}}}\n")
        log = open(work / f"watch-{share or 'default'}.log", "wb")
        daemon = subprocess.Popen([binary(), "watch", "--config", str(cfg)], stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not scrape(port) and time.monotonic() < deadline:
                if daemon.poll() is not None:
                    raise RuntimeError(f"diffmon watch exited {daemon.returncode}")
                time.sleep(0.3)
            shared = train(net, device, seconds, every, run)
            text = scrape(port)
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
        label = f"gpu_share {share}" if share else "gpu_share default (0.5)"
        result("share", f"training with diffmon at {label}", steps_per_s=shared,
               kept=shared / alone, evaluated=metric(text, "diffmon_checkpoints_evaluated_total"),
               diffmon_gpu_s=metric(text, "diffmon_gpu_seconds_total"),
               checkpoints_written=len(list(run.glob("ckpt_*.pt"))))


# ----------------------------------------------------------------------------- the report


def markdown(meta: dict) -> str:
    lines = [f"GPU benchmark: {meta['device_name']}, torch {meta['torch']}, network {meta['net']} "
             f"({meta.get('params_m', float('nan')):.1f} M parameters), batch {BATCH}; {meta['when']}", "",
             "| part | what | values |", "|---|---|---|"]
    for r in RESULTS:
        values = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in r.items() if k not in ("part", "what"))
        lines.append(f"| {r['part']} | {r['what']} | {values} |")
    return "\n".join(lines) + "\n"


def write(out: Path, meta: dict) -> None:
    (out / "bench-gpu.json").write_text(json.dumps({"meta": meta, "results": RESULTS}, indent=1))
    (out / "bench-gpu.md").write_text(markdown(meta))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default=None, choices=sorted(NETS))
    ap.add_argument("--only", default="forward,icr,pfd,share,compile,aoti")
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--share-seconds", type=float, default=30.0)
    args = ap.parse_args()
    dry = args.device == "cpu"
    if not dry and not torch.cuda.is_available():
        print("bench-gpu: no CUDA device visible (torch.cuda.is_available() is False); "
              "`--device cpu` is a dry run of the script")
        return 1
    net = args.net or ("tiny" if dry else "ddpm")
    parts = args.only.split(",")
    for slow in ("compile", "aoti"):
        if dry and slow in parts and args.only == ap.get_default("only"):
            parts.remove(slow)  # minutes on a CPU, and not what the dry run checks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    (work / "run").mkdir()
    meta = {"device_name": torch.cuda.get_device_name(0) if not dry else "cpu (dry run)",
            "torch": torch.__version__, "net": net, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    say(f"bench-gpu on {meta['device_name']}, torch {meta['torch']}, work {work}")
    WRITE_TO[:] = [out, meta]
    try:
        unet, params, size, ckpts = assets(work, net, 1024 if dry else 4096)
        meta["params_m"] = params / 1e6
        rates: dict = {}
        steps = [("forward", lambda: rates.update(bench_forward(work, size, args.device, dry))),
                 ("icr", lambda: bench_icr(work, ckpts, args.device, (256,) if dry else (4096, 512), rates)),
                 ("pfd", lambda: bench_pfd(work, ckpts, args.device, 64 if dry else 1000, size, rates)),
                 ("share", lambda: bench_share(work, net, args.device, 12 if dry else args.share_seconds,
                                               256 if dry else 4096, 20 if dry else 100)),
                 ("compile", lambda: bench_compiled(unet, size, args.device, rates)),
                 ("aoti", lambda: bench_aoti(work, unet, size, ckpts, args.device,
                                             (64,) if dry else (4096, 512), 16 if dry else 1000,
                                             rates))]
        for name, run in steps:
            if name not in parts:
                continue
            t0 = time.perf_counter()
            try:
                run()
            except Exception as e:  # noqa: BLE001 - one part failing must not lose the others
                result(name, "FAILED", error=str(e)[-2000:])
            say(f"{name}: {time.perf_counter() - t0:.0f} s")
            write(out, meta)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["what"] == "FAILED" for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
