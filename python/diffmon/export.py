"""Export any ``torch.nn.Module`` to the diffmon model contract (docs/design.md §11).

The exported TorchScript file has one method::

    forward(x: Tensor[B,C,H,W] float32, sigma: Tensor[B] float32)
        -> (denoised: Tensor[B,C,H,W], features: Tensor[B,C',H',W'] or Tensor[B,d])

``denoised`` is the EDM denoiser D(x; sigma) ~ E[x0 | x] for ``x = x0 + sigma * n``, whatever the
network's own parameterization; ``features`` is the output of the submodule named
``feature_layer`` (a dotted name as listed by ``module.named_modules()``), captured during the
same forward pass.

How the feature layer is captured
---------------------------------
Python forward hooks are not part of TorchScript, so a hook on the exported file would be lost.
Instead the module is *traced* (``torch.jit.trace``) while a forward hook is installed that stashes
the layer's output, and the traced function returns that stashed tensor next to the denoised
image. Tracing records tensor operations, not Python, so the stashed value simply becomes an extra
output of the graph; for a nested layer the tracer threads it out through every enclosing
submodule (their traced ``forward`` methods return an extra value). The hook stores a ``clone()``
of the output so that a later in-place op (``ReLU(inplace=True)``) cannot alter it.

The trace is made on a deep copy of the module in eval mode whose ``forward`` is replaced by the
conversion function, so the exported file's parameters and buffers carry exactly the names of
``module.state_dict()`` (no wrapper prefix): checkpoints saved with
``torch.save(module.state_dict())`` load into it by name. The conversion's own constants (noise
schedule tables) are graph constants, not buffers, so they never show up as extra keys.

Limits (the usual ones of tracing): Python control flow that depends on tensor *values* or on the
batch size is frozen at the traced example (B=2); ``export`` re-runs the reloaded file at B=3 on
different noise levels and compares it with the eager module, so such a freeze is normally caught
and raised as :class:`ExportError`, but a branch that the check inputs happen to take the same
way as the trace is not. The network must be callable as ``module(x, sigma_or_t)`` (wrap
conditional models so that the extra inputs are fixed); its output may be a tensor, a tuple/list
whose first item is the tensor, or an object with a ``.sample`` attribute (diffusers). The feature
layer must run exactly once per forward and return a tensor; a ``[B,L,D]`` token output is
mean-pooled over ``L`` to ``[B,D]``.

Device independence
-------------------
Tracing freezes the device of tensors a network creates itself: diffusers' ``torch.ones(B,
device=timesteps.device)`` is recorded as ``device=torch.device("cpu")`` (a ``prim::Constant`` of
type ``Device``), so a file traced on the CPU would fail on CUDA and the other way round. After
tracing, ``export`` rewrites every such constant, in every method graph of the module and of all
its submodules, to ``prim::device(t)`` of that graph's first tensor input ``t`` (``x`` for the
top-level ``forward``): the created tensors then follow the input's device. A graph with a device
constant but no tensor input cannot be rewritten and is an :class:`ExportError`. After saving,
the reloaded file is checked to hold no device constant (:func:`device_constants` lists them,
with the op that uses each); the file's ``diffmon.json`` note records ``"device_independent":
true`` and the torch version. Tensor constants (the VP schedule table) are not device constants:
they follow the device the file is loaded on (``map_location`` / ``CModule::load_on_device``).
Dtype constants are left alone: they do not depend on the device.

Parameterizations
-----------------
``edm``      ``module(x, sigma)`` already returns D(x; sigma).
``edm_raw``  ``module(c_in x, c_noise)`` returns the raw network output F of Karras et al. (2022):
             ``D = c_skip x + c_out F`` with ``c_skip = sd^2/(sigma^2+sd^2)``,
             ``c_out = sigma sd / sqrt(sigma^2+sd^2)``, ``c_in = 1/sqrt(sigma^2+sd^2)``,
             ``c_noise = ln(sigma)/4`` and ``sd = sigma_data``.
``eps``      VP epsilon prediction ``module(x_vp, t) ~ E[n | x_vp]``.
``v``        VP v-prediction ``module(x_vp, t) ~ E[v | x_vp]``, ``v = alpha n - s x0``.
``x0``       VP data prediction ``module(x_vp, t) ~ E[x0 | x_vp]``.

VP <-> EDM. A VP state is ``x_vp = alpha x0 + s n`` with ``alpha^2 + s^2 = 1``. Dividing by alpha
gives the EDM state ``x = x_vp / alpha = x0 + (s/alpha) n``, so ``sigma = s/alpha``,
``alpha = 1/sqrt(1+sigma^2)``, ``s = sigma/sqrt(1+sigma^2)`` and the network input is
``x_vp = x / sqrt(1+sigma^2)``. Then, with ``n = (x - x0)/sigma``:

* eps: ``D = x - sigma * eps``.
* v:   ``x0 = alpha x_vp - s v`` (because ``alpha x_vp - s v = alpha^2 x0 + alpha s n - s alpha n
  + s^2 x0 = x0``), so ``D = x / (1+sigma^2) - sigma / sqrt(1+sigma^2) * v``. This is the EDM
  preconditioning with ``sigma_data = 1`` and ``F = -v``.
* x0:  ``D = x0``.

The scale factors always use the requested sigma itself (as in the ``iDDPMPrecond`` of the EDM
code); only the timestep handed to the network is derived from the schedule:

* ``schedule="linear"`` (default; DDPM: betas = linspace(beta_min, beta_max, T), defaults 1e-4,
  0.02, 1000), ``"scaled_linear"`` (betas = linspace(sqrt(beta_min), sqrt(beta_max), T)^2, Stable
  Diffusion's, defaults 0.00085, 0.012), ``"cosine"`` (Nichol & Dhariwal, s = 0.008, betas
  clipped at 0.999), or an explicit ``alphas_cumprod`` table: discrete timesteps ``t = 0..T-1``
  with ``alphabar_t = prod_{i<=t} (1 - beta_i)`` and ``sigma_t = sqrt((1-alphabar_t)/alphabar_t)``.
  ``timestep="nearest"`` (default) passes the int64 index whose ``sigma_t`` is nearest to sigma in
  log space; ``timestep="interp"`` passes a float32 fractional index, linear in ``log sigma_t``
  between the two neighbouring indices (clamped to ``[0, T-1]``), for networks whose time
  embedding accepts non-integer times.
* ``schedule="continuous"``: the VP SDE of Song et al. with linear ``beta(t) = beta_min +
  t (beta_max - beta_min)``, ``t`` in ``[0, 1]`` (defaults 0.1, 20), ``alphabar(t) =
  exp(-beta_min t - (beta_max-beta_min) t^2 / 2)``; the exact inverse
  ``t = (sqrt(beta_min^2 + 2 (beta_max-beta_min) ln(1+sigma^2)) - beta_min) / (beta_max-beta_min)``
  is used and the network receives ``t * t_scale`` (default 999, as in score_sde / EDM's
  ``VPPrecond``), float32, not clamped.

``sigma_data`` is used by ``edm_raw`` only.

Command line
------------
``diffmon-export`` (installed with the ``diffmon`` binary by ``pip install ./``; ``pip install
./python`` installs the helpers alone, only for environments that never run the daemon, and
replaces the binary) and ``python -m diffmon.export`` are the same program.
``--factory module:attr.attr`` names a callable (dotted attributes after the colon are followed)
that returns the module, called with the JSON ``--factory-kwargs``; ``--weights`` then loads a
state_dict into it, read by content: a safetensors file (with the ``safetensors``
package) or a ``torch.save`` file (``torch.load(weights_only=True)``, optionally nested under
``--weights-key``), with ``--strip-prefix`` removed from the names.

A diffusers model saved with ``save_pretrained`` (``checkpoint-500/unet``, as diffusers'
``train_unconditional.py`` writes it) is built by its own ``from_pretrained``::

    diffmon-export --factory diffusers:UNet2DModel.from_pretrained \
        --factory-kwargs '{"pretrained_model_name_or_path": "run/checkpoint-500/unet"}' \
        --feature-layer mid_block --shape 3 64 64 --out run/model.ts \
        --parameterization eps --schedule linear --T 1000

A UNet trained with ``DDPMScheduler`` predicts the noise (``prediction_type="epsilon"``, the
default: ``--parameterization eps``; ``"v_prediction"`` is ``v``, ``"sample"`` is ``x0``) on the
schedule of its ``scheduler_config.json``: ``beta_schedule="linear"`` is ``--schedule linear``
with ``--beta-min``/``--beta-max`` = ``beta_start``/``beta_end`` (defaults 1e-4, 0.02, as
DDPMScheduler's) and ``--T`` = ``num_train_timesteps`` (1000); ``"scaled_linear"`` and
``"squaredcos_cap_v2"`` are ``--schedule scaled_linear`` and ``cosine``. The exported file's
parameter names are those of ``unet.state_dict()``, so every later ``checkpoint-N`` of the run
loads into it.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "export",
    "ExportError",
    "device_constants",
    "PARAMETERIZATIONS",
    "SCHEDULES",
    "vp_alphas_cumprod",
    "edm_sampling_sigmas",
]

PARAMETERIZATIONS = ("edm", "edm_raw", "eps", "v", "x0")
SCHEDULES = ("linear", "scaled_linear", "cosine", "continuous")
_VP = ("eps", "v", "x0")

_DEFAULT_BETAS = {
    "linear": (1e-4, 0.02),
    "scaled_linear": (0.00085, 0.012),
    "continuous": (0.1, 20.0),
}


class ExportError(RuntimeError):
    """The module cannot be exported, or the exported file does not reproduce it."""


def vp_alphas_cumprod(schedule: str = "linear", beta_min: Optional[float] = None,
                      beta_max: Optional[float] = None, T: int = 1000) -> Tensor:
    """alphabar_t, t = 0..T-1, of a discrete VP schedule (float64)."""
    if T < 2:
        raise ValueError(f"T must be >= 2, got {T}")
    if schedule == "cosine":
        s = 0.008

        def f(u: Tensor) -> Tensor:
            return torch.cos((u + s) / (1 + s) * math.pi / 2) ** 2

        i = torch.arange(T, dtype=torch.float64)
        betas = (1 - f((i + 1) / T) / f(i / T)).clamp(max=0.999)
    elif schedule in ("linear", "scaled_linear"):
        lo, hi = _DEFAULT_BETAS[schedule]
        lo = lo if beta_min is None else float(beta_min)
        hi = hi if beta_max is None else float(beta_max)
        if not (0 < lo <= hi < 1):
            raise ValueError(f"need 0 < beta_min <= beta_max < 1, got {lo}, {hi}")
        if schedule == "linear":
            betas = torch.linspace(lo, hi, T, dtype=torch.float64)
        else:
            betas = torch.linspace(math.sqrt(lo), math.sqrt(hi), T, dtype=torch.float64) ** 2
    else:
        raise ValueError(f"unknown discrete schedule {schedule!r}")
    return torch.cumprod(1 - betas, dim=0)


def edm_sampling_sigmas(n: int = 18, sigma_min: float = 0.002, sigma_max: float = 80.0,
                        rho: float = 7.0) -> Tensor:
    """The EDM sampling noise levels t_0 > ... > t_{n-1} (float64, docs/design.md §3)."""
    i = torch.arange(n, dtype=torch.float64)
    return (sigma_max ** (1 / rho) + i / (n - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


class _Converter:
    """The EDM <-> network conversion, written with torch ops so it traces."""

    def __init__(self, parameterization: str, sigma_data: float, schedule: str,
                 beta_min: Optional[float], beta_max: Optional[float], T: int,
                 alphas_cumprod: Any, timestep: str, t_scale: Optional[float],
                 timestep_dtype: Optional[torch.dtype], device: torch.device):
        if parameterization not in PARAMETERIZATIONS:
            raise ValueError(f"parameterization must be one of {PARAMETERIZATIONS}, got {parameterization!r}")
        self.p = parameterization
        self.sigma_data = float(sigma_data)
        if self.sigma_data <= 0:
            raise ValueError(f"sigma_data must be > 0, got {sigma_data}")
        self.continuous = False
        self.log_sigmas: Optional[Tensor] = None
        if parameterization not in _VP:
            return
        if timestep not in ("nearest", "interp"):
            raise ValueError(f"timestep must be 'nearest' or 'interp', got {timestep!r}")
        self.timestep = timestep
        if alphas_cumprod is not None:
            ab = torch.as_tensor(alphas_cumprod, dtype=torch.float64).flatten().cpu()
            if ab.numel() < 2 or not bool(((ab > 0) & (ab < 1)).all()) or not bool((ab[1:] < ab[:-1]).all()):
                raise ValueError("alphas_cumprod must be a strictly decreasing table of values in (0, 1)")
        elif schedule == "continuous":
            lo, hi = _DEFAULT_BETAS["continuous"]
            self.beta_min = lo if beta_min is None else float(beta_min)
            self.beta_d = (hi if beta_max is None else float(beta_max)) - self.beta_min
            if self.beta_min < 0 or self.beta_d <= 0:
                raise ValueError(f"need 0 <= beta_min < beta_max, got {beta_min}, {beta_max}")
            self.continuous = True
            self.t_scale = 999.0 if t_scale is None else float(t_scale)
            self.t_dtype = timestep_dtype or torch.float32
            return
        elif schedule in SCHEDULES:
            ab = vp_alphas_cumprod(schedule, beta_min, beta_max, T)
        else:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if t_scale is not None:
            raise ValueError("t_scale applies to schedule='continuous' only")
        self.alphas_cumprod = ab
        self.log_sigmas = (0.5 * torch.log((1 - ab) / ab)).to(device)  # ascending
        default_dtype = torch.int64 if timestep == "nearest" else torch.float32
        self.t_dtype = timestep_dtype or default_dtype

    # -- sigma -> network time -------------------------------------------------------------------
    def time(self, sigma: Tensor) -> Tensor:
        """sigma [B] float32 -> the time argument the VP network expects, [B]."""
        s = sigma.to(torch.float64)
        if self.continuous:
            t = (torch.sqrt(self.beta_min ** 2 + 2 * self.beta_d * torch.log1p(s * s)) - self.beta_min) / self.beta_d
            return (t * self.t_scale).to(self.t_dtype)
        ls = torch.log(s)
        # A graph constant: it follows the load device (torch.jit.load(map_location=...) /
        # tch CModule::load_on_device), not a later module.to(device).
        table = self.log_sigmas
        assert table is not None
        if self.timestep == "nearest":
            idx = torch.argmin(torch.abs(ls.unsqueeze(1) - table.unsqueeze(0)), dim=1)
            return idx.to(self.t_dtype)
        n = table.shape[0]
        hi = torch.searchsorted(table, ls.contiguous()).clamp(1, n - 1)
        lo = hi - 1
        w = (ls - table[lo]) / (table[hi] - table[lo])
        t = (lo.to(torch.float64) + w).clamp(0, n - 1)
        return t.to(self.t_dtype)

    # -- the whole conversion --------------------------------------------------------------------
    def denoise(self, net_call, x: Tensor, sigma: Tensor) -> Tensor:
        sig = sigma.to(x.dtype).reshape(-1)
        s4 = sig.reshape(-1, 1, 1, 1)
        if self.p == "edm":
            return _as_tensor(net_call(x, sig))
        if self.p == "edm_raw":
            sd = self.sigma_data
            c_skip = sd * sd / (s4 * s4 + sd * sd)
            c_out = s4 * sd / torch.sqrt(s4 * s4 + sd * sd)
            c_in = 1 / torch.sqrt(s4 * s4 + sd * sd)
            c_noise = torch.log(sig) / 4
            return c_skip * x + c_out * _as_tensor(net_call(c_in * x, c_noise))
        x_vp = x / torch.sqrt(1 + s4 * s4)
        out = _as_tensor(net_call(x_vp, self.time(sig)))
        if self.p == "eps":
            return x - s4 * out
        if self.p == "v":
            return x / (1 + s4 * s4) - s4 / torch.sqrt(1 + s4 * s4) * out
        return out  # x0


def _as_tensor(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    sample = getattr(out, "sample", None)
    if isinstance(sample, Tensor):
        return sample
    raise ExportError(f"the network returned {type(out).__name__}; expected a Tensor, a tuple whose "
                      "first item is a Tensor, or an object with a .sample Tensor")


def _example_inputs(shape: Sequence[int], batch: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape
    # Noise levels across the useful range, spread differently for the trace and the check.
    if batch == 2:
        sigma = torch.tensor([0.35, 3.0])
    else:
        base = torch.tensor([0.02, 0.6, 18.0, 0.1, 2.5, 60.0, 0.005, 7.0])
        sigma = base.repeat(batch // base.numel() + 1)[:batch]
    x0 = 0.5 * torch.randn(batch, c, h, w, generator=g).clamp(-2, 2)
    x = x0 + sigma.reshape(-1, 1, 1, 1) * torch.randn(batch, c, h, w, generator=g)
    return x.to(device), sigma.to(device)


def _parse_shape(example_shape) -> tuple:
    if example_shape is None:
        raise ValueError("example_shape is required: (C,H,W) or (B,C,H,W) of one input image batch")
    shape = tuple(int(v) for v in example_shape)
    if len(shape) == 4:
        shape = shape[1:]
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"example_shape must be (C,H,W) or (B,C,H,W), got {example_shape!r}")
    return shape


def _atomic_tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _non_persistent_buffers(net: nn.Module) -> list:
    """Dotted names of the buffers registered with ``persistent=False``."""
    names = []
    for prefix, mod in net.named_modules():
        for b in sorted(getattr(mod, "_non_persistent_buffers_set", ())):
            if mod._buffers.get(b) is not None:
                names.append(f"{prefix}.{b}" if prefix else b)
    return names


# ---------------------------------------------------------------------------------------------
# Device independence (module docstring)
# ---------------------------------------------------------------------------------------------

def _method_graphs(script_module) -> list:
    """``(name, graph)`` of every method of a ScriptModule and of all its submodules, ``name``
    being ``forward`` or ``time_proj.forward`` (dotted submodule path). Submodules of one class
    type share their method graphs: each graph is listed once."""
    out, seen = [], set()
    for prefix, mod in script_module.named_modules():
        c = mod._c
        type_name = c._type().qualified_name()
        for meth in c._method_names():
            if (type_name, meth) in seen:
                continue
            seen.add((type_name, meth))
            out.append((f"{prefix}.{meth}" if prefix else meth, c._get_method(meth).graph))
    return out


def _nodes(block):
    """Every node of a graph or block, nested blocks (``prim::If``, ``prim::Loop``) included."""
    for n in block.nodes():
        yield n
        for b in n.blocks():
            yield from _nodes(b)


def _is_device_constant(node) -> bool:
    return node.kind() == "prim::Constant" and node.output().type().kind() == "DeviceObjType"


def _where(node) -> str:
    """The first line of a node's source range: the Python line it was traced from."""
    lines = [ln.strip() for ln in str(node.sourceRange()).splitlines() if ln.strip()]
    return lines[0] if lines else "(no source range)"


def _describe(method: str, const) -> list:
    device = str(const.output().toIValue())
    users = [u.user for u in const.output().uses()]
    if not users:
        return [{"device": device, "op": "(unused)", "method": method, "where": _where(const)}]
    return [{"device": device, "op": u.kind(), "method": method, "where": _where(u)} for u in users]


def device_constants(script_module) -> list:
    """The device constants (``prim::Constant`` of type ``Device``) in every method graph of a
    TorchScript module and of all its submodules, nested blocks included: one dict per use,
    ``{"device": "cpu", "op": "aten::ones", "method": "forward", "where": "unet_2d.py(285): forward"}``
    (``method`` is dotted by submodule, ``where`` is the source line of the op). ``script_module``
    is a loaded ``torch.jit.ScriptModule`` or the path of a TorchScript file (loaded on the CPU).
    An empty list means the file runs on whatever device its inputs are on."""
    if isinstance(script_module, (str, os.PathLike)):
        script_module = torch.jit.load(str(script_module), map_location="cpu")
    found = []
    for method, graph in _method_graphs(script_module):
        for n in _nodes(graph):
            if _is_device_constant(n):
                found.extend(_describe(method, n))
    return found


def _format_pins(pins: list) -> str:
    return "; ".join(f"{p['op']} pins device {p['device']!r} in {p['method']} ({p['where']})" for p in pins)


def _make_device_independent(script_module) -> int:
    """Replace every device constant of every method graph by ``prim::device`` of that graph's
    first tensor input (inserted at the start of the graph, so it dominates nested blocks too).
    Returns the number of constants replaced; raises ExportError for a graph without a tensor
    input."""
    replaced = 0
    for method, graph in _method_graphs(script_module):
        consts = [n for n in _nodes(graph) if _is_device_constant(n)]
        if not consts:
            continue
        # inputs()[0] is `self` (a module type); Optional[Tensor] or scalar inputs do not count.
        source = next((v for v in graph.inputs() if v.type().kind() == "TensorType"), None)
        if source is None:
            pins = [p for n in consts for p in _describe(method, n)]
            raise ExportError(f"cannot make the export device-independent: {_format_pins(pins)}, and "
                              f"{method} takes no tensor input whose device could replace it; create the "
                              "tensor on the device of an input tensor (device=x.device) in a method that has one")
        device = graph.create("prim::device", [source], 1)
        device.output().setType(torch._C.DeviceObjType.get())
        device.insertBefore(next(iter(graph.nodes())))
        for n in consts:
            n.output().replaceAllUsesWith(device.output())
            n.destroy()
            replaced += 1
    return replaced


def export(module: nn.Module, feature_layer: str, path, parameterization: str = "edm",
           example_shape=None, sigma_data: float = 0.5, *, schedule: str = "linear",
           beta_min: Optional[float] = None, beta_max: Optional[float] = None, T: int = 1000,
           alphas_cumprod=None, timestep: str = "nearest", t_scale: Optional[float] = None,
           timestep_dtype: Optional[torch.dtype] = None, device="cpu", atol: float = 1e-5,
           check: bool = True) -> torch.jit.ScriptModule:
    """Wrap ``module`` into the diffmon model contract and save it as TorchScript at ``path``.

    Args:
        module: the network. It is not modified: a deep copy, moved to ``device`` (and cast to
            float32 when its parameters are not), is traced in eval mode.
        feature_layer: dotted name of the submodule whose output is the feature map.
        path: output file; written atomically (temporary name, checked, then renamed).
        parameterization: ``edm`` | ``edm_raw`` | ``eps`` | ``v`` | ``x0`` (see module docstring).
        example_shape: ``(C,H,W)`` or ``(B,C,H,W)`` of the model input; any B is ignored: the
            trace is made with B=2 and checked with B=3, so the batch dimension is dynamic.
        sigma_data: EDM sigma_data (``edm_raw`` only).
        schedule, beta_min, beta_max, T, alphas_cumprod, timestep, t_scale, timestep_dtype:
            the VP noise schedule for ``eps``/``v``/``x0`` (see module docstring).
        device: where the trace is made (and where the saved constants live); default CPU.
        atol: largest allowed max-abs difference between the reloaded file and the eager
            module, on both outputs.
        check: reload and compare (on by default).

    Returns the reloaded ``torch.jit.ScriptModule``.
    Raises ValueError for bad arguments and ExportError when tracing fails or the check differs.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    shape = _parse_shape(example_shape)
    device = torch.device(device)
    path = Path(path)
    conv = _Converter(parameterization, sigma_data, schedule, beta_min, beta_max, T, alphas_cumprod,
                      timestep, t_scale, timestep_dtype, device)
    if not feature_layer:
        raise ValueError("feature_layer must name a submodule (not the whole module)")
    names = dict(module.named_modules())
    if feature_layer not in names:
        listing = ", ".join(n for n in names if n) or "(none)"
        raise ValueError(f"feature_layer {feature_layer!r} is not a submodule of {type(module).__name__}; "
                         f"submodules: {listing}")

    try:
        net = copy.deepcopy(module)
    except Exception as e:  # pragma: no cover - exotic modules
        raise ExportError(f"cannot deep-copy the module for tracing: {e}") from e
    net = net.to(device).eval()
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in net.parameters()):
        net = net.float()  # half / bfloat16 / double weights: the contract is float32
    for p in net.parameters():
        p.requires_grad_(False)

    captured: list = []

    def hook(_mod, _inp, out):
        captured.append(out.clone() if isinstance(out, Tensor) else out)

    layer = net.get_submodule(feature_layer)
    handle = layer.register_forward_hook(hook)
    inner_forward = type(net).forward

    def net_call(a, b):
        return inner_forward(net, a, b)

    def contract_forward(x: Tensor, sigma: Tensor):
        captured.clear()
        denoised = conv.denoise(net_call, x, sigma)
        if len(captured) != 1:
            raise ExportError(f"feature layer {feature_layer!r} ran {len(captured)} times in one forward; "
                              "it must run exactly once")
        feats = captured[0]
        captured.clear()
        if not isinstance(feats, Tensor):
            raise ExportError(f"feature layer {feature_layer!r} returned {type(feats).__name__}, not a Tensor")
        if feats.dim() == 3:
            feats = feats.mean(dim=1)
        if not torch.jit.is_tracing():  # checked eagerly before the trace and after it
            if feats.dim() not in (2, 4) or feats.shape[0] != x.shape[0]:
                raise ExportError(f"feature layer {feature_layer!r} output has shape {tuple(feats.shape)}; "
                                  "expected [B,C,H,W], [B,d] or [B,L,d]")
            if denoised.shape != x.shape:
                raise ExportError(f"denoised output has shape {tuple(denoised.shape)}, input {tuple(x.shape)}")
        return denoised.to(torch.float32), feats.to(torch.float32)

    # Tracing `net` itself (with an instance-level forward) keeps its parameter names unprefixed.
    net.forward = contract_forward
    x2, s2 = _example_inputs(shape, 2, 0, device)
    try:
        with torch.no_grad():
            contract_forward(x2, s2)  # eager first: the module's own errors, not the tracer's
    except Exception:
        handle.remove()
        raise
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # TorchScript is the contract (libtorch loads it); its deprecation notices are noise here.
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit")
            # torch.nn.functional's own batch-size sanity checks (group_norm, ...) are frozen
            # harmlessly; warnings about the user's code are kept.
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r"torch\.nn\.functional")
            traced = torch.jit.trace(net, (x2, s2), check_trace=False)
    except ExportError:
        handle.remove()
        raise
    except Exception as e:
        handle.remove()
        raise ExportError(f"torch.jit.trace failed: {e}") from e

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _atomic_tmp(path)
    try:
        # The trace's device constants become the input's device (module docstring).
        _make_device_independent(traced)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit")
            # Non-persistent buffers are part of the module but never of a state_dict(): the
            # note tells diffmon not to expect them in checkpoints (they keep these values).
            note = {"non_persistent_buffers": _non_persistent_buffers(net),
                    "device_independent": True, "torch": torch.__version__}
            torch.jit.save(traced, str(tmp), _extra_files={"diffmon.json": json.dumps(note)})
            loaded = torch.jit.load(str(tmp), map_location=device)
        pins = device_constants(loaded)
        if pins:
            raise ExportError(f"the exported file is not device-independent: {_format_pins(pins)}; it "
                              "would fail on any other device")
        if check:
            x3, s3 = _example_inputs(shape, 3, 1, device)
            with torch.no_grad():
                want_d, want_f = contract_forward(x3, s3)
                try:
                    got = loaded(x3, s3)
                except Exception as e:
                    raise ExportError(f"the exported file fails at batch 3 (the trace used batch 2): {e}") from e
            if not (isinstance(got, tuple) and len(got) == 2):
                raise ExportError("the exported forward does not return (denoised, features)")
            for what, a, b in (("denoised", got[0], want_d), ("features", got[1], want_f)):
                if a.shape != b.shape:
                    raise ExportError(f"exported {what} has shape {tuple(a.shape)} at batch 3, eager "
                                      f"{tuple(b.shape)}: the batch dimension is not dynamic")
                diff = float((a - b).abs().max()) if a.numel() else 0.0
                if not diff <= atol:
                    raise ExportError(f"exported {what} differs from the eager module by {diff:.3g} "
                                      f"(> {atol:g}) at batch 3: data- or shape-dependent control flow "
                                      "was probably frozen by tracing")
        os.replace(tmp, path)
    finally:
        handle.remove()
        if tmp.exists():
            tmp.unlink()
    return loaded


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"--factory must look like package.module:callable, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _is_safetensors(path: str) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= os.path.getsize(path) - 8


def load_weights(path: str, key: Optional[str] = None, strip_prefix: str = "") -> dict:
    """The state_dict in ``path``: safetensors (detected by content) or a ``torch.save`` file read
    with ``weights_only=True``, optionally nested under ``key``, with ``strip_prefix`` removed."""
    if _is_safetensors(path):
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise SystemExit(f"{path} is a safetensors file: pip install safetensors") from e
        sd = load_file(path, device="cpu")
    else:
        # From an open file: torch.load would otherwise pick its reader by the file's extension.
        with open(path, "rb") as f:
            sd = torch.load(f, map_location="cpu", weights_only=True)
    if key:
        for part in key.split("."):
            sd = sd[part]
    if strip_prefix:
        sd = {k[len(strip_prefix):] if k.startswith(strip_prefix) else k: v for k, v in sd.items()}
    return sd


_EPILOG = """\
diffusers (a save_pretrained folder, e.g. a checkpoint-N/unet of train_unconditional.py):
  %(prog)s --factory diffusers:UNet2DModel.from_pretrained \\
      --factory-kwargs '{"pretrained_model_name_or_path": "run/checkpoint-500/unet"}' \\
      --feature-layer mid_block --shape 3 64 64 --out run/model.ts \\
      --parameterization eps --schedule linear --T 1000
A UNet trained with DDPMScheduler (prediction_type "epsilon", beta_schedule "linear",
num_train_timesteps 1000) is --parameterization eps --schedule linear --T 1000, with
--beta-min/--beta-max = the scheduler's beta_start/beta_end when not 1e-4/0.02
("v_prediction" is v, "sample" is x0; "scaled_linear" and "squaredcos_cap_v2" are
--schedule scaled_linear and cosine).
"""


def main(argv=None) -> int:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    ap = argparse.ArgumentParser(
        prog=prog if prog.startswith("diffmon-export") else "python -m diffmon.export",
        description="Export a PyTorch network to diffmon's TorchScript model contract "
                    "(forward(x, sigma) -> (EDM denoised, features)).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factory", required=True,
                    help="module:callable returning the nn.Module (importable from the current folder); "
                         "dotted attributes after the colon are followed, e.g. "
                         "diffusers:UNet2DModel.from_pretrained")
    ap.add_argument("--factory-kwargs", default="{}", help="JSON object of keyword arguments for the factory")
    ap.add_argument("--weights", help="optional state_dict to load first: safetensors (detected by content) "
                                      "or a torch.save file (read with torch.load(weights_only=True))")
    ap.add_argument("--weights-key", help="key under which the state_dict is nested (e.g. ema, model; "
                                          "dots for deeper levels)")
    ap.add_argument("--strip-prefix", default="", help="key prefix to strip, e.g. module.")
    ap.add_argument("--list-layers", action="store_true", help="print the submodule names and exit")
    ap.add_argument("--feature-layer", help="dotted submodule name of the feature layer")
    ap.add_argument("--shape", type=int, nargs=3, metavar=("C", "H", "W"), help="input image shape")
    ap.add_argument("--parameterization", default="edm", choices=PARAMETERIZATIONS)
    ap.add_argument("--sigma-data", type=float, default=0.5)
    ap.add_argument("--schedule", default="linear", choices=SCHEDULES)
    ap.add_argument("--beta-min", type=float)
    ap.add_argument("--beta-max", type=float)
    ap.add_argument("--T", type=int, default=1000, help="number of discrete timesteps")
    ap.add_argument("--timestep", default="nearest", choices=("nearest", "interp"))
    ap.add_argument("--t-scale", type=float)
    ap.add_argument("--out", help="output TorchScript file")
    args = ap.parse_args(argv)

    module = _load_factory(args.factory)(**json.loads(args.factory_kwargs))
    if args.list_layers:
        for name, m in module.named_modules():
            if name:
                print(f"{name}\t{type(m).__name__}")
        return 0
    if not (args.feature_layer and args.shape and args.out):
        ap.error("--feature-layer, --shape and --out are required (or use --list-layers)")
    if args.weights:
        module.load_state_dict(load_weights(args.weights, args.weights_key, args.strip_prefix))
    export(module, args.feature_layer, args.out, parameterization=args.parameterization,
           example_shape=tuple(args.shape), sigma_data=args.sigma_data, schedule=args.schedule,
           beta_min=args.beta_min, beta_max=args.beta_max, T=args.T, timestep=args.timestep,
           t_scale=args.t_scale)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
