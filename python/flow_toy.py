#!/usr/bin/env python3
"""Flow matching on the scikit-learn digits, on the CPU: the toy of ``train_toy.py`` trained as a
velocity network (diffmon's flow-matching demo and test network).

The same data, split, U-Net and noise levels as ``train_toy.py`` (EDM's log-normal sigma, mapped
to each path's time), but the network is a flow-matching velocity network ``forward(x_t, t)``,
``t`` the path's time in [0, 1], trained with ``|v_pred - dx_t/dt|^2`` on one of the paths the
exporter converts (``--path``: ``rectified_flow``, ``cosine``, ``sit_linear``, ``sit_gvp``), and
exported with the matching parameterization and ``t_scale`` 1. ``--arch sit`` trains a tiny SiT
(a DiT of 2x2 patches with adaLN-Zero) instead of the U-Net. Writes into ``--run-dir``:

    train.h5, heldout.h5   as train_toy.py writes them
    model.ts               the architecture, exported as the path's parameterization
    ckpt_{step:06d}.pt     the weights (a state_dict: the EMA weights with --ema), every
                           --ckpt-every steps, written atomically

and obeys diffmon's stop file like ``train_toy.py``. Example::

    python python/flow_toy.py --run-dir runs/flow --path sit_linear --train-size 64 --steps 1600
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffmon.export import export  # noqa: E402
from diffmon.stop import should_stop  # noqa: E402
from train_toy import (P_MEAN, P_STD, FEATURE_LAYER, FourierEmbedding, ToyUNet, ema_update,  # noqa: E402
                       load_digit_images, split_indices, write_h5_atomic)


# --path -> the exporter's parameterization of the velocity network it trains.
OBJECTIVES = {"rectified_flow": "rectified_flow", "cosine": "cosine_flow",
              "sit_linear": "sit_linear_velocity", "sit_gvp": "sit_gvp_velocity"}


def flow_path(path: str, t: Tensor) -> tuple:
    """``(alpha, sigma_t, d_alpha, d_sigma_t)`` of ``x_t = alpha x + sigma_t n`` at time ``t``, as
    each path defines it: rectified flow and cosine (data at t = 0), SiT's Linear and GVP (data at
    t = 1, SiT's code)."""
    one = torch.ones_like(t)
    h = math.pi / 2
    if path == "rectified_flow":
        return 1 - t, t, -one, one
    if path == "cosine":
        return torch.cos(h * t), torch.sin(h * t), -h * torch.sin(h * t), h * torch.cos(h * t)
    if path == "sit_linear":
        return t, 1 - t, one, -one
    if path == "sit_gvp":
        return torch.sin(h * t), torch.cos(h * t), h * torch.cos(h * t), -h * torch.sin(h * t)
    raise ValueError(f"unknown flow path {path!r}")


def time_at_noise_level(path: str, sigma: Tensor) -> Tensor:
    """The path's time whose noise-to-signal ratio sigma_t / alpha is ``sigma``."""
    if path == "rectified_flow":        # sigma = t / (1 - t)
        return sigma / (1 + sigma)
    if path == "cosine":                # sigma = tan(pi t / 2)
        return torch.atan(sigma) * (2 / math.pi)
    if path == "sit_linear":            # sigma = (1 - t) / t
        return 1 / (1 + sigma)
    if path == "sit_gvp":               # sigma = cot(pi t / 2)
        return torch.atan(1 / sigma) * (2 / math.pi)
    raise ValueError(f"unknown flow path {path!r}")


def flow_loss(model: nn.Module, x0: Tensor, path: str, generator: torch.Generator | None = None) -> Tensor:
    """Velocity matching, ``|model(x_t, t) - dx_t/dt|^2``, with the noise levels of EDM's training
    (sigma = sigma_t / alpha log-normal, P_mean -1.2, P_std 1.2) mapped to the path's time: the
    same noise as ``edm_loss``, another parameterization and weighting."""
    b = x0.shape[0]
    sigma = torch.exp(P_MEAN + P_STD * torch.randn(b, generator=generator))
    t = time_at_noise_level(path, sigma)
    alpha, sigma_t, d_alpha, d_sigma_t = (c.reshape(-1, 1, 1, 1) for c in flow_path(path, t))
    n = torch.randn(x0.shape, generator=generator)
    target = d_alpha * x0 + d_sigma_t * n
    return ((model(alpha * x0 + sigma_t * n, t) - target) ** 2).mean()


class ToyVelocity(ToyUNet):
    """The U-Net as a flow-matching velocity network: forward(x_t, t), t the path's time in [0, 1]
    (exported with ``t_scale`` 1)."""

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        return super().forward(x, t.to(x.dtype).reshape(-1))


class SiTBlock(nn.Module):
    """A DiT/SiT block: self-attention and an MLP, each modulated by the time (adaLN-Zero)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))
        nn.init.zeros_(self.ada[1].weight)
        nn.init.zeros_(self.ada[1].bias)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, dim=2)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + gate1 * self.proj(a)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class ToySiT(nn.Module):
    """A tiny SiT (a DiT trained by flow matching): patches of 2x2, ``depth`` blocks, velocity out.
    forward(x_t, t), t in [0, 1]; the middle block, ``blocks.{(depth-1)//2}``, is the feature layer."""

    def __init__(self, channels: int = 1, size: int = 16, width: int = 64, depth: int = 4, heads: int = 4,
                 patch: int = 2):
        super().__init__()
        self.patch, self.grid, self.channels = patch, size // patch, channels
        self.x_embed = nn.Conv2d(channels, width, patch, stride=patch)
        self.pos = nn.Parameter(0.02 * torch.randn(1, self.grid * self.grid, width))
        self.t_embed = FourierEmbedding(width)
        self.t_mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(SiTBlock(width, heads) for _ in range(depth))
        self.norm_out = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.out = nn.Linear(width, patch * patch * channels)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        h = self.x_embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.t_mlp(self.t_embed(t.to(x.dtype).reshape(-1)))
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.ada_out(c).unsqueeze(1).chunk(2, dim=2)
        h = self.out(self.norm_out(h) * (1 + scale) + shift)
        g, p = self.grid, self.patch
        h = h.reshape(-1, g, g, p, p, self.channels).permute(0, 5, 1, 3, 2, 4)
        return h.reshape(-1, self.channels, g * p, g * p)




def make_model(arch: str, width: int, size: int) -> nn.Module:
    return ToySiT(1, size, width) if arch == "sit" else ToyVelocity(1, width)


def feature_layer(model: nn.Module) -> str:
    return f"blocks.{(len(model.blocks) - 1) // 2}" if isinstance(model, ToySiT) else FEATURE_LAYER


def export_model(model: nn.Module, path: Path, example_shape: tuple, path_name: str, **kw):
    """Exports ``model`` with the parameterization of its path (time scale 1)."""
    return export(model, feature_layer(model), path, OBJECTIVES[path_name], example_shape=example_shape,
                  t_scale=1.0, **kw)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Small flow-matching training on the sklearn digits (CPU).")
    ap.add_argument("--run-dir", required=True, type=Path, help="output folder (created)")
    ap.add_argument("--path", default="rectified_flow", choices=tuple(OBJECTIVES),
                    help="the flow path (default rectified_flow); exported as rectified_flow, cosine_flow, "
                         "sit_linear_velocity or sit_gvp_velocity")
    ap.add_argument("--arch", default="unet", choices=("unet", "sit"),
                    help="unet (default, train_toy.py's) or sit: a tiny SiT of 2x2 patches")
    ap.add_argument("--size", type=int, default=16, choices=(8, 16), help="image side (default 16)")
    ap.add_argument("--train-size", type=int, default=64, help="training images (default 64: data-limited)")
    ap.add_argument("--heldout-size", type=int, default=None, help="held-out images (default: all the rest)")
    ap.add_argument("--width", type=int, default=32, help="base channels (default 32)")
    ap.add_argument("--steps", type=int, default=1600, help="training steps (default 1600)")
    ap.add_argument("--batch-size", type=int, default=32, help="batch (default 32)")
    ap.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default 2e-3)")
    ap.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints (default 50)")
    ap.add_argument("--ema", type=float, default=0.0, help="EMA decay of the saved weights (default 0: off)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the split, init and noise")
    ap.add_argument("--stop-file", default="EARLY_STOP", help="diffmon's stop file name in the run dir")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args(argv)
    if min(args.steps, args.ckpt_every, args.batch_size, args.width) < 1 or not 0.0 <= args.ema < 1.0:
        ap.error("--steps, --ckpt-every, --batch-size and --width must be >= 1, --ema in [0, 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    run_dir: Path = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if should_stop(run_dir, args.stop_file):
        print("flow_toy: the stop file is there; not training (exit 0)", flush=True)
        return 0
    torch.manual_seed(args.seed)
    images = load_digit_images(args.size)
    train_idx, held_idx = split_indices(args.seed, args.train_size, args.heldout_size)
    train = images[torch.from_numpy(train_idx)]
    write_h5_atomic(run_dir / "train.h5", train, train_idx)
    write_h5_atomic(run_dir / "heldout.h5", images[torch.from_numpy(held_idx)], held_idx)
    model = make_model(args.arch, args.width, args.size)
    example_shape = (1, 1, args.size, args.size)
    export_model(model, run_dir / "model.ts", example_shape, args.path)
    ema = copy.deepcopy(model).eval() if args.ema > 0 else model
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    print(f"flow_toy: {len(train)} train / {len(held_idx)} held-out images, {args.arch} on the {args.path} "
          f"path, {sum(p.numel() for p in model.parameters())} parameters, {args.steps} steps", flush=True)
    t_start = time.perf_counter()
    loss_sum, loss_n = 0.0, 0
    model.train()
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(train), (args.batch_size,), generator=gen)
        loss = flow_loss(model, train[idx], args.path, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.ema > 0:
            ema_update(ema, model, args.ema)
        loss_sum, loss_n = loss_sum + float(loss.detach()), loss_n + 1
        if step % args.ckpt_every == 0 or step == args.steps:
            path = run_dir / f"ckpt_{step:06d}.pt"
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save(ema.state_dict(), tmp)
            os.replace(tmp, path)
            print(f"step {step:6d}  loss {loss_sum / loss_n:.4f}  (total {time.perf_counter() - t_start:.1f}s)  "
                  f"{path.name}", flush=True)
            loss_sum, loss_n = 0.0, 0
            if should_stop(run_dir, args.stop_file):
                print(f"diffmon's stop file is there; stopping at step {step} (exit 0)", flush=True)
                return 0
    print(f"flow_toy: done, {args.steps} steps in {time.perf_counter() - t_start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
