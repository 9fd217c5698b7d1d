"""A PFD evaluation on the GPU: the student, the teacher and the empirical flow integrated from
the same CPU-drawn latents; E_gen and E_mem finite, the caches written."""

import math


def test_pfd_on_cuda(dm, tier, tmp_path, measure):
    device = tier.dev("cuda")
    body = (
        "icr: {enabled: false}\n"
        f"pfd: {{enabled: true, teacher: '{dm.assets.teacher}', samples: {tier.n(128)}, steps: 12, "
        "seed: 2, batch_size: 128}\n"
        "early_stop: {metric: pfd_generalization, confirm: none}\n")
    cfg = dm.config(tmp_path / "c.yaml", device, body)
    rec, out = dm.eval_json(cfg)
    assert "icr" not in rec  # not computed: absent, never zero (docs/design.md §13)
    for key in ("pfd_generalization", "pfd_memorization"):
        assert math.isfinite(rec[key]) and rec[key] > 0, (key, rec.get(key))
    # The teacher's and the empirical flow's outputs are cached in the state folder (§4).
    cache = tmp_path / "c.state" / "cache"
    names = sorted(p.name.split("-")[0] for p in cache.glob("*.h5"))
    assert {"teacher", "empirical"} <= set(names), names
    measure(f"device {device}: pfd_generalization {rec['pfd_generalization']:.6g}, "
            f"pfd_memorization {rec['pfd_memorization']:.6g} (M {tier.n(128)}, 12 steps), "
            f"eval {rec['seconds']:.2f} s")
