"""Regenerates the checkpoint fixtures used by the unit tests of `src/weights`.

Run from this folder with the project's virtual environment:

    ../../../.venv/bin/python make.py

The tests compare against literal values written in the Rust tests, so the tensors here are
built from small exact values (aranges, powers of two), never from random numbers. Files are
written deterministically except for torch's random `.data/serialization_id` entry, which the
reader ignores.
"""

import collections

import torch
from safetensors.torch import save_file


def dtypes_state_dict():
    """A module state dict (OrderedDict with `_metadata`) plus tensors of every supported dtype,
    a transposed (non-contiguous) view, a view with a storage offset and a permuted 3-d view."""
    lin = torch.nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3))
        lin.bias.copy_(torch.tensor([-1.0, 0.5]))
    sd = lin.state_dict()  # OrderedDict, carries `_metadata` (pickled through BUILD)
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    sd["f32"] = base
    sd["f32_t"] = base.t()  # shares base's storage, strides (1, 3)
    sd["f32_view"] = base.view(-1)[2:5]  # shares base's storage, storage_offset 2
    sd["f64"] = torch.tensor([1.5, -2.25], dtype=torch.float64)
    sd["f16"] = torch.tensor([1.0, -0.5, 65504.0], dtype=torch.float16)
    sd["bf16"] = torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16)
    sd["i64"] = torch.tensor([-(2**40), 7], dtype=torch.int64)
    sd["i32"] = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4).permute(2, 0, 1)
    sd["i16"] = torch.tensor([-300, 300], dtype=torch.int16)
    sd["i8"] = torch.tensor([-128, 127], dtype=torch.int8)
    sd["u8"] = torch.tensor([0, 255], dtype=torch.uint8)
    sd["bool"] = torch.tensor([True, False, True])
    sd["scalar"] = torch.tensor(3.0)  # 0-d tensor
    sd["empty"] = torch.zeros(0, 4)
    sd["param"] = torch.nn.Parameter(torch.tensor([2.0, 4.0]))
    return sd


def small_sd(scale):
    sd = collections.OrderedDict()
    sd["w"] = torch.tensor([1.0, 2.0]) * scale
    sd["b"] = torch.tensor([3.0]) * scale
    return sd


def main():
    torch.save(dtypes_state_dict(), "dtypes.pt")

    # One nested dict of tensors among plain values and a tensor of a dtype diffmon does not
    # support (uint16, written with `_rebuild_tensor_v3` + UntypedStorage): automatic pick.
    torch.save(
        {"step": 7, "ema": small_sd(10.0), "lr": 0.5, "name": "run", "u16": torch.tensor([1, 2], dtype=torch.uint16)},
        "nested_one.pt",
    )

    # Two candidate state dicts: needs weights_key; `state.ema` is the same object as `ema`
    # (pickled as a memo reference), `big` needs LONG1.
    ema = small_sd(10.0)
    torch.save(
        {"model": small_sd(1.0), "ema": ema, "step": 7, "state": {"ema": ema, "big": 2**40}},
        "nested_two.pt",
    )

    # DataParallel-style prefixes.
    sd = collections.OrderedDict()
    sd["module.w"] = torch.tensor([1.0, 2.0])
    sd["module.b"] = torch.tensor([3.0])
    sd["other"] = torch.tensor([4.0])
    torch.save(sd, "ddp.pt")

    # safetensors (the writer orders the data by dtype then name, not by insertion).
    save_file(
        {
            "z.f32": torch.tensor([1.0, 2.0]),
            "a.bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "m.i64": torch.tensor([5, -6], dtype=torch.int64),
            "ema.w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
            "ema.b": torch.tensor([0.5]),
        },
        "model.safetensors",
    )

    # A TorchScript archive (has constants.pkl and code/).
    torch.jit.script(torch.nn.Linear(2, 1)).save("torchscript.pt")


if __name__ == "__main__":
    main()
