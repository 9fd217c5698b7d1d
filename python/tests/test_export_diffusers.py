"""diffmon.export's command line on a diffusers UNet2DModel: built by ``from_pretrained`` through
``--factory diffusers:UNet2DModel.from_pretrained``, weights from a safetensors file, epsilon
prediction on DDPMScheduler's linear schedule; the exported file reproduces the eager UNet. Built
from its constructor before training has saved anything (the guide's command), checkpoints saved
later load into it. diffusers' harmless TracerWarnings are filtered, the network's own kept."""

import json
import re
import shlex
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from diffmon.export import main  # noqa: E402
from diffmon.export.condition import _is_safetensors  # noqa: E402
from stacks import tiny_unet  # noqa: E402


def test_from_pretrained_factory_and_safetensors_weights(tmp_path):
    from diffusers import DDPMScheduler
    from safetensors.torch import save_file

    tiny_unet(seed=1).save_pretrained(tmp_path / "unet")
    trained = tiny_unet(seed=2)  # the weights to load: not those of the pretrained folder
    weights = tmp_path / "weights.bin"  # named .bin on purpose: detected by content
    save_file(trained.state_dict(), str(weights))
    assert _is_safetensors(str(weights))
    out = tmp_path / "model.ts"
    assert main(["--factory", "diffusers:UNet2DModel.from_pretrained",
                 "--factory-kwargs", json.dumps({"pretrained_model_name_or_path": str(tmp_path / "unet")}),
                 "--weights", str(weights), "--feature-layer", "mid_block", "--shape", "1", "8", "8",
                 "--out", str(out), "--parameterization", "eps", "--schedule", "linear", "--T", "1000"]) == 0

    ts = torch.jit.load(str(out))
    assert set(ts.state_dict()) == set(trained.state_dict())

    # The reference, independently: DDPMScheduler's own alphas_cumprod, nearest timestep in log sigma,
    # D = x - sigma * eps(x / sqrt(1 + sigma^2), t).
    ab = DDPMScheduler(num_train_timesteps=1000).alphas_cumprod.double().numpy()
    sig_t = np.sqrt((1 - ab) / ab)
    g = torch.Generator().manual_seed(0)
    sigma = torch.tensor([0.02, 0.3, 1.5, 20.0])
    x = torch.randn(4, 1, 8, 8, generator=g) + sigma.view(-1, 1, 1, 1) * torch.randn(4, 1, 8, 8, generator=g)
    t = torch.tensor([int(np.argmin(np.abs(np.log(sig_t) - np.log(s)))) for s in sigma.double().numpy()])
    feats = []
    trained.eval()
    h = trained.mid_block.register_forward_hook(lambda _m, _i, o: feats.append(o))
    with torch.no_grad():
        eps = trained(x / torch.sqrt(1 + sigma**2).view(-1, 1, 1, 1), t).sample
        want = x - sigma.view(-1, 1, 1, 1) * eps
        got_d, got_f = ts(x, sigma)
    h.remove()
    assert got_f.shape == feats[0].shape == (4, 16, 4, 4)
    # float32 round-off only: 1e-5 relative to 1 + sigma on D, 1e-5 absolute on the features.
    assert float(((got_d - want).abs() / (1 + sigma.view(-1, 1, 1, 1))).max()) < 1e-5
    assert float((got_f - feats[0]).abs().max()) < 1e-5
    # The safetensors weights were used, not the pretrained folder's.
    assert torch.equal(ts.state_dict()["conv_in.weight"], trained.state_dict()["conv_in.weight"])


ROOT = Path(__file__).resolve().parents[2]


def _tracer_warnings(export_call):
    """The TracerWarnings ``export_call()`` shows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_call()
    return [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]


def test_diffusers_tracer_warnings_are_filtered_and_the_networks_own_kept(tmp_path, monkeypatch):
    import importlib

    from diffmon.export import export

    exporter = importlib.import_module("diffmon.export.trace")  # the tracing module of the package

    def unet():
        export(tiny_unet(), "mid_block", tmp_path / "unet.ts", parameterization="eps", example_shape=(1, 8, 8))

    shown = _tracer_warnings(unet)
    assert not shown, [f"{w.filename}:{w.lineno}: {w.message}" for w in shown]
    # Not for want of warnings: without the diffusers entry, its shape checks are shown.
    monkeypatch.setattr(exporter, "_HARMLESS_TRACER_WARNINGS",
                        tuple(f for f in exporter._HARMLESS_TRACER_WARNINGS if "diffusers" not in f[0]))
    unfiltered = _tracer_warnings(unet)
    assert unfiltered and all("/diffusers/" in Path(w.filename).as_posix() for w in unfiltered), \
        [f"{w.filename}:{w.lineno}: {w.message}" for w in unfiltered]
    monkeypatch.undo()

    class Gated(torch.nn.Module):
        """Reads a tensor's value in its own forward: the trace keeps the branch it took."""

        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 1, 3, padding=1)

        def forward(self, x, t):
            if bool((t >= 0).all()):
                return self.conv(x)
            return x

    mine = _tracer_warnings(lambda: export(Gated(), "conv", tmp_path / "gated.ts", parameterization="eps",
                                           example_shape=(1, 8, 8)))
    assert mine, "the network's own TracerWarning was filtered"
    assert all(Path(w.filename) == Path(__file__) for w in mine), [w.filename for w in mine]
    assert "Converting a tensor to a Python boolean" in str(mine[0].message)


def _guide_command():
    """The diffmon-export command line of the guide's "Before the first checkpoint", as arguments."""
    guide = (ROOT / "docs" / "guide" / "training-stacks.md").read_text()
    section = guide[guide.index("\n### Before the first checkpoint"):guide.index("\n## Names and entries")]
    (command,) = [b for b in re.findall(r"```sh\n(.*?)```", section, re.S) if "diffmon-export" in b]
    return shlex.split(command.replace("\\\n", " "))


def test_the_guides_export_before_the_first_checkpoint(tmp_path):
    # The guide's command line as written, but for the network's size: the tiny config of the
    # stacks, one channel of 8x8, written under tmp_path. Then training saves a checkpoint with
    # save_pretrained, which loads into the exported file by name.
    from diffusers import UNet2DModel
    from safetensors.torch import load_file
    from stacks import UNET_CONFIG

    args = _guide_command()
    assert args[0] == "diffmon-export"
    args = args[1:]
    assert args[args.index("--factory") + 1] == "diffusers:UNet2DModel"
    kwargs = args.index("--factory-kwargs") + 1
    shape = args.index("--shape") + 1
    documented = json.loads(args[kwargs])
    with torch.device("meta"):  # the documented config builds, without its memory
        network = UNet2DModel(**documented)
    c, h, w = (int(v) for v in args[shape:shape + 3])
    assert (network.config.in_channels, network.config.sample_size) == (c, h) and h == w

    args[kwargs] = json.dumps(UNET_CONFIG)
    args[shape:shape + 3] = ["1", "8", "8"]
    out = tmp_path / "model.ts"
    args[args.index("--out") + 1] = str(out)
    assert main(args) == 0

    torch.manual_seed(5)
    unet = UNet2DModel(**UNET_CONFIG)  # as training builds it, then trains and saves it
    unet.save_pretrained(tmp_path / "checkpoint-500" / "unet")
    saved = load_file(str(tmp_path / "checkpoint-500" / "unet" / "diffusion_pytorch_model.safetensors"))
    ts = torch.jit.load(str(out))
    names = ts.state_dict()
    assert set(names) == set(unet.state_dict()) == set(saved)
    assert all(names[k].shape == saved[k].shape for k in saved)
    ts.load_state_dict(saved)  # strict
    assert torch.equal(ts.state_dict()["conv_in.weight"], unet.state_dict()["conv_in.weight"])
