"""The compiled network: an AOTInductor package of the model contract beside the TorchScript file.

``diffmon-export ... --compile`` writes, next to ``model.ts``:

* ``model.pt2``: ``torch.export`` of the very wrapper the TorchScript file was traced from
  (``forward(x, sigma) -> (denoised, features)``, the condition and the parameterization
  conversion inside, the same parameter and buffer names), compiled by
  ``torch._inductor.aoti_compile_and_package`` for one device, with a dynamic batch dimension
  (``min_batch`` to ``max_batch``; diffmon pads a shorter batch with copies of its last image and
  drops their outputs, so the draws never change). It holds the kernels only, no weights:
  diffmon gives it each checkpoint's weights by name before it runs, so the package is not a
  second copy of the network's weights (a 113.7 M-parameter U-Net's would be 455 MB), and no
  network is too large for a shared object's 2 GiB;
* ``model.pt2.constants``, where the graph has constants of its own (tensors its forward
  creates, a VP schedule's table, a condition; ``_tensor_constant<N>`` in the package): those
  tensors, by their names in the package, a ``torch.save`` of a dict that diffmon reads as it
  reads a checkpoint (no code runs);
* ``model.pt2.json``: the sidecar diffmon reads *before* it loads the package (which runs native
  code): the format, the torch release, the device kind and its arch (the CPU's instruction-set
  flags: Inductor compiles C++ with ``-march=native``; the CUDA compute capability), the
  precision baked in (``fp32``, or ``bf16`` autocast inside the graph), the batch range, the
  weight names the package takes per checkpoint, ``weights_inside: false``, the constants file's
  SHA-256 and each of its tensors' dtype and shape, the SHA-256 of the TorchScript file
  it belongs to, and the command that rebuilds it.

Compile where the network will run. A package is tied to one torch release and one device arch,
so the compile step belongs to the machine that evaluates (or one identical to it): the flag is
on the exporter because the wrapper only exists in the exporter's process (the network's Python
code, the feature hook, the conversion), and re-running ``diffmon-export ... --compile`` there is
the rebuild command the daemon prints when it refuses a package. The TorchScript file, the format
that always works, is written first, exactly as without the flag.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor, nn

__all__ = ["compile_contract", "sidecar_path", "const_path", "cpu_isa_flags", "PRECISIONS",
           "FORMAT"]

FORMAT = "diffmon-aoti/1"
PRECISIONS = ("fp32", "bf16")
# A bf16 package against eager bf16 autocast: the largest difference relative to the output's
# largest value. bfloat16 keeps 8 bits (0.4 % a rounding); a network's outputs differ by a few
# roundings where the two round at different places, and a wrong graph or an unreachable weight
# by far more.
BF16_RTOL = 0.05

# /proc/cpuinfo flags that name instructions (Inductor compiles with -march=native, so the code
# may use any of them); the others (hypervisor, constant_tsc, ...) say nothing about what runs.
_ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "bmi", "amx", "popcnt", "movbe", "aes",
                 "sha", "vaes", "vpclmulqdq", "gfni", "adx", "abm", "lzcnt", "asimd", "sve",
                 "fp", "neon", "bf16", "i8mm", "dotprod")


def cpu_isa_flags() -> list:
    """The instruction-set flags of this CPU (Linux's /proc/cpuinfo ``flags`` or ``Features``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted({f for f in value.split() if f.startswith(_ISA_PREFIXES)})
    return []


def sidecar_path(package: Path) -> Path:
    return Path(str(package) + ".json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _device_arch(device: torch.device) -> dict:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"device": "cuda", "arch": f"sm_{major}{minor}",
                "device_name": torch.cuda.get_device_name(device)}
    return {"device": "cpu", "arch": platform.machine(), "cpu_flags": cpu_isa_flags()}


def _examples(shape, batch: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape
    sigma = torch.exp(torch.linspace(-4.0, 4.0, batch))
    x = 0.5 * torch.randn(batch, c, h, w, generator=g) + sigma.reshape(-1, 1, 1, 1) * torch.randn(
        batch, c, h, w, generator=g)
    return x.to(device), sigma.to(device)


def compile_contract(net: nn.Module, script: Path, shape, device, *, precision: str = "fp32",
                     min_batch: int = 2, max_batch: int = 4096, out: Optional[Path] = None,
                     rebuild: Optional[str] = None, rtol: float = 1e-5,
                     say: Callable[[str], None] = print) -> Path:
    """Compile ``net`` (the exporter's wrapper: its ``forward`` is the model contract) into an
    AOTInductor package beside the TorchScript file ``script``; returns the package's path.

    The package is checked before it is kept: loaded back and run at batches ``min_batch`` and
    ``min_batch + 1`` against the eager wrapper, both outputs, the largest difference relative to
    the output's largest value: ``rtol`` in fp32; in bf16 against eager bf16 autocast at
    ``BF16_RTOL`` (Inductor rounds to bfloat16 at other places than eager autocast does).
    Relative, because an epsilon network's denoised output ``x - sigma * eps`` carries the
    rounding of ``eps`` times sigma, as its values scale with sigma. Both files are written
    under temporary names and renamed, the package first.
    """
    import torch._inductor  # noqa: F401  (the package API)

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not 2 <= min_batch <= max_batch:
        raise ValueError(f"need 2 <= min_batch <= max_batch, got {min_batch}, {max_batch}")
    device = torch.device(device)
    script = Path(script)
    out = Path(out) if out is not None else script.with_suffix(".pt2")
    contract = net.forward

    def forward(x: Tensor, sigma: Tensor):
        if precision == "fp32":
            return contract(x, sigma)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            d, f = contract(x, sigma)
        return d.float(), f.float()

    net.forward = forward
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.pt2")
    side_tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.json")
    const_tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.constants")
    # fp32 is float32 throughout, as diffmon runs it (evaluation.precision: fp32 turns TF32
    # off): CUDA's TF32 convolutions (cuDNN's default) would move both the compiled kernels'
    # choice and the eager reference by 1e-3.
    tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    if precision == "fp32":
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x, s = _examples(shape, max(min_batch, 3), 0, device)
        batch = torch.export.Dim("batch", min=min_batch, max=max_batch)
        started = time.perf_counter()
        # torch.export's own use of a pytree class torch deprecates, not the user's to act on.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, message=r".*LeafSpec")
            program = torch.export.export(net, (x, s), dynamic_shapes=({0: batch}, {0: batch}),
                                          strict=False)
            # Small weights (a bias of 4 values) would otherwise be inlined as literals into the
            # kernels, where no checkpoint could reach them. The weights go beside the shared
            # object, not into it, and are then taken out of the package (_take_out_weights).
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(tmp),
                inductor_configs={"always_keep_tensor_constants": True,
                                  "aot_inductor.package_constants_in_so": False,
                                  "aot_inductor.package_constants_on_disk_format":
                                      "pickle_weights"})
        seconds = time.perf_counter() - started
        named = dict(net.named_parameters())
        named.update(net.named_buffers())
        # Every tensor the package reads, by its name there: the network's weights (each
        # checkpoint gives them) and the graph's own constants (a VP schedule's table, a
        # condition: `_tensor_constant<N>`), which go into a file beside it.
        held = _take_out_weights(tmp)
        constants = {n: t for n, t in held.items() if n not in named}
        cases = [_examples(shape, b, 1 + b, device) for b in (min_batch, min_batch + 1)]
        swap_case = _examples(shape, min_batch, 9, device)
        on_cpu = lambda out: tuple(t.cpu() for t in out)  # noqa: E731
        with torch.no_grad():
            wants = [on_cpu(forward(*c)) for c in cases]
        # Every weight the outputs depend on must be reachable by name: perturbed weights
        # swapped in must give what the eager network gives with them.
        saved = {n: t.detach().clone() for n, t in named.items()}
        g = torch.Generator().manual_seed(7)
        try:
            with torch.no_grad():
                for t in named.values():
                    if t.is_floating_point() and t.numel() > 0:
                        t.add_(0.05 * (t.std() if t.numel() > 1 else 1.0) * torch.randn(
                            t.shape, generator=g).to(t.device))
                perturbed = {n: t.detach().clone() for n, t in named.items()}
                want_swapped = on_cpu(forward(*swap_case))
        finally:
            with torch.no_grad():
                for n, t in named.items():
                    t.copy_(saved[n])
        # The package runs in a child process: libtorch's loader is native code, and where it
        # crashes (CUDA packages on torch 2.11, BENCHMARKS.md) the exporter says so instead.
        fqns, gots, got_swapped = probe_package(tmp, device, cases, swap_case, perturbed,
                                                constants={**saved, **constants})
        if fqns != set(held):
            raise RuntimeError(f"the package takes {sorted(fqns)}, and Inductor wrote "
                               f"{sorted(held)} beside it")
        # The graph's weights; any other parameter or buffer (num_batches_tracked) it never reads.
        weights = [n for n in named if n in fqns]
        tol = rtol if precision == "fp32" else BF16_RTOL
        for b, got, want in zip((min_batch, min_batch + 1), gots, wants):
            _agree(got, want, tol, f"at batch {b}")
        _agree(got_swapped, want_swapped, tol,
               "after new weights were swapped in (a weight is not reachable by name: folded "
               "into the code at compile time)")
        note = {
            "format": FORMAT,
            "torch": torch.__version__.split("+")[0],
            **_device_arch(device),
            "precision": precision,
            "min_batch": min_batch,
            "max_batch": max_batch,
            "weights": weights,
            "weights_inside": False,
            "constants": _write_constants(constants, const_tmp),
            "architecture": script.name,
            "architecture_sha256": _sha256(script),
            "rebuild": rebuild or f"diffmon-export ... --compile (the export of {script.name})",
            "compile_seconds": round(seconds, 1),
        }
        side_tmp.write_text(json.dumps(note, indent=1) + "\n")
        os.replace(tmp, out)
        if constants:
            os.replace(const_tmp, const_path(out))
        elif os.path.lexists(const_path(out)):
            os.unlink(const_path(out))
        os.replace(side_tmp, sidecar_path(out))
    finally:
        net.forward = contract
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
        for t in (tmp, side_tmp, const_tmp, _kernels_tmp(tmp)):
            if t.exists():
                t.unlink()
    say(f"wrote {out} ({precision}, {device.type}, batch {min_batch}..{max_batch}, "
        f"compiled in {seconds:.0f} s)")
    return out


def const_path(package: Path) -> Path:
    """The file of the graph's own constants beside ``package``: ``model.pt2.constants``."""
    return Path(str(package) + ".constants")


def _take_out_weights(package: Path) -> dict:
    """Every tensor ``package`` reads, by its name there, taken out of it: Inductor wrote them
    as pickles beside the shared object (``package_constants_on_disk_format``); the package is
    rewritten without them, so it holds the kernels only (diffmon gives it each checkpoint's
    weights, and the constants from their file, before it runs)."""
    import io
    import zipfile

    with zipfile.ZipFile(package) as z:
        names = z.namelist()
        configs = [n for n in names if n.endswith("/weights_config.json")]
        if len(configs) != 1:
            raise RuntimeError(f"the package {package} has {len(configs)} weights configs, "
                               "expected 1 (one model)")
        root = configs[0].split("/data/")[0]
        held = {}
        for fqn, (file, shape, stride, offset) in json.loads(z.read(configs[0])).items():
            blob = torch.load(io.BytesIO(z.read(f"{root}/data/weights/{file}")), weights_only=True)
            held[fqn] = blob.as_strided(shape, stride, offset).clone()
        kept = [n for n in names if n not in configs and not n.startswith(f"{root}/data/weights/")]
        rewritten = _kernels_tmp(package)
        with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_STORED) as out:
            for n in kept:
                out.writestr(z.getinfo(n), z.read(n))
    os.replace(rewritten, package)
    return held


def _kernels_tmp(package: Path) -> Path:
    return package.with_name(package.name + ".kernels")


def _write_constants(constants: dict, tmp: Path):
    """Writes the graph's own constants (``torch.save`` of a dict of tensors, which diffmon
    reads as it reads a checkpoint: no code runs) to ``tmp``, renamed to :func:`const_path` of
    the package later; returns what the sidecar says of them (the file's SHA-256, each tensor's
    dtype and shape), or None when the graph has none."""
    if not constants:
        return None
    torch.save({n: t.detach().cpu().contiguous() for n, t in constants.items()}, tmp)
    return {"sha256": _sha256(tmp),
            "tensors": {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                        for n, t in constants.items()}}


def _agree(got, want, rtol: float, when: str) -> None:
    """Both outputs of the package within ``rtol`` of the eager network's largest value."""
    for what, a, w in zip(("denoised", "features"), got, want):
        diff = float((a - w).abs().max()) if a.shape == w.shape else float("inf")
        diff /= max(float(w.abs().max()), 1e-12)
        if not diff <= rtol:
            raise RuntimeError(f"the compiled package's {what} differs from the eager network "
                               f"{when} by {diff:.3g} of its largest value (> {rtol:g})")


def probe_package(package: Path, device, cases, swap_case, weights: dict,
                  child: Optional[list] = None, constants: Optional[dict] = None):
    """Loads ``package`` in a child process, gives it ``constants`` (every tensor it reads: it
    holds none), and runs it on each of ``cases`` (``(x, sigma)``), then with those of
    ``weights`` it takes swapped in, on ``swap_case``. Returns the package's weight names, the
    outputs of each case and the output after the swap (on the CPU). A child that crashes (a
    signal) or fails is a RuntimeError that says so; ``child`` replaces the child's command
    (tests)."""
    import subprocess
    import sys
    import tempfile

    cpu = lambda t: t.detach().cpu()  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="diffmon-probe-") as d:
        todo, done = Path(d) / "in.pt", Path(d) / "out.pt"
        torch.save({"package": str(package), "device": str(device),
                    "cases": [tuple(map(cpu, c)) for c in cases], "swap_case": tuple(map(cpu, swap_case)),
                    "weights": {n: cpu(t) for n, t in weights.items()},
                    "constants": {n: cpu(t) for n, t in (constants or {}).items()}}, todo)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")])))
        # -X faulthandler: a crash prints the Python frames it happened under (the loader's
        # call, or the first forward), which the error repeats.
        command = child or [sys.executable, "-X", "faulthandler", "-c",
                            "import sys; from diffmon.compile import _probe_child; _probe_child(*sys.argv[1:])"]
        p = subprocess.run([*command, str(todo), str(done)], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or [""])[-1]
            if p.returncode < 0:
                import signal
                why = f"crashed ({signal.Signals(-p.returncode).name})"
                frame = crash_frame(p.stderr)
                if frame:
                    why += f" at {frame}"
            else:
                why = f"failed (exit {p.returncode}: {last})"
            raise RuntimeError(f"libtorch's AOTInductor loader {why} on the package just compiled, "
                               "in a process of its own; this torch cannot run it here "
                               "(BENCHMARKS.md, \"The compiled network\")")
        out = torch.load(done, weights_only=True)
    return set(out["fqns"]), out["outputs"], out["swapped"]


def crash_frame(stderr: str) -> str:
    """The innermost Python frame faulthandler printed for the crashing thread ("Current thread
    ... (most recent call first):", then the frames), or "" where it printed none."""
    lines = stderr.strip().splitlines()
    current = [i for i, line in enumerate(lines) if line.startswith("Current thread")]
    frames = [line.strip() for line in lines[current[-1] + 1:]] if current else []
    return frames[0] if frames and frames[0].startswith("File ") else ""


def _probe_child(todo: str, done: str) -> None:
    """The child of :func:`probe_package`."""
    import torch._inductor

    job = torch.load(todo, weights_only=True)
    device = torch.device(job["device"])
    loaded = torch._inductor.aoti_load_package(job["package"])
    fqns = list(loaded.get_constant_fqns())
    run = lambda c: tuple(t.cpu() for t in loaded(*(t.to(device) for t in c)))  # noqa: E731
    with torch.no_grad():
        # A package without its weights inside reads memory never written until it has them.
        missing = [n for n in fqns if n not in job["constants"]]
        if missing:
            raise SystemExit(f"no value for the package's constants {missing}")
        loaded.load_constants({n: t.to(device) for n, t in job["constants"].items() if n in fqns},
                              check_full_update=True)
        outputs = [run(c) for c in job["cases"]]
        loaded.load_constants({n: t.to(device) for n, t in job["weights"].items() if n in fqns},
                              check_full_update=False)
        swapped = run(job["swap_case"])
    torch.save({"fqns": fqns, "outputs": outputs, "swapped": swapped}, done)


def add_arguments(ap) -> None:
    """The exporter's flags for the compiled package."""
    g = ap.add_argument_group("compiled package (--compile: AOTInductor, beside --out)")
    g.add_argument("--compile", action="store_true",
                   help="also write OUT.pt2 (and OUT.pt2.json): the network compiled by "
                        "AOTInductor for this machine's device, torch and arch")
    g.add_argument("--compile-device", default="cpu", help="cpu (default), cuda or cuda:N")
    g.add_argument("--compile-precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (default) or bf16 (autocast compiled in; evaluation.precision: bf16)")
    g.add_argument("--compile-min-batch", type=int, default=2,
                   help="smallest batch the package takes (default 2; diffusers' U-Nets: 64)")


def options(args, argv) -> Optional[dict]:
    """The :func:`compile_contract` keywords the flags ask for (``None`` without --compile)."""
    if not args.compile:
        return None
    # The command as it was run, with the PYTHONPATH that made --factory importable.
    path = os.environ.get("PYTHONPATH")
    prefix = f"PYTHONPATH={shlex.quote(path)} " if path else ""
    return {"device": args.compile_device, "precision": args.compile_precision,
            "min_batch": args.compile_min_batch,
            "rebuild": prefix + "diffmon-export " + shlex.join(argv)}
