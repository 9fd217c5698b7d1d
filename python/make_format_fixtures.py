"""Checkpoints as real training stacks write them, for diffmon's format tests.

Usage: make_format_fixtures.py OUT_DIR

Writes, with the real libraries (torch, pytorch_lightning, diffusers):

    arch.ts                 Net(tie=False, cache=False) exported with diffmon.export (feature layer body.0)
    arch_cache.ts           Net(tie=False, cache=True): with the non-persistent buffers `cache`
    whole_module.pt         torch.save(net): a pickled module tree; nested submodules, a
                            non-persistent buffer, a tied parameter, a module class whose
                            __setstate__ and an attribute whose __reduce__ would create the marker
                            files MARKER_SETSTATE / MARKER_REDUCE (this script checks that
                            torch.load(weights_only=False) creates them, then removes them)
    whole_module.safetensors  net.state_dict() (reference; every reference X.safetensors has an
                            X.safetensors.order listing the names in state_dict() order)
    snapshot.pkl            pickle.dump(dict(ema=net, loss_fn=..., augment_pipe=None, ...)) with
                            persistence-style modules (__reduce__ -> (_reconstruct, (meta,)),
                            meta["state"] = the module's __dict__), EDM network-snapshot style
    snapshot.safetensors    the snapshot's ema.state_dict() (reference)
    training_state.pt       torch.save(dict(net=net, optimizer_state=...)) (EDM training state)
    lightning.ckpt          ModelCheckpoint of a 3-step CPU Lightning run (names `net.*`)
    lightning.safetensors   its ckpt["state_dict"] (reference)
    lightning_ema.ckpt      the same run with EMAWeightAveraging
    lightning_ema.safetensors / lightning_raw.safetensors
                            its ckpt["state_dict"] (averaged) and ckpt["current_model_state"]
    diffusers_ema.pt        torch.save(EMAModel(net.parameters()).state_dict()) after two steps
    diffusers_ema.safetensors  shadow_params as `shadow_params.<i>` (reference)
    diffusers_ema_short.pt / diffusers_ema_wrong.pt
                            the same with one shadow parameter left out / flattened
"""

import copy
import os
import pickle
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffmon.export import export  # noqa: E402

OUT = Path(sys.argv[1])
MARKER_SETSTATE = OUT / "MARKER_SETSTATE"
MARKER_REDUCE = OUT / "MARKER_REDUCE"


class Block(nn.Module):
    def __init__(self, c, cache=True):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(1, c)
        self.gain = nn.Parameter(torch.ones(1))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, c))
        if cache:
            self.register_buffer("cache", torch.zeros(3), persistent=False)
        else:
            self.cache = None

    def forward(self, x):
        return self.norm(self.conv(x)) * self.scale.view(1, -1, 1, 1) * self.gain


class Net(nn.Module):
    def __init__(self, tie=True, cache=True):
        super().__init__()
        self.inp = nn.Conv2d(1, 4, 1)
        self.body = nn.Sequential(Block(4, cache), Block(4, cache))
        self.out = nn.Conv2d(4, 1, 1)
        if tie:
            # One parameter under two names (both are state_dict() entries).
            self.body[1].gain = self.body[0].gain

    def forward(self, x, sigma):
        return self.out(self.body(self.inp(x))) + 0 * sigma.view(-1, 1, 1, 1)


class Marker:
    """An attribute whose unpickling creates a file (stands for any code a pickle can run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class MarkedNet(Net):
    """A module class whose __setstate__ creates a file when torch.load unpickles it."""

    def __setstate__(self, state):
        open(state["marker_path"], "w").close()
        super().__setstate__(state)


def _reconstruct(meta):
    """Rebuilds a persistence-style object (for this script's own check only)."""
    cls = globals()[meta["class_name"]]
    obj = cls.__new__(cls)
    obj.__dict__.update(meta["state"])
    return obj


class PersistentMixin:
    """Pickles like a persistent class of a training codebase: the source travels with it."""

    def __reduce__(self):
        meta = dict(type="class", version=6, module_src="raise SystemExit('never run')",
                    class_name=type(self).__name__, state=dict(self.__dict__))
        return (_reconstruct, (meta,))


class PBlock(PersistentMixin, Block):
    pass


class PNet(PersistentMixin, Net):
    def __init__(self):
        super().__init__(tie=False)
        self.body = nn.Sequential(PBlock(4), Block(4))


class LossFn:
    def __init__(self):
        self.P_mean = -1.2


def reference(sd, name):
    """`name` (safetensors: sorted by name) and `name.order` (the state_dict() order)."""
    save_file({k: v.detach().clone().contiguous() for k, v in sd.items()}, str(OUT / name))
    (OUT / (name + ".order")).write_text("".join(k + "\n" for k in sd))


def randomize(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            t.copy_(torch.randn(t.shape, generator=g))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    shape = (1, 8, 8)
    # The TorchScript export lists non-persistent buffers too (no checkpoint holds them): the
    # exporter notes them in the file, so arch_cache.ts (with `cache`) loads state dicts too.
    export(Net(tie=False, cache=False), "body.0", OUT / "arch.ts", example_shape=shape)
    export(Net(tie=False, cache=True), "body.0", OUT / "arch_cache.ts", example_shape=shape)

    # torch.save(model) with code that would run on torch.load.
    net = MarkedNet()
    randomize(net, 1)
    net.marker_path = str(MARKER_SETSTATE)
    net.extra = Marker(MARKER_REDUCE)
    torch.save(net, OUT / "whole_module.pt")
    reference(net.state_dict(), "whole_module.safetensors")
    back = torch.load(OUT / "whole_module.pt", weights_only=False)
    assert MARKER_SETSTATE.exists() and MARKER_REDUCE.exists(), "markers not created by Python"
    assert list(back.state_dict()) == list(net.state_dict())
    MARKER_SETSTATE.unlink()
    MARKER_REDUCE.unlink()

    # EDM-style network snapshot (plain pickle) and training state (torch.save zip).
    pnet = PNet()
    randomize(pnet, 2)
    ema = copy.deepcopy(pnet).eval().requires_grad_(False)
    with open(OUT / "snapshot.pkl", "wb") as f:
        pickle.dump(dict(ema=ema, loss_fn=LossFn(), augment_pipe=None,
                         dataset_kwargs=dict(path="x", resolution=8)), f)
    reference(ema.state_dict(), "snapshot.safetensors")
    with open(OUT / "snapshot.pkl", "rb") as f:
        back = pickle.load(f)["ema"]
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ema.state_dict().values()))
    opt = torch.optim.Adam(pnet.parameters())
    pnet(torch.randn(2, *shape), torch.ones(2)).square().mean().backward()
    opt.step()
    torch.save(dict(net=pnet, optimizer_state=opt.state_dict()), OUT / "training_state.pt")
    reference(pnet.state_dict(), "training_state.safetensors")

    lightning(shape)

    # diffusers EMAModel.state_dict() saved with torch.save.
    from diffusers.training_utils import EMAModel

    enet = Net(tie=False)
    randomize(enet, 3)
    ema = EMAModel(enet.parameters(), decay=0.9)
    for s in (4, 5):
        randomize(enet, s)
        ema.step(enet.parameters())
    torch.save(ema.state_dict(), OUT / "diffusers_ema.pt")
    reference({f"shadow_params.{i}": p for i, p in enumerate(ema.shadow_params)},
              "diffusers_ema.safetensors")
    sd = ema.state_dict()
    torch.save(dict(sd, shadow_params=sd["shadow_params"][:-1]), OUT / "diffusers_ema_short.pt")
    wrong = list(sd["shadow_params"])
    wrong[0] = wrong[0].reshape(-1)
    torch.save(dict(sd, shadow_params=wrong), OUT / "diffusers_ema_wrong.pt")
    print("ok")


def lightning(shape):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import EMAWeightAveraging, ModelCheckpoint

    class Lit(pl.LightningModule):
        def __init__(self, lr=0.1):
            super().__init__()
            self.save_hyperparameters()
            self.net = Net()

        def training_step(self, batch, _):
            (x,) = batch
            return (self.net(x, torch.ones(len(x))) - x).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, *shape)),
                                       batch_size=2)
    for name, extra in (("lightning", []), ("lightning_ema", [EMAWeightAveraging(decay=0.5)])):
        torch.manual_seed(7)
        ck = ModelCheckpoint(dirpath=str(OUT / f"{name}_dir"), save_last=True)
        trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(OUT / f"{name}_dir"), callbacks=[ck, *extra])
        trainer.fit(Lit(), data)
        os.replace(ck.last_model_path, OUT / f"{name}.ckpt")
        saved = torch.load(OUT / f"{name}.ckpt", weights_only=False)
        reference(saved["state_dict"], f"{name}.safetensors")
        if extra:
            assert "current_model_state" in saved
            reference(saved["current_model_state"], "lightning_raw.safetensors")


if __name__ == "__main__":
    main()
