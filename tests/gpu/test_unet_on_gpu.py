"""A diffusers UNet2DModel exported on the CPU (as users export, on a login node) evaluated on the
GPU: the exported file must not pin the CPU (issue: `torch.ones(..., device=cpu)` frozen by the
trace made `watch` exit 1 at start on cuda)."""

import math


def test_cpu_exported_unet_evaluates_on_cuda(dm, tier, tmp_path, measure):
    device = tier.dev("cuda")
    cfg = dm.config(tmp_path / "c.yaml", device,
                    f"icr: {{samples: {tier.n(1024)}, batch_size: 256, seed: 3}}\n"
                    "early_stop: {confirm: none}\n")
    rec, out = dm.eval_json(cfg)
    assert rec["icr_samples"] == tier.n(1024)
    assert math.isfinite(rec["icr"]) and 0 < rec["icr"] <= 1, rec["icr"]
    assert math.isfinite(rec["icr_stderr"]) and rec["icr_stderr"] > 0
    # The features are the mid_block's channels (128 on the GPU): one eigenvalue each.
    assert len(rec["icr_eigenvalues"]) == tier.feature_dim
    # The gap runs on the same device (the held-out set is in the config).
    assert math.isfinite(rec["generalization_gap"])
    measure(f"device {device}: icr {rec['icr']:.6f} +- {rec['icr_stderr']:.6f} (n {rec['icr_samples']}), "
            f"gap {rec['generalization_gap']:.6g}, eval {rec['seconds']:.2f} s")
