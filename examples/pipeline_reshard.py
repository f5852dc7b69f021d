"""Save from a 4-stage pipeline, load into a 2-stage pipeline: no conversion.

Each stage numbers its layers from 0. `shift_layers` gives them global keys on
save (and maps them back on load), so the checkpoint holds one logical tensor
per global layer whatever the pipeline size. Runs 4 then 2 gloo processes on
127.0.0.1:

    python examples/pipeline_reshard.py [--dir DIR]
"""

import argparse
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorckpt

NUM_LAYERS, WIDTH = 8, 16


def stage_model(pp_size: int, pp_rank: int) -> torch.nn.Module:
    first = tensorckpt.stage_offset(NUM_LAYERS, pp_size, pp_rank)
    count = tensorckpt.stage_offset(NUM_LAYERS, pp_size, pp_rank + 1) if pp_rank + 1 < pp_size else NUM_LAYERS
    torch.manual_seed(1000 * pp_size + pp_rank)
    return torch.nn.ModuleDict({"layers": torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(count - first))})


def reference_layer(i: int) -> torch.nn.Linear:
    """What global layer i is in the saved run (PP=4)."""
    for rank in range(4):
        first = tensorckpt.stage_offset(NUM_LAYERS, 4, rank)
        model = stage_model(4, rank)
        if first <= i < first + len(model["layers"]):
            return model["layers"][i - first]
    raise IndexError(i)


def worker(rank: int, world: int, port: int, path: str, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = stage_model(world, rank)
    state = {"model": tensorckpt.shift_layers(model.state_dict(), tensorckpt.stage_offset(NUM_LAYERS, world, rank))}
    if mode == "save":
        tensorckpt.save(state, path, overwrite=True)
    else:
        tensorckpt.load(state, path)  # fills this stage's tensors in place
        first = tensorckpt.stage_offset(NUM_LAYERS, world, rank)
        for j, layer in enumerate(model["layers"]):
            assert torch.equal(layer.weight, reference_layer(first + j).weight), f"layer {first + j} differs"
        print(f"PP={world} stage {rank}: global layers {first}..{first + len(model['layers']) - 1} loaded bit-exact")
    dist.destroy_process_group()


def launch(world: int, path: str, mode: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, path, mode), nprocs=world)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None)
    root = parser.parse_args().dir or tempfile.mkdtemp(prefix="tensorckpt-pp-")
    path = os.path.join(root, "pp4")
    launch(4, path, "save")
    print(f"saved from PP=4 to {path}: keys {tensorckpt.open(path).keys()[:3]} ...")
    launch(2, path, "load")
