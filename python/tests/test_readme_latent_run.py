"""The README's "A latent model: steps 1 to 3", run exactly as the README writes them.

The fenced ``sh`` blocks of that subsection are taken from README.md and run in order, in the
environment of the README's Install block (``test_readme_own_run.activated_env``), in a fresh
folder holding a run of the latent toy (``python/train_latent_toy.py``: a diffusers
``AutoencoderKL`` and a class-conditional ``DiTTransformer2DModel`` saved with
``save_pretrained``). The test checks what each step is for: the exports write the autoencoder
(with ``encode``) and the network held at its null class, ``init`` finds both and writes a config
that ``check-config`` accepts unchanged and describes as latent and held at the null class, and
steps 4 to 7's ``eval`` on it gives the last checkpoint's ICR.
"""

import json
import re
import subprocess
import sys
import zipfile

from test_readme_own_run import BINARY, ROOT, activated_env, own_run_blocks

import pytest

STEPS = [50, 100, 150, 200]


def note(path) -> dict:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith("extra/diffmon.json"))
        return json.loads(z.read(name))


@pytest.mark.long
def test_the_latent_steps_reach_an_evaluated_checkpoint(tmp_path):
    if not BINARY.is_file():
        pytest.fail(f"{BINARY} is missing: run `make setup` (or `cargo build --release`) first")
    blocks = own_run_blocks(latent=True)
    assert [lang for lang, _ in blocks] == ["sh", "sh"], blocks

    run = tmp_path / "runs" / "latent1"
    subprocess.run([sys.executable, str(ROOT / "python" / "train_latent_toy.py"), "--run-dir", str(run),
                    "--steps", "200"], check=True, cwd=tmp_path, capture_output=True)
    assert sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*")) == STEPS

    env = activated_env()
    outputs = []
    for _, code in blocks:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{code}\nexit {out.returncode}\n{out.stdout}\n{out.stderr}"
        outputs.append(out.stdout + out.stderr)
    export_out, config_out = outputs
    # The scheduler checks the parameterization: no guess from the output at high noise.
    assert "warning:" not in export_out, export_out

    assert note(run / "vae.ts")["kind"] == "vae"
    condition = note(run / "model.ts")["condition"]
    assert condition["kind"] == "class" and condition["null_class"] and condition["label"] == 10, condition
    config = (tmp_path / "latent.yaml").read_text()
    assert re.search(r"^  vae: \S*runs/latent1/vae\.ts", config, re.M), config
    assert "held at the null class 10" in config_out and "latent, autoencoder" in config_out, config_out

    # Step 5 on this config: the last checkpoint's step and an ICR in (0, 1].
    out = subprocess.run(["diffmon", "eval", "--config", "latent.yaml", "runs/latent1/checkpoint-200",
                          "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout.splitlines()[0])
    assert record["step"] == 200 and 0 < record["icr"] <= 1, record
