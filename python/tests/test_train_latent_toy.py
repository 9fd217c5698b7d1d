"""train_latent_toy.py: the run folder's layout, a VAE that reconstructs with unit-std scaled
latents, a DiT that learns, the stop file, and determinism.

Two runs of the script, side by side as subprocesses and shared by the tests: a complete short
one (100 VAE steps, 100 DiT steps, checkpoints at 50 and 100) and one told to run 1000 steps that
the stop file ends after its first checkpoint (same seed and VAE steps, so its VAE and
checkpoint-50 must be the complete run's, byte for byte).
"""

import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_latent_toy

# Two trainings of the latent toy (a minute of CPU): make test-long.
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.long]

SCRIPT = Path(train_latent_toy.__file__)
SMALL = ["--vae-steps", "100", "--ckpt-every", "50"]
MODEL_FILE = "diffusion_pytorch_model.safetensors"


def _cmd(run_dir, *extra):
    return [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), *SMALL, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs at once (one thread each, the default: two cores). The stopped one keeps its VAE, scheduler
    and data outside its run folder; EARLY_STOP appears there once checkpoint-50 does (during the
    3 s pause after it)."""
    root = tmp_path_factory.mktemp("latent")
    run_dir, stop_dir, side = root / "run", root / "stopped", root / "side"
    full = subprocess.Popen(_cmd(run_dir, "--steps", "100"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = subprocess.Popen(_cmd(stop_dir, "--steps", "1000", "--pause", "3",
                                 "--vae-out", str(side / "vae"), "--scheduler-out", str(side / "scheduler"),
                                 "--data-out", str(side)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (stop_dir / "checkpoint-50").is_dir():
            assert stop.poll() is None, stop.communicate()[0]
            assert time.monotonic() < deadline, "no checkpoint-50"
            time.sleep(0.05)
        seen = sorted(p.name for p in stop_dir.glob("checkpoint-*"))
        (stop_dir / "EARLY_STOP").write_text("")
        stop_out = stop.communicate(timeout=300)[0]
        full_out = full.communicate(timeout=300)[0]
    finally:
        for p in (full, stop):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert full.returncode == 0, full_out
    return {"run": (run_dir, full_out), "stopped": (stop_dir, side, seen, stop.returncode, stop_out)}


@pytest.fixture(scope="module")
def run(runs):
    return runs["run"]


@pytest.fixture(scope="module")
def stopped(runs):
    return runs["stopped"]


def _h5(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}


def _train(run_dir):
    d = _h5(run_dir / "train.h5")
    return torch.from_numpy(d["images"]), torch.from_numpy(d["labels"])


def test_run_folder_layout(run):
    run_dir, out = run
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoint-100", "checkpoint-50", "heldout.h5", "scheduler", "train.h5", "vae"]
    for step in (50, 100):
        ck = run_dir / f"checkpoint-{step}"
        assert [p.name for p in ck.iterdir()] == ["transformer"]
        assert sorted(p.name for p in (ck / "transformer").iterdir()) == ["config.json", MODEL_FILE]
        assert f"step {step:6d}  loss " in out
    assert sorted(p.name for p in (run_dir / "vae").iterdir()) == ["config.json", MODEL_FILE]
    assert [p.name for p in (run_dir / "scheduler").iterdir()] == ["scheduler_config.json"]

    train, held = _h5(run_dir / "train.h5"), _h5(run_dir / "heldout.h5")
    for d in (train, held):
        x, y = d["images"], d["labels"]
        assert x.dtype == np.float32 and x.shape == (256, 3, 16, 16)
        assert x.min() >= -1 and x.max() <= 1 and x.min() < -0.99 and x.max() > 0.9
        assert y.dtype == np.int64 and y.shape == (256,) and set(y) == set(range(10))
    assert not set(train["index"]) & set(held["index"])
    # Tinted: the three channels differ (colour jitter changes the image).
    x = train["images"]
    assert np.abs(x[:, 0] - x[:, 1]).mean() > 0.05 and np.abs(x[:, 1] - x[:, 2]).mean() > 0.05


def test_checkpoints_load_with_diffusers(run):
    from diffusers import AutoencoderKL, DDPMScheduler, DiTTransformer2DModel

    run_dir, _ = run
    dit = DiTTransformer2DModel.from_pretrained(run_dir / "checkpoint-100" / "transformer")
    c = dit.config
    assert (c.in_channels, c.out_channels, c.sample_size, c.patch_size, c.num_layers) == (4, 4, 8, 2, 4)
    assert (c.num_attention_heads, c.attention_head_dim, c.num_embeds_ada_norm) == (2, 16, 10)
    # Every block's label table has the null row (index 10).
    tables = [b.norm1.emb.class_embedder.embedding_table for b in dit.transformer_blocks]
    assert [t.num_embeddings for t in tables] == [11] * 4
    assert all(not torch.equal(t.weight[10], t.weight[0]) for t in tables)

    vae = AutoencoderKL.from_pretrained(run_dir / "vae")
    assert vae.config.latent_channels == 4 and vae.config.shift_factor == 0.0
    assert vae.encode(torch.zeros(1, 3, 16, 16)).latent_dist.mean.shape == (1, 4, 8, 8)
    sch = DDPMScheduler.from_pretrained(run_dir / "scheduler")
    assert (sch.config.num_train_timesteps, sch.config.beta_schedule, sch.config.prediction_type) == (
        1000, "linear", "epsilon")
    assert (sch.config.beta_start, sch.config.beta_end, sch.config.clip_sample) == (1e-4, 0.02, False)


@torch.no_grad()
def test_vae_reconstructs_and_scaled_latents_have_unit_std(run):
    from diffusers import AutoencoderKL

    run_dir, _ = run
    vae = AutoencoderKL.from_pretrained(run_dir / "vae").eval()
    s = vae.config.scaling_factor
    for name in ("train.h5", "heldout.h5"):
        x = torch.from_numpy(_h5(run_dir / name)["images"])
        mean = vae.encode(x).latent_dist.mean
        mse = F.mse_loss(vae.decode(mean).sample, x).item()
        # After only 100 steps the reconstruction is about 0.035 against a pixel variance of
        # 0.28 (predicting the mean image scores the variance itself).
        assert mse < 0.25 * x.var().item(), (name, mse)
        std = (mean * s).std().item()
        if name == "train.h5":
            # scaling_factor is 1/std of exactly these latents: equal up to float rounding.
            assert abs(std - 1) < 1e-3
        else:
            # Unseen images: the same distribution, 256 of them (about 0.97 here).
            assert abs(std - 1) < 0.1, std


@torch.no_grad()
def test_dit_denoising_loss_falls(run):
    from diffusers import AutoencoderKL, DDPMScheduler, DiTTransformer2DModel

    run_dir, _ = run
    vae = AutoencoderKL.from_pretrained(run_dir / "vae").eval()
    sch = DDPMScheduler.from_pretrained(run_dir / "scheduler")
    x, y = _train(run_dir)
    z = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
    g = torch.Generator().manual_seed(123)
    noise = torch.randn(z.shape, generator=g)
    t = torch.randint(0, 1000, (len(z),), generator=g)
    zt = sch.add_noise(z, noise, t)

    def loss(model):
        return F.mse_loss(model.eval()(zt, timestep=t, class_labels=y).sample, noise).item()

    first = DiTTransformer2DModel.from_pretrained(run_dir / "checkpoint-50" / "transformer")
    last = DiTTransformer2DModel.from_pretrained(run_dir / "checkpoint-100" / "transformer")
    torch.manual_seed(7)
    fresh = DiTTransformer2DModel.from_config(last.config)
    l_fresh, l_first, l_last = loss(fresh), loss(first), loss(last)
    # Measured: about 1.4, 0.5, 0.25.
    assert l_last < 0.8 * l_first < 0.8 * l_fresh, (l_fresh, l_first, l_last)


def test_stop_file_stops_after_the_next_checkpoint(stopped):
    run_dir, side, seen, rc, out = stopped
    assert rc == 0, out
    assert seen == ["checkpoint-50"]
    # Stopped during the pause after checkpoint-50 or, had the file come late, after the next one.
    names = sorted(p.name for p in run_dir.iterdir())
    assert names in (["EARLY_STOP", "checkpoint-50"], ["EARLY_STOP", "checkpoint-100", "checkpoint-50"]), names
    assert "stopping at step" in out
    # --vae-out / --scheduler-out / --data-out: nothing but checkpoints in the run folder.
    assert sorted(p.name for p in side.iterdir()) == ["heldout.h5", "scheduler", "train.h5", "vae"]


def test_same_seed_same_bytes(run, stopped):
    run_dir, _ = run
    other, side, _, _, _ = stopped
    assert (run_dir / "vae" / MODEL_FILE).read_bytes() == (side / "vae" / MODEL_FILE).read_bytes()
    ck = Path("checkpoint-50") / "transformer" / MODEL_FILE
    assert (run_dir / ck).read_bytes() == (other / ck).read_bytes()
    for name in ("train.h5", "heldout.h5"):
        a, b = _h5(run_dir / name), _h5(side / name)
        assert all(np.array_equal(a[k], b[k]) for k in ("images", "labels", "index"))


def test_existing_stop_file_stops_before_training(tmp_path, capsys):
    (tmp_path / "EARLY_STOP").write_text("")
    assert train_latent_toy.main(["--run-dir", str(tmp_path), "--threads", "1"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["EARLY_STOP"]
    assert "stopping before training" in capsys.readouterr().out


def test_argument_checks():
    with pytest.raises(SystemExit):
        train_latent_toy.parse_args(["--run-dir", "x", "--train-size", "1700", "--heldout-size", "200"])
    with pytest.raises(SystemExit):
        train_latent_toy.parse_args(["--run-dir", "x", "--cfg-drop", "1"])
    a = train_latent_toy.parse_args(["--run-dir", "x"])
    assert (a.vae_steps, a.steps, a.ckpt_every, a.threads, a.train_size, a.heldout_size) == (
        300, 300, 50, 1, 256, 256)
