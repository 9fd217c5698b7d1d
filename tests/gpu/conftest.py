"""The GPU test tier: the prebuilt ``diffmon`` binary driven as a user drives it, on a CUDA device.

Run it with ``make test-gpu`` or ``scripts/test-gpu`` (CONTRIBUTING.md, "Testing on a GPU").
Everything here is Python so that it runs on a GPU machine that has torch with CUDA but no Rust
toolchain: the binary is found from ``DIFFMON_BIN``, else ``target/release/diffmon``, else
``diffmon`` on ``PATH``.

``DIFFMON_GPU_TIER_DEVICE`` chooses what the tier runs on:

* unset or ``cuda``: the GPU; without a visible CUDA device every test is skipped, saying why;
* ``cpu``: a dry run of the harness on a CPU machine, ``cpu`` standing in for the GPU (the tests
  that only mean something on a real GPU, such as running out of its memory, skip);
* ``off``: every test skipped (``make test`` collects the tier this way, so that the skip and its
  reason show there while ``make test`` stays CPU-only).

The models are diffusers ``UNet2DModel``s exported with ``diffmon.export.export`` on the CPU, as a
user exports on a login node, and evaluated wherever the test says. Measured values are collected
with the ``measure`` fixture and printed at the end of the session ("GPU tier measurements"), so
that a closing note can quote them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

# A DDPM CIFAR-10-like UNet, small enough to be quick (4.4 M parameters; DDPM's own is 35.7 M):
# 3x32x32, epsilon prediction on the linear schedule, the feature layer is mid_block (128 ch).
UNET = dict(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(64, 128, 128),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"))
# The CPU dry run checks the harness, not the numbers: a quarter of the widths (1/16 of the work
# per image) and a quarter of the sample counts (Tier.n), so it takes minutes on 2 cores.
UNET_DRY_RUN = dict(UNET, block_out_channels=(16, 32, 32), norm_num_groups=8)
SHAPE = (1, 3, 32, 32)
N_TRAIN, N_HELDOUT = 256, 128
# Every diffmon process gets this long; a hang is a failure, not a stuck tier.
PROCESS_TIMEOUT = 600


def _device_setting() -> str:
    return os.environ.get("DIFFMON_GPU_TIER_DEVICE", "cuda").strip().lower() or "cuda"


def _find_binary() -> str | None:
    env = os.environ.get("DIFFMON_BIN")
    if env:
        return str(Path(env).resolve()) if Path(env).exists() else None
    built = ROOT / "target" / "release" / "diffmon"
    if built.exists():
        return str(built)
    return shutil.which("diffmon")


@dataclass
class Tier:
    """Where the tier runs: ``device`` is what stands for "the GPU" in configs (``cuda`` or, in
    the dry run, ``cpu``)."""

    device: str
    dry_run: bool
    binary: str | None
    device_name: str
    skip_reason: str | None
    measurements: list = field(default_factory=list)

    @property
    def unet(self) -> dict:
        return UNET_DRY_RUN if self.dry_run else UNET

    @property
    def feature_dim(self) -> int:
        """Channels of the UNet's mid_block: the ICR feature dimension d."""
        return self.unet["block_out_channels"][-1]

    def n(self, count: int) -> int:
        """A sample count as the tier runs it: itself on the GPU, a quarter in the dry run."""
        return count // 4 if self.dry_run else count

    def dev(self, spec: str) -> str:
        """A GPU device spec (``cuda``, ``cuda:0``) as the tier runs it: itself, or ``cpu`` in
        the dry run."""
        return "cpu" if self.dry_run else spec


def _make_tier() -> Tier:
    setting = _device_setting()
    binary = _find_binary()
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means the tier cannot run
        return Tier("cuda", False, binary, "none", f"torch is not importable: {e}")
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "none"
    no_cuda = "no CUDA device visible: torch.cuda.is_available() is False"
    if setting == "off":
        why = "the GPU tier runs with `make test-gpu` (scripts/test-gpu); `make test` is CPU-only"
        return Tier("cuda", False, binary, name, f"{why} ({no_cuda if not cuda else 'CUDA: ' + name})")
    if setting == "cpu":
        return Tier("cpu", True, binary, "cpu (dry run: DIFFMON_GPU_TIER_DEVICE=cpu)", None)
    if setting != "cuda":
        return Tier("cuda", False, binary, name,
                    f"DIFFMON_GPU_TIER_DEVICE must be cuda, cpu or off, got {setting!r}")
    if not cuda:
        return Tier("cuda", False, binary, name, no_cuda)
    return Tier("cuda", False, binary, name, None)


TIER = _make_tier()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_only: needs a real GPU; skipped in the CPU dry run")
    # Tracing diffusers' UNet warns about every shape check it freezes; the exporter's own
    # reload-and-compare check is what guards the export.
    config.addinivalue_line("filterwarnings", r"ignore:.*torch\.jit.*:DeprecationWarning")
    config.addinivalue_line("filterwarnings", r"ignore:Converting a tensor to a Python:Warning")
    config.addinivalue_line("filterwarnings", r"ignore:.*might cause the trace to be incorrect:Warning")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        if TIER.skip_reason:
            item.add_marker(pytest.mark.skip(reason=TIER.skip_reason))
        elif TIER.dry_run and item.get_closest_marker("gpu_only"):
            item.add_marker(pytest.mark.skip(
                reason="needs a real GPU (CPU dry run: DIFFMON_GPU_TIER_DEVICE=cpu)"))


def pytest_terminal_summary(terminalreporter):
    if not TIER.measurements:
        return
    tr = terminalreporter
    tr.section("GPU tier measurements")
    tr.write_line(f"device: {TIER.device_name}; binary: {TIER.binary}")
    for test, text in TIER.measurements:
        tr.write_line(f"{test}: {text}")


@pytest.fixture(scope="session")
def tier() -> Tier:
    if TIER.binary is None:
        pytest.fail("no diffmon binary: set DIFFMON_BIN, build target/release/diffmon, or put "
                    "diffmon on PATH", pytrace=False)
    return TIER


@pytest.fixture
def measure(request, tier):
    """``measure("icr cpu=... cuda=...")``: a line for the session's measurements."""
    def add(text: str):
        tier.measurements.append((request.node.name, text))
        print(f"{request.node.name}: {text}")
    return add


# ----------------------------------------------------------------------------- the assets


@dataclass
class Assets:
    dir: Path
    model: Path        # the student's architecture, exported on the CPU
    teacher: Path      # another UNet of the same contract, exported on the CPU
    train: Path
    heldout: Path
    checkpoint: Path   # torch.save(state_dict) of the student, weights perturbed: ckpt_000100.pt


def _unet(seed: int, config: dict):
    import torch
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    return UNet2DModel(**config)


def _images(n: int, seed: int):
    """``n`` smooth 3x32x32 images in [-1, 1] (blurred noise through tanh), float32."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
    k = (k[:, None] * k[None, :] / 256.0).expand(3, 1, 5, 5)
    x = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (2, 2, 2, 2), mode="reflect"), k, groups=3)
    x = torch.tanh(2.5 * x / x.std())
    return np.ascontiguousarray(x.numpy().astype(np.float32))


def _write_h5(path: Path, images) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=images)


@pytest.fixture(scope="session")
def assets(tmp_path_factory, tier) -> Assets:
    import torch
    from diffmon.export import export

    d = tmp_path_factory.mktemp("assets")
    student, teacher = _unet(0, tier.unet), _unet(1, tier.unet)
    # Exported on the CPU (the exporter's default device), whatever the tier runs on.
    export(student, "mid_block", d / "model.ts", "eps", SHAPE, schedule="linear")
    export(teacher, "mid_block", d / "teacher.ts", "eps", SHAPE, schedule="linear")
    # The checkpoint: the student's weights moved by 5% of each tensor's spread, so it is not the
    # architecture file's own weights.
    g = torch.Generator().manual_seed(2)
    state = {}
    for k, v in student.state_dict().items():
        if v.is_floating_point() and v.numel() > 1:
            v = v + 0.05 * v.std() * torch.randn(v.shape, generator=g)
        state[k] = v.clone()
    torch.save(state, d / "ckpt_000100.pt")
    _write_h5(d / "train.h5", _images(N_TRAIN, 10))
    _write_h5(d / "heldout.h5", _images(N_HELDOUT, 11))
    return Assets(d, d / "model.ts", d / "teacher.ts", d / "train.h5", d / "heldout.h5",
                  d / "ckpt_000100.pt")


# ----------------------------------------------------------------------------- running diffmon


def write_config(path: Path, assets: Assets, device: str, body: str, run_dir: Path | None = None) -> Path:
    """A config at ``path``: the student, the data (with the held-out set), ``device``, and the
    YAML ``body`` (sections given there replace nothing: do not repeat run/model/data/device)."""
    run_dir = run_dir or assets.dir
    path.write_text(
        f"run: {{dir: '{run_dir}', name: gpu}}\n"
        f"state_dir: '{path.parent / (path.stem + '.state')}'\n"
        f"model: {{architecture: '{assets.model}'}}\n"
        f"device: '{device}'\n"
        f"data: {{path: '{assets.train}', heldout_path: '{assets.heldout}'}}\n"
        + body)
    return path


def run_diffmon(tier: Tier, *args: str, timeout: float = PROCESS_TIMEOUT) -> subprocess.CompletedProcess:
    t = time.monotonic()
    out = subprocess.run([tier.binary, *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "DIFFMON_LOG": "info"})
    out.seconds = time.monotonic() - t
    return out


def eval_json(tier: Tier, config: Path, checkpoint: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """``diffmon eval --config F CKPT --json``, which must succeed with one record."""
    import json

    out = run_diffmon(tier, "eval", "--config", config, checkpoint, "--json")
    assert out.returncode == 0, f"diffmon eval exited {out.returncode}:\n{out.stderr[-4000:]}"
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert len(records) == 1, out.stdout
    return records[0], out


@dataclass
class Diffmon:
    """The helpers above, bound to the session's tier and assets (the ``dm`` fixture)."""

    tier: Tier
    assets: Assets

    def config(self, path: Path, device: str, body: str, run_dir: Path | None = None) -> Path:
        return write_config(path, self.assets, device, body, run_dir)

    def run(self, *args, timeout: float = PROCESS_TIMEOUT) -> subprocess.CompletedProcess:
        return run_diffmon(self.tier, *args, timeout=timeout)

    def eval_json(self, config: Path, checkpoint: Path | None = None):
        return eval_json(self.tier, config, checkpoint or self.assets.checkpoint)


@pytest.fixture(scope="session")
def dm(tier, assets) -> Diffmon:
    return Diffmon(tier, assets)
