"""diffmon.export with the condition held fixed (class labels, the null class, a fixed embedding),
learned-sigma outputs, the suggested feature layer, and the VAE export, on tiny real diffusers
networks. Every reference is written here, apart from the exporter: the linear DDPM schedule's
nearest timestep and D = x - sigma * eps(x / sqrt(1 + sigma^2), t) (epsilon prediction)."""

import hashlib
import json

import numpy as np
import pytest
import torch
from torch import nn

diffusers = pytest.importorskip("diffusers")

from diffmon.export import (Embedding, ExportError, device_constants, export, export_vae,  # noqa: E402
                            load_embedding, main, suggest_feature_layer)
from stacks import UNET_CONFIG  # noqa: E402  (1x8x8, block_out_channels (8, 16))

DIT = dict(in_channels=4, sample_size=8, patch_size=2, num_layers=4, num_attention_heads=2,
           attention_head_dim=8, num_embeds_ada_norm=10)  # out_channels None: in_channels, no learned sigma
COND_UNET = dict(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16), layers_per_block=1,
                 norm_num_groups=4, cross_attention_dim=8, attention_head_dim=2,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
           up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16),
           layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
           scaling_factor=0.7, shift_factor=0.2)
K = 5  # class embeddings of the class-conditional UNet


def note(path):
    extra = {"diffmon.json": ""}
    torch.jit.load(str(path), _extra_files=extra)
    return json.loads(extra["diffmon.json"])


def nearest_t(sigma):
    """Nearest timestep in log sigma of DDPM's linear schedule (1e-4..0.02, T = 1000)."""
    ab = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000))
    log_sig = 0.5 * np.log((1 - ab) / ab)
    return torch.tensor([int(np.argmin(np.abs(log_sig - np.log(s)))) for s in sigma.double().numpy()])


def inputs(c, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigma = torch.tensor([0.05, 0.8, 12.0])  # batch 3: the export traced batch 2
    x = 0.5 * torch.randn(3, c, size, size, generator=g) + sigma.view(-1, 1, 1, 1) * torch.randn(
        3, c, size, size, generator=g)
    return x, sigma


def eps_reference(net, x, sigma, layer=None, channels=None, **cond):
    """The EDM denoiser of an epsilon network called with ``cond``, and ``layer``'s output."""
    feats = []
    h = layer.register_forward_hook(lambda _m, _i, o: feats.append(o)) if layer is not None else None
    s4 = sigma.view(-1, 1, 1, 1)
    with torch.no_grad():
        eps = net(x / torch.sqrt(1 + s4**2), nearest_t(sigma), **cond).sample
    if h is not None:
        h.remove()
    if channels is not None:
        eps = eps[:, :channels]
    return x - s4 * eps, (feats[0] if feats else None)


def assert_close(got, want, tol=1e-5):
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < tol


@pytest.fixture(scope="module")
def class_unet():
    torch.manual_seed(0)
    return diffusers.UNet2DModel(**UNET_CONFIG, num_class_embeds=K).eval()


def test_class_conditional_unet_defaults_to_the_null_class(class_unet, tmp_path, capsys):
    out = tmp_path / "model.ts"
    export(class_unet, "mid_block", out, "eps", (1, 8, 8))
    printed = capsys.readouterr().out
    assert f"class_labels={K - 1}" in printed and "class_embedding rule" in printed and "by default" in printed
    n = note(out)
    assert n["condition"]["kind"] == "class" and n["condition"]["keyword"] == "class_labels"
    assert n["condition"]["label"] == K - 1 and n["condition"]["null_class"] is True
    assert n["condition"]["default"] is True and "class_embedding" in n["condition"]["rule"]
    assert n["feature_layer"] == "mid_block" and n["parameterization"] == "eps"
    assert n["learned_sigma"] is False and n["device_independent"] is True
    assert device_constants(str(out)) == []

    ts = torch.jit.load(str(out))
    x, sigma = inputs(1, 8)
    want, _ = eps_reference(class_unet, x, sigma, class_labels=torch.full((3,), K - 1, dtype=torch.long))
    with torch.no_grad():
        got, _ = ts(x, sigma)
    assert_close(got, want)

    # --class-label 3 (through the command line, with the weights from a file) is another network.
    weights = tmp_path / "w.pt"
    torch.save(class_unet.state_dict(), weights)
    out3 = tmp_path / "label3.ts"
    cfg = json.dumps({**UNET_CONFIG, "num_class_embeds": K})
    assert main(["--factory", "diffusers:UNet2DModel", "--factory-kwargs", cfg, "--weights", str(weights),
                 "--feature-layer", "mid_block", "--shape", "1", "8", "8", "--out", str(out3),
                 "--parameterization", "eps", "--class-label", "3"]) == 0
    assert note(out3)["condition"] == {"kind": "class", "keyword": "class_labels", "label": 3,
                                       "null_class": False, "rule": None, "default": False}
    with torch.no_grad():
        got3, _ = torch.jit.load(str(out3))(x, sigma)
    want3, _ = eps_reference(class_unet, x, sigma, class_labels=torch.full((3,), 3, dtype=torch.long))
    assert_close(got3, want3)
    assert float((got3 - got).abs().max()) > 1e-4


def test_dit_null_class_from_its_label_embedding_and_token_features(tmp_path, capsys):
    torch.manual_seed(1)
    dit = diffusers.DiTTransformer2DModel(**DIT).eval()
    assert dit.config.out_channels is None and dit.out_channels == 4  # the default: no learned sigma
    assert suggest_feature_layer(dit) == "transformer_blocks.1"  # (4 - 1) // 2
    out = tmp_path / "dit.ts"
    export(dit, "transformer_blocks.1", out, "eps", (4, 8, 8), condition="null")
    assert "LabelEmbedding rule" in capsys.readouterr().out
    c = note(out)["condition"]
    assert (c["label"], c["null_class"], c["default"]) == (10, True, False) and "LabelEmbedding" in c["rule"]
    assert note(out)["learned_sigma"] is False

    x, sigma = inputs(4, 8)
    null = torch.full((3,), 10, dtype=torch.long)
    want, feats = eps_reference(dit, x, sigma, dit.transformer_blocks[1], class_labels=null)
    with torch.no_grad():
        got, got_f = torch.jit.load(str(out))(x, sigma)
    assert_close(got, want)
    assert_close(got_f, feats.mean(dim=1))  # [B, L, D] tokens, mean-pooled


def test_dit_with_learned_sigma_keeps_the_first_channels(tmp_path):
    torch.manual_seed(2)
    dit = diffusers.DiTTransformer2DModel(**DIT, out_channels=8).eval()
    out = tmp_path / "dit.ts"
    export(dit, "transformer_blocks.1", out, "eps", (4, 8, 8), verbose=False)  # the default: null class
    n = note(out)
    assert n["learned_sigma"] is True and n["condition"]["label"] == 10 and n["condition"]["default"] is True
    x, sigma = inputs(4, 8, seed=1)
    want, _ = eps_reference(dit, x, sigma, channels=4, class_labels=torch.full((3,), 10, dtype=torch.long))
    with torch.no_grad():
        got, _ = torch.jit.load(str(out))(x, sigma)
    assert_close(got, want)


def test_text_conditional_unet_held_at_an_embedding_file(tmp_path):
    torch.manual_seed(3)
    unet = diffusers.UNet2DConditionModel(**COND_UNET).eval()
    weights, emb_file = tmp_path / "w.pt", tmp_path / "empty_prompt.pt"
    torch.save(unet.state_dict(), weights)
    emb = torch.randn(1, 5, 8)
    torch.save(emb, emb_file)
    out = tmp_path / "model.ts"
    assert main(["--factory", "diffusers:UNet2DConditionModel", "--factory-kwargs", json.dumps(COND_UNET),
                 "--weights", str(weights), "--embedding", str(emb_file), "--feature-layer", "mid_block",
                 "--shape", "1", "8", "8", "--out", str(out), "--parameterization", "eps"]) == 0
    n = note(out)
    assert n["condition"] == {"kind": "embedding", "keyword": "encoder_hidden_states", "file": "empty_prompt.pt",
                              "sha256": hashlib.sha256(emb_file.read_bytes()).hexdigest(), "shape": [1, 5, 8]}
    assert device_constants(str(out)) == []  # the embedding is a tensor constant, not a device one
    x, sigma = inputs(1, 8)
    want, _ = eps_reference(unet, x, sigma, encoder_hidden_states=emb.expand(3, -1, -1))
    with torch.no_grad():
        got, _ = torch.jit.load(str(out))(x, sigma)
    assert_close(got, want)


def test_vae_export_encodes_the_scaled_posterior_mean_and_decodes(tmp_path):
    torch.manual_seed(4)
    vae = diffusers.AutoencoderKL(**VAE).eval()
    out = tmp_path / "vae.ts"
    export_vae(vae, out, (3, 16, 16))
    n = note(out)
    assert {k: n[k] for k in ("kind", "scaling_factor", "shift_factor", "encode", "image_shape",
                              "latent_shape", "device_independent")} == {
        "kind": "vae", "scaling_factor": 0.7, "shift_factor": 0.2, "encode": "posterior mean",
        "image_shape": [3, 16, 16], "latent_shape": [4, 8, 8], "device_independent": True}
    ts = torch.jit.load(str(out))
    assert device_constants(ts) == []
    assert set(ts.state_dict()) == set(vae.state_dict())
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(5)) * 2 - 1
    with torch.no_grad():
        z_want = (vae.encode(x).latent_dist.mean - 0.2) * 0.7
        z = ts.encode(x)
        assert_close(z, z_want)
        assert_close(ts(x), z_want)
        assert_close(ts.decode(z_want), vae.decode(z_want / 0.7 + 0.2).sample)

    # The command line, with the weights from a file and the scaling factor overridden.
    weights, out2 = tmp_path / "vae.safetensors", tmp_path / "vae2.ts"
    from safetensors.torch import save_file
    save_file(vae.state_dict(), str(weights))
    assert main(["--vae", "--factory", "diffusers:AutoencoderKL", "--factory-kwargs", json.dumps(VAE),
                 "--weights", str(weights), "--shape", "3", "16", "16", "--out", str(out2),
                 "--scaling-factor", "0.5"]) == 0
    assert (note(out2)["scaling_factor"], note(out2)["shift_factor"]) == (0.5, 0.2)
    with torch.no_grad():
        assert_close(torch.jit.load(str(out2)).encode(x), (vae.encode(x).latent_dist.mean - 0.2) * 0.5)


def test_list_layers_marks_the_middle_blocks_and_the_suggestion(capsys):
    assert main(["--factory", "diffusers:DiTTransformer2DModel", "--factory-kwargs", json.dumps(DIT),
                 "--list-layers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "transformer_blocks.1\tBasicTransformerBlock\t(middle of 4, suggested)" in lines
    assert "transformer_blocks.0\tBasicTransformerBlock" in lines  # unmarked: name<TAB>Type as before
    assert main(["--factory", "diffusers:UNet2DModel", "--factory-kwargs", json.dumps(UNET_CONFIG),
                 "--list-layers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "mid_block\tUNetMidBlock2D\t(U-Net middle block, suggested)" in lines

    class SiTLike(nn.Module):  # no mid_block: the middle of the longest *blocks list
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Identity() for _ in range(28))
            self.final_blocks = nn.ModuleList(nn.Identity() for _ in range(3))

    assert suggest_feature_layer(SiTLike()) == "blocks.13"  # block 14 of 28
    assert suggest_feature_layer(nn.Linear(2, 2)) is None


def test_no_condition_and_wrappers_that_fix_the_label(class_unet, tmp_path):
    class Fixed(nn.Module):  # forward(x, t) fixes the label itself: no default is added
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, t):
            return self.net(x, t, class_labels=torch.zeros_like(t, dtype=torch.long)).sample

    out = tmp_path / "m.ts"
    export(Fixed(class_unet), "net.mid_block", out, "eps", (1, 8, 8))
    assert note(out)["condition"] is None
    # condition=None (--no-condition) calls without labels: diffusers' own error for this UNet,
    # in an ExportError that shows the call.
    with pytest.raises(ExportError, match=r"forward\(x, t\): ValueError: class_labels should be provided"):
        export(class_unet, "mid_block", out, "eps", (1, 8, 8), condition=None)


def test_error_cases(tmp_path, capsys):
    torch.manual_seed(0)
    plain = diffusers.UNet2DModel(**UNET_CONFIG).eval()
    with pytest.raises(ExportError, match=r"pass the class index explicitly \(condition=N / --class-label N\)"):
        export(plain, "mid_block", tmp_path / "m.ts", "eps", (1, 8, 8), condition="null")
    assert not (tmp_path / "m.ts").exists()

    two = tmp_path / "two.pt"
    torch.save({"prompt": torch.zeros(4, 8), "negative": torch.ones(4, 8)}, two)
    with pytest.raises(ValueError, match=r"holds 2 tensors \(prompt, negative\).*--embedding-key"):
        Embedding.from_file(two)
    with pytest.raises(SystemExit):
        main(["--factory", "diffusers:UNet2DModel", "--factory-kwargs", json.dumps(UNET_CONFIG),
              "--embedding", str(two), "--feature-layer", "mid_block", "--shape", "1", "8", "8",
              "--out", str(tmp_path / "m.ts")])
    assert "--embedding-key" in capsys.readouterr().err
    assert torch.equal(load_embedding(two, "negative"), torch.ones(4, 8))
    with pytest.raises(ValueError, match=r"\[L,D\] or \[1,L,D\]"):
        Embedding(torch.zeros(2, 4, 8))
    # Hostile embeddings (issue #45): a zero-sized dimension, NaN or Inf, refused naming the file.
    for name, bad in [("empty.pt", torch.zeros(1, 0, 8)), ("nan.pt", torch.full((4, 8), float("nan"))),
                      ("inf.pt", torch.tensor([[1.0, float("inf")]]))]:
        torch.save(bad, tmp_path / name)
        with pytest.raises(ValueError, match=rf"{name}: the embedding (has a zero-sized|holds NaN)"):
            Embedding.from_file(tmp_path / name)
    with pytest.raises(SystemExit):  # mutually exclusive
        main(["--factory", "x:y", "--class-label", "1", "--null-class"])
    with pytest.raises(SystemExit):
        main(["--factory", "x:y", "--vae", "--feature-layer", "mid_block"])
