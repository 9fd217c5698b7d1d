"""Flow-matching networks through the exporter (issue 44), and diffusers' transformer signatures.

Every reference here is written from the path's definition (x_t = alpha x + sigma_t n, the
prediction's definition), not by calling the exporter's conversion: the time t that holds an EDM
noise level sigma is found by bisection on sigma_t(t) / alpha(t) = sigma, and a velocity is
turned into the clean image by solving the 2x2 system of x_t and dx_t/dt.

Tolerance 1e-6 (absolute, on denoised values of order 1 at sigma <= 20): the export computes in
float32 from the same network outputs; its rounding is a few float32 ulps of the inputs (|x| up to
about 20 here, ulp 2e-6 at 20, but x is scaled down to x_t before any subtraction), and the measured
differences are below 5e-7.
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch

import flow_toy
import train_toy
from diffmon.export import (PARAMETERIZATION_TABLE, PARAMETERIZATIONS, Embedding, ExportError, build_parser,
                            export, main)

TOL = 1e-6
SIGMAS = (0.02, 0.29, 1.0, 4.0, 20.0)


# -- references, from the definitions ---------------------------------------------------------

def path_coefficients(path, t):
    """alpha, sigma_t and their t-derivatives, float64, from each path's definition."""
    t = torch.as_tensor(t, dtype=torch.float64)
    if path == "rectified_flow":  # x_t = (1 - t) x + t n
        return 1 - t, t, -torch.ones_like(t), torch.ones_like(t)
    if path == "cosine":          # REPA's: x_t = cos(pi t / 2) x + sin(pi t / 2) n
        h = math.pi / 2
        return torch.cos(h * t), torch.sin(h * t), -h * torch.sin(h * t), h * torch.cos(h * t)
    if path == "sit_linear":      # SiT's code: x_t = t x + (1 - t) n
        return t, 1 - t, torch.ones_like(t), -torch.ones_like(t)
    if path == "sit_gvp":         # SiT's code: x_t = sin(pi t / 2) x + cos(pi t / 2) n
        h = math.pi / 2
        return torch.sin(h * t), torch.cos(h * t), h * torch.cos(h * t), -h * torch.sin(h * t)
    raise ValueError(path)


def time_of(path, sigma):
    """The t with sigma_t(t) / alpha(t) = sigma, by bisection (the ratio is monotone in t)."""
    lo, hi = 1e-12, 1 - 1e-12

    def ratio(t):
        a, s, _, _ = path_coefficients(path, t)
        return float(s / a)

    increasing = ratio(0.25) < ratio(0.75)
    for _ in range(200):
        mid = (lo + hi) / 2
        if (ratio(mid) < sigma) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def reference_denoiser(net_call, path, prediction, x, sigma, t_scale=1.0):
    """D(x; sigma) of a network on a flow path: x is the EDM state x0 + sigma n."""
    t = time_of(path, sigma)
    a, s, da, ds = (float(c) for c in path_coefficients(path, t))
    x_t = (a * x.double()).float()
    out = net_call(x_t, torch.full((x.shape[0],), t * t_scale, dtype=torch.float32)).double()
    x_t = x_t.double()
    if prediction == "velocity":
        # [x_t; u] = [[a, s], [da, ds]] [x0; n]: Cramer's rule for x0.
        return (x_t * ds - s * out) / (a * ds - s * da)
    if prediction == "noise":
        return (x_t - s * out) / a
    if prediction == "score":  # score = -n / sigma_t
        return (x_t + s * s * out) / a
    raise ValueError(prediction)


def digits(size=8, n=64):
    return train_toy.load_digit_images(size)[:n]


# -- --help ------------------------------------------------------------------------------------

def test_help_lists_every_parameterization_on_one_line_and_every_option_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    for row in PARAMETERIZATION_TABLE:
        hits = [ln for ln in lines if ln.split()[:1] == [row.name] and row.help in ln]
        assert len(hits) == 1, (row.name, hits)
    assert {"rectified_flow", "sit_linear_velocity", "sit_gvp_score", "sit_gvp_noise"} <= set(PARAMETERIZATIONS)
    assert "shift" in text and "sampler" in text
    undocumented = [a.dest for a in build_parser()._actions if not a.help]
    assert undocumented == []


def test_the_model_contract_lists_exactly_the_exporters_parameterizations():
    """docs/guide/model-contract.md's table is tested against PARAMETERIZATION_TABLE, the one
    definition (a name added to the code and not to the docs, or the reverse, fails here)."""
    text = (Path(__file__).resolve().parents[2] / "docs/guide/model-contract.md").read_text()
    table = text.split("| `--parameterization` |", 1)[1].split("\n\n", 1)[0]
    listed = set()
    for row in table.splitlines()[2:]:
        stem = ""
        for name in re.findall(r"`(\w+)`", row.split("|")[1]):
            if name.startswith("_"):  # `sit_linear_velocity`, `_score`: the same stem
                name = stem + name
            else:
                stem = name.rsplit("_", 1)[0]
            listed.add(name)
    assert listed == {p.name for p in PARAMETERIZATION_TABLE}


# -- SD3: the diffusers rectified-flow transformer --------------------------------------------

def tiny_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                 pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8)


SD3_KWARGS = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                  pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8)


def test_sd3_transformer_exports_as_rectified_flow_whatever_the_scheduler_shift(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    net = tiny_sd3()
    emb, pooled = torch.randn(5, 16), torch.randn(8)
    files = {}
    for shift in (1.0, 3.0):
        sched = FlowMatchEulerDiscreteScheduler(shift=shift)
        config = dict(sched.config, _class_name="FlowMatchEulerDiscreteScheduler")
        files[shift] = export(net, "transformer_blocks.0", tmp_path / f"sd3_{shift}.ts", "rectified_flow",
                              (4, 8, 8), condition=Embedding(emb),
                              extra_conditions=[Embedding(pooled, "pooled_projections", pooled=True)],
                              scheduler=config, verbose=False)

    # The reference's convention is diffusers' own: scale_noise(x0, tau, n) = (x0 + sigma n) / (1 + sigma)
    # with t = tau / 1000 and sigma = t / (1 - t), for a timestep of a shifted schedule.
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    tau = sched.timesteps[500]
    g = torch.Generator().manual_seed(1)
    x0, n = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    t = float(tau) / 1000
    s = t / (1 - t)
    assert torch.allclose(sched.scale_noise(x0, tau.reshape(1), n), (x0 + s * n) / (1 + s), atol=1e-6)
    assert time_of("rectified_flow", s) == pytest.approx(t, abs=1e-7)

    def call(x_t, timestep):
        with torch.no_grad():
            return net(x_t, encoder_hidden_states=emb.expand(len(x_t), -1, -1),
                       pooled_projections=pooled.expand(len(x_t), -1), timestep=timestep).sample

    for sigma in SIGMAS:
        x = x0 * 0.5 + sigma * n
        want = reference_denoiser(call, "rectified_flow", "velocity", x, sigma, t_scale=1000.0)
        for shift, m in files.items():
            got = m(x, torch.full((2,), sigma))[0].double()
            assert float((got - want).abs().max()) <= TOL, (shift, sigma)
    note = json.loads(_note(tmp_path / "sd3_3.0.ts"))
    assert (note["family"], note["path"], note["prediction"], note["t_scale"]) == \
        ("flow", "rectified_flow", "velocity", 1000.0)
    assert [e["keyword"] for e in note["condition"]["extra"]] == ["pooled_projections"]


def _note(path):
    extra = {"diffmon.json": ""}
    torch.jit.load(str(path), _extra_files=extra)
    return extra["diffmon.json"]


def test_the_training_scheduler_refuses_a_ddpm_parameterization_of_a_flow_network(tmp_path):
    net = tiny_sd3()
    flow = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
    with pytest.raises(ExportError, match="rectified_flow, not eps"):
        export(net, "transformer_blocks.0", tmp_path / "x.ts", "eps", (4, 8, 8),
               condition=Embedding(torch.randn(5, 16)),
               extra_conditions=[Embedding(torch.randn(8), "pooled_projections", pooled=True)], scheduler=flow)
    ddpm = {"_class_name": "DDPMScheduler", "prediction_type": "v_prediction", "beta_schedule": "scaled_linear",
            "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000}
    with pytest.raises(ExportError, match="--parameterization v, not rectified_flow"):
        export(net, "transformer_blocks.0", tmp_path / "x.ts", "rectified_flow", (4, 8, 8), scheduler=ddpm)
    with pytest.raises(ExportError, match="--schedule scaled_linear, not linear"):
        export(net, "transformer_blocks.0", tmp_path / "x.ts", "v", (4, 8, 8), scheduler=ddpm)
    with pytest.raises(ExportError, match="trains an EDM network: --parameterization edm or edm_raw, not rectified_flow"):
        export(net, "transformer_blocks.0", tmp_path / "x.ts", "rectified_flow", (4, 8, 8),
               scheduler={"_class_name": "EDMEulerScheduler", "prediction_type": "epsilon", "sigma_data": 0.5})
    assert not (tmp_path / "x.ts").exists()


def test_sd3_without_its_pooled_embedding_is_one_line_not_a_traceback(tmp_path, capsys):
    argv = ["--factory", "diffusers:SD3Transformer2DModel", "--factory-kwargs", json.dumps(SD3_KWARGS),
            "--feature-layer", "transformer_blocks.0", "--shape", "4", "8", "8",
            "--out", str(tmp_path / "m.ts"), "--parameterization", "rectified_flow"]
    emb = tmp_path / "emb.pt"
    torch.save(torch.randn(5, 16), emb)
    assert main(argv + ["--embedding", str(emb)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "pooled_projections" in err and "--pooled-embedding" in err
    pooled = tmp_path / "pooled.pt"
    torch.save(torch.randn(8), pooled)
    assert main(argv + ["--embedding", str(emb), "--pooled-embedding", str(pooled)]) == 0
    assert (tmp_path / "m.ts").is_file()


def test_pixart_transformer_gets_the_time_by_keyword(tmp_path, capsys):
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    kwargs = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
                  cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=12,
                  norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6)
    net = PixArtTransformer2DModel(**kwargs)
    emb = torch.randn(5, 12)
    torch.save(emb, tmp_path / "emb.pt")
    # Before: the time went in as the second positional argument, encoder_hidden_states, and the
    # embedding's keyword collided with it ("got multiple values for argument").
    rc = main(["--factory", "diffusers:PixArtTransformer2DModel", "--factory-kwargs", json.dumps(kwargs),
               "--feature-layer", "transformer_blocks.0", "--shape", "4", "8", "8", "--out",
               str(tmp_path / "pixart.ts"), "--parameterization", "eps", "--embedding", str(tmp_path / "emb.pt")])
    assert rc == 0, capsys.readouterr().err
    m = torch.jit.load(str(tmp_path / "pixart.ts"))
    m.load_state_dict(net.state_dict(), strict=False)  # pos_embed: a non-persistent buffer, the same
    # At a noise level of the schedule itself, the time is that step (from the definition of
    # DDPM's linear schedule, written here).
    ab = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0)
    k = 400
    sigma = float(torch.sqrt((1 - ab[k]) / ab[k]))
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        x_vp = (x.double() / math.sqrt(1 + sigma ** 2)).float()
        eps = net(x_vp, encoder_hidden_states=emb.expand(2, -1, -1), timestep=torch.tensor([k, k]),
                  added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample[:, :4]
        got = m(x, torch.full((2,), sigma))[0]
    assert float((got.double() - (x.double() - sigma * eps.double())).abs().max()) <= 1e-4 * (1 + sigma)
    assert json.loads(_note(tmp_path / "pixart.ts"))["learned_sigma"] is True


# -- SiT: a tiny SiT trained a few steps on the digits, Linear and GVP -------------------------

PREDICTIONS = {"sit_linear": {"velocity": "sit_linear_velocity", "score": "sit_linear_score",
                              "noise": "sit_linear_noise"},
               "sit_gvp": {"velocity": "sit_gvp_velocity", "score": "sit_gvp_score", "noise": "sit_gvp_noise"},
               "cosine": {"velocity": "cosine_flow"}}


@pytest.mark.parametrize("path", list(PREDICTIONS))
def test_tiny_sit_trained_on_digits_matches_the_reference_for_each_prediction(tmp_path, path):
    torch.manual_seed(0)
    net = flow_toy.ToySiT(1, 8, width=32, depth=2, heads=2)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    data = digits()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        loss = flow_toy.flow_loss(net, data[torch.randint(len(data), (16,), generator=g)], path, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()

    def call(x_t, t):
        with torch.no_grad():
            return net(x_t, t)

    x0 = data[:3]
    n = torch.randn(x0.shape, generator=g)
    for prediction, name in PREDICTIONS[path].items():
        m = export(net, "blocks.0", tmp_path / f"{prediction}.ts", name, (1, 8, 8), verbose=False)
        note = json.loads(_note(tmp_path / f"{prediction}.ts"))
        assert (note["family"], note["path"], note["prediction"], note["t_scale"]) == ("flow", path, prediction, 1.0)
        for sigma in SIGMAS:
            x = x0 + sigma * n
            want = reference_denoiser(call, path, prediction, x, sigma)
            got = m(x, torch.full((3,), sigma))[0].double()
            scale = 1.0 if prediction == "velocity" else max(1.0, sigma)  # noise/score: D = x - sigma n
            assert float((got - want).abs().max()) <= TOL * scale, (prediction, sigma)


def test_sigma_star_in_t_on_each_path():
    # The ICR paper's sigma* = 0.29 in each path's time (docs/guide/model-contract.md).
    assert time_of("rectified_flow", 0.29) == pytest.approx(0.2248, abs=1e-4)
    assert time_of("sit_linear", 0.29) == pytest.approx(0.7752, abs=1e-4)
    assert time_of("sit_gvp", 0.29) == pytest.approx(0.8203, abs=1e-4)
    assert time_of("cosine", 0.29) == pytest.approx(0.1797, abs=1e-4)
    # The ICR paper's SiT setting t = 0.2 in the SiT paper's convention (data at t = 0, Linear:
    # x_t = (1 - t) x + t n) is sigma = 0.25, SiT's code time 0.8.
    a, s, _, _ = path_coefficients("rectified_flow", 0.2)
    assert float(s / a) == pytest.approx(0.25)


def test_every_flow_path_has_the_coefficients_of_its_definition():
    """The exporter's coefficients of each path in FLOW_PATHS (and every path a row of the table
    names) are those of the path's definition above: a path known to flow_time but not to
    _flow_coefficients is an error there, never another path's coefficients. Tolerance 1e-9:
    float64 throughout."""
    from diffmon.export.parameterization import FLOW_PATHS, _flow_coefficients
    assert {r.path for r in PARAMETERIZATION_TABLE if r.path} == set(FLOW_PATHS)
    s = torch.tensor(SIGMAS, dtype=torch.float64)
    for path in FLOW_PATHS:
        t, a, st, da, dst = _flow_coefficients(path, s)
        ref = path_coefficients(path, t)
        for got, want, what in zip((a, st, da, dst), ref, ("alpha", "sigma_t", "d alpha", "d sigma_t")):
            assert torch.allclose(got, want, rtol=0, atol=1e-9), (path, what)
    with pytest.raises(ValueError, match="made_up"):
        _flow_coefficients("made_up", s)


# -- the likely mistake: a flow network exported as eps ---------------------------------------

def test_a_trained_flow_network_exported_as_eps_is_warned_about(tmp_path, capsys):
    torch.manual_seed(0)
    net = flow_toy.ToyVelocity(1, 16)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    data = digits()
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        loss = flow_toy.flow_loss(net, data[torch.randint(len(data), (32,), generator=g)], "rectified_flow", g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(net.state_dict(), tmp_path / "w.pt")
    common = ["--factory", "flow_toy:ToyVelocity", "--factory-kwargs", '{"channels": 1, "width": 16}',
              "--weights", str(tmp_path / "w.pt"), "--feature-layer", "mid", "--shape", "1", "8", "8"]
    assert main(common + ["--out", str(tmp_path / "right.ts"), "--parameterization", "rectified_flow",
                          "--t-scale", "1"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(common + ["--out", str(tmp_path / "wrong.ts"), "--parameterization", "eps"]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "parameterization is probably not the one stated" in err


# -- the flow toy trainer ----------------------------------------------------------------------

@pytest.mark.parametrize("arch,path", [("unet", "rectified_flow"), ("sit", "sit_linear")])
def test_flow_toy_writes_a_run_whose_checkpoints_load_into_its_architecture(tmp_path, arch, path):
    rc = flow_toy.main(["--run-dir", str(tmp_path), "--arch", arch, "--path", path, "--size", "8", "--width", "16",
                        "--train-size", "16", "--heldout-size", "20", "--steps", "4", "--ckpt-every", "2",
                        "--batch-size", "8", "--ema", "0.9"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000002.pt", "ckpt_000004.pt", "heldout.h5",
                                                          "model.ts", "train.h5"]
    note = json.loads(_note(tmp_path / "model.ts"))
    assert (note["parameterization"], note["t_scale"]) == (flow_toy.OBJECTIVES[path], 1.0)
    arch_file = torch.jit.load(str(tmp_path / "model.ts"))
    arch_file.load_state_dict(torch.load(tmp_path / "ckpt_000004.pt", weights_only=True))
    d, f = arch_file(torch.zeros(2, 1, 8, 8), torch.tensor([0.29, 2.0]))
    assert d.shape == (2, 1, 8, 8) and torch.isfinite(d).all() and f.shape[0] == 2


def test_the_scheduler_round_trip_compares_the_noising_itself(tmp_path):
    from diffmon.export import scheduler_round_trip
    from diffmon.export.parameterization import _Converter

    ddpm = {"_class_name": "DDPMScheduler", "prediction_type": "epsilon", "beta_schedule": "linear",
            "beta_start": 1e-4, "beta_end": 0.02, "num_train_timesteps": 1000}
    flow = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}

    def conv(p, **kw):
        return _Converter(p, 0.5, kw.pop("schedule", "linear"), kw.pop("beta_min", None), kw.pop("beta_max", None),
                          1000, None, "nearest", kw.pop("t_scale", None), None, torch.device("cpu"))

    assert scheduler_round_trip(ddpm, conv("eps")) is None
    assert scheduler_round_trip(flow, conv("rectified_flow")) is None
    # Other betas than the scheduler's: its own add_noise disagrees with the export's input.
    assert "differs from the DDPMScheduler's own noising" in scheduler_round_trip(ddpm, conv("eps", beta_max=0.03))
    # Another flow path than the scheduler's: the same check sees it.
    assert "FlowMatchEulerDiscreteScheduler's own noising" in scheduler_round_trip(flow, conv("sit_linear_velocity"))
    # A matching export passes end to end.
    export(flow_toy.ToyVelocity(1, 8), "mid", tmp_path / "ok.ts", "eps", (1, 8, 8), scheduler=ddpm, verbose=False)
    assert (tmp_path / "ok.ts").is_file()
