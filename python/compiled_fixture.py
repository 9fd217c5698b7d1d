#!/usr/bin/env python3
"""Write the compiled-network fixtures of diffmon's Rust integration tests (tests/integration/
compiled.rs), which cache them under target/ keyed by the sources' hash: compiling a package
takes 30 to 60 s on a CPU, so a test session compiles at most these three.

    python python/compiled_fixture.py OUT_DIR [--width 16]

    arch.ts, arch.pt2(.json)   train_toy.ToyDenoiser (seed 0) exported with diffmon-export's
                               compile step: the architecture and its package
    ckpt_b.pt                  another instance's state_dict (seed 1, BatchNorm statistics moved)
    b.ts, b.pt2(.json)         that instance exported and compiled: the package built fresh from
                               the checkpoint, for the weight swap's check
    eps.ts, eps.pt2(.json, .constants)
                               an epsilon network (the toy, width 4, fed t / 1000) with DDPM's
                               linear schedule: its table is a constant of the graph, which goes
                               into the constants file beside the package
    ckpt_eps.pt                another instance's state_dict of it
    done                       written last
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffmon.export import export  # noqa: E402
from train_toy import FEATURE_LAYER, ToyDenoiser  # noqa: E402

SIZE = 16


def _model(width: int, seed: int) -> ToyDenoiser:
    torch.manual_seed(seed)
    model = ToyDenoiser(1, width)
    g = torch.Generator().manual_seed(seed + 100)
    model.train()
    with torch.no_grad():  # BatchNorm running statistics away from (0, 1)
        for _ in range(3):
            model(0.7 * torch.randn(8, 1, SIZE, SIZE, generator=g) + 0.3,
                  torch.exp(-1.2 + 1.2 * torch.randn(8, generator=g)))
    return model.eval()


class Timed(torch.nn.Module):
    """The toy as an epsilon network of DDPM's timesteps: it sees t / 1000."""

    def __init__(self, net: ToyDenoiser):
        super().__init__()
        self.net = net

    def forward(self, x, t):
        return self.net(x, t / 1000)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--width", type=int, default=16)
    args = ap.parse_args(argv)
    out: Path = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    shape = (1, 1, SIZE, SIZE)
    rebuild = f"python python/compiled_fixture.py {out}"
    export(_model(args.width, 0), FEATURE_LAYER, out / "arch.ts", example_shape=shape,
           compile={"rebuild": rebuild})
    b = _model(args.width, 1)
    torch.save(b.state_dict(), out / "ckpt_b.pt")
    export(b, FEATURE_LAYER, out / "b.ts", example_shape=shape, compile={"rebuild": rebuild})
    eps = Timed(_model(4, 2))
    export(eps, "net." + FEATURE_LAYER, out / "eps.ts", "eps", example_shape=shape,
           schedule="linear", compile={"rebuild": rebuild})
    torch.save(Timed(_model(4, 3)).state_dict(), out / "ckpt_eps.pt")
    (out / "done").write_text("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
