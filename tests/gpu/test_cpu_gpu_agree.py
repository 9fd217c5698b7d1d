"""The same checkpoint, config and seed on the CPU and on the GPU give the same numbers: the views,
the noise and the latents are drawn on the CPU and moved, and TF32 is off, so the two differ only
by float32 round-off (summation order in cuDNN's convolutions and cuBLAS's products). Every
metric of the record that can differ is compared with a stated tolerance."""

import math

import pytest

M_GPU = 64  # PF-ODE latents on the GPU (a quarter in the dry run)


@pytest.fixture(scope="module")
def records(dm, tier, tmp_path_factory):
    d = tmp_path_factory.mktemp("agree")
    M = tier.n(M_GPU)
    body = (
        f"icr: {{samples: {tier.n(512)}, batch_size: 128, seed: 3}}\n"
        f"pfd: {{enabled: true, teacher: '{dm.assets.teacher}', samples: {M}, steps: 8, seed: 1, "
        "batch_size: 64}\n"
        # The ratio of an untrained UNet is 0 at any usable threshold: its PF-ODE samples lie far
        # from every training image, d1/d2 in [0.9997, 1] (measured on the dry run's model), so
        # the comparison below is of 0 with 0 unless the student memorizes. It still checks that
        # the ratio is computed on both devices; a meaningful value needs a memorizing student.
        "memorization: {enabled: true, threshold: 0.9}\n"
        "early_stop: {confirm: none}\n")
    out = {}
    # Separate state folders: the teacher's and the empirical flow's caches (docs/design.md §4)
    # are keyed by the model, not the device, and must be computed on each device.
    for name, device in (("cpu", "cpu"), ("gpu", tier.dev("cuda"))):
        rec, _ = dm.eval_json(dm.config(d / f"{name}.yaml", device, body))
        out[name] = rec
    return out


def _rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def test_icr_agrees(records, tier, measure):
    c, g = records["cpu"], records["gpu"]
    assert c["icr_samples"] == g["icr_samples"] == tier.n(512)
    diff = abs(c["icr"] - g["icr"])
    measure(f"icr cpu {c['icr']:.6f} gpu {g['icr']:.6f} |diff| {diff:.2e} (tol 2e-3; "
            f"stderr {c['icr_stderr']:.4f}); traces rel diff "
            f"{_rel(c['icr_invariant_trace'], g['icr_invariant_trace']):.2e}, "
            f"{_rel(c['icr_residual_trace'], g['icr_residual_trace']):.2e} (tol 1e-3)")
    # ICR is computed in float64 from float32 features that differ by round-off (~1e-6 relative,
    # up to ~1e-5 with cuDNN's algorithms); the generalized eigenproblem amplifies that by at most
    # the conditioning of the ridged residual covariance. 2e-3 is a tenth or less of the jackknife
    # standard error at n = 512 and below the difference that the issue measured when the views
    # were drawn per device (0.6634 vs 0.6569, 6.5e-3), so that regression fails here.
    assert diff <= 2e-3
    # The traces are plain sums of feature moments: round-off only.
    assert _rel(c["icr_invariant_trace"], g["icr_invariant_trace"]) <= 1e-3
    assert _rel(c["icr_residual_trace"], g["icr_residual_trace"]) <= 1e-3


def test_generalization_gap_agrees(records, measure):
    c, g = records["cpu"], records["gpu"]
    rl_t = _rel(c["loss_train"], g["loss_train"])
    rl_h = _rel(c["loss_heldout"], g["loss_heldout"])
    gap_diff = abs(c["generalization_gap"] - g["generalization_gap"])
    scale = c["loss_train"] + c["loss_heldout"]
    measure(f"loss_train cpu {c['loss_train']:.6g} gpu {g['loss_train']:.6g} rel {rl_t:.2e}; "
            f"loss_heldout rel {rl_h:.2e} (tol 1e-3); gap cpu {c['generalization_gap']:.6g} "
            f"gpu {g['generalization_gap']:.6g} |diff| {gap_diff:.2e} "
            f"(tol 1e-3 x (loss_train + loss_heldout) = {1e-3 * scale:.2e})")
    # Each loss is a float64 mean of squared errors of one float32 forward per image at a fixed
    # noise: round-off gives ~1e-5 relative; 1e-3 leaves room for cuDNN's algorithms and still
    # fails on other noise or other images (which move a 128-image mean by percents).
    assert rl_t <= 1e-3 and rl_h <= 1e-3
    # The gap is a difference of the two losses: its error is bounded by theirs.
    assert gap_diff <= 1e-3 * scale


def test_pfd_and_memorization_agree(records, tier, measure):
    c, g = records["cpu"], records["gpu"]
    M = tier.n(M_GPU)
    r_mem = _rel(c["pfd_memorization"], g["pfd_memorization"])
    r_gen = _rel(c["pfd_generalization"], g["pfd_generalization"])
    ratio_diff = abs(c["memorization_ratio"] - g["memorization_ratio"])
    measure(f"pfd_memorization (E_mem) cpu {c['pfd_memorization']:.6g} gpu "
            f"{g['pfd_memorization']:.6g} rel {r_mem:.2e}; pfd_generalization cpu "
            f"{c['pfd_generalization']:.6g} gpu {g['pfd_generalization']:.6g} rel {r_gen:.2e} "
            f"(tol 1e-2); memorization_ratio cpu {c['memorization_ratio']:.4f} gpu "
            f"{g['memorization_ratio']:.4f} |diff| {ratio_diff:.4f} (tol {2 / M:.4f} = 2/M)")
    for r in (c, g):
        assert math.isfinite(r["pfd_memorization"]) and r["pfd_memorization"] > 0
        assert math.isfinite(r["pfd_generalization"]) and r["pfd_generalization"] > 0
    # The latents are the same (drawn on the CPU); 15 network calls of the Heun sampler carry
    # round-off forward and the ODE can grow it, so 1e-2 relative: ten times looser than the
    # losses, still far below what other latents would give at M = 64.
    assert r_mem <= 1e-2
    assert r_gen <= 1e-2
    # A sample counts when d1 < 0.9 d2: round-off can flip one that sits on the threshold;
    # two such samples out of M are allowed.
    assert ratio_diff <= 2 / M + 1e-12
