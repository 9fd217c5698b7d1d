#!/usr/bin/env python3
"""Write the fixtures diffmon's Rust integration tests need (deterministic by --seed, ~300 KB).

    python python/make_fixtures.py OUT_DIR [--seed 0] [--width 4]

Model (train_toy.ToyDenoiser, 1x16x16 input, feature layer "mid", EDM parameterization; it has a
BatchNorm with non-default running statistics and a random Fourier frequency buffer ``freqs``):

    arch.ts                 instance A exported with diffmon.export (the architecture)
    ckpt_state_dict.pt      instance B: torch.save(B.state_dict())  (an OrderedDict)
    ckpt_ema.pt             torch.save({"ema": B.state_dict(), "step": 7})
    ckpt_module_prefix.pt   B.state_dict() with every key prefixed "module." (as DDP saves it)
    ckpt.safetensors        B's state_dict via safetensors.torch.save_file
    ckpt.ts                 B exported with diffmon.export
    reference.h5            /x [4,1,16,16], /sigma [4], /denoised [4,1,16,16], /features [4,8,4,4]:
                            B's eager forward in eval mode (what arch.ts + any ckpt_* must give)

Broken inputs:

    ckpt_truncated.pt       the first half of ckpt_state_dict.pt
    ckpt_zero.pt            an empty file
    ckpt_evil.pt            torch.save zip whose data.pkl calls os.system("touch OUT_DIR/PWNED")
                            when unpickled (never load it with weights_only=False)
    ckpt_wrong_shape.pt     state_dict of the same model class at another width
    ckpt_missing_keys.pt    B.state_dict() without the key named in manifest.json

Data (the same 10 digit images, 16x16):

    data_f32.h5             /images float32 [10,1,16,16] = u8/127.5 - 1, and /expected (same values)
    data_u8_nhwc.h5         /images uint8 [10,16,16,1]
    data_u8_nchw.h5         /images uint8 [10,1,16,16]

manifest.json records the shapes, the missing key and the other settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffmon.export import export  # noqa: E402
from train_toy import FEATURE_LAYER, ToyDenoiser, load_digit_images  # noqa: E402

SIZE = 16
REFERENCE_SIGMAS = (0.02, 0.29, 1.0, 10.0)


class _RunsShell:
    """Unpickling this calls os.system(command). Only ever pickled, never loaded, here."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _make_model(width: int, seed: int, bn_seed: int) -> ToyDenoiser:
    torch.manual_seed(seed)
    model = ToyDenoiser(1, width)
    # A few train-mode forwards so the BatchNorm running statistics move away from (0, 1).
    g = torch.Generator().manual_seed(bn_seed)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            x = 0.7 * torch.randn(8, 1, SIZE, SIZE, generator=g) + 0.3
            sigma = torch.exp(-1.2 + 1.2 * torch.randn(8, generator=g))
            model(x, sigma)
    return model.eval()


def _save_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _h5(path: Path, **datasets) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        for name, value in datasets.items():
            f.create_dataset(name, data=value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write diffmon's Rust test fixtures.")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=4, help="model width (default 4: tiny files)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest and immune to busy neighbours
    out: Path = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []

    def mark(name: str) -> Path:
        written.append(name)
        return out / name

    shape = (1, 1, SIZE, SIZE)
    seed = args.seed
    arch = _make_model(args.width, seed, seed + 100)
    export(arch, FEATURE_LAYER, mark("arch.ts"), example_shape=shape)

    b = _make_model(args.width, seed + 1, seed + 101)
    sd = b.state_dict()
    assert isinstance(sd, OrderedDict)
    torch.save(sd, mark("ckpt_state_dict.pt"))
    torch.save({"ema": sd, "step": 7}, mark("ckpt_ema.pt"))
    torch.save(OrderedDict((f"module.{k}", v) for k, v in sd.items()), mark("ckpt_module_prefix.pt"))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(mark("ckpt.safetensors")))
    export(b, FEATURE_LAYER, mark("ckpt.ts"), example_shape=shape)

    # Reference outputs of B: digit images plus noise at a spread of noise levels.
    images = load_digit_images(SIZE)
    g = torch.Generator().manual_seed(seed + 2)
    x0 = images[torch.randperm(len(images), generator=g)[:4]]
    sigma = torch.tensor(REFERENCE_SIGMAS, dtype=torch.float32)
    x = (x0 + sigma.reshape(-1, 1, 1, 1) * torch.randn(x0.shape, generator=g)).contiguous()
    feats: list = []
    handle = b.get_submodule(FEATURE_LAYER).register_forward_hook(lambda m, i, o: feats.append(o.clone()))
    with torch.no_grad():
        denoised = b(x, sigma)
    handle.remove()
    features = feats[0]
    _h5(mark("reference.h5"), x=x.numpy(), sigma=sigma.numpy(), denoised=denoised.numpy(),
        features=features.numpy())

    # Self-check: the architecture with B's weights loaded by name reproduces the reference.
    check = torch.jit.load(str(out / "arch.ts"))
    check.load_state_dict(sd)
    with torch.no_grad():
        d2, f2 = check(x, sigma)
        d3, f3 = torch.jit.load(str(out / "ckpt.ts"))(x, sigma)
    for got in (d2, d3):
        assert float((got - denoised).abs().max()) <= 1e-5, "arch.ts + weights does not reproduce reference"
    for got in (f2, f3):
        assert float((got - features).abs().max()) <= 1e-5, "feature capture does not reproduce reference"

    # Broken inputs.
    full = (out / "ckpt_state_dict.pt").read_bytes()
    _save_bytes_atomic(mark("ckpt_truncated.pt"), full[: len(full) // 2])
    _save_bytes_atomic(mark("ckpt_zero.pt"), b"")
    evil_cmd = "touch " + shlex.quote(str(out / "PWNED"))
    evil = OrderedDict([("embed.freqs", sd["embed.freqs"].clone()), ("conv_in.weight", _RunsShell(evil_cmd))])
    torch.save(evil, mark("ckpt_evil.pt"))
    torch.manual_seed(seed + 3)
    torch.save(ToyDenoiser(1, args.width + 2).state_dict(), mark("ckpt_wrong_shape.pt"))
    missing_key = f"{FEATURE_LAYER}.conv1.weight"
    torch.save(OrderedDict((k, v) for k, v in sd.items() if k != missing_key), mark("ckpt_missing_keys.pt"))

    # Data in the three layouts of docs/design.md §12.
    idx = torch.randperm(len(images), generator=g)[:10]
    u8_nchw = np.clip(np.rint((images[idx].numpy().astype(np.float64) + 1.0) * 127.5), 0, 255).astype(np.uint8)
    u8_nchw[0, 0, 0, 0], u8_nchw[0, 0, 0, 1] = 0, 255  # both ends of the range
    expected = u8_nchw.astype(np.float32) / np.float32(127.5) - np.float32(1.0)
    _h5(mark("data_f32.h5"), images=expected, expected=expected)
    _h5(mark("data_u8_nhwc.h5"), images=np.ascontiguousarray(u8_nchw.transpose(0, 2, 3, 1)))
    _h5(mark("data_u8_nchw.h5"), images=u8_nchw)

    manifest = {
        "seed": seed,
        "width": args.width,
        "input_shape": [1, SIZE, SIZE],
        "feature_layer": FEATURE_LAYER,
        "feature_shape": list(features.shape[1:]),
        "parameterization": "edm",
        "sigma_data": 0.5,
        "reference_sigmas": list(REFERENCE_SIGMAS),
        "tolerance": 1e-5,
        "state_dict_keys": list(sd.keys()),
        "ema_key": "ema",
        "strip_prefix": "module.",
        "missing_key": missing_key,
        "wrong_shape_width": args.width + 2,
        "evil_marker": str(out / "PWNED"),
        "u8_conversion": "x / 127.5 - 1 (float32)",
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    written.append("manifest.json")
    print(f"wrote {len(written)} files to {out}: {' '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
