"""A latent, class-conditional model on the GPU gives the CPU's numbers (docs/design.md §20).

A diffusers ``AutoencoderKL`` (``diffmon-export --vae``'s ``export_vae``) and a class-conditional
``DiTTransformer2DModel`` held at its null class, both exported on the CPU, evaluated with ICR,
the gap and PFD with the memorization ratio on the CPU and on the GPU. ICR's views are augmented in
pixel space and encoded by the VAE on the evaluation device, and the training latents are encoded
there too (each device has its own state folder, so its own cache): the two devices differ by
float32 round-off of the VAE and the DiT only. The tolerances are those of
``test_cpu_gpu_agree.py``, for the same reasons."""

import math

import pytest

M = 64  # PF-ODE latents (a quarter in the dry run)


def _vae_and_dit(tier):
    import torch
    from diffusers import AutoencoderKL, DiTTransformer2DModel

    width = (16, 32) if tier.dry_run else (64, 128)
    torch.manual_seed(4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=width,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                        layers_per_block=1, norm_num_groups=8, scaling_factor=0.7)
    torch.manual_seed(5)
    dit = DiTTransformer2DModel(in_channels=4, sample_size=16, patch_size=2,
                                num_layers=4 if tier.dry_run else 8, num_attention_heads=4,
                                attention_head_dim=16 if tier.dry_run else 32,
                                num_embeds_ada_norm=10)
    return vae, dit


@pytest.fixture(scope="module")
def records(dm, tier, tmp_path_factory):
    import torch
    from diffmon.export import export, export_vae

    d = tmp_path_factory.mktemp("latent")
    vae, dit = _vae_and_dit(tier)
    export_vae(vae, d / "vae.ts", (3, 32, 32))
    export(dit, "transformer_blocks.1", d / "dit.ts", "eps", (4, 16, 16))  # the null class
    g = torch.Generator().manual_seed(6)
    state = {k: (v + 0.05 * v.std() * torch.randn(v.shape, generator=g)
                 if v.is_floating_point() and v.numel() > 1 else v).clone()
             for k, v in dit.state_dict().items()}
    torch.save(state, d / "dit_000100.pt")
    m = tier.n(M)
    out = {}
    for name, device in (("cpu", "cpu"), ("gpu", tier.dev("cuda"))):
        config = d / f"{name}.yaml"
        config.write_text(
            f"run: {{dir: '{d}', name: latent}}\n"
            f"state_dir: '{d / (name + '.state')}'\n"
            f"model: {{architecture: '{d / 'dit.ts'}', vae: '{d / 'vae.ts'}'}}\n"
            f"device: '{device}'\n"
            f"data: {{path: '{dm.assets.train}', heldout_path: '{dm.assets.heldout}'}}\n"
            f"icr: {{samples: {tier.n(512)}, batch_size: 128, seed: 3}}\n"
            f"pfd: {{enabled: true, samples: {m}, steps: 8, seed: 1, batch_size: 64}}\n"
            "memorization: {enabled: true, threshold: 0.9}\nearly_stop: {confirm: none}\n")
        rec, _ = dm.eval_json(config, d / "dit_000100.pt")
        out[name] = rec
    return out


def _rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def test_latent_model_agrees_on_cpu_and_gpu(records, tier, measure):
    c, g = records["cpu"], records["gpu"]
    m = tier.n(M)
    icr_diff = abs(c["icr"] - g["icr"])
    r_t = _rel(c["loss_train"], g["loss_train"])
    r_h = _rel(c["loss_heldout"], g["loss_heldout"])
    r_mem = _rel(c["pfd_memorization"], g["pfd_memorization"])
    ratio_diff = abs(c["memorization_ratio"] - g["memorization_ratio"])
    measure(f"latent DiT + VAE: icr cpu {c['icr']:.6f} gpu {g['icr']:.6f} |diff| {icr_diff:.2e} "
            f"(tol 2e-3; stderr {c['icr_stderr']:.4f}); losses rel {r_t:.2e}, {r_h:.2e} (tol 1e-3); "
            f"E_mem cpu {c['pfd_memorization']:.6g} gpu {g['pfd_memorization']:.6g} rel {r_mem:.2e} "
            f"(tol 1e-2); memorization ratio |diff| {ratio_diff:.4f} (tol {2 / m:.4f})")
    assert c["icr_samples"] == g["icr_samples"] == tier.n(512)
    assert icr_diff <= 2e-3
    assert r_t <= 1e-3 and r_h <= 1e-3
    for r in (c, g):
        assert math.isfinite(r["pfd_memorization"]) and r["pfd_memorization"] > 0
    assert r_mem <= 1e-2
    assert ratio_diff <= 2 / m + 1e-12
