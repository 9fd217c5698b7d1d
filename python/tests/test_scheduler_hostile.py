"""A hostile ``--scheduler`` file (issue 62's chaos suite): huge, deeply nested, of the wrong
types, a FIFO, a class of diffusers that is not a scheduler. Each is a ValueError naming the file
(and the key), raised at once with bounded memory, never a traceback of the JSON parser or a
scheduler built from what the file asks for."""

import json
import os
import threading

import pytest

from diffmon.export.scheduler import MAX_SCHEDULER_BYTES, read_scheduler_config, scheduler_round_trip

DDPM = {"_class_name": "DDPMScheduler", "prediction_type": "epsilon", "beta_schedule": "linear",
        "beta_start": 0.0001, "beta_end": 0.02, "num_train_timesteps": 1000}


def refused(tmp_path, text, *said):
    path = tmp_path / "scheduler_config.json"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        read_scheduler_config(tmp_path)  # the folder, as a pipeline's scheduler/ is named
    message = str(e.value)
    assert str(path) in message, message
    for s in said:
        assert s in message, message
    assert len(message) < 400, message
    return message


def test_a_genuine_config_is_read(tmp_path):
    (tmp_path / "scheduler_config.json").write_text(json.dumps(DDPM))
    assert read_scheduler_config(tmp_path) == DDPM


def test_a_huge_file_is_refused_by_its_size_before_it_is_read(tmp_path):
    path = tmp_path / "scheduler_config.json"
    with open(path, "wb") as f:  # sparse: 10 GB that take no disk
        f.truncate(10 << 30)
    with pytest.raises(ValueError, match=f"10737418240 bytes, more than a scheduler config's {MAX_SCHEDULER_BYTES}"):
        read_scheduler_config(path)


def test_deep_nesting_is_a_clear_error_not_a_recursion_traceback(tmp_path):
    refused(tmp_path, "[" * 500_000 + "]" * 500_000, "nested too deeply")


def test_not_json_not_an_object_and_no_class_are_refused(tmp_path):
    refused(tmp_path, "{\"_class_name\": ", "cannot read the scheduler config")
    refused(tmp_path, "[1, 2]", "is not a diffusers scheduler config")
    refused(tmp_path, "{\"_class_name\": 5}", "is not a diffusers scheduler config")


@pytest.mark.parametrize("key,value,what", [
    ("prediction_type", 5, "not a string"),
    ("beta_schedule", ["linear"], "not a string"),
    ("beta_start", "0.0001", "not a number"),
    ("beta_end", True, "not a number"),
    ("beta_end", 1e999, "not a number"),  # json reads 1e999 as inf
    ("num_train_timesteps", 1000.5, "not an integer"),
    ("num_train_timesteps", {"n": 1}, "not an integer"),
])
def test_each_compared_key_of_the_wrong_type_is_named(tmp_path, key, value, what):
    text = json.dumps({**DDPM, key: value}).replace("Infinity", "1e999")
    refused(tmp_path, text, f"{key} is ", what)


def test_a_table_too_long_to_allocate_is_refused(tmp_path):
    # DDPMScheduler(num_train_timesteps=10**9) would allocate 8 GB of betas.
    refused(tmp_path, json.dumps({**DDPM, "num_train_timesteps": 10**9}), "outside 1..100000")


def test_a_class_that_is_not_a_scheduler_is_refused_and_never_built(tmp_path):
    refused(tmp_path, json.dumps({"_class_name": "UNet2DModel", "block_out_channels": [1 << 20]}),
            "does not name a diffusers scheduler")
    refused(tmp_path, json.dumps({"_class_name": "os.system"}), "does not name a diffusers scheduler")
    # A dict given in code is checked the same way, and the round trip builds schedulers only.
    cfg = {"_class_name": "DiffusionPipelineScheduler"}  # named like one, none in diffusers
    assert read_scheduler_config(cfg) is cfg
    assert scheduler_round_trip(cfg, conv=None) is None


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "scheduler_config.json"
    os.mkfifo(fifo)
    result = {}

    def read():
        try:
            read_scheduler_config(fifo)
        except ValueError as e:
            result["error"] = str(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert "not a regular file" in result["error"], result
