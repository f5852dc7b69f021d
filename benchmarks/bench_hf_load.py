"""Hugging Face weights into an FSDP2-sharded model at world 2: ``tensorckpt.load_safetensors``
against ``from_pretrained`` + manual sharding.

    hf-direct   the model built on the meta device, fully_shard (each layer, then the model),
                to_empty, tensorckpt.load_safetensors: each rank reads only its own byte ranges
    baseline    AutoModelForCausalLM.from_pretrained on every rank (each reads the whole
                model), then fully_shard, which keeps each rank's shard

The model is a random-init Llama sized to about ``--size-gib`` of float32
(written once with ``save_pretrained``, shards of 500 MB; no download). Each
method runs in a fresh 2-process gloo launch; the time is from the start of
model construction to the sharded, loaded model on the slowest rank (process
start and imports, of the modeling code too, excluded). The methods alternate (A B, B A, ...) for
``--reps`` reps and the medians are compared. Every run is checked: each
rank's shard of every parameter equals the baseline's, bit for bit. The page
cache is dropped before each run when the script runs as root.

    python benchmarks/bench_hf_load.py [--size-gib 1.0] [--reps 3] [--dir PARENT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
sys.path.insert(0, os.path.dirname(_HERE))

import dist  # tests/dist.py: the gloo launcher the test suite uses
from common import drop_caches

import tensorckpt


def config(size_gib: float):
    import transformers

    d, inter, vocab = 1024, 2816, 32000
    per_layer = (4 * d * d + 3 * d * inter + 2 * d) * 4
    layers = max(1, int((size_gib * 2**30 - 2 * vocab * d * 4) // per_layer))
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
                                    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
                                    tie_word_embeddings=False)


def _shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _run(rank: int, world: int, hf_dir: str, method: str):
    import torch.distributed as tdist
    import transformers

    torch.set_num_threads(1)
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    _ = transformers.LlamaForCausalLM  # import the modeling code (a lazy import) before the clock starts
    stats = tensorckpt.LoadStats()
    tdist.barrier()
    t0 = time.perf_counter()
    if method == "hf-direct":
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        _shard(model)
        model.to_empty(device="cpu")
        tensorckpt.load_safetensors(model, hf_dir, stats=stats)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        _shard(model)
    seconds = time.perf_counter() - t0
    tdist.barrier()
    sums = {k: float(v.to_local().double().sum()) for k, v in model.state_dict().items()}
    return seconds, stats.bytes_read, stats.bytes_needed, sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers

    root = tempfile.mkdtemp(prefix="bench-hf-load-", dir=args.dir)
    try:
        cfg = config(args.size_gib)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        hf_dir = os.path.join(root, "hf")
        model.save_pretrained(hf_dir, max_shard_size="500MB")
        nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        del model
        files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
        cache = drop_caches()
        print(f"model: Llama, {cfg.num_hidden_layers} layers, {nbytes / 2**30:.2f} GiB float32 in {len(files)} files; "
              f"world 2; page cache {'dropped before each run' if cache is None else 'NOT dropped (' + cache + ')'}")
        times: dict[str, list[float]] = {"hf-direct": [], "baseline": []}
        reads: list[list[int]] = []
        ok = True
        for rep in range(args.reps):
            order = ["hf-direct", "baseline"] if rep % 2 == 0 else ["baseline", "hf-direct"]
            got = {}
            for method in order:
                drop_caches()
                out = dist.run(2, _run, hf_dir, method, timeout=900)
                times[method].append(max(o[0] for o in out))
                got[method] = out
            reads = [[o[1] for o in got["hf-direct"]], [o[2] for o in got["hf-direct"]]]
            for rank in range(2):
                if got["hf-direct"][rank][3] != got["baseline"][rank][3]:
                    ok = False
                    print(f"FAIL: rank {rank}'s shards differ between the methods")
        med = {k: statistics.median(v) for k, v in times.items()}
        gib = nbytes / 2**30
        print(f"hf-direct {med['hf-direct']:6.2f} s   baseline {med['baseline']:6.2f} s   "
              f"ratio {med['hf-direct'] / med['baseline']:4.2f}x   runs {[round(x, 2) for x in times['hf-direct']]} vs "
              f"{[round(x, 2) for x in times['baseline']]}")
        print(f"bytes read per rank (hf-direct) {reads[0]}, needed {reads[1]}; the baseline reads {nbytes} "
              f"({gib:.2f} GiB) on each rank")
        print("OK" if ok else "FAIL")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": nbytes, "seconds": times, "median": med, "read_per_rank": reads[0]}, f, indent=1)
        if not ok:
            sys.exit(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
