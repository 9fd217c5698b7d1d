#!/usr/bin/env python3
"""Which AOTInductor packages this torch can load and run on this device (BENCHMARKS.md, "The
compiled network"): libtorch's loader crashed (SIGSEGV) on every CUDA package of the model
contract with torch 2.11.0+cu130 on an H200, in `aoti_load_package`, before anything ran. This
probe compiles one small network (a convolution, a linear layer and a tensor constant of the
graph, the kinds of tensors diffmon's packages take) in each of a few ways, loads and runs each
package in a process of its own (so a crash is a row, not the end), and prints which work:

  in-so         the tensors inside the shared object (Inductor's default; diffmon's packages
                before the kernels-only ones)
  kernels-only  diffmon's packages: the tensors written beside the shared object, taken out,
                and given by `load_constants` before the first forward
  no-tensors    a network with no tensor at all (x * 2 + sigma): does the loader crash without
                constants too?
  embedded      in-so with the kernels' binaries embedded in the shared object
                (`aot_inductor.embed_kernel_binary`) instead of files beside it

The in-so package is also loaded two other ways (rows `in-so` with `load`): with the device's
index given (`device_index=0`, as diffmon's loader gives it, instead of the current device; on
CUDA only) and single-threaded (`run_single_threaded=True`, one runner without the container's thread pool).

    python bench/aoti_probe.py [--device cuda|cpu] [--only NAMES] [--out DIR]

A row per variant: compiled (seconds), loaded, ran, the largest difference from the eager
network relative to its largest value, or where the child crashed (its signal and the Python
frame, from faulthandler). Results also go to DIR/aoti-probe.json. `--device cpu` checks the
harness on a CPU machine (there every variant should run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from diffmon import compile as compiling  # noqa: E402

VARIANTS = ("in-so", "kernels-only", "no-tensors", "embedded")
# How the in-so package is loaded besides the default (`aoti_load_package`'s keywords).
LOADS = {"device-0": {"device_index": 0}, "single-threaded": {"run_single_threaded": True}}


class Small(nn.Module):
    """A convolution, a linear layer on the pooled features, and a table the graph owns."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16, 3)
        self.table = torch.linspace(0.5, 1.5, 10)  # a plain attribute: a constant of the graph

    def forward(self, x, sigma):
        h = torch.relu(self.conv(x))
        scale = self.table[(sigma.clamp(0, 0.999) * 10).long()]
        return x - scale.reshape(-1, 1, 1, 1) * h[:, :3], self.head(h.mean((2, 3)))


class NoTensors(nn.Module):
    def forward(self, x, sigma):
        return x * 2 + sigma.reshape(-1, 1, 1, 1), x.mean((1, 2, 3))


def compile_variant(name: str, device: torch.device, out: Path) -> dict:
    import torch._inductor  # noqa: F401  (the package API)

    torch.manual_seed(0)
    net = (NoTensors() if name == "no-tensors" else Small()).to(device).eval()
    if hasattr(net, "table"):
        net.table = net.table.to(device)
    x = torch.randn(4, 3, 16, 16, device=device)
    sigma = torch.rand(4, device=device)
    batch = torch.export.Dim("batch", min=2, max=64)
    configs = {"always_keep_tensor_constants": True}
    if name == "kernels-only":
        configs["aot_inductor.package_constants_in_so"] = False
        configs["aot_inductor.package_constants_on_disk_format"] = "pickle_weights"
    if name == "embedded":
        configs["aot_inductor.embed_kernel_binary"] = True
    row = {"variant": name}
    started = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(net, (x, sigma), dynamic_shapes=({0: batch}, {0: batch}),
                                      strict=False)
        want = [t.cpu() for t in net(x, sigma)]
        torch._inductor.aoti_compile_and_package(program, package_path=str(out),
                                                 inductor_configs=configs)
    row["compile_s"] = round(time.perf_counter() - started, 1)
    tensors = compiling._take_out_weights(out) if name == "kernels-only" else {}
    job = out.with_suffix(".job.pt")
    torch.save({"x": x.cpu(), "sigma": sigma.cpu(), "want": want,
                "tensors": {n: t.cpu() for n, t in tensors.items()}}, job)
    return row


def child(package: str, job: str, device: str, load: str) -> None:
    """Loads `package` the `load` way, gives it the job's tensors (a kernels-only package), runs
    it once."""
    import torch._inductor

    case = torch.load(job, weights_only=True)
    print("loading", flush=True)
    loaded = torch._inductor.aoti_load_package(package, **LOADS.get(load, {}))
    print("loaded", flush=True)
    if case["tensors"]:
        loaded.load_constants({n: t.to(device) for n, t in case["tensors"].items()},
                              check_full_update=True)
        print("constants given", flush=True)
    with torch.no_grad():
        got = loaded(case["x"].to(device), case["sigma"].to(device))
    diff = max(float((g.cpu() - w).abs().max()) / max(float(w.abs().max()), 1e-12)
               for g, w in zip(got, case["want"]))
    print(json.dumps({"ran": True, "relative_difference": diff}), flush=True)


def run_child(package: Path, device: str, load: str = "default") -> dict:
    p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--child", str(package),
                        str(package.with_suffix(".job.pt")), "--device", device, "--load", load],
                       capture_output=True, text=True, timeout=600)
    out = p.stdout.strip().splitlines()
    row = {"load": load, "loaded": "loaded" in out}
    if out and out[-1].startswith("{"):
        row.update(json.loads(out[-1]))
    if p.returncode < 0:
        import signal

        frame = compiling.crash_frame(p.stderr)
        row["crashed"] = f"{signal.Signals(-p.returncode).name} after '{out[-1] if out else ''}'" \
                         + (f" at {frame}" if frame else "")
    elif p.returncode != 0:
        row["failed"] = (p.stderr.strip().splitlines() or [""])[-1][:300]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--load", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.device, args.load)
        return 0
    device = torch.device(args.device)
    print(f"== AOTInductor probe: torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="aoti-probe-") as work:
        for name in args.only.split(","):
            package = Path(work) / f"{name}.pt2"
            try:
                row = compile_variant(name, device, package)
            except Exception as e:  # a variant this torch cannot compile is a row too
                row = {"variant": name, "compile_failed": str(e).splitlines()[0][:300]}
            else:
                row.update(run_child(package, args.device))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if name == "in-so" and "compile_failed" not in row:
                for load in LOADS if device.type == "cuda" else ["single-threaded"]:
                    rows.append({"variant": name, **run_child(package, args.device, load)})
                    print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "aoti-probe.json").write_text(json.dumps(
        {"torch": torch.__version__, "device": str(device), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
