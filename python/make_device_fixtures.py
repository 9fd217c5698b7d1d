"""Write the TorchScript files of diffmon's device tests (tests/integration/devices.rs).

Written into OUT_DIR (all follow the model contract, forward(x, sigma) -> (denoised, features),
on 1x16x16 images):

* ``pinned_cpu.ts``: traced on the CPU without the exporter's rewrite, so its graph holds a
  device constant (``torch.ones(..., device=cpu)``), as a file written by an older exporter.
* ``exported.ts``: the same network through ``diffmon.export`` (feature layer ``conv``), which
  rewrites the constant to the input's device.
* ``pinned_cuda.ts``: the same graph with that constant made ``cuda:0``, as a file traced on a
  GPU (made on the CPU: the constant is data until the graph runs).
* ``oom_at_4.ts`` / ``oom_never.ts``: a scripted network whose forward raises libtorch's
  "CUDA out of memory" error for a batch of more than 4 images (``oom_at_4``) or never, with the
  same per-image arithmetic otherwise, and ``oom_weights.pt``, a checkpoint of both.
* ``data.h5``: 64 random images in [-1, 1] (dataset ``images``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor, nn

from diffmon.export import export

SIZE = 16


class PinsDevice(nn.Module):
    """An EDM-style denoiser whose per-image scale comes from ``torch.ones(..., device=...)``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x: Tensor, sigma: Tensor):
        scale = torch.ones(x.shape[0], device=x.device) / (1 + sigma * sigma)
        h = torch.tanh(self.conv(x))
        return x * scale.reshape(-1, 1, 1, 1), h


class FailsAbove(nn.Module):
    """Per-image features ``tanh(flatten(x) @ w)``; a batch above ``limit`` fails as CUDA does."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.w = nn.Parameter(torch.randn(SIZE * SIZE, 8, generator=torch.Generator().manual_seed(0)) / SIZE)

    def forward(self, x: Tensor, sigma: Tensor):
        if x.shape[0] > self.limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test fixture)")
        s = sigma.reshape(-1, 1, 1, 1)
        return x / (1 + s * s), torch.tanh(x.flatten(1) @ self.w)


def device_constants(graph) -> list:
    """The Device-typed ``prim::Constant`` nodes of ``graph``, nested blocks included."""
    found, blocks = [], [graph.block()] if hasattr(graph, "block") else [graph]
    while blocks:
        for node in blocks.pop().nodes():
            blocks.extend(node.blocks())
            if node.kind() == "prim::Constant" and node.output().type().kind() == "DeviceObjType":
                found.append(node)
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    out = ap.parse_args(argv).out_dir
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    x = torch.randn(2, 1, SIZE, SIZE)
    sigma = torch.ones(2)

    traced = torch.jit.trace(PinsDevice().eval(), (x, sigma), check_trace=False)
    assert device_constants(traced.graph), "tracing no longer pins the device: the fixture is moot"
    torch.jit.save(traced, str(out / "pinned_cpu.ts"))
    export(PinsDevice(), "conv", out / "exported.ts", "edm", (1, 1, SIZE, SIZE))
    for node in device_constants(traced.graph):
        with traced.graph.insert_point_guard(node):
            cuda = traced.graph.insertConstant(torch.device("cuda:0"))
        node.output().replaceAllUsesWith(cuda)
        node.destroy()
    torch.jit.save(traced, str(out / "pinned_cuda.ts"))

    torch.jit.save(torch.jit.script(FailsAbove(4).eval()), str(out / "oom_at_4.ts"))
    never = FailsAbove(1 << 30).eval()
    torch.jit.save(torch.jit.script(never), str(out / "oom_never.ts"))
    with torch.no_grad():
        never.w.mul_(1.5)
    torch.save(never.state_dict(), out / "oom_weights.pt")

    import h5py

    with h5py.File(out / "data.h5", "w") as f:
        f.create_dataset("images", data=(torch.rand(64, 1, SIZE, SIZE) * 2 - 1).numpy())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
