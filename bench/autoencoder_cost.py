#!/usr/bin/env python3
"""What a latent model's autoencoder costs diffmon's start against an evaluation (BENCHMARKS.md,
"The autoencoder"): seconds an image for an encoder of Stable Diffusion's configuration at
3x256x256 against a DiT-B/2-sized transformer's forward at 4x32x32, and the encoder in the
contiguous and the channels-last layout. Random weights (the cost does not depend on them), eager
PyTorch, best of --repeat calls of --batch images.

    python bench/autoencoder_cost.py [--threads 1] [--repeat 3] [--batch 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def best_seconds(fn, repeat: int, device: str) -> float:
    best = float("inf")
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    from diffusers import AutoencoderKL, DiTTransformer2DModel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = args.device
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                        latent_channels=4).to(dev).eval()
    dit = DiTTransformer2DModel(num_attention_heads=12, attention_head_dim=64, in_channels=4,
                                out_channels=8, num_layers=12, patch_size=2, sample_size=32,
                                num_embeds_ada_norm=1000).to(dev).eval()
    nhwc = copy.deepcopy(vae).to(memory_format=torch.channels_last)
    b = args.batch
    x = torch.randn(b, 3, 256, 256, device=dev)
    z = torch.randn(b, 4, 32, 32, device=dev)
    t = torch.arange(b, device=dev) * 100
    y = torch.arange(b, device=dev)
    encode = lambda m, x: m.encode(x).latent_dist.mean  # noqa: E731
    with torch.no_grad():
        e = best_seconds(lambda: encode(vae, x), args.repeat, dev) / b
        e_cl = best_seconds(lambda: encode(nhwc, x.contiguous(memory_format=torch.channels_last)),
                            args.repeat, dev) / b
        f = best_seconds(lambda: dit(z, timestep=t, class_labels=y), args.repeat, dev) / b
        a, c = encode(vae, x), encode(nhwc, x.contiguous(memory_format=torch.channels_last))
    print(f"encoder {sum(p.numel() for p in vae.encoder.parameters()) / 1e6:.1f} M parameters, "
          f"DiT {sum(p.numel() for p in dit.parameters()) / 1e6:.1f} M; {dev}, "
          f"{args.threads} thread(s)")
    print(f"encode {e:.3f} s an image, DiT forward {f:.3f} s: encode / forward {e / f:.2f}")
    print(f"encode channels-last {e_cl:.3f} s an image: {e / e_cl:.2f}x, relative difference "
          f"{float((a - c).abs().max() / a.abs().max()):.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
