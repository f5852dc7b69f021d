"""Quickstart: save a model's training state, load it back bit-exact, then read
the same checkpoint with zarr-python alone (no tensorckpt import in that step).

    python examples/quickstart.py [--dir DIR]
"""

import argparse
import subprocess
import sys
import tempfile

import torch

import tensorckpt


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="tensorckpt-demo-")
    path = f"{root}/step-100"

    torch.manual_seed(0)
    model = build_model()
    state = {"model": model.state_dict(), "step": 100, "config": {"lr": 3e-4, "betas": [0.9, 0.95]}}
    tensorckpt.save(state, path, overwrite=True, metadata={"run": "quickstart"})
    print(f"saved {len(state['model'])} tensors to {path}\n")

    fresh = build_model()  # different random init
    target = {"model": fresh.state_dict(), "step": 0, "config": {"lr": 0.0, "betas": []}}
    tensorckpt.load(target, path)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    print(f"loaded back: bit-exact={same}, step={target['step']}, config={target['config']}")
    if not same:
        sys.exit("mismatch after load")

    ckpt = tensorckpt.open(path)
    print(f"partial read of model/0.weight rows 0..2: shape {tuple(ckpt.read('model/0.weight', index=(slice(0, 2),)).shape)}\n")
    tensorckpt.cli.inspect(path)

    # Any Zarr v3 reader works: a separate Python that never imports tensorckpt.
    # bfloat16 is not in Zarr v3 core: zarr-python needs the 150-line data-type
    # module tensorckpt_zarr_dtypes (standalone: zarr + ml_dtypes only).
    reader = (
        "import zarr, sys, tensorckpt_zarr_dtypes\n"
        "tensorckpt_zarr_dtypes.register()\n"
        f"g = zarr.open_group({path!r}, mode='r')\n"
        "w = g['model']['2.weight']\n"
        "print('zarr-python sees', dict(g.attrs)['tensorckpt']['format_version'], w.shape, w.dtype, float(w[0, 0]))\n"
        "assert 'tensorckpt' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", reader], check=True)


if __name__ == "__main__":
    main()
