"""Device selection: ``device: cuda`` and ``cuda:0`` evaluate; one past the last device is a clear
error that names the device and how many are visible, and writes no record."""

import math

import pytest



def icr_only(tier) -> str:
    # ICR only (the held-out set is in every config, so early_stop.confirm: auto would pick the
    # gap; none keeps the run to what the test looks at). 256 pairs = 2 x d on the GPU.
    return f"icr: {{samples: {tier.n(256)}, batch_size: 256, seed: 3}}\nearly_stop: {{confirm: none}}\n"


@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_device_evaluates(dm, tier, tmp_path, measure, spec):
    device = tier.dev(spec)
    rec, out = dm.eval_json(dm.config(tmp_path / "c.yaml", device, icr_only(tier)))
    assert rec["step"] == 100
    assert rec["icr_samples"] == tier.n(256)
    assert math.isfinite(rec["icr"]) and 0 < rec["icr"] <= 1, rec["icr"]
    measure(f"device {device}: icr {rec['icr']:.6f} (n {rec['icr_samples']}), eval {rec['seconds']:.2f} s, "
            f"process {out.seconds:.2f} s")


def test_missing_device_is_a_clear_error(dm, tier, tmp_path, measure):
    import torch

    count = torch.cuda.device_count()  # 0 on a machine without CUDA (the dry run)
    spec = f"cuda:{count}"  # one past the last device
    cfg = dm.config(tmp_path / "c.yaml", spec, icr_only(tier))

    # check-config validates the file without touching devices (it may run on a login node);
    # where it does probe the device, it must say the same thing, with the config exit code.
    check = dm.run("check-config", cfg)
    assert check.returncode in (0, 2), check.stderr
    if check.returncode == 2:
        assert spec in check.stderr, check.stderr

    out = dm.run("eval", "--config", cfg, dm.assets.checkpoint, "--json")
    # docs/design.md §11 and §14: a device that is not there is a config problem on this
    # machine, exit 2, and nothing in the record stream.
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout.strip() == "", out.stdout
    assert f"device {spec}: not available" in out.stderr, out.stderr
    visible = f"{count} CUDA device(s) visible" if count else "no CUDA device is visible"
    assert visible in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "panicked" not in out.stderr, out.stderr
    message = next(line for line in out.stderr.splitlines() if spec in line)
    measure(f"device {spec} with {count} visible: check-config exit {check.returncode}, "
            f"eval exit {out.returncode}: {message.strip()}")
