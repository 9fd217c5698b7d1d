"""diffmon.stop: the stop file check and the (lazily imported) Lightning callback."""

import copy
import importlib.util
import json
import sys
import types

import pytest

import diffmon
from diffmon import stop
from diffmon.stop import DiffmonEarlyStopping, describe_event, read_stop_event, should_stop

EVENT = {
    "id": "3f2a9c", "event": "early_stop", "run": "toy", "metric": "icr", "best_step": 400,
    "best_checkpoint": "runs/exp1/ckpt_000400.pt",
    "best_checkpoint_kept": "runs/exp1/.diffmon/best/ckpt_000400.pt", "best_value": 0.41,
    "current_step": 550, "current_value": 0.45, "fired_at": "2026-01-01T00:00:00Z",
}
HAS_LIGHTNING = any(importlib.util.find_spec(m) is not None for m in ("lightning", "pytorch_lightning"))


def test_no_stop_file(tmp_path):
    assert should_stop(tmp_path) is False
    assert read_stop_event(tmp_path) is None
    assert should_stop(tmp_path / "does-not-exist") is False


def test_stop_file_with_event(tmp_path):
    (tmp_path / "EARLY_STOP").write_text(json.dumps(EVENT))
    assert should_stop(tmp_path) is True
    assert read_stop_event(tmp_path) == EVENT
    # another name is another file
    assert should_stop(tmp_path, stop_file="STOP_NOW") is False
    (tmp_path / "STOP_NOW").write_text(json.dumps(EVENT))
    assert should_stop(str(tmp_path), stop_file="STOP_NOW") is True


@pytest.mark.parametrize("content", [b"", b'{"id": "3f2a9c", "event": "ear', b"\xff\xfe garbage", b"[1, 2]"])
def test_partial_or_garbled_file_still_stops(tmp_path, content):
    (tmp_path / "EARLY_STOP").write_bytes(content)
    assert should_stop(tmp_path) is True
    assert read_stop_event(tmp_path) is None


def test_resolved_event_withdraws_the_stop(tmp_path):
    (tmp_path / "EARLY_STOP").write_text(json.dumps(dict(EVENT, event="resolved")))
    assert should_stop(tmp_path) is False
    assert read_stop_event(tmp_path)["event"] == "resolved"


def test_describe_event_names_the_kept_copy_or_the_only_copy():
    assert describe_event(EVENT) == (
        "diffmon early_stop on run toy: best icr = 0.41 at step 400: runs/exp1/ckpt_000400.pt "
        "(kept as runs/exp1/.diffmon/best/ckpt_000400.pt); now 0.45 at step 550")
    # Values as the daemon's messages write them.
    assert "best icr = 0.82289 at step 400" in describe_event(dict(EVENT, best_value=0.8228899064025648))
    assert "now 1.2346e-4 at step 550" in describe_event(dict(EVENT, current_value=0.000123456))
    # Keeping failed, or early_stop.keep_best is off: the original is the only copy.
    assert ("at step 400: runs/exp1/ckpt_000400.pt (not kept: the original is the only copy); "
            in describe_event(dict(EVENT, best_checkpoint_kept=None)))
    # An event from a diffmon without the field names the checkpoint alone.
    older = {k: v for k, v in EVENT.items() if k != "best_checkpoint_kept"}
    assert "at step 400: runs/exp1/ckpt_000400.pt; now" in describe_event(older)
    assert describe_event(None) == "diffmon early-stop file present (no readable event)"
    # A stop the memorization ratio fired says so; one the turn fired reads as before.
    assert describe_event(dict(EVENT, trigger="memorization")).startswith(
        "diffmon early_stop on run toy (the memorization ratio reached its stop level): best icr =")
    assert describe_event(dict(EVENT, trigger="turn")) == describe_event(EVENT)


def test_package_exports():
    for name in ("export", "should_stop", "read_stop_event", "DiffmonEarlyStopping"):
        assert hasattr(diffmon, name)


class FakeTrainer:
    def __init__(self):
        self.should_stop = False
        self.sanity_checking = False
        self.is_global_zero = True


@pytest.fixture
def fake_lightning(monkeypatch):
    """A stand-in `lightning.pytorch` module with a Callback base class."""

    class Callback:
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pass

        def on_validation_end(self, trainer, pl_module):
            pass

    pkg = types.ModuleType("lightning")
    sub = types.ModuleType("lightning.pytorch")
    sub.Callback = Callback
    pkg.pytorch = sub
    monkeypatch.setitem(sys.modules, "lightning", pkg)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", sub)
    monkeypatch.setattr(stop, "_CONCRETE", {})
    return Callback


def test_callback_sets_should_stop_when_the_file_appears(tmp_path, fake_lightning, capsys):
    cb = DiffmonEarlyStopping(tmp_path)
    assert isinstance(cb, fake_lightning) and isinstance(cb, DiffmonEarlyStopping)
    clone = copy.deepcopy(cb)  # Lightning may copy callbacks
    assert type(clone) is type(cb) and clone.run_dir == cb.run_dir
    trainer = FakeTrainer()
    cb.on_train_batch_end(trainer, None, None, None, 0)
    cb.on_validation_end(trainer, None)
    assert trainer.should_stop is False
    (tmp_path / "EARLY_STOP").write_text(json.dumps(EVENT))
    cb.on_train_batch_end(trainer, None, None, None, 1)
    assert trainer.should_stop is True and cb.event == EVENT
    # The message names the kept copy beside the original, which rotation may have deleted.
    assert ("best icr = 0.41 at step 400: runs/exp1/ckpt_000400.pt "
            "(kept as runs/exp1/.diffmon/best/ckpt_000400.pt); now 0.45 at step 550; "
            "stopping training") in capsys.readouterr().out
    trainer2 = FakeTrainer()
    cb.on_validation_end(trainer2, None)
    assert trainer2.should_stop is True


def test_callback_every_n_batches_and_sanity_check(tmp_path, fake_lightning):
    (tmp_path / "STOP").write_text("")
    cb = DiffmonEarlyStopping(tmp_path, stop_file="STOP", every_n_batches=3, verbose=False)
    trainer = FakeTrainer()
    cb.on_train_batch_end(trainer, None, None, None, 0)
    cb.on_train_batch_end(trainer, None, None, None, 1)
    assert trainer.should_stop is False
    cb.on_train_batch_end(trainer, None, None, None, 2)
    assert trainer.should_stop is True and cb.event is None
    sanity = FakeTrainer()
    sanity.sanity_checking = True
    cb.on_validation_end(sanity, None)
    assert sanity.should_stop is False


def test_callback_shares_the_decision_across_ranks(tmp_path, fake_lightning):
    calls = []

    class Strategy:
        def reduce_boolean_decision(self, decision, all=True):
            calls.append((decision, all))
            return True  # another rank saw the file

    trainer = FakeTrainer()
    trainer.strategy = Strategy()
    DiffmonEarlyStopping(tmp_path, verbose=False).on_train_batch_end(trainer, None, None, None, 0)
    assert calls == [(False, False)] and trainer.should_stop is True


def test_callback_without_lightning_is_a_clear_import_error(tmp_path, monkeypatch):
    # None in sys.modules makes `import lightning` fail even where it is installed.
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(stop, "_CONCRETE", {})
    import diffmon.stop  # noqa: F401  (the module itself imports fine)

    with pytest.raises(ImportError, match="pip install lightning"):
        DiffmonEarlyStopping(tmp_path)
    assert should_stop(tmp_path) is False  # the plain helper still works


@pytest.mark.skipif(not HAS_LIGHTNING, reason="PyTorch Lightning is not installed")
def test_callback_with_real_lightning(tmp_path):
    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback
    cb = DiffmonEarlyStopping(tmp_path, verbose=False)
    assert isinstance(cb, Callback)
    trainer = FakeTrainer()
    (tmp_path / "EARLY_STOP").write_text(json.dumps(EVENT))
    cb.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.should_stop is True
