#!/usr/bin/env python3
"""Write a run folder the way a real training stack does, for diffmon's tests of issue #16.

    python python/stacks.py --stack S[,S...] --out RUN --flat FLAT [--steps 6 --every 2]
        [--ema] [--limit L] [--pause SECS] [--data train.h5] [--export model.ts]
        [--hostile MARKER] [--resume-from CHECKPOINT] [--stop-on-early-stop]

Every stack trains the same tiny diffusers ``UNet2DModel`` (:func:`tiny_unet`: 1x8x8 input,
epsilon prediction, ``DDPMScheduler`` with its defaults: linear betas 1e-4..0.02, 1000 steps) on a
few dozen seeded 8x8 blob images in [-1, 1] (:func:`images`) with the library's own training and
saving code, and writes a checkpoint every ``--every`` optimizer steps:

``accelerate``  the loop of diffusers' ``train_unconditional.py``: ``Accelerator(project_config=
                ProjectConfiguration(project_dir=RUN))``, ``accelerator.save_state(RUN/checkpoint-N)``
                (``model.safetensors``, ``optimizer.bin``, ``random_states_0.pkl``). ``--limit L``
                deletes the oldest ``checkpoint-*`` folders before a save so that at most L remain
                after it (that script's ``--checkpoints_total_limit``).
``diffusers``   the same loop with ``train_unconditional.py``'s save hook: ``save_state`` writes
                ``checkpoint-N/unet`` (``model.save_pretrained``) instead of ``model.safetensors``
                and, with ``--ema``, ``checkpoint-N/unet_ema`` (``EMAModel.save_pretrained``).
``emamodel``    ``torch.save(ema_model.state_dict(), RUN/ema-N.pt)`` of diffusers' ``EMAModel``
                (``shadow_params``: a list in ``model.parameters()`` order, no names).
``lightning``   a ``LightningModule`` holding the UNet as ``self.model``, ``Trainer(accelerator="cpu")``
                with ``ModelCheckpoint(dirpath=RUN, every_n_train_steps=K, save_top_k=-1,
                filename="{step}")``: ``RUN/step=N.ckpt``, keys ``model.*``. With ``--ema``,
                ``EMAWeightAveraging``: ``state_dict`` then holds the average and
                ``current_model_state`` the trained weights.
``module``      ``torch.save(model, RUN/model-N.pt)``, the whole module pickled. ``--hostile MARKER``
                adds an attribute whose unpickling creates the file MARKER (``builtins.open``
                through ``__reduce__``): a reader that runs the pickle creates it.
``dcp``         ``torch.distributed.checkpoint.save({"model": ..., "optimizer": ...},
                checkpoint_id=RUN/checkpoint-N)``, one process (``.metadata``, ``__0_0.distcp``).

For every checkpoint it writes, ``FLAT/step_N.safetensors`` holds exactly the weights diffmon
should evaluate from it (the EMA weights where the stack has them, since ``checkpoints.prefer_ema``
is on by default), saved with ``safetensors.torch.save_file`` under the names of the UNet's own
``state_dict()``. They are taken from the training objects (the model, ``EMAModel``, Lightning's
averaged model), not read back from the checkpoint, so comparing the two checks the stack.

``--resume-from PATH`` (one stack: ``accelerate``, ``diffusers`` or ``lightning``) resumes
training from one of that stack's checkpoints with the library's own resume code and goes on to
``--steps`` in all, saving at the same absolute steps as before (``--limit`` rotating as before):
``accelerator.load_state(PATH)`` after ``prepare`` as ``train_unconditional.py``'s
``--resume_from_checkpoint`` does (the step from the folder name ``checkpoint-N``, the batches of
the resumed epoch that came before it skipped; the ``diffusers`` stack registers that script's load
hook, which reads ``unet/``), or ``trainer.fit(..., ckpt_path=PATH)`` (``step=N.ckpt``; a step
whose file exists is saved again as ``step=N-v1.ckpt``: ModelCheckpoint does not overwrite). Once the
weights are loaded it checks them against the checkpoint file (``model.safetensors``,
``unet/diffusion_pytorch_model.safetensors``, or the ``.ckpt``'s ``current_model_state`` when it
has one, else its ``state_dict``) and prints ``{"resumed_from": PATH, "step": N, "exact": BOOL}``
on stdout. ``--stop-on-early-stop`` makes the loop obey diffmon's stop file in ``--out`` as a
user's loop would (``diffmon.stop``): ``should_stop(RUN)`` after every optimizer step (after that
step's save) in the accelerate loop, ``DiffmonEarlyStopping(RUN)`` among Lightning's callbacks;
when it stops training early it prints ``{"stopped_early_at": N}`` on stdout (the callback also
prints its own sentence there).

``--data F.h5`` writes the training images (dataset ``images``, float32 ``[N,1,8,8]``) and
``--export F.ts`` the architecture (``diffmon.export`` of a fresh UNet, feature layer
``mid_block``, ``eps``, linear schedule, T=1000), so one call makes a complete fixture.
Several stacks in one call (``--stack diffusers,emamodel --out runs/{stack} --flat flat/{stack}``)
share the imports (diffusers alone takes seconds to import). ``--pause`` sleeps after each checkpoint (to let a watching daemon see a rotated run). Seeded and
deterministic; each stack takes a few seconds on two CPU cores. Heavy libraries are imported only
for the stack asked. Tested by ``python/tests/test_stacks.py`` and used by the Rust tests in
``tests/integration/stacks.rs``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

STACKS = ("accelerate", "diffusers", "emamodel", "lightning", "module", "dcp")
FEATURE_LAYER = "mid_block"
SIZE = 8
UNET_CONFIG = dict(sample_size=SIZE, in_channels=1, out_channels=1, block_out_channels=(8, 16),
                   layers_per_block=1, norm_num_groups=4,
                   down_block_types=("DownBlock2D", "DownBlock2D"),
                   up_block_types=("UpBlock2D", "UpBlock2D"))


def tiny_unet(seed: int = 0):
    """The tiny ``diffusers.UNet2DModel`` every stack trains (initialized from ``seed``)."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    return UNet2DModel(**UNET_CONFIG)


def images(n: int = 48, seed: int = 0) -> np.ndarray:
    """``n`` seeded 8x8 one-channel images in [-1, 1]: one or two Gaussian blobs each."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64)
    out = np.empty((n, 1, SIZE, SIZE), dtype=np.float32)
    for i in range(n):
        img = np.zeros((SIZE, SIZE))
        for _ in range(rng.integers(1, 3)):
            cy, cx = rng.uniform(1.5, SIZE - 2.5, size=2)
            w = rng.uniform(0.8, 2.0)
            img += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * w * w))
        out[i, 0] = 2 * np.clip(img, 0, 1) - 1
    return out


def write_data(path: Path, x: np.ndarray) -> None:
    import h5py

    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=x)


def export_architecture(path: Path) -> None:
    from diffmon.export import export

    export(tiny_unet(seed=1234), FEATURE_LAYER, path, parameterization="eps",
           example_shape=(1, 1, SIZE, SIZE), schedule="linear", T=1000)


def save_flat(flat: Path, step: int, state_dict) -> None:
    from safetensors.torch import save_file

    flat.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()},
              str(flat / f"step_{step}.safetensors"))


def ddpm_loss(model, noise_scheduler, clean, generator):
    """The denoising loss of train_unconditional.py (epsilon prediction)."""
    noise = torch.randn(clean.shape, generator=generator)
    t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean.shape[0],),
                      generator=generator).long()
    noisy = noise_scheduler.add_noise(clean, noise, t)
    pred = model(noisy, t).sample
    return torch.nn.functional.mse_loss(pred, noise)


def new_ema(model):
    from diffusers import UNet2DModel
    from diffusers.training_utils import EMAModel

    return EMAModel(model.parameters(), decay=0.999, model_cls=UNet2DModel, model_config=model.config)


def ema_state_dict(model, ema_model):
    """The weights ``EMAModel.save_pretrained`` writes: a fresh model from the config, the shadow
    parameters copied in."""
    from diffusers import UNet2DModel

    m = UNet2DModel.from_config(model.config)
    ema_model.copy_to(m.parameters())
    return m.state_dict()


def say(obj) -> None:
    """One JSON line on stdout, flushed (the lines tests read: resumed_from, stopped_early_at)."""
    print(json.dumps(obj), flush=True)


def same_weights(got, want) -> bool:
    """The same names and bit-identical tensors."""
    return set(got) == set(want) and all(
        torch.equal(got[k].detach().cpu(), want[k].detach().cpu()) for k in want)


def rotate(run: Path, limit: int) -> None:
    """Before a save: delete the oldest checkpoint-* folders so that ``limit`` remain after it."""
    folders = sorted((d for d in os.listdir(run) if d.startswith("checkpoint-")),
                     key=lambda d: int(d.split("-")[1]))
    if len(folders) >= limit:
        for d in folders[: len(folders) - limit + 1]:
            shutil.rmtree(run / d)


def plain_loop(args, x, on_checkpoint):
    """A plain PyTorch loop (the ``emamodel``, ``module`` and ``dcp`` stacks)."""
    from diffusers import DDPMScheduler

    model = tiny_unet(args.seed)
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ema_model = new_ema(model) if args.stack == "emamodel" else None
    g = torch.Generator().manual_seed(args.seed)
    data = torch.from_numpy(x)
    model.train()
    for step in range(1, args.steps + 1):
        batch = data[torch.randint(0, len(data), (args.batch,), generator=g)]
        loss = ddpm_loss(model, noise_scheduler, batch, g)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if ema_model is not None:
            ema_model.step(model.parameters())
        if step % args.every == 0:
            on_checkpoint(step, model, optimizer, ema_model)
            time.sleep(args.pause)


def stack_emamodel(args, x):
    def save(step, model, _opt, ema_model):
        torch.save(ema_model.state_dict(), args.out / f"ema-{step}.pt")
        save_flat(args.flat, step, ema_state_dict(model, ema_model))

    plain_loop(args, x, save)


class _OpensOnLoad:
    """Unpickling this opens (creates) ``path`` for writing: ``builtins.open(path, "w")``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def stack_module(args, x):
    def save(step, model, _opt, _ema):
        if args.hostile:
            model.diffmon_marker = _OpensOnLoad(str(args.hostile))
        torch.save(model, args.out / f"model-{step}.pt")
        if args.hostile:
            del model.diffmon_marker
        save_flat(args.flat, step, model.state_dict())

    plain_loop(args, x, save)


def stack_dcp(args, x):
    import torch.distributed.checkpoint as dcp

    def save(step, model, optimizer, _ema):
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                 checkpoint_id=str(args.out / f"checkpoint-{step}"))
        save_flat(args.flat, step, model.state_dict())

    import warnings

    with warnings.catch_warnings():
        # One process without a process group: DCP says it falls back to no_dist, which is the point.
        warnings.filterwarnings("ignore", message=".*process group.*")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        plain_loop(args, x, save)


def stack_accelerate(args, x):
    """train_unconditional.py's loop; the ``diffusers`` stack adds its save hook."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.training_utils import EMAModel

    set_seed(args.seed)
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=str(args.out)), cpu=True)
    model = tiny_unet(args.seed)
    use_ema = args.stack == "diffusers" and args.ema
    ema_model = new_ema(model) if use_ema else None

    if args.stack == "diffusers":
        def save_model_hook(models, weights, output_dir):
            if accelerator.is_main_process:
                if use_ema:
                    ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
                for m in models:
                    m.save_pretrained(os.path.join(output_dir, "unet"))
                    weights.pop()  # saved above: accelerate must not write model.safetensors too

        def load_model_hook(models, input_dir):
            if use_ema:
                loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
                ema_model.load_state_dict(loaded.state_dict())
                ema_model.to(accelerator.device)
                del loaded
            for _ in range(len(models)):
                m = models.pop()  # popped: accelerate must not look for model.safetensors
                loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
                m.register_to_config(**loaded.config)
                m.load_state_dict(loaded.state_dict())
                del loaded

        accelerator.register_save_state_pre_hook(save_model_hook)
        accelerator.register_load_state_pre_hook(load_model_hook)

    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = torch.utils.data.DataLoader(torch.from_numpy(x), batch_size=args.batch, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(args.seed))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    num_update_steps_per_epoch = len(loader)  # no gradient accumulation
    g = torch.Generator().manual_seed(args.seed + 1)
    step = 0
    first_epoch = resume_step = 0
    if args.resume_from:
        # train_unconditional.py's --resume_from_checkpoint (a given folder, not "latest").
        path = os.path.basename(os.path.normpath(args.resume_from))
        accelerator.load_state(args.resume_from)
        step = int(path.split("-")[1])
        first_epoch = step // num_update_steps_per_epoch
        resume_step = step % num_update_steps_per_epoch
        from safetensors.torch import load_file

        stored = load_file(os.path.join(args.resume_from, "unet", "diffusion_pytorch_model.safetensors")
                           if args.stack == "diffusers" else
                           os.path.join(args.resume_from, "model.safetensors"))
        if accelerator.is_main_process:
            say({"resumed_from": args.resume_from, "step": step,
                 "exact": same_weights(accelerator.unwrap_model(model).state_dict(), stored)})
    if args.stop_on_early_stop:
        from diffmon.stop import should_stop
    stopped = False
    epoch = first_epoch
    model.train()
    while step < args.steps and not stopped:
        for batch_idx, clean in enumerate(loader):
            if args.resume_from and epoch == first_epoch and batch_idx < resume_step:
                continue  # train_unconditional.py: skip the resumed epoch's batches up to the step
            with accelerator.accumulate(model):
                loss = ddpm_loss(model, noise_scheduler, clean, g)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                if use_ema:
                    ema_model.step(model.parameters())
                step += 1
                if step % args.every == 0 and accelerator.is_main_process:
                    if args.limit:
                        rotate(args.out, args.limit)
                    accelerator.save_state(str(args.out / f"checkpoint-{step}"))
                    unwrapped = accelerator.unwrap_model(model)
                    assert isinstance(unwrapped, UNet2DModel)
                    save_flat(args.flat, step,
                              ema_state_dict(unwrapped, ema_model) if use_ema else unwrapped.state_dict())
                    time.sleep(args.pause)
                if args.stop_on_early_stop and should_stop(args.out):
                    if accelerator.is_main_process:
                        say({"stopped_early_at": step})
                    stopped = True
                    break
            if step >= args.steps:
                break
        epoch += 1
    accelerator.end_training()


def stack_lightning(args, x):
    import pytorch_lightning as pl
    from diffusers import DDPMScheduler
    from pytorch_lightning.callbacks import EMAWeightAveraging, ModelCheckpoint

    pl.seed_everything(args.seed, verbose=False)

    class Diffusion(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_unet(args.seed)
            self.noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
            self.g = torch.Generator().manual_seed(args.seed + 1)

        def training_step(self, batch, batch_idx):
            return ddpm_loss(self.model, self.noise_scheduler, batch, self.g)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    class Flat(pl.Callback):
        """Writes the flat copy at the steps ModelCheckpoint saves (checkpoint callbacks run last,
        so this sees the weights after the step's EMA update and before the save)."""

        def __init__(self, ema):
            self.ema = ema

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step % args.every == 0:
                # The averaged copy of the whole LightningModule (a private attribute of the
                # callback: the public way is the checkpoint itself, which is what is checked).
                src = self.ema._average_model.module if self.ema is not None else pl_module
                save_flat(args.flat, step, src.model.state_dict())

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            time.sleep(args.pause)

    class Resumed(pl.Callback):
        """After Lightning has restored ``--resume-from`` (weights, optimizer, loops, callbacks):
        are the module's weights the trained ones the checkpoint holds?"""

        def on_train_start(self, trainer, pl_module):
            ck = torch.load(args.resume_from, map_location="cpu", weights_only=True)
            # With EMAWeightAveraging, state_dict holds the average and the trained weights, which
            # it loads into the module, are current_model_state.
            want = ck.get("current_model_state", ck["state_dict"])
            say({"resumed_from": args.resume_from, "step": trainer.global_step,
                 "exact": same_weights(pl_module.state_dict(), want)})

    ema = EMAWeightAveraging(decay=0.9) if args.ema else None
    stopper = None
    if args.stop_on_early_stop:
        from diffmon.stop import DiffmonEarlyStopping

        stopper = DiffmonEarlyStopping(args.out)
    callbacks = ([ema] if ema else []) + [Flat(ema)] + ([Resumed()] if args.resume_from else []) + (
        [stopper] if stopper else []) + [
        ModelCheckpoint(dirpath=str(args.out), every_n_train_steps=args.every, save_top_k=-1,
                        filename="{step}"),
    ]
    loader = torch.utils.data.DataLoader(torch.from_numpy(x), batch_size=args.batch, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(args.seed))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=str(args.out))
    trainer.fit(Diffusion(), loader, ckpt_path=args.resume_from)
    if stopper is not None and stopper.stopped:
        say({"stopped_early_at": trainer.global_step})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", required=True,
                    help=f"one of {', '.join(STACKS)}, or several separated by commas (one process "
                         "shares the imports; then --out and --flat contain {stack})")
    ap.add_argument("--out", required=True, help="the run folder the checkpoints go to")
    ap.add_argument("--flat", required=True,
                    help="folder for step_N.safetensors: the weights diffmon should evaluate")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2, help="a checkpoint every this many steps")
    ap.add_argument("--ema", action="store_true", help="diffusers: unet_ema; lightning: EMAWeightAveraging")
    ap.add_argument("--limit", type=int, default=0,
                    help="accelerate/diffusers: keep at most this many checkpoint folders (0: all)")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each checkpoint")
    ap.add_argument("--hostile", type=Path, help="module: a marker file that unpickling would create")
    ap.add_argument("--data", type=Path, help="also write the training images to this HDF5 file")
    ap.add_argument("--export", type=Path, help="also export the architecture to this TorchScript file")
    ap.add_argument("--resume-from", metavar="PATH",
                    help="accelerate/diffusers: a checkpoint-N folder; lightning: a step=N.ckpt file "
                         "(one stack): resume from it with the library's own code, up to --steps in all")
    ap.add_argument("--stop-on-early-stop", action="store_true",
                    help="accelerate/diffusers/lightning: stop when diffmon's stop file appears in --out "
                         "(diffmon.stop)")
    ap.add_argument("--n-images", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny tensors: 1 is fastest)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        ap.error("--steps and --every must be >= 1")
    stacks = args.stack.split(",")
    for s in stacks:
        if s not in STACKS:
            ap.error(f"--stack: unknown stack {s!r} (choose from {', '.join(STACKS)})")
    if len(stacks) > 1 and not ("{stack}" in args.out and "{stack}" in args.flat):
        ap.error("with several stacks, --out and --flat must contain {stack}")
    if args.limit and not set(stacks) & {"accelerate", "diffusers"}:
        ap.error("--limit applies to the accelerate and diffusers stacks")
    if args.hostile and "module" not in stacks:
        ap.error("--hostile applies to the module stack")
    resumable = ("accelerate", "diffusers", "lightning")
    if args.resume_from:
        if len(stacks) > 1 or stacks[0] not in resumable:
            ap.error("--resume-from applies to one stack: accelerate, diffusers or lightning")
        if not os.path.exists(args.resume_from):
            ap.error(f"--resume-from: {args.resume_from} does not exist")
        name = os.path.basename(os.path.normpath(args.resume_from))
        if stacks[0] != "lightning" and not (name.startswith("checkpoint-")
                                             and name.split("-")[1].isdigit()):
            ap.error("--resume-from: an accelerate checkpoint is a folder named checkpoint-N")
    if args.stop_on_early_stop and not set(stacks) & set(resumable):
        ap.error("--stop-on-early-stop applies to the accelerate, diffusers and lightning stacks")
    torch.set_num_threads(args.threads)
    x = images(args.n_images, args.seed)
    if args.data:
        write_data(args.data, x)
    if args.export:
        export_architecture(args.export)
    run = {"accelerate": stack_accelerate, "diffusers": stack_accelerate, "emamodel": stack_emamodel,
           "lightning": stack_lightning, "module": stack_module, "dcp": stack_dcp}
    for s in stacks:
        one = argparse.Namespace(**vars(args))
        one.stack = s
        one.out = Path(args.out.replace("{stack}", s))
        one.flat = Path(args.flat.replace("{stack}", s))
        one.limit = args.limit if s in ("accelerate", "diffusers") else 0
        one.hostile = args.hostile if s == "module" else None
        one.stop_on_early_stop = args.stop_on_early_stop and s in resumable
        one.out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        run[s](one, x)
        print(f"{s}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
