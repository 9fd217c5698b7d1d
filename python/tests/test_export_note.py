"""The exporter's note through the daemon's reader (issue 48, item 1): a file exported with each
exporter option (a parameterization of each family and flow path, each VP schedule and a
continuous time, each kind of condition, an SD3-style extra embedding, the autoencoder) is read
by ``diffmon check-config``, whose typed reader (src/engine/model/note.rs) refuses a versioned note with a field it does not
know. A field renamed on one side, or a note of a newer version, is refused, naming the file."""

import json
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffmon.export import PARAMETERIZATION_TABLE, Embedding, export, export_vae  # noqa: E402
from diffmon.export.note import NOTE_VERSION  # noqa: E402
from stacks import UNET_CONFIG  # noqa: E402  (1x8x8)

ROOT = Path(__file__).resolve().parents[2]
BINARY = ROOT / "target" / "release" / "diffmon"
SD3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
           num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
           pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8)
VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
           up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16),
           layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16)
COND_UNET = dict(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16), layers_per_block=1,
                 norm_num_groups=4, cross_attention_dim=8, attention_head_dim=2,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))

pytestmark = pytest.mark.skipif(not BINARY.exists(), reason="needs the release build (make build)")


def read_note(path):
    extra = {"diffmon.json": ""}
    torch.jit.load(str(path), _extra_files=extra)
    return json.loads(extra["diffmon.json"])


def images(path, shape):
    with h5py.File(path, "w") as f:
        f["images"] = np.random.default_rng(0).uniform(-1, 1, size=(16, *shape)).astype(np.float32)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (architecture, vae or None, the line check-config must print)."""
    d = tmp_path_factory.mktemp("notes")

    def exp(net, layer, name, *args, **kw):
        export(net, layer, d / f"{name}.ts", *args, verbose=False, **kw)
        return d / f"{name}.ts"
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(**UNET_CONFIG).eval()
    out = {}
    # One parameterization per family and path: they write the same fields, and the path is the
    # one the daemon reads as a closed set. (Each export traces the U-Net: seconds in make test.)
    first = {}
    for p in PARAMETERIZATION_TABLE:
        first.setdefault((p.family, p.path), p)
    for p in first.values():
        out[p.name] = (exp(unet, "mid_block", p.name, p.name, (1, 8, 8)), None, f"exported as `{p.name}`")
    for name, kw in (("cosine", dict(schedule="cosine")),
                     ("alphas_cumprod", dict(alphas_cumprod=torch.linspace(0.999, 0.01, 1000))),
                     ("continuous", dict(schedule="continuous"))):
        out[name] = (exp(unet, "mid_block", name, "eps", (1, 8, 8), **kw), None, "exported as `eps`")
    classes = diffusers.UNet2DModel(**UNET_CONFIG, num_class_embeds=5).eval()
    out["null_class"] = (exp(classes, "mid_block", "null", "eps", (1, 8, 8)), None,
                         "held at the null class 4")
    out["class_3"] = (exp(classes, "mid_block", "c3", "eps", (1, 8, 8), condition=3), None,
                      "held at class 3")
    text = diffusers.UNet2DConditionModel(**COND_UNET).eval()
    torch.save(torch.randn(1, 5, 8), d / "empty.pt")
    out["embedding"] = (exp(text, "mid_block", "text", "eps", (1, 8, 8),
                            condition=Embedding.from_file(d / "empty.pt")),
                        None, "held at the embedding of empty.pt [1,5,8]")
    sd3 = diffusers.SD3Transformer2DModel(**SD3).eval()
    out["sd3_extra"] = (exp(sd3, "transformer_blocks.0", "sd3", "rectified_flow", (4, 8, 8),
                            condition=Embedding(torch.randn(5, 16)),
                            extra_conditions=[Embedding(torch.randn(8), "pooled_projections", pooled=True)]),
                        None, "and `pooled_projections` at the embedding of a tensor [1,8]")
    export_vae(diffusers.AutoencoderKL(**VAE).eval(), d / "vae.ts", (3, 16, 16))
    out["vae"] = (d / "sd3.ts", d / "vae.ts", "latent, autoencoder")
    return d, out


def check_config(d, name, arch, vae=None):
    shape = (3, 16, 16) if vae else (1, 8, 8)
    data = images(d / f"{name}.h5", shape)
    (d / "run").mkdir(exist_ok=True)
    model = f"{{architecture: '{arch}'" + (f", vae: '{vae}'" if vae else "") + "}"
    cfg = d / f"{name}.yaml"
    cfg.write_text(f"run: {{dir: '{d / 'run'}'}}\nstate_dir: '{d / (name + '.state')}'\n"
                   f"model: {model}\ndata: {{path: '{data}'}}\npfd: {{enabled: false}}\n")
    return subprocess.run([str(BINARY), "check-config", str(cfg)], capture_output=True, text=True,
                          timeout=120)


def test_every_exporter_option_is_read_by_the_daemon(exported):
    d, files = exported
    for name, (arch, vae, says) in files.items():
        note = read_note(vae or arch)
        assert note["note_version"] == NOTE_VERSION and note["kind"] == ("vae" if vae else "network")
        p = check_config(d, name, arch, vae)
        assert p.returncode == 0, f"{name}: {p.stdout}{p.stderr}"
        assert says in p.stdout, f"{name}: {p.stdout}"
        assert f"exporter note version {NOTE_VERSION}" in p.stdout, f"{name}: {p.stdout}"


def rewrite(src, dst, change):
    note = read_note(src)
    change(note)
    torch.jit.save(torch.jit.load(str(src)), str(dst), _extra_files={"diffmon.json": json.dumps(note)})
    return dst


def test_a_field_renamed_on_one_side_or_a_newer_version_is_refused_naming_the_file(exported):
    d, files = exported
    arch = files["eps"][0]

    def rename(note):
        note["noise_schedule"] = note.pop("schedule")
    renamed = rewrite(arch, d / "renamed.ts", rename)
    p = check_config(d, "renamed", renamed)
    assert p.returncode == 2, p.stdout + p.stderr
    assert str(renamed) in p.stderr and "noise_schedule" in p.stderr, p.stderr

    newer = rewrite(arch, d / "newer.ts", lambda n: n.update(note_version=NOTE_VERSION + 1))
    p = check_config(d, "newer", newer)
    assert p.returncode == 2 and "newer diffmon-export" in p.stderr, p.stderr

    # A note from before the versions: read with the fields it has.
    def unversioned(note):
        del note["note_version"], note["kind"]
        note["retired_field"] = 1
    old = rewrite(arch, d / "old.ts", unversioned)
    p = check_config(d, "old", old)
    assert p.returncode == 0 and "exporter note from before its versions" in p.stdout, p.stderr
