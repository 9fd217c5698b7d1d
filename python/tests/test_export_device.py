"""diffmon.export writes device-independent files: the trace's device constants (diffusers'
``torch.ones(B, device=timesteps.device)`` frozen to ``device=cpu``) become the input's device, the
saved graphs hold none (checked here by walking them independently of the exporter), the file still
reproduces the eager network, and an export that would pin a device fails naming the op."""

import importlib
import json

import numpy as np
import pytest
import torch
from torch import nn

from diffmon.export import ExportError, device_constants, export

# `diffmon.export` the attribute is the function (diffmon/__init__.py); the module is needed to patch.
export_module = importlib.import_module("diffmon.export.trace")  # where the export traces

UNET = dict(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(32, 64),
            layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"))
DIT = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
           sample_size=8, patch_size=2, num_embeds_ada_norm=10)  # out_channels = 2 x in: learn_sigma


def graphs(script_module):
    """Every method graph of a ScriptModule and its submodules (written apart from the exporter's)."""
    for name, mod in script_module.named_modules():
        for meth in mod._c._method_names():
            yield (f"{name}.{meth}" if name else meth), mod._c._get_method(meth).graph


def nodes(block):
    for n in block.nodes():
        yield n
        for b in n.blocks():
            yield from nodes(b)


def pinned_devices(script_module):
    """(method, op using it, device) for each Device-typed constant, nested blocks included."""
    found = []
    for meth, g in graphs(script_module):
        for n in nodes(g):
            if n.kind() == "prim::Constant" and n.output().type().kind() == "DeviceObjType":
                found += [(meth, u.user.kind(), str(n.output().toIValue())) for u in n.output().uses()]
    return found


def assert_device_independent(path):
    ts = torch.jit.load(str(path))
    assert device_constants(ts) == []
    assert pinned_devices(ts) == []
    for meth, g in graphs(ts):
        assert 'Device = prim::Constant[value="cpu"]' not in str(g), meth
    # The rewrite did happen: the ops follow the input's device.
    assert "prim::device" in str(ts.graph)
    extra = {"diffmon.json": ""}
    torch.jit.load(str(path), _extra_files=extra)
    note = json.loads(extra["diffmon.json"])
    assert note["device_independent"] is True and note["torch"] == torch.__version__
    return ts


def ddpm_nearest_t(sigma):
    """Nearest DDPM timestep in log sigma, from diffusers' own DDPMScheduler (linear, T = 1000)."""
    from diffusers import DDPMScheduler

    ab = DDPMScheduler(num_train_timesteps=1000).alphas_cumprod.double().numpy()
    log_sig_t = 0.5 * np.log((1 - ab) / ab)
    return torch.tensor([int(np.argmin(np.abs(log_sig_t - np.log(s)))) for s in sigma.double().numpy()])


def eps_reference(net, layer, x, sigma):
    """D = x - sigma * eps(x / sqrt(1 + sigma^2), t) and the layer's output, eagerly."""
    feats = []
    h = layer.register_forward_hook(lambda _m, _i, o: feats.append(o))
    s4 = sigma.view(-1, 1, 1, 1)
    with torch.no_grad():
        eps = net(x / torch.sqrt(1 + s4**2), ddpm_nearest_t(sigma))
    h.remove()
    return x - s4 * eps, feats[0]


def check_inputs(c, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigma = torch.tensor([0.02, 0.3, 1.5, 20.0])
    x = 0.5 * torch.randn(4, c, size, size, generator=g) + sigma.view(-1, 1, 1, 1) * torch.randn(
        4, c, size, size, generator=g)
    return x, sigma


def assert_d_close(got, want, sigma):
    # float32 round-off only, relative to 1 + sigma.
    assert float(((got - want).abs() / (1 + sigma.view(-1, 1, 1, 1))).max()) < 1e-5


class Sample(nn.Module):
    """A diffusers model called as module(x, t) -> Tensor (for a direct torch.jit.trace)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, t):
        return self.net(x, t).sample


class NullClassDiT(nn.Module):
    """A class-conditional DiT with the label fixed to the null (classifier-free) class, returning
    the epsilon half of its learn_sigma output."""

    def __init__(self, dit):
        super().__init__()
        self.dit = dit

    def forward(self, x, t):
        null = self.dit.config.num_embeds_ada_norm
        labels = torch.full((x.shape[0],), null, dtype=torch.long, device=x.device)
        return self.dit(x, timestep=t, class_labels=labels).sample[:, : x.shape[1]]


@pytest.fixture(scope="module")
def unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DModel(**UNET).eval()


@pytest.fixture(scope="module")
def dit():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(1)
    return NullClassDiT(diffusers.DiTTransformer2DModel(**DIT)).eval()


def test_unet_exported_on_the_cpu_pins_no_device(unet, tmp_path):
    out = tmp_path / "unet.ts"
    export(unet, "mid_block", out, parameterization="eps", example_shape=(3, 16, 16))
    ts = assert_device_independent(out)
    x, sigma = check_inputs(3, 16)
    want_d, want_f = eps_reference(lambda a, t: unet(a, t).sample, unet.mid_block, x, sigma)
    with torch.no_grad():
        got_d, got_f = ts(x, sigma)
    assert got_f.shape == want_f.shape == (4, 64, 8, 8)
    assert_d_close(got_d, want_d, sigma)
    assert float((got_f - want_f).abs().max()) < 1e-5


def test_dit_exported_on_the_cpu_pins_no_device(dit, tmp_path):
    out = tmp_path / "dit.ts"
    export(dit, "dit.transformer_blocks.0", out, parameterization="eps", example_shape=(4, 8, 8))
    ts = assert_device_independent(out)
    x, sigma = check_inputs(4, 8)
    want_d, want_f = eps_reference(dit, dit.dit.transformer_blocks[0], x, sigma)
    with torch.no_grad():
        got_d, got_f = ts(x, sigma)
    assert want_f.shape == (4, 16, 16)  # [B, L, D] tokens: the file mean-pools them
    assert got_f.shape == (4, 16)
    assert_d_close(got_d, want_d, sigma)
    assert float((got_f - want_f.mean(dim=1)).abs().max()) < 1e-5
    # The label is really fixed to the null class: another class gives another output.
    with torch.no_grad():
        t = ddpm_nearest_t(sigma)
        a = x / torch.sqrt(1 + sigma.view(-1, 1, 1, 1) ** 2)
        other = dit.dit(a, timestep=t, class_labels=torch.zeros(4, dtype=torch.long)).sample[:, :4]
        null = dit(a, t)
    assert float((other - null).abs().max()) > 1e-4


def test_a_plain_trace_pins_the_device_and_the_rewrite_removes_it(unet, dit):
    # Without the rewrite, tracing on the CPU freezes device=cpu into the graphs: the check above
    # would fail if the rewrite stopped working.
    x = torch.randn(2, 3, 16, 16)
    t = torch.tensor([3, 500])
    with torch.no_grad():
        traced = torch.jit.trace(Sample(unet), (x, t), check_trace=False)
        want = traced(x, t)
    pins = pinned_devices(traced)
    assert {("net.forward", "aten::ones", "cpu"), ("net.time_proj.forward", "aten::arange", "cpu")} <= set(pins)
    listed = device_constants(traced)
    assert sorted((p["method"], p["op"], p["device"]) for p in listed) == sorted(pins)
    assert any("unet_2d.py" in p["where"] for p in listed if p["op"] == "aten::ones")
    assert export_module._make_device_independent(traced) >= 2
    assert pinned_devices(traced) == [] and device_constants(traced) == []
    with torch.no_grad():
        assert torch.equal(traced(x, t), want)

    xd = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        traced_dit = torch.jit.trace(dit, (xd, t), check_trace=False)
    ops = {op for _, op, _ in pinned_devices(traced_dit)}
    assert {"aten::full", "aten::arange"} <= ops  # the wrapper's labels and the timestep embedding
    export_module._make_device_independent(traced_dit)
    assert pinned_devices(traced_dit) == []


def test_a_file_that_still_pins_a_device_fails_the_export_naming_the_op(unet, tmp_path, monkeypatch):
    monkeypatch.setattr(export_module, "_make_device_independent", lambda traced: 0)
    out = tmp_path / "pinned.ts"
    with pytest.raises(ExportError, match=r"aten::ones pins device 'cpu' in forward \(.*unet_2d\.py") as e:
        export(unet, "mid_block", out, parameterization="eps", example_shape=(3, 16, 16))
    assert "aten::arange pins device 'cpu' in time_proj.forward" in str(e.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []


class Offset(nn.Module):
    def forward(self):
        return torch.ones(4, device="cpu") * 0.5


class OffsetNet(nn.Module):
    """Its submodule `offset` makes a tensor on a fixed device and takes no tensor input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.offset = Offset()
        self.out = nn.Conv2d(4, 1, 1)

    def forward(self, x, sigma):
        return self.out(self.conv(x) + self.offset().reshape(1, -1, 1, 1))


def test_a_method_without_tensor_input_cannot_be_rewritten(tmp_path):
    out = tmp_path / "net.ts"
    with pytest.raises(ExportError, match=r"aten::ones pins device 'cpu' in offset\.forward .*"
                                          r"takes no tensor input"):
        export(OffsetNet(), "conv", out, example_shape=(1, 4, 4))
    assert not out.exists()


def test_device_constants_in_nested_blocks_are_found_and_rewritten():
    class Branch(nn.Module):
        def forward(self, x):
            if bool(x.sum() > 0):
                return x + torch.ones(x.shape[0], 1, device=torch.device("cpu"))
            return x

    m = torch.jit.script(Branch())
    g = m.graph
    const = next(n for n in g.nodes() if n.output().type().kind() == "DeviceObjType")
    if_node = next(n for n in g.nodes() if n.kind() == "prim::If")
    ones = next(n for b in if_node.blocks() for n in b.nodes() if n.kind() == "aten::ones")
    const.moveBefore(ones)  # scripting hoists constants; put it back inside the branch
    assert pinned_devices(m) == [("forward", "aten::ones", "cpu")]
    assert [(p["method"], p["op"], p["device"]) for p in device_constants(m)] == [("forward", "aten::ones", "cpu")]
    assert export_module._make_device_independent(m) == 1
    assert pinned_devices(m) == []
    assert torch.equal(m(torch.ones(2, 1)), torch.full((2, 1), 2.0))
