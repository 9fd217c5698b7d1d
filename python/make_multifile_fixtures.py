"""Multi-file checkpoints as real libraries write them, for diffmon's multi-file tests.

Usage: make_multifile_fixtures.py OUT_DIR

Writes, with the real libraries (torch, diffusers):

    sharded/                  a tiny diffusers UNet2DModel saved with
                              save_pretrained(max_shard_size="20KB"): config.json,
                              diffusion_pytorch_model.safetensors.index.json and its shards
    sharded.safetensors       the same model's state_dict() in one file (reference)
    dcp/                      torch.distributed.checkpoint.save({"model": ..., "optimizer": ...})
                              in one process: .metadata + __0_0.distcp
    chunked/                  a distributed checkpoint whose tensors are split in chunks across
                              two .distcp files, as ranks of a sharded (FSDP) save store them;
                              written with torch's own Metadata classes and checked by loading
                              it back with torch.distributed.checkpoint.load
    dcp.safetensors           the state_dict() both DCP folders hold (reference)
"""

import io
import os
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

warnings.filterwarnings("ignore")


def unet():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
        layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )


def sharded(out: Path):
    m = unet()
    m.save_pretrained(out / "sharded", max_shard_size="20KB")
    shards = [f for f in os.listdir(out / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 1, shards
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, out / "sharded.safetensors")


def small_net():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.GroupNorm(2, 4), torch.nn.Linear(6, 5))


def dcp(out: Path):
    import torch.distributed.checkpoint as dist_cp

    net = small_net()
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(2, 1, 8, 8)).sum().backward()
    opt.step()
    dist_cp.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(out / "dcp"))
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, out / "dcp.safetensors")
    return net


def chunked(out: Path, net):
    """Each tensor of net's state_dict split in two chunks along dim 0 (where it has two rows or
    more), the chunks of rank r in __r_0.distcp, the metadata built with torch's classes."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    folder = out / "chunked"
    folder.mkdir()
    files = {0: io.BytesIO(), 1: io.BytesIO()}
    sdm, storage, planner = {}, {}, {}
    for name, t in net.state_dict().items():
        fqn = f"model.{name}"
        planner[fqn] = ("model", name)
        cuts = [(0, t.shape[0] // 2), (t.shape[0] // 2, t.shape[0])] if t.dim() and t.shape[0] >= 2 else [(0, t.shape[0] if t.dim() else 0)]
        chunks = []
        for rank, (a, b) in enumerate(cuts):
            part = t[a:b].clone() if t.dim() else t.clone()
            offsets = torch.Size([a] + [0] * (t.dim() - 1)) if t.dim() else torch.Size([])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=part.size()))
            f = files[rank]
            start = f.tell()
            torch.save(part, f)
            storage[MetadataIndex(fqn, offsets, len(chunks) - 1)] = _StorageInfo(
                f"__{rank}_0.distcp", start, f.tell() - start)
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.size(), chunks)
    for rank, f in files.items():
        (folder / f"__{rank}_0.distcp").write_bytes(f.getvalue())
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    with open(folder / ".metadata", "wb") as fh:
        import pickle
        pickle.dump(md, fh)
    # torch's own loader reads it back: the folder is a valid distributed checkpoint.
    back = {"model": {k: torch.zeros_like(v) for k, v in net.state_dict().items()}}
    dist_cp.load(back, checkpoint_id=str(folder))
    for k, v in net.state_dict().items():
        assert torch.equal(back["model"][k], v), k


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    sharded(out)
    net = dcp(out)
    chunked(out, net)


if __name__ == "__main__":
    main()
