"""The compiled network on the tier's device: the student exported with ``diffmon-export``'s
compile step for that device (AOTInductor, fp32, batch 64 and up: diffusers' ``Upsample2D``
guards smaller batches), then ``diffmon eval`` with ``model.compiled`` naming the package against
the same config with ``model.compiled: off``, on identical draws. The checkpoint's weights reach
the package by name (the architecture file holds other weights), so the agreement also checks
the weight swap on the device. Skipped where torch cannot compile (no C++ compiler, no Triton)."""

import json
import time

import pytest

from conftest import SHAPE

# fp32 compiled against fp32 TorchScript: 1e-5 relative on the CPU (tests/integration/compiled.rs);
# on a GPU Inductor's generated kernels sum in another order than cuDNN's, as the CPU and the GPU
# do (ICR 1.2e-5 apart on an H200): the bar here is ten times the CPU's.
TOL = {"cpu": 1e-5, "cuda": 1e-4}


@pytest.fixture(scope="module")
def package(tier, assets, tmp_path_factory):
    import torch
    from conftest import _unet
    from diffmon.export import ExportError, export

    d = tmp_path_factory.mktemp("compiled")
    device = tier.dev("cuda")
    t0 = time.perf_counter()
    try:
        export(_unet(0, tier.unet), "mid_block", d / "model.ts", "eps", SHAPE, schedule="linear",
               device=device, compile={"min_batch": 64})
    except ExportError as e:  # a machine that cannot compile (no C++ compiler, no Triton)
        if "compiling it with AOTInductor failed" not in str(e):
            raise
        pytest.skip(f"AOTInductor cannot compile here: {e}")
    return d, time.perf_counter() - t0, torch.__version__


def _config(path, assets, model, device, compiled):
    path.write_text(
        f"run: {{dir: '{assets.dir}', name: gpu}}\n"
        f"state_dir: '{path.parent / (path.stem + '.state')}'\n"
        f"model: {{architecture: '{model}', compiled: '{compiled}'}}\n"
        f"device: '{device}'\n"
        f"data: {{path: '{assets.train}', heldout_path: '{assets.heldout}'}}\n"
        "icr: {samples: 1024, batch_size: 100, seed: 3}\n")
    return path


def test_the_compiled_package_gives_torchscripts_numbers(dm, tier, assets, package, measure):
    d, compile_s, torch_version = package
    device = tier.dev("cuda")
    side = json.loads((d / "model.pt2.json").read_text())
    assert side["device"] == device.split(":")[0] and side["min_batch"] == 64
    rec = {}
    for name, compiled in (("compiled", d / "model.pt2"), ("torchscript", "off")):
        config = _config(d / f"{name}.yaml", assets, d / "model.ts", device, compiled)
        checked = dm.run("check-config", config)
        assert checked.returncode == 0, checked.stderr
        assert ("compiled package" in checked.stdout) == (name == "compiled"), checked.stdout
        t0 = time.perf_counter()
        rec[name], _ = dm.eval_json(config)
        rec[name]["_s"] = time.perf_counter() - t0
    tol = TOL[device.split(":")[0]]
    worst = 0.0
    for key in ("icr", "icr_invariant_trace", "icr_residual_trace", "loss_train", "loss_heldout"):
        a, b = rec["compiled"][key], rec["torchscript"][key]
        r = abs(a - b) / abs(b)
        worst = max(worst, r)
        assert r <= tol, f"{key}: compiled {a}, TorchScript {b} ({r:.2e} > {tol:g})"
    size = (d / "model.pt2").stat().st_size
    measure(f"compiled (AOTInductor, fp32, torch {torch_version}): worst relative difference "
            f"{worst:.2e} (tol {tol:g}); eval {rec['compiled']['_s']:.1f} s against TorchScript "
            f"{rec['torchscript']['_s']:.1f} s; export and compile {compile_s:.0f} s; package "
            f"{size / 2**20:.1f} MiB")
