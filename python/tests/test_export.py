"""diffmon.export: conversion math (checked on Gaussian data, where every optimal predictor is known
in closed form), feature capture, dynamic batch, parameter names, and failure modes."""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from torch import nn

from diffmon.export import ExportError, export, vp_alphas_cumprod
from train_toy import ToyDenoiser

S = 0.8  # data std: x0 ~ N(0, S^2) per pixel
SHAPE = (1, 2, 4, 4)


def gaussian_denoiser(x, sigma):
    """E[x0 | x0 + sigma n] for x0 ~ N(0, S^2): x S^2 / (S^2 + sigma^2) (float64)."""
    s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1, 1, 1, 1)
    return x.double() * S**2 / (S**2 + s**2)


def ddpm_alphabar(beta_min=1e-4, beta_max=0.02, T=1000):
    betas = np.linspace(beta_min, beta_max, T)
    return np.cumprod(1.0 - betas)


def inputs(sigmas, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigma = torch.tensor(sigmas, dtype=torch.float32)
    x0 = S * torch.randn(len(sigmas), *SHAPE[1:], generator=g)
    return x0 + sigma.reshape(-1, 1, 1, 1) * torch.randn(x0.shape, generator=g), sigma


def assert_close(got, want, sigma, tol=2e-5):
    """Float32 round-off of the conversion scales with the noise level: compare relative to 1 + sigma."""
    scale = 1 + torch.as_tensor(sigma, dtype=torch.float64).reshape(-1, 1, 1, 1)
    err = float(((got.double() - want.double()).abs() / scale).max())
    assert err < tol, f"max error / (1 + sigma) = {err}"


class GaussVP(nn.Module):
    """Optimal VP predictor for Gaussian data: module(x_vp, t) with x_vp = a x0 + s n."""

    def __init__(self, kind, alphabar=None, continuous=None):
        super().__init__()
        self.kind = kind
        self.continuous = continuous  # (beta_min, beta_max, t_scale)
        if alphabar is not None:
            self.register_buffer("alphabar", torch.tensor(alphabar, dtype=torch.float64))
        self.probe = nn.Identity()

    def forward(self, x_vp, t):
        if self.continuous is not None:
            bmin, bmax, scale = self.continuous
            u = t.double() / scale
            ab = torch.exp(-bmin * u - 0.5 * (bmax - bmin) * u * u)
        else:
            ab = self.alphabar[t.long()]
        ab = ab.reshape(-1, 1, 1, 1)
        a, s = ab.sqrt(), (1 - ab).sqrt()
        xv = self.probe(x_vp).double()
        denom = ab * S**2 + (1 - ab)
        e_x0 = a * S**2 * xv / denom
        e_n = s * xv / denom
        out = {"eps": e_n, "v": a * e_n - s * e_x0, "x0": e_x0}[self.kind]
        return out.float()


class EchoTime(nn.Module):
    """x0-parameterized 'network' whose output is the time it was given, broadcast."""

    def __init__(self):
        super().__init__()
        self.probe = nn.Identity()

    def forward(self, x_vp, t):
        return self.probe(x_vp) * 0 + t.to(torch.float64).reshape(-1, 1, 1, 1).float()


def grid_sigmas(alphabar, ts):
    return [float(math.sqrt((1 - alphabar[t]) / alphabar[t])) for t in ts]


@pytest.mark.parametrize("kind", ["eps", "v", "x0"])
def test_discrete_vp_on_grid_gives_the_gaussian_edm_denoiser(tmp_path, kind):
    ab = ddpm_alphabar()
    ts = [0, 10, 100, 500, 999]
    sig = grid_sigmas(ab, ts)
    m = export(GaussVP(kind, ab), "probe", tmp_path / "m.ts", kind, SHAPE,
               beta_min=1e-4, beta_max=0.02, T=1000)
    x, sigma = inputs(sig)
    d, _ = m(x, sigma)
    assert_close(d, gaussian_denoiser(x, sigma), sigma)


def test_discrete_eps_off_grid_uses_nearest_timestep_in_log_sigma(tmp_path):
    ab = ddpm_alphabar()
    log_sig_t = 0.5 * np.log((1 - ab) / ab)
    net = GaussVP("eps", ab)
    m = export(net, "probe", tmp_path / "m.ts", "eps", SHAPE)
    sig = list(np.exp(np.random.default_rng(0).uniform(np.log(0.01), np.log(100), 7)))
    x, sigma = inputs(sig, seed=3)
    # Independent re-implementation of the conversion.
    s64 = sigma.double().numpy()
    t_star = torch.tensor([int(np.argmin(np.abs(np.log(s) - log_sig_t))) for s in s64])
    s4 = sigma.reshape(-1, 1, 1, 1)
    with torch.no_grad():
        eps = net(x / torch.sqrt(1 + s4**2), t_star)
    want = x - s4 * eps
    d, _ = m(x, sigma)
    assert_close(d, want, sigma)
    # Off the grid the rounded timestep makes the result differ from the exact Gaussian denoiser.
    assert float((d.double() - gaussian_denoiser(x, sigma)).abs().max()) > 1e-4


@pytest.mark.parametrize("mode", ["nearest", "interp"])
def test_timestep_mapping(tmp_path, mode):
    ab = ddpm_alphabar()
    log_sig_t = 0.5 * np.log((1 - ab) / ab)
    m = export(EchoTime(), "probe", tmp_path / "m.ts", "x0", SHAPE, timestep=mode)
    sig = [0.001, 0.0123, 0.37, 1.0, 3.3, 47.0, 1000.0]
    x, sigma = inputs(sig)
    d, _ = m(x, sigma)
    got = d[:, 0, 0, 0].double().numpy()
    ls = np.log(sigma.double().numpy())
    if mode == "nearest":
        want = np.array([np.argmin(np.abs(v - log_sig_t)) for v in ls], dtype=np.float64)
        np.testing.assert_array_equal(got, want)
    else:
        want = np.interp(ls, log_sig_t, np.arange(len(ab)))  # clamps at both ends
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)
        assert got[0] == 0 and got[-1] == len(ab) - 1
        assert np.any(np.abs(got - np.round(got)) > 0.05)  # really fractional


@pytest.mark.parametrize("kind", ["eps", "v", "x0"])
def test_continuous_vp_gives_the_gaussian_edm_denoiser_at_any_sigma(tmp_path, kind):
    bmin, bmax = 0.1, 20.0
    m = export(GaussVP(kind, continuous=(bmin, bmax, 999.0)), "probe", tmp_path / "m.ts", kind, SHAPE,
               schedule="continuous", beta_min=bmin, beta_max=bmax)
    sig = [0.005, 0.05, 0.29, 1.0, 2.7, 12.0, 80.0]
    x, sigma = inputs(sig, seed=1)
    d, _ = m(x, sigma)
    assert_close(d, gaussian_denoiser(x, sigma), sigma)


def test_continuous_time_is_the_inverse_of_the_schedule(tmp_path):
    bmin, bmax = 0.1, 20.0
    m = export(EchoTime(), "probe", tmp_path / "m.ts", "x0", SHAPE, schedule="continuous",
               beta_min=bmin, beta_max=bmax)
    sig = [0.01, 0.5, 5.0, 60.0]
    x, sigma = inputs(sig)
    d, _ = m(x, sigma)
    for s, got in zip(sigma.double().tolist(), d[:, 0, 0, 0].tolist()):
        # alphabar(t) = 1 / (1 + sigma^2), solved numerically.
        t = brentq(lambda u: math.exp(-bmin * u - 0.5 * (bmax - bmin) * u * u) - 1 / (1 + s * s), 0, 5)
        assert got == pytest.approx(999.0 * t, rel=1e-5)


def test_edm_raw_preconditioning_uses_sigma_data(tmp_path):
    sd = 0.7

    class GaussF(nn.Module):
        def __init__(self):
            super().__init__()
            self.probe = nn.Identity()

        def forward(self, x_in, c_noise):
            sig = torch.exp(4 * c_noise.double()).reshape(-1, 1, 1, 1)
            x = self.probe(x_in).double() * torch.sqrt(sig**2 + sd**2)
            d = x * S**2 / (S**2 + sig**2)
            c_skip = sd**2 / (sig**2 + sd**2)
            c_out = sig * sd / torch.sqrt(sig**2 + sd**2)
            return ((d - c_skip * x) / c_out).float()

    sig = [0.01, 0.3, 2.0, 40.0]
    x, sigma = inputs(sig)
    d, _ = export(GaussF(), "probe", tmp_path / "m.ts", "edm_raw", SHAPE, sigma_data=sd)(x, sigma)
    assert_close(d, gaussian_denoiser(x, sigma), sigma)
    d_wrong, _ = export(GaussF(), "probe", tmp_path / "w.ts", "edm_raw", SHAPE, sigma_data=0.5)(x, sigma)
    assert float((d_wrong.double() - gaussian_denoiser(x, sigma)).abs().max()) > 1e-3


def test_edm_passes_sigma_through(tmp_path):
    class GaussD(nn.Module):
        def __init__(self):
            super().__init__()
            self.probe = nn.Identity()

        def forward(self, x, sigma):
            assert sigma.dim() == 1
            s2 = sigma.double().reshape(-1, 1, 1, 1) ** 2
            return (self.probe(x).double() * S**2 / (S**2 + s2)).float()

    x, sigma = inputs([0.02, 0.5, 9.0])
    d, f = export(GaussD(), "probe", tmp_path / "m.ts", "edm", SHAPE)(x, sigma)
    assert_close(d, gaussian_denoiser(x, sigma), sigma)
    assert torch.equal(f, x)


def test_custom_and_named_schedules():
    ab = vp_alphas_cumprod("linear", 1e-4, 0.02, 1000).numpy()
    np.testing.assert_allclose(ab, ddpm_alphabar(), rtol=1e-12)
    sl = vp_alphas_cumprod("scaled_linear", 0.00085, 0.012, 1000).numpy()
    np.testing.assert_allclose(sl, np.cumprod(1 - np.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2), rtol=1e-12)
    cos = vp_alphas_cumprod("cosine", T=1000).numpy()
    f = lambda u: np.cos((u + 0.008) / 1.008 * np.pi / 2) ** 2  # noqa: E731
    t = np.arange(990)  # away from the 0.999 clip at the very end
    np.testing.assert_allclose(cos[t], f((t + 1) / 1000) / f(0), rtol=1e-9)


def test_explicit_alphas_cumprod_table(tmp_path):
    ab = vp_alphas_cumprod("cosine", T=200).numpy()
    m = export(GaussVP("v", ab), "probe", tmp_path / "m.ts", "v", SHAPE, alphas_cumprod=ab)
    x, sigma = inputs(grid_sigmas(ab, [0, 20, 120, 199]))
    assert_close(m(x, sigma)[0], gaussian_denoiser(x, sigma), sigma)


# --------------------------------------------------------------------------------------------
# Feature capture, batch, names
# --------------------------------------------------------------------------------------------

def eager_with_hook(model, layer, x, sigma):
    out = []
    h = model.get_submodule(layer).register_forward_hook(lambda m, i, o: out.append(o.clone()))
    with torch.no_grad():
        d = model(x, sigma)
    h.remove()
    return d, out[0]


def toy(seed=0, width=4):
    torch.manual_seed(seed)
    m = ToyDenoiser(1, width)
    m.train()
    with torch.no_grad():  # move the BatchNorm statistics
        m(torch.randn(6, 1, 8, 8) + 0.5, torch.rand(6) + 0.1)
    return m.eval()


@pytest.mark.parametrize("layer", ["mid", "mid.conv1", "enc1.norm2", "emb_mlp.2", "norm_in"])
def test_feature_capture_matches_an_eager_hook_for_nested_layers(tmp_path, layer):
    model = toy()
    ts = export(model, layer, tmp_path / "m.ts", example_shape=(1, 1, 8, 8))
    x, sigma = torch.randn(3, 1, 8, 8), torch.tensor([0.1, 1.0, 7.0])
    d, f = ts(x, sigma)
    d_ref, f_ref = eager_with_hook(model, layer, x, sigma)
    assert f.shape == f_ref.shape
    assert torch.allclose(f, f_ref, atol=1e-6) and torch.allclose(d, d_ref, atol=1e-6)
    assert f.shape[0] == 3 and f.dim() in (2, 4)


def test_feature_is_the_layer_output_before_later_in_place_ops(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Conv2d(2, 3, 1)
            self.act = nn.ReLU(inplace=True)
            self.out = nn.Conv2d(3, 2, 1)

        def forward(self, x, sigma):
            return self.out(self.act(self.lin(x)))

    net = Net()
    ts = export(net, "lin", tmp_path / "m.ts", example_shape=SHAPE)
    x, sigma = inputs([0.3, 1.0, 3.0])
    _, f = ts(x, sigma)
    with torch.no_grad():
        pre = net.lin(x)
    assert (pre < 0).any() and torch.allclose(f, pre, atol=1e-6)


def test_dynamic_batch_and_unprefixed_names(tmp_path):
    model = toy(0)
    ts = export(model, "mid", tmp_path / "m.ts", example_shape=(1, 1, 8, 8))
    for b in (1, 3, 5):
        x, sigma = torch.randn(b, 1, 8, 8), torch.exp(torch.randn(b))
        d, f = ts(x, sigma)
        assert d.shape == (b, 1, 8, 8) and f.shape == (b, 8, 2, 2)
    loaded = torch.jit.load(str(tmp_path / "m.ts"))
    assert list(loaded.state_dict().keys()) == list(model.state_dict().keys())


def test_loading_another_state_dict_by_name_reproduces_that_model(tmp_path):
    """The Rust path: architecture file + weights loaded by name (params and buffers)."""
    a, b = toy(0), toy(1)
    assert not torch.equal(a.norm_in.running_mean, b.norm_in.running_mean)
    assert not torch.equal(a.embed.freqs, b.embed.freqs)
    export(a, "mid", tmp_path / "arch.ts", example_shape=(1, 1, 8, 8))
    arch = torch.jit.load(str(tmp_path / "arch.ts"))
    arch.load_state_dict(b.state_dict())
    x, sigma = torch.randn(4, 1, 8, 8), torch.tensor([0.01, 0.3, 2.0, 50.0])
    d, f = arch(x, sigma)
    d_ref, f_ref = eager_with_hook(b, "mid", x, sigma)
    assert torch.allclose(d, d_ref, atol=1e-5) and torch.allclose(f, f_ref, atol=1e-5)


def test_token_features_are_mean_pooled(tmp_path):
    class Tok(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 6)

        def forward(self, x, sigma):
            tokens = self.proj(x.flatten(2).transpose(1, 2).reshape(x.shape[0], -1, 4))
            return x + tokens.mean() * 0

    net = Tok()
    x, sigma = inputs([0.1, 1.0, 5.0])
    _, f = export(net, "proj", tmp_path / "m.ts", example_shape=SHAPE)(x, sigma)
    with torch.no_grad():
        want = net.proj(x.flatten(2).transpose(1, 2).reshape(3, -1, 4)).mean(1)
    assert f.shape == (3, 6) and torch.allclose(f, want, atol=1e-6)


def test_export_leaves_the_module_untouched(tmp_path):
    model = toy()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export(model, "mid", tmp_path / "m.ts", example_shape=(1, 1, 8, 8))
    assert model.training and "forward" not in model.__dict__
    assert not model.mid._forward_hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------

def test_unknown_layer_lists_the_names(tmp_path):
    with pytest.raises(ValueError, match="enc1"):
        export(toy(), "nope", tmp_path / "m.ts", example_shape=(1, 1, 8, 8))


def test_layer_that_does_not_run_or_runs_twice(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(2, 2, 1)
            self.unused = nn.Conv2d(2, 2, 1)

        def forward(self, x, sigma):
            return self.a(self.a(x))

    with pytest.raises(ExportError, match="ran 0 times"):
        export(Net(), "unused", tmp_path / "m.ts", example_shape=SHAPE)
    with pytest.raises(ExportError, match="ran 2 times"):
        export(Net(), "a", tmp_path / "m.ts", example_shape=SHAPE)


def test_batch_size_frozen_by_tracing_is_caught(tmp_path):
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(2, 2, 1)

        def forward(self, x, sigma):
            h = self.a(x)
            return h.reshape(2, -1).reshape(x.shape) if x.shape[0] == 2 else h * 2

    with pytest.warns(torch.jit.TracerWarning), pytest.raises(ExportError):
        export(Frozen(), "a", tmp_path / "m.ts", example_shape=SHAPE)
    assert not (tmp_path / "m.ts").exists() and not list(tmp_path.iterdir())


def test_value_dependent_branch_frozen_by_tracing_is_caught(tmp_path):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(2, 2, 1)

        def forward(self, x, sigma):
            h = self.a(x)
            return h if bool(sigma.min() > 0.1) else -h

    with pytest.warns(torch.jit.TracerWarning), pytest.raises(ExportError, match="differs"):
        export(Branchy(), "a", tmp_path / "m.ts", example_shape=SHAPE)


def test_bad_arguments(tmp_path):
    net = toy()
    with pytest.raises(ValueError, match="parameterization"):
        export(net, "mid", tmp_path / "m.ts", "score", (1, 1, 8, 8))
    with pytest.raises(ValueError, match="example_shape"):
        export(net, "mid", tmp_path / "m.ts")
    with pytest.raises(ValueError, match="schedule"):
        export(net, "mid", tmp_path / "m.ts", "eps", (1, 1, 8, 8), schedule="quadratic")


def test_command_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    py_dir = Path(__file__).resolve().parents[1]
    out = tmp_path / "cli.ts"
    cmd = [sys.executable, "-m", "diffmon.export", "--factory", "train_toy:ToyDenoiser",
           "--factory-kwargs", '{"width": 4}', "--feature-layer", "mid", "--shape", "1", "8", "8",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=py_dir, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "RuntimeWarning" not in p.stderr
    d, f = torch.jit.load(str(out))(torch.zeros(2, 1, 8, 8), torch.ones(2))
    assert d.shape == (2, 1, 8, 8) and f.shape == (2, 8, 2, 2)


def test_load_weights_by_content(tmp_path):
    """--weights: a torch.save dict nested under a key with a prefix, and a safetensors file under
    a misleading name, give the same state_dict."""
    from safetensors.torch import save_file

    from diffmon.export import load_weights

    sd = {"a.weight": torch.randn(3, 2), "b": torch.arange(4)}
    torch.save({"ema": {"module." + k: v for k, v in sd.items()}, "step": 3}, tmp_path / "c.safetensors")
    save_file(sd, str(tmp_path / "c.pt"))
    for got in (load_weights(str(tmp_path / "c.safetensors"), "ema", "module."),
                load_weights(str(tmp_path / "c.pt"))):
        assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
