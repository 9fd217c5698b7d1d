"""python/stacks.py writes what the real libraries write, and its flat copies are the weights the
library itself loads back from each checkpoint (EMA where the stack has it)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("accelerate")
pytest.importorskip("pytorch_lightning")

import stacks  # noqa: E402
from diffmon.stop import DEFAULT_STOP_FILE  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

STEPS = (2, 4, 6)
EVENT = {"id": "3f2a9c", "event": "early_stop", "run": "run", "metric": "icr", "best_step": 0,
         "best_checkpoint": None, "best_checkpoint_kept": None, "best_value": 0.4,
         "current_step": 0, "current_value": 0.5, "fired_at": "2026-01-01T00:00:00Z"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every stack once, in this process (the imports are shared): {stack: (run, flat)}."""
    root = tmp_path_factory.mktemp("stacks")
    assert stacks.main(["--stack", ",".join(stacks.STACKS), "--ema", "--hostile", str(root / "MARKER"),
                        "--out", str(root / "{stack}"), "--flat", str(root / "{stack}.flat"),
                        "--data", str(root / "train.h5")]) == 0
    return root, {s: (root / s, root / f"{s}.flat") for s in stacks.STACKS}


def flat(runs, stack, step):
    return load_file(str(runs[1][stack][1] / f"step_{step}.safetensors"))


def assert_same(got, want):
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_flat_names_are_the_unets_own(runs):
    names = set(stacks.tiny_unet().state_dict())
    for s in stacks.STACKS:
        assert sorted(os.listdir(runs[1][s][1])) == [f"step_{n}.safetensors" for n in STEPS], s
        assert set(flat(runs, s, 6)) == names, s


def test_data_file(runs):
    import h5py

    with h5py.File(runs[0] / "train.h5") as f:
        x = f["images"][()]
    assert x.shape == (48, 1, 8, 8) and x.dtype == "float32"
    assert x.min() >= -1 and x.max() <= 1 and x.std() > 0.1


def test_accelerate_save_state_and_load_state(runs):
    from accelerate import Accelerator

    run = runs[1]["accelerate"][0]
    assert sorted(os.listdir(run)) == [f"checkpoint-{n}" for n in STEPS]
    assert sorted(os.listdir(run / "checkpoint-4")) == ["model.safetensors", "optimizer.bin",
                                                        "random_states_0.pkl"]
    acc = Accelerator(cpu=True)
    model = stacks.tiny_unet(seed=99)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    acc.load_state(str(run / "checkpoint-4"))
    assert_same(acc.unwrap_model(model).state_dict(), flat(runs, "accelerate", 4))
    assert not torch.equal(flat(runs, "accelerate", 4)["conv_in.weight"],
                           flat(runs, "accelerate", 6)["conv_in.weight"])  # it trained


def test_accelerate_rotation(tmp_path):
    assert stacks.main(["--stack", "accelerate", "--limit", "2", "--out", str(tmp_path / "run"),
                        "--flat", str(tmp_path / "flat")]) == 0
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-4", "checkpoint-6"]
    assert len(os.listdir(tmp_path / "flat")) == 3


def test_diffusers_unet_and_unet_ema(runs):
    from diffusers import UNet2DModel

    ck = runs[1]["diffusers"][0] / "checkpoint-6"
    assert sorted(os.listdir(ck)) == ["optimizer.bin", "random_states_0.pkl", "unet", "unet_ema"]
    assert sorted(os.listdir(ck / "unet_ema")) == ["config.json", "diffusion_pytorch_model.safetensors"]
    ema = UNet2DModel.from_pretrained(str(ck / "unet_ema")).state_dict()
    raw = UNet2DModel.from_pretrained(str(ck / "unet")).state_dict()
    assert_same(ema, flat(runs, "diffusers", 6))  # prefer_ema: the flat copy is the EMA
    assert not torch.equal(raw["conv_in.weight"], ema["conv_in.weight"])


def test_emamodel_state_dict(runs):
    from diffusers.training_utils import EMAModel

    path = runs[1]["emamodel"][0] / "ema-4.pt"
    sd = torch.load(path, weights_only=True)
    assert isinstance(sd["shadow_params"], list) and sd["optimization_step"] == 4
    model = stacks.tiny_unet(seed=99)
    assert len(sd["shadow_params"]) == len(list(model.parameters()))
    ema = EMAModel(model.parameters())
    ema.load_state_dict(sd)
    ema.copy_to(model.parameters())
    assert_same(model.state_dict(), flat(runs, "emamodel", 4))


def test_lightning_checkpoint_with_ema(runs):
    run = runs[1]["lightning"][0]
    assert sorted(os.listdir(run)) == [f"step={n}.ckpt" for n in STEPS]
    ck = torch.load(run / "step=4.ckpt", weights_only=True)
    assert ck["global_step"] == 4
    assert all(k.startswith("model.") for k in ck["state_dict"])
    assert all(k.startswith("model.") for k in ck["current_model_state"])
    model = stacks.tiny_unet(seed=99)
    model.load_state_dict({k[len("model."):]: v for k, v in ck["state_dict"].items()})
    assert_same(model.state_dict(), flat(runs, "lightning", 4))  # the average, not the trained weights
    cur = ck["current_model_state"]["model.conv_in.weight"]
    assert not torch.equal(cur, ck["state_dict"]["model.conv_in.weight"])


def test_module_pickle_and_its_marker(runs):
    root, r = runs
    path = r["module"][0] / "model-6.pt"
    assert sorted(os.listdir(r["module"][0])) == [f"model-{n}.pt" for n in STEPS]
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)  # not plain data
    assert not (root / "MARKER").exists()
    model = torch.load(path, weights_only=False)  # runs the pickle: it creates the marker
    assert (root / "MARKER").exists()
    assert_same(model.state_dict(), flat(runs, "module", 6))


def test_dcp_checkpoint(runs):
    import torch.distributed.checkpoint as dcp

    ck = runs[1]["dcp"][0] / "checkpoint-2"
    assert sorted(os.listdir(ck)) == [".metadata", "__0_0.distcp"]
    model = stacks.tiny_unet(seed=99)
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(ck))
    model.load_state_dict(sd)
    assert_same(model.state_dict(), flat(runs, "dcp", 2))


def json_lines(out):
    """The JSON lines stacks.py prints on stdout (Lightning's callback also prints a sentence)."""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def second_process(argv):
    """stacks.py in a fresh process, as a resumed job starts: its JSON lines."""
    p = subprocess.run([sys.executable, stacks.__file__, *argv], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json_lines(p.stdout)


def mtimes(folder):
    return {f: os.stat(folder / f).st_mtime_ns for f in os.listdir(folder)}


def test_accelerate_resume_from_checkpoint(tmp_path):
    run, fl = tmp_path / "run", tmp_path / "flat"
    common = ["--stack", "accelerate", "--every", "2", "--out", str(run), "--flat", str(fl)]
    assert stacks.main(common + ["--steps", "4"]) == 0
    before = mtimes(run / "checkpoint-4")
    ck2 = str(run / "checkpoint-2")
    assert second_process(common + ["--steps", "6", "--resume-from", ck2]) == [
        {"resumed_from": ck2, "step": 2, "exact": True}]
    assert sorted(os.listdir(run)) == [f"checkpoint-{n}" for n in STEPS]
    after = mtimes(run / "checkpoint-4")
    assert set(after) == set(before) and all(after[f] > before[f] for f in before)  # saved again
    assert_same(load_file(str(fl / "step_6.safetensors")),
                load_file(str(run / "checkpoint-6" / "model.safetensors")))


def test_lightning_resume_from_checkpoint(tmp_path):
    run, fl = tmp_path / "run", tmp_path / "flat"
    common = ["--stack", "lightning", "--every", "2", "--out", str(run), "--flat", str(fl)]
    assert stacks.main(common + ["--steps", "4"]) == 0
    ck2 = str(run / "step=2.ckpt")
    assert second_process(common + ["--steps", "6", "--resume-from", ck2]) == [
        {"resumed_from": ck2, "step": 2, "exact": True}]
    # ModelCheckpoint does not overwrite the step=4.ckpt of the first run: it versions the name.
    assert sorted(os.listdir(run)) == ["step=2.ckpt", "step=4-v1.ckpt", "step=4.ckpt", "step=6.ckpt"]
    ck = torch.load(run / "step=6.ckpt", weights_only=True)
    assert ck["global_step"] == 6
    assert_same({k[len("model."):]: v for k, v in ck["state_dict"].items()},
                load_file(str(fl / "step_6.safetensors")))


@pytest.mark.parametrize("stack", ["accelerate", "lightning"])
def test_stop_on_early_stop(tmp_path, capsys, stack):
    run = tmp_path / "run"
    run.mkdir()
    (run / DEFAULT_STOP_FILE).write_text(json.dumps(EVENT))
    assert stacks.main(["--stack", stack, "--stop-on-early-stop", "--steps", "6", "--every", "2",
                        "--out", str(run), "--flat", str(tmp_path / "flat")]) == 0
    assert json_lines(capsys.readouterr().out) == [{"stopped_early_at": 1}]
    assert sorted(os.listdir(run)) == [DEFAULT_STOP_FILE]  # stopped before the first checkpoint
