#!/usr/bin/env python3
"""A small, real latent class-conditional diffusion training job on CPU (diffmon's latent demo).

Latent diffusion the way Stable Diffusion and DiT do it, scaled down to the scikit-learn digits:
a tiny ``diffusers.AutoencoderKL`` is trained first and frozen, then a tiny class-conditional
``diffusers.DiTTransformer2DModel`` is trained with ``DDPMScheduler`` on the VAE's latents of the
training images, and checkpoints are written with diffusers' own ``save_pretrained``::

    python python/train_latent_toy.py --run-dir runs/latent [--train-size 256]
        [--heldout-size 256] [--vae-steps 300] [--steps 300] [--ckpt-every 50]
        [--batch-size 64] [--seed 0] [--stop-file EARLY_STOP] [--pause SECS] [--threads 1]
        [--vae-out DIR] [--scheduler-out DIR] [--data-out DIR]

Files (RUN = ``--run-dir``; all written atomically: a hidden ``.NAME.tmp`` file or folder, then
renamed, so a watcher never sees a half-written one)::

    RUN/train.h5      /images float32 [N,3,16,16] in [-1,1] (PIXEL images, not latents),
                      /labels int64 [N] (the digit, 0..9), /index int64 [N] (ids in load_digits)
    RUN/heldout.h5    the same for M images never trained on (neither the VAE nor the DiT)
    RUN/vae/          AutoencoderKL.save_pretrained: config.json (with the fitted scaling_factor
                      and shift_factor 0.0) + diffusion_pytorch_model.safetensors
    RUN/scheduler/    DDPMScheduler.save_pretrained: scheduler_config.json
    RUN/checkpoint-N/transformer/   DiTTransformer2DModel.save_pretrained (config.json +
                      diffusion_pytorch_model.safetensors), every --ckpt-every steps and at the
                      last step: the layout diffusers' training scripts write

``--vae-out``, ``--scheduler-out`` and ``--data-out`` put the VAE, the scheduler and the two
HDF5 files elsewhere (for instance beside the run folder, so the watched folder holds only
checkpoints). One line is printed per checkpoint: the step and the mean training loss since the
previous one. After every checkpoint (and during ``--pause``) the script checks diffmon's stop
file (``--stop-file``, default ``EARLY_STOP`` in the run folder) and exits 0 when it is there;
it also exits 0 at once, before training, when the file is already there.

Data. The 1797 8x8 digits (0..16 -> 0..1), upsampled bilinearly to 16x16, tinted with one colour
per image (seeded, drawn for all 1797 images at once: channels uniform in [0.25, 1], divided by
their maximum, so the strokes keep full brightness and colour jitter changes the image): pixel =
2 * intensity * colour - 1, a black (-1) background. A seeded ``torch.Generator`` permutation
gives the training subset and the held-out images after it.

Sizes (chosen to train in well under a minute on two cores):

* VAE: ``block_out_channels=(16, 32)``, two ``DownEncoderBlock2D`` / ``UpDecoderBlock2D``,
  ``layers_per_block=1``, ``norm_num_groups=8``, ``latent_channels=4``, the mid-block attention
  kept (as in Stable Diffusion's VAE): 16x16x3 -> 4x8x8, 0.17 M parameters. (32, 64) channels
  (0.66 M) reconstruct better in as many steps (about 0.002) but cost about 2.5 times as much
  per step, over a minute for the VAE alone. Trained with AdamW (lr 2e-3),
  batch 32, on a posterior sample: MSE + 1e-3 * KL (the KL per latent element). After 300 steps
  the reconstruction MSE of decode(mean) is about 0.018 (0.021 on the held-out images) against
  a pixel variance of 0.28; it keeps falling (about 0.004 after 500 steps, ``--vae-steps``).
  A one-cycle or linearly decaying learning rate did no better in 300 steps.
* Scaling, as Stable Diffusion does it: ``scaling_factor = 1 / std`` of the posterior means of
  the training images (every element of every latent), written with
  ``vae.register_to_config``. ``shift_factor`` is 0.0 (written explicitly): the latents' mean is
  already near 0 (the KL term pulls it there), and with 0 the SD convention
  ``z = scaling_factor * mean`` and the SD3 one ``z = scaling_factor * (mean - shift_factor)``
  agree. The DiT trains on ``z``, encoded once with the frozen VAE. (The held-out images'
  scaled latents have std about 0.97.)
* DiT: ``in_channels=4``, ``out_channels=4`` (epsilon only; diffusers' default, in_channels, also
  gives 4: no learned sigma), ``sample_size=8``, ``patch_size=2`` (16 tokens),
  ``num_layers=4``, ``num_attention_heads=2``, ``attention_head_dim=16``,
  ``num_embeds_ada_norm=10``: 0.12 M parameters. AdamW lr 1e-3, batch 64. Its denoising loss
  on fixed noise falls from 1.38 (fresh) to 0.52 at step 50 and 0.15 at step 300.
* Classes and the null class. Each block's ``AdaLayerNormZero`` holds a
  ``CombinedTimestepLabelEmbeddings`` whose ``LabelEmbedding`` is built with diffusers' default
  ``class_dropout_prob=0.1``: its table has 11 rows, row 10 the null class. In training mode that
  module drops labels itself, but every block (and the output layer, which calls block 0's again)
  draws its own dropout from the global RNG, so one sample would be "unconditional" in some
  blocks and not others. This script turns that off (``dropout_prob = 0`` on each module; the
  null row stays, and ``from_pretrained`` rebuilds it) and replaces 10% of the labels with 10
  itself (``--cfg-drop``), seeded, the same label for every block. (diffusers' ``DiTPipeline``
  hard-codes the null label 1000 for guidance, so it samples this model only with
  ``guidance_scale=1``.)
* Noise: ``DDPMScheduler`` with epsilon prediction, linear betas 1e-4..0.02, 1000 steps, and
  ``clip_sample=False`` (its default, True, clips the predicted x0 to [-1, 1] when sampling;
  latents are not bounded by 1). ``DiTPipeline`` runs with whatever scheduler config it is
  given, so RUN/scheduler records the one the transformer was trained with. Loss:
  MSE(eps_pred, eps), t uniform in 0..999. ``--objective rectified_flow`` trains by flow matching
  instead, as diffusers' SD3 script does: ``FlowMatchEulerDiscreteScheduler(shift=3)`` saved in
  RUN/scheduler, t logit-normal, ``z_t = (1 - t) z0 + t n``, the DiT at ``timestep = 1000 t``
  predicting ``n - z0`` (``diffmon-export --parameterization rectified_flow --scheduler
  RUN/scheduler``).

Time, defaults (300 VAE steps, 300 DiT steps, 256 training images, one thread), on a two-core
machine shared with other jobs: about 31 s wall (imports about 5 s; data, VAE training and
encoding about 19.5 s; DiT with its 6 checkpoints about 6.5 s). ``--threads 2`` was slower, about 46 s: with ``OMP_WAIT_POLICY=PASSIVE`` (set
here so that diffmon evaluating beside the job is not starved) the second thread sleeps between
these small ops and waking it costs more than it saves; for 100 + 100 steps, 15 s with one
thread, 17-20 s with two, 12-14 s with two and ``OMP_WAIT_POLICY=ACTIVE`` (fastest alone, but
it spins on the core diffmon needs).

Seeded and deterministic: the split and colours, the initializations (the DiT's is seeded apart
from the VAE's, so ``--vae-steps`` does not change it), batches, noise, timesteps and dropped
labels all come from ``--seed``; the same seed and thread count gave the same bytes (VAE and
checkpoints, with one thread and with two).

diffmon evaluates the run by exporting the VAE and the transformer (with its null class) to its
model contract, e.g. (the ``--vae`` and ``--null-class`` flags are being added to
``diffmon-export``)::

    diffmon-export --vae --factory diffusers:AutoencoderKL.from_pretrained \\
        --factory-kwargs '{"pretrained_model_name_or_path": "RUN/vae"}' --shape 3 16 16 --out vae.ts
    diffmon-export --factory diffusers:DiTTransformer2DModel.from_pretrained \\
        --factory-kwargs '{"pretrained_model_name_or_path": "RUN/checkpoint-50/transformer"}' \\
        --feature-layer transformer_blocks.1 --shape 4 8 8 --parameterization eps \\
        --schedule linear --T 1000 --null-class --out model.ts

Tested by ``python/tests/test_train_latent_toy.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

# With busy-waiting OpenMP threads, a second process on the same cores (diffmon evaluating the
# checkpoints) slows training by an order of magnitude; passive waiting avoids that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers import AutoencoderKL, DDPMScheduler, DiTTransformer2DModel, FlowMatchEulerDiscreteScheduler  # noqa: E402
from diffusers.models.embeddings import LabelEmbedding  # noqa: E402
from torch import Tensor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffmon.stop import describe_event, read_stop_event, should_stop  # noqa: E402

N_DIGITS = 1797
SIZE = 16
NUM_CLASSES = 10
NULL_CLASS = NUM_CLASSES  # the extra row of LabelEmbedding's table (class_dropout_prob > 0)
VAE_CONFIG = dict(in_channels=3, out_channels=3,
                  down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                  up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
                  block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
                  latent_channels=4, sample_size=SIZE)
DIT_CONFIG = dict(in_channels=4, out_channels=4, sample_size=SIZE // 2, patch_size=2, num_layers=4,
                  num_attention_heads=2, attention_head_dim=16, num_embeds_ada_norm=NUM_CLASSES)
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02,
                        beta_schedule="linear", prediction_type="epsilon", clip_sample=False)
# --objective rectified_flow: SD3's scheduler, with its shift (the sampler's; training below draws
# its times from the logit-normal, as SD3's training script does by default).
FLOW_SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

def load_tinted_digits(seed: int) -> tuple[Tensor, Tensor]:
    """All 1797 digits as float32 [1797,3,16,16] in [-1,1], each tinted with its own seeded
    colour, and their labels (int64 [1797])."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    v = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1) / 16.0
    v = F.interpolate(v, size=(SIZE, SIZE), mode="bilinear", align_corners=False).clamp(0, 1)
    g = torch.Generator().manual_seed(seed)
    colour = torch.rand(N_DIGITS, 3, 1, 1, generator=g) * 0.75 + 0.25
    colour = colour / colour.amax(dim=1, keepdim=True)
    images = (2 * v * colour - 1).clamp(-1, 1).contiguous()
    return images, torch.from_numpy(digits.target.astype(np.int64))


def split_indices(seed: int, train_size: int, heldout_size: int) -> tuple[Tensor, Tensor]:
    """Seeded disjoint (sorted) training and held-out ids."""
    if train_size < 1 or heldout_size < 0 or train_size + heldout_size > N_DIGITS:
        raise ValueError(f"train size {train_size} + held-out size {heldout_size} must be within 1..{N_DIGITS}")
    perm = torch.randperm(N_DIGITS, generator=torch.Generator().manual_seed(seed + 1))
    return perm[:train_size].sort().values, perm[train_size:train_size + heldout_size].sort().values


def write_h5_atomic(path: Path, images: Tensor, labels: Tensor, index: Tensor) -> None:
    import h5py

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        f.create_dataset("images", data=images.numpy().astype(np.float32))
        f.create_dataset("labels", data=labels.numpy().astype(np.int64))
        f.create_dataset("index", data=index.numpy().astype(np.int64))
        f.attrs["source"] = "sklearn.datasets.load_digits, 16x16, tinted"
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------

def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final`` (an old ``final`` is moved aside first)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old.tmp")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save_pretrained_atomic(obj, final: Path) -> Path:
    """``obj.save_pretrained`` into a hidden ``.NAME.tmp`` folder beside ``final``, then renamed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    obj.save_pretrained(str(tmp))
    replace_dir(tmp, final)
    return final


def save_checkpoint(run_dir: Path, step: int, transformer: DiTTransformer2DModel) -> Path:
    """``RUN/checkpoint-N/transformer``: the whole ``checkpoint-N`` folder is written under the
    hidden name ``.checkpoint-N.tmp`` (not matching ``checkpoint-*``) and renamed when complete."""
    final = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    transformer.save_pretrained(str(tmp / "transformer"))
    replace_dir(tmp, final)
    return final


# ---------------------------------------------------------------------------------------------
# Models and training
# ---------------------------------------------------------------------------------------------

def new_vae(seed: int) -> AutoencoderKL:
    torch.manual_seed(seed)
    return AutoencoderKL(**VAE_CONFIG)


def new_transformer(seed: int) -> DiTTransformer2DModel:
    torch.manual_seed(seed + 2)
    return DiTTransformer2DModel(**DIT_CONFIG)


def disable_builtin_label_dropout(transformer: DiTTransformer2DModel) -> None:
    """Every ``LabelEmbedding`` keeps its null row but stops dropping labels on its own."""
    found = 0
    for m in transformer.modules():
        if isinstance(m, LabelEmbedding):
            if m.embedding_table.num_embeddings != NUM_CLASSES + 1:
                raise RuntimeError("the DiT's label embedding has no null-class row")
            m.dropout_prob = 0.0
            found += 1
    if not found:
        raise RuntimeError("no LabelEmbedding in the DiT")


def train_vae(vae: AutoencoderKL, images: Tensor, steps: int, batch_size: int, lr: float,
              kl_weight: float, generator: torch.Generator, log_every: int) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    vae.train()
    t0 = time.perf_counter()
    mse_sum = kl_sum = 0.0
    n = 0
    for step in range(1, steps + 1):
        x = images[torch.randint(len(images), (batch_size,), generator=generator)]
        posterior = vae.encode(x).latent_dist
        z = posterior.sample(generator=generator)
        mse = F.mse_loss(vae.decode(z).sample, x)
        kl = posterior.kl().mean() / z[0].numel()  # per latent element
        loss = mse + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mse_sum += float(mse.detach())
        kl_sum += float(kl.detach())
        n += 1
        if step % log_every == 0 or step == steps:
            print(f"vae step {step:5d}  mse {mse_sum / n:.4f}  kl {kl_sum / n:.3f}  "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
            mse_sum = kl_sum = 0.0
            n = 0
    vae.eval()
    for p in vae.parameters():
        p.requires_grad_(False)


@torch.no_grad()
def encode_means(vae: AutoencoderKL, images: Tensor, batch_size: int = 256) -> Tensor:
    """Posterior means of ``images`` (unscaled)."""
    return torch.cat([vae.encode(images[i:i + batch_size]).latent_dist.mean
                      for i in range(0, len(images), batch_size)])


def fit_scaling(vae: AutoencoderKL, means: Tensor) -> tuple[float, float]:
    """Stable Diffusion's scaling: 1 / std of the latents (every element); shift 0."""
    scaling = float(1.0 / means.float().std())
    shift = 0.0
    vae.register_to_config(scaling_factor=scaling, shift_factor=shift)
    return scaling, shift


def ddpm_loss(transformer: DiTTransformer2DModel, scheduler: DDPMScheduler, z0: Tensor,
              labels: Tensor, generator: torch.Generator) -> Tensor:
    noise = torch.randn(z0.shape, generator=generator)
    t = torch.randint(0, scheduler.config.num_train_timesteps, (z0.shape[0],), generator=generator)
    noisy = scheduler.add_noise(z0, noise, t)
    pred = transformer(noisy, timestep=t, class_labels=labels).sample
    return F.mse_loss(pred, noise)


def flow_loss(transformer: DiTTransformer2DModel, z0: Tensor, labels: Tensor,
              generator: torch.Generator) -> Tensor:
    """Rectified flow as diffusers' SD3 training script writes it: t logit-normal (mean 0, std 1),
    ``z_t = (1 - t) z0 + t n``, the transformer at ``timestep = 1000 t`` predicts ``n - z0``."""
    noise = torch.randn(z0.shape, generator=generator)
    t = torch.sigmoid(torch.randn(z0.shape[0], generator=generator))
    t4 = t.reshape(-1, 1, 1, 1)
    pred = transformer((1 - t4) * z0 + t4 * noise, timestep=t * 1000, class_labels=labels).sample
    return F.mse_loss(pred, noise - z0)


def _stop(run_dir: Path, stop_file: str, where: str) -> None:
    event = read_stop_event(run_dir, stop_file)
    if event is not None:
        print(json.dumps(event, sort_keys=True), flush=True)
    print(f"{describe_event(event)}; stopping {where} (exit 0). Remove {run_dir / stop_file} to train again.",
          flush=True)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Small latent class-conditional diffusion (AutoencoderKL + DiT) on the tinted "
                    "sklearn digits (CPU).")
    ap.add_argument("--run-dir", required=True, type=Path, help="output folder (created)")
    ap.add_argument("--train-size", type=int, default=256, help="training images (default 256)")
    ap.add_argument("--heldout-size", type=int, default=256, help="held-out images (default 256)")
    ap.add_argument("--vae-steps", type=int, default=300, help="VAE training steps (default 300)")
    ap.add_argument("--vae-batch-size", type=int, default=32)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--kl-weight", type=float, default=1e-3,
                    help="weight of the KL term (per latent element) against the pixel MSE")
    ap.add_argument("--steps", type=int, default=300, help="DiT training steps (default 300)")
    ap.add_argument("--batch-size", type=int, default=64, help="DiT batch (default 64)")
    ap.add_argument("--lr", type=float, default=1e-3, help="DiT AdamW learning rate")
    ap.add_argument("--cfg-drop", type=float, default=0.1,
                    help="fraction of labels replaced by the null class 10 (default 0.1)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--objective", default="ddpm", choices=("ddpm", "rectified_flow"),
                    help="ddpm (default): epsilon prediction with DDPMScheduler; rectified_flow: flow "
                         "matching with FlowMatchEulerDiscreteScheduler (the DiT predicts n - z0 at "
                         "timestep 1000 t; export with --parameterization rectified_flow)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seeds the colours, the split, the initializations and the noise")
    ap.add_argument("--stop-file", default="EARLY_STOP", help="diffmon's stop file name in the run dir")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds to pause after each checkpoint (lets a watching daemon keep up)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: faster than 2 for these small ops with "
                         "passive OpenMP waiting, and leaves a core to diffmon)")
    ap.add_argument("--vae-out", type=Path, default=None, help="the VAE folder (default RUN/vae)")
    ap.add_argument("--scheduler-out", type=Path, default=None,
                    help="the scheduler folder (default RUN/scheduler)")
    ap.add_argument("--data-out", type=Path, default=None,
                    help="folder for train.h5 and heldout.h5 (default RUN)")
    args = ap.parse_args(argv)
    if min(args.steps, args.ckpt_every, args.batch_size, args.vae_batch_size) < 1 or args.vae_steps < 0:
        ap.error("--steps, --ckpt-every and the batch sizes must be >= 1, --vae-steps >= 0")
    if not 0.0 <= args.cfg_drop < 1.0:
        ap.error("--cfg-drop must be in [0, 1)")
    if args.train_size < 1 or args.heldout_size < 0 or args.train_size + args.heldout_size > N_DIGITS:
        ap.error(f"--train-size ({args.train_size}) + --heldout-size ({args.heldout_size}) "
                 f"must be within 1..{N_DIGITS}")
    return args


def _pause(run_dir: Path, stop_file: str, seconds: float) -> bool:
    """Sleep ``seconds``, checking the stop file; True when it appeared."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        if should_stop(run_dir, stop_file):
            return True
    return False


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    run_dir: Path = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if should_stop(run_dir, args.stop_file):
        _stop(run_dir, args.stop_file, "before training")
        return 0
    t_start = time.perf_counter()

    # Data
    images, labels = load_tinted_digits(args.seed)
    train_idx, held_idx = split_indices(args.seed, args.train_size, args.heldout_size)
    train_x, train_y = images[train_idx], labels[train_idx]
    data_out = args.data_out if args.data_out is not None else run_dir
    write_h5_atomic(data_out / "train.h5", train_x, train_y, train_idx)
    write_h5_atomic(data_out / "heldout.h5", images[held_idx], labels[held_idx], held_idx)

    # VAE
    vae = new_vae(args.seed)
    n_vae = sum(p.numel() for p in vae.parameters())
    print(f"train_latent_toy: {len(train_idx)} train / {len(held_idx)} held-out images 3x{SIZE}x{SIZE}; "
          f"VAE {n_vae} parameters, {args.vae_steps} steps; run dir {run_dir}", flush=True)
    gen_vae = torch.Generator().manual_seed(args.seed + 3)
    train_vae(vae, train_x, args.vae_steps, args.vae_batch_size, args.vae_lr, args.kl_weight, gen_vae,
              log_every=max(1, args.vae_steps // 4))
    means = encode_means(vae, train_x)
    scaling, shift = fit_scaling(vae, means)
    vae_out = args.vae_out if args.vae_out is not None else run_dir / "vae"
    save_pretrained_atomic(vae, vae_out)
    latents = ((means - shift) * scaling).contiguous()
    print(f"vae: latents 4x{SIZE // 2}x{SIZE // 2}, mean {float(means.mean()):+.4f}, "
          f"std {float(means.std()):.4f} -> scaling_factor {scaling:.6f}, shift_factor {shift}; "
          f"saved {vae_out} ({time.perf_counter() - t_start:.1f}s)", flush=True)

    # Scheduler and DiT
    flow = args.objective == "rectified_flow"
    scheduler = (FlowMatchEulerDiscreteScheduler(**FLOW_SCHEDULER_CONFIG) if flow
                 else DDPMScheduler(**SCHEDULER_CONFIG))
    save_pretrained_atomic(scheduler, args.scheduler_out if args.scheduler_out is not None
                           else run_dir / "scheduler")
    transformer = new_transformer(args.seed)
    disable_builtin_label_dropout(transformer)
    n_dit = sum(p.numel() for p in transformer.parameters())
    print(f"dit: {n_dit} parameters, {args.steps} steps, batch {args.batch_size}, "
          f"label dropout {args.cfg_drop} -> null class {NULL_CLASS}", flush=True)
    opt = torch.optim.AdamW(transformer.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 4)
    transformer.train()
    t_dit = t_last = time.perf_counter()
    loss_sum, loss_n = 0.0, 0
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(latents), (args.batch_size,), generator=gen)
        y = train_y[idx].clone()
        drop = torch.rand(args.batch_size, generator=gen) < args.cfg_drop
        y[drop] = NULL_CLASS
        loss = (flow_loss(transformer, latents[idx], y, gen) if flow
                else ddpm_loss(transformer, scheduler, latents[idx], y, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += float(loss.detach())
        loss_n += 1
        if step % args.ckpt_every == 0 or step == args.steps:
            path = save_checkpoint(run_dir, step, transformer)
            now = time.perf_counter()
            print(f"step {step:6d}  loss {loss_sum / loss_n:.4f}  {now - t_last:6.2f}s  "
                  f"(total {now - t_start:.1f}s)  {path.name}", flush=True)
            loss_sum, loss_n = 0.0, 0
            if should_stop(run_dir, args.stop_file) or _pause(run_dir, args.stop_file, args.pause):
                _stop(run_dir, args.stop_file, f"at step {step}")
                return 0
            t_last = time.perf_counter()
    print(f"train_latent_toy: done, {args.steps} DiT steps in {time.perf_counter() - t_dit:.1f}s, "
          f"{time.perf_counter() - t_start:.1f}s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
