"""Tracing a network to the contract: the feature layer, the example inputs, the trace itself, the
device constants that tracing freezes (rewritten to the input's device) and the file's note;
:func:`export`, the denoiser's export."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from .condition import Embedding, _WRAPPER_HINT, _fixed_inputs, _resolve_condition, _time_keyword
from .errors import ExportError
from .note import NOTE_VERSION
from .parameterization import _Converter, _as_tensor
from .scheduler import consistency_warning, read_scheduler_config, scheduler_mismatches, scheduler_round_trip


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
# Choosing the feature layer (module docstring)
# ---------------------------------------------------------------------------------------------

def _block_lists(module: nn.Module) -> list:
    """``(name, ModuleList)`` of every ModuleList whose last name component ends in ``blocks``."""
    return [(n, m) for n, m in module.named_modules()
            if n and isinstance(m, nn.ModuleList) and n.rsplit(".", 1)[-1].endswith("blocks") and len(m) > 0]


def suggest_feature_layer(module: nn.Module) -> Optional[str]:
    """The suggested feature layer: ``mid_block`` (a U-Net's bottleneck) if ``module`` has one,
    else the middle block, index ``(n-1)//2``, of the longest ModuleList named like ``*blocks``
    (the first of the longest; ``transformer_blocks.13`` of a 28-block DiT/SiT: block 14 of 28,
    the ICR paper's choice for SiT-XL/2). None when there is neither."""
    if dict(module.named_modules()).get("mid_block") is not None:
        return "mid_block"
    lists = _block_lists(module)
    if not lists:
        return None
    name, blocks = max(lists, key=lambda p: len(p[1]))  # max keeps the first of equals
    return f"{name}.{(len(blocks) - 1) // 2}"


def layer_marks(module: nn.Module) -> dict:
    """``{name: mark}`` for ``--list-layers``: ``middle of N`` on the middle block of each
    ModuleList of blocks (of at least 2), ``U-Net middle block`` on ``mid_block``, and
    ``suggested`` on :func:`suggest_feature_layer`'s choice."""
    marks: dict = {}
    for name, blocks in _block_lists(module):
        if len(blocks) >= 2:
            marks.setdefault(f"{name}.{(len(blocks) - 1) // 2}", []).append(f"middle of {len(blocks)}")
    if dict(module.named_modules()).get("mid_block") is not None:
        marks.setdefault("mid_block", []).append("U-Net middle block")
    best = suggest_feature_layer(module)
    if best is not None:
        marks.setdefault(best, []).append("suggested")
    return {k: ", ".join(v) for k, v in marks.items()}


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


_HARMLESS_TRACER_WARNINGS = (
    # torch.nn.functional's batch-size sanity checks (group_norm, ...).
    (r"torch\.nn\.functional", ""),
    # diffusers' checks of the channel count and the spatial size, and its .contiguous()
    # workarounds for large batches.
    (r"diffusers\.", r"Converting a tensor to a Python (boolean|integer)"),
)


@contextlib.contextmanager
def _quiet_trace():
    """The warnings filters of a trace: torch's deprecation notices about TorchScript (the
    contract: libtorch loads it) and :data:`_HARMLESS_TRACER_WARNINGS`; any other TracerWarning,
    one from the network's own code in particular, is shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit")
        for module, message in _HARMLESS_TRACER_WARNINGS:
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=module,
                                    message=message)
        yield


def export(module: nn.Module, feature_layer: str, path, parameterization: str = "edm",
           example_shape=None, sigma_data: float = 0.5, *, schedule: str = "linear",
           beta_min: Optional[float] = None, beta_max: Optional[float] = None, T: int = 1000,
           alphas_cumprod=None, timestep: str = "nearest", t_scale: Optional[float] = None,
           timestep_dtype: Optional[torch.dtype] = None, device="cpu", atol: float = 1e-5,
           check: bool = True, condition: Any = "auto", class_keyword: str = "class_labels",
           extra_conditions: Sequence[Embedding] = (), scheduler: Any = None,
           warn_inconsistent: bool = False, verbose: bool = True,
           compile: Optional[dict] = None) -> torch.jit.ScriptModule:
    """Wrap ``module`` into the diffmon model contract and save it as TorchScript at ``path``.

    Args:
        module: the network. It is not modified: a deep copy, moved to ``device`` (and cast to
            float32 when its parameters are not), is traced in eval mode.
        feature_layer: dotted name of the submodule whose output is the feature map.
        path: output file; written atomically (temporary name, checked, then renamed).
        parameterization: a name of :data:`PARAMETERIZATION_TABLE` (``edm``, ``edm_raw``, ``eps``,
            ``v``, ``x0``, ``rectified_flow``, ``sit_linear_velocity``, ...; module docstring).
        example_shape: ``(C,H,W)`` or ``(B,C,H,W)`` of the model input; any B is ignored: the
            trace is made with B=2 and checked with B=3, so the batch dimension is dynamic.
        sigma_data: EDM sigma_data (``edm_raw`` only).
        schedule, beta_min, beta_max, T, alphas_cumprod, timestep, t_scale, timestep_dtype:
            the VP noise schedule for ``eps``/``v``/``x0`` (see module docstring); ``t_scale``
            and ``timestep_dtype`` also set the time of a flow-matching network.
        device: where the trace is made (and where the saved constants live); default CPU.
        atol: largest allowed max-abs difference between the reloaded file and the eager
            module, on both outputs.
        check: reload and compare (on by default).
        condition: what the network gets besides (x, t), held fixed (module docstring,
            "Conditional networks"): ``"auto"`` (default: the null class if the module is
            class-conditional, else nothing), ``None`` (nothing), ``"null"`` (the null class, see
            :func:`null_class`), a class index ``int``, or an :class:`Embedding`.
        class_keyword: the keyword the class labels are passed as (``class_labels``, diffusers').
        extra_conditions: further :class:`Embedding` s held fixed next to ``condition``, each
            passed as its own keyword (SD3's ``pooled_projections``: ``Embedding(t,
            "pooled_projections", pooled=True)``).
        scheduler: the diffusers scheduler the network was trained with (a config dict, a
            ``scheduler_config.json`` or its folder): the export is checked against it and a
            mismatch is an :class:`ExportError` (module docstring, "What a wrong parameterization
            does").
        warn_inconsistent: print a warning when the exported denoiser does not behave as a
            trained one at high noise (:func:`consistency_warning`); for trained weights only,
            and not where ``scheduler`` checked the parameterization exactly (an early
            checkpoint, still far from trained at high noise, would be warned about for
            nothing).
        verbose: print the condition applied (one line), if any.
        compile: also compile the same wrapper into an AOTInductor package beside ``path``: the
            keywords of :func:`diffmon.compile.compile_contract` (``device`` must be this
            export's; ``{}`` for the defaults). ``None`` (default): TorchScript only.

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
    sched_cfg = read_scheduler_config(scheduler) if scheduler is not None else None
    if sched_cfg is not None:
        wrong = scheduler_mismatches(sched_cfg, conv, schedule, beta_min, beta_max, T)
        wrong = wrong or list(filter(None, [scheduler_round_trip(sched_cfg, conv)]))
        if wrong:
            raise ExportError("the export disagrees with the training scheduler: " + "; ".join(wrong))
    cond = _fixed_inputs(module, _resolve_condition(module, condition, class_keyword), extra_conditions).to(device)
    time_keyword = _time_keyword(module)
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
        if isinstance(out, (tuple, list)):
            # A joint (MMDiT) block of SD3/Flux returns (encoder_hidden_states, hidden_states):
            # the image tokens are its last tensor.
            tensors = [o for o in out if isinstance(o, Tensor)]
            out = tensors[-1] if tensors else out
        captured.append(out.clone() if isinstance(out, Tensor) else out)

    layer = net.get_submodule(feature_layer)
    handle = layer.register_forward_hook(hook)
    inner_forward = type(net).forward

    channels = shape[0]
    learned_sigma: list = []  # set by the eager run before the trace

    def net_call(a, b):
        if time_keyword is None:
            out = _as_tensor(inner_forward(net, a, b, **cond.kwargs(a, b)))
        else:
            out = _as_tensor(inner_forward(net, a, **{time_keyword: b}, **cond.kwargs(a, b)))
        if not torch.jit.is_tracing():
            learned_sigma[:] = [out.dim() == 4 and out.shape[1] == 2 * channels]
        if learned_sigma[0]:
            out = out[:, :channels]  # learned sigma: the first C channels are the prediction
        return out

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
                raise ExportError(f"denoised output has shape {tuple(denoised.shape)}, input {tuple(x.shape)} "
                                  "(a network output of 2*C channels is taken as learned sigma; any other "
                                  "mismatch is an error)")
        return denoised.to(torch.float32), feats.to(torch.float32)

    # Tracing `net` itself (with an instance-level forward) keeps its parameter names unprefixed.
    net.forward = contract_forward
    if verbose and cond.line:
        print(cond.line)
    x2, s2 = _example_inputs(shape, 2, 0, device)
    try:
        with torch.no_grad():
            contract_forward(x2, s2)  # eager first: the module's own errors, not the tracer's
    except ExportError:
        handle.remove()
        raise
    except Exception as e:
        handle.remove()
        given = ", ".join(["x", f"{time_keyword}=t" if time_keyword else "t"]
                          + [f"{k}=..." for k in cond.kwargs(x2, s2)])
        raise ExportError(f"{type(module).__name__} failed when called as forward({given}): "
                          f"{type(e).__name__}: {e}; " + _WRAPPER_HINT) from e
    try:
        with torch.no_grad(), _quiet_trace():
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
            note = {"note_version": NOTE_VERSION, "kind": "network",
                    "non_persistent_buffers": _non_persistent_buffers(net),
                    "device_independent": True, "torch": torch.__version__,
                    "input_shape": [int(d) for d in shape],
                    "feature_layer": feature_layer, "parameterization": parameterization,
                    "learned_sigma": bool(learned_sigma[0]), "condition": cond.note, **conv.note()}
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
        if warn_inconsistent and sched_cfg is None:
            top = float(conv.log_sigmas[-1].exp()) if conv.log_sigmas is not None else 80.0
            warning = consistency_warning(loaded, shape, device, sigma_max=top)
            if warning:
                print(f"warning: {warning}", file=sys.stderr)
        os.replace(tmp, path)
        if compile is not None:
            _compile(net, path, shape, device, compile)
    finally:
        handle.remove()
        if tmp.exists():
            tmp.unlink()
    return loaded


def _compile(net: nn.Module, path: Path, shape, device: torch.device, options: dict) -> None:
    """The compiled package beside the TorchScript file (diffmon/compile.py)."""
    from ..compile import compile_contract

    options = dict(options)
    if torch.device(options.pop("device", device)) != device:
        raise ValueError("compile: the package is compiled on the export's device; pass device= "
                         "to export() as well")
    try:
        compile_contract(net, path, shape, device, **options)
    except (ValueError, ExportError):
        raise
    except Exception as e:
        raise ExportError(f"{path} written; compiling it with AOTInductor failed: {e}") from e
