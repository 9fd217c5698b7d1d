"""The autoencoder of a latent model exported beside it: ``encode(images in [-1, 1]) -> scaled
latents`` (:func:`export_vae`)."""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .errors import ExportError
from .note import NOTE_VERSION
from .parameterization import _as_tensor
from .trace import _atomic_tmp, _format_pins, _make_device_independent, _non_persistent_buffers, _parse_shape, _quiet_trace, device_constants


def _posterior_mean(out: Any) -> Tensor:
    """The posterior mean of an ``encode`` result: ``.latent_dist.mean`` (diffusers'
    ``DiagonalGaussianDistribution``), or its ``mode()``."""
    dist = getattr(out, "latent_dist", None)
    if dist is None and isinstance(out, (tuple, list)) and out:
        dist = out[0]
    mean = getattr(dist, "mean", None)
    if isinstance(mean, Tensor):
        return mean
    mode = getattr(dist, "mode", None)
    if callable(mode):
        return mode()
    raise ExportError(f"encode(x) returned {type(out).__name__}; expected an object whose .latent_dist "
                      "has a .mean tensor (diffusers' AutoencoderKLOutput)")


def _config_value(vae: nn.Module, key: str):
    config = getattr(vae, "config", None)
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)


def export_vae(vae: nn.Module, path, example_shape, scaling_factor: Optional[float] = None,
               shift_factor: Optional[float] = None, device="cpu", *, atol: float = 1e-5,
               check: bool = True) -> torch.jit.ScriptModule:
    """Export a VAE (diffusers ``AutoencoderKL`` or anything with its ``encode(x).latent_dist`` /
    ``decode(z).sample`` interface) to one TorchScript file with the methods ``encode`` (=
    ``forward``) and ``decode`` (module docstring, "The VAE file").

    Args:
        vae: the autoencoder; not modified (a float32 deep copy is traced in eval mode).
        path: output file; written atomically.
        example_shape: ``(C,H,W)`` or ``(B,C,H,W)`` of the images (any B is ignored).
        scaling_factor, shift_factor: the latent scaling, ``z = (mean - shift) * scale``; default
            ``vae.config.scaling_factor`` / ``vae.config.shift_factor`` (missing or None: 1.0 / 0.0).
        device: where the trace is made; atol, check: as for :func:`export` (both methods).

    Returns the reloaded ``torch.jit.ScriptModule``.
    """
    if not isinstance(vae, nn.Module):
        raise TypeError(f"vae must be a torch.nn.Module, got {type(vae).__name__}")
    for meth in ("encode", "decode"):
        if not callable(getattr(vae, meth, None)):
            raise ValueError(f"{type(vae).__name__} has no {meth}() method: not a VAE")
    shape = _parse_shape(example_shape)
    device = torch.device(device)
    path = Path(path)
    if scaling_factor is None:
        scaling_factor = _config_value(vae, "scaling_factor")
    if shift_factor is None:
        shift_factor = _config_value(vae, "shift_factor")
    scale = 1.0 if scaling_factor is None else float(scaling_factor)
    shift = 0.0 if shift_factor is None else float(shift_factor)
    if not (math.isfinite(scale) and scale != 0 and math.isfinite(shift)):
        raise ValueError(f"need a finite non-zero scaling_factor and a finite shift_factor, got {scale}, {shift}")

    try:
        net = copy.deepcopy(vae)
    except Exception as e:  # pragma: no cover - exotic modules
        raise ExportError(f"cannot deep-copy the VAE for tracing: {e}") from e
    net = net.to(device).eval()
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in net.parameters()):
        net = net.float()
    for p in net.parameters():
        p.requires_grad_(False)
    enc, dec = type(net).encode, type(net).decode

    def encode(x: Tensor) -> Tensor:
        return ((_posterior_mean(enc(net, x)) - shift) * scale).to(torch.float32)

    def decode(z: Tensor) -> Tensor:
        return _as_tensor(dec(net, z / scale + shift)).to(torch.float32)

    def forward(x: Tensor) -> Tensor:
        return encode(x)

    # Instance attributes: the traced file's parameter names stay those of vae.state_dict().
    net.encode, net.decode, net.forward = encode, decode, forward
    g = torch.Generator().manual_seed(0)
    c, h, w = shape
    x2 = (torch.rand(2, c, h, w, generator=g) * 2 - 1).to(device)
    x3 = (torch.rand(3, c, h, w, generator=g) * 2 - 1).to(device)
    with torch.no_grad():
        z2 = encode(x2)
        if z2.dim() != 4 or z2.shape[0] != 2:
            raise ExportError(f"encode returned shape {tuple(z2.shape)} for {tuple(x2.shape)}; expected [B,c,h,w]")
        back = decode(z2)
        if back.shape != x2.shape:
            raise ExportError(f"decode returned shape {tuple(back.shape)} for latents {tuple(z2.shape)}; "
                              f"expected {tuple(x2.shape)}")
    try:
        with torch.no_grad(), _quiet_trace():
            traced = torch.jit.trace_module(net, {"forward": (x2,), "encode": (x2,), "decode": (z2,)},
                                            check_trace=False)
    except Exception as e:
        raise ExportError(f"torch.jit.trace_module failed: {e}") from e

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _atomic_tmp(path)
    try:
        _make_device_independent(traced)
        note = {"note_version": NOTE_VERSION, "kind": "vae", "scaling_factor": scale, "shift_factor": shift, "encode": "posterior mean",
                "image_shape": list(shape), "latent_shape": list(z2.shape[1:]),
                "non_persistent_buffers": _non_persistent_buffers(net),
                "device_independent": True, "torch": torch.__version__}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit")
            torch.jit.save(traced, str(tmp), _extra_files={"diffmon.json": json.dumps(note)})
            loaded = torch.jit.load(str(tmp), map_location=device)
        pins = device_constants(loaded)
        if pins:
            raise ExportError(f"the exported file is not device-independent: {_format_pins(pins)}; it "
                              "would fail on any other device")
        if check:
            with torch.no_grad():
                z3 = encode(x3)
                checks = (("encode", lambda: loaded.encode(x3), z3), ("forward", lambda: loaded(x3), z3),
                          ("decode", lambda: loaded.decode(z3), decode(z3)))
                for what, run, want in checks:
                    try:
                        got = run()
                    except Exception as e:
                        raise ExportError(f"the exported {what} fails at batch 3 (the trace used batch 2): {e}") from e
                    if got.shape != want.shape:
                        raise ExportError(f"exported {what} has shape {tuple(got.shape)} at batch 3, eager "
                                          f"{tuple(want.shape)}: the batch dimension is not dynamic")
                    diff = float((got - want).abs().max()) if got.numel() else 0.0
                    if not diff <= atol:
                        raise ExportError(f"exported {what} differs from the eager VAE by {diff:.3g} "
                                          f"(> {atol:g}) at batch 3")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return loaded
