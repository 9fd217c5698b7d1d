#!/usr/bin/env python3
"""The compiled network against TorchScript on this CPU: the toy's package and TorchScript file
as ``python/compiled_fixture.py`` writes them (the integration tests keep them under
``target/compiled-fixture/``), the network alone at one batch (best of 15 calls each, after
warm-up), the checkpoint's weights swapped into the package with ``load_constants``, and the
files' sizes.

    python bench/bench_compiled.py DIR [--batch 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def best(f, k: int = 15) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch._inductor

    torch.set_num_threads(args.threads)
    d = args.dir
    script = torch.jit.load(str(d / "arch.ts"))
    package = torch._inductor.aoti_load_package(str(d / "arch.pt2"))
    n = args.batch
    x = torch.randn(n, 1, 16, 16)
    sigma = torch.exp(torch.linspace(-3, 3, n))
    with torch.no_grad():
        for _ in range(3):
            script(x, sigma)
            package(x, sigma)
        t_script = best(lambda: script(x, sigma))
        t_package = best(lambda: package(x, sigma))
    state = torch.load(d / "ckpt_b.pt", weights_only=True)
    names = set(package.get_constant_fqns())
    weights = {k: v for k, v in state.items() if k in names}
    t_swap = best(lambda: package.load_constants(weights, check_full_update=False), 20)
    side = json.loads((d / "arch.pt2.json").read_text())
    print(json.dumps({
        "batch": n, "threads": args.threads,
        "torchscript_images_per_s": round(n / t_script, 1),
        "compiled_images_per_s": round(n / t_package, 1),
        "compiled_over_torchscript": round(t_script / t_package, 2),
        "swap_weights": len(weights), "swap_ms": round(t_swap * 1e3, 3),
        "forward_ms": round(t_package * 1e3, 1),
        "package_bytes": (d / "arch.pt2").stat().st_size,
        "torchscript_bytes": (d / "arch.ts").stat().st_size,
        "compile_seconds": side.get("compile_seconds"),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
