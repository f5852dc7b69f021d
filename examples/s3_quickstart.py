"""Checkpoints on S3: start a local S3-compatible server (moto, as the tests
do), save a training state to ``s3://``, load it back bit-exact, read one
slice (byte ranges only), keep the last two steps with a CheckpointManager,
and read a tensor with zarr-python alone through obstore (no tensorckpt).

    pip install 'moto[server]' boto3 obstore   # all in the test extra
    python examples/s3_quickstart.py

Against real S3, skip the server: set AWS_REGION and your credentials (or
pass ``storage_options=``) and use your bucket.
"""

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request

import torch

import tensorckpt


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return server, endpoint
        except OSError:
            time.sleep(0.1)
    server.kill()
    sys.exit(f"moto did not start on {endpoint}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None, help="unused (the checkpoints go to the local S3 server)")
    parser.parse_args()
    try:
        import boto3
        import moto.server  # noqa: F401
    except ImportError:
        print("skipped: needs moto[server] and boto3 (pip install 'moto[server]' boto3)")
        return
    server, endpoint = start_server()
    try:
        run(endpoint, boto3)
    finally:
        server.terminate()
        server.wait()


def run(endpoint: str, boto3) -> None:  # noqa: ANN001 - the boto3 module
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "region": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="runs")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(torch.bfloat16)
    url = "s3://runs/exp1/step-100"
    tensorckpt.save({"model": model.state_dict(), "step": 100}, url, storage_options=opts)
    print(f"saved {len(model.state_dict())} tensors to {url}")

    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(torch.bfloat16)
    target = {"model": fresh.state_dict(), "step": 0}
    tensorckpt.load(target, url, storage_options=opts)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    print(f"loaded back: bit-exact={same}, step={target['step']}")
    if not same:
        sys.exit("mismatch after load")

    rows = tensorckpt.open(url, storage_options=opts).read("model/0.weight", (slice(0, 2),))
    print(f"read rows 0..1 of model/0.weight: shape {tuple(rows.shape)}, equal={torch.equal(rows, model[0].weight[:2])}")

    # a superseded step stays readable for reader_grace seconds (60 by default) for readers that resolved it
    mgr = tensorckpt.CheckpointManager("s3://runs/exp2", keep_last=2, reader_grace=0, storage_options=opts)
    for step in (1, 2, 3):
        mgr.save(step, {"model": model.state_dict(), "step": step})
    kept = [s.step for s in mgr.steps()]
    print(f"manager keeps steps {kept} (keep_last=2); latest {mgr.latest()}")
    if kept != [2, 3]:
        sys.exit(f"retention kept {kept}")

    try:
        import obstore.store
        import zarr
        import zarr.storage

        import tensorckpt_zarr_dtypes  # noqa: F401 - bfloat16 for zarr-python (the published dtype entry point)
    except ImportError:
        print("skipped the zarr-python read: needs obstore")
        return
    store = obstore.store.S3Store("runs", prefix="exp1/step-100", endpoint=endpoint, region="us-east-1",
                                  access_key_id="testing", secret_access_key="testing", client_options={"allow_http": True})
    arr = zarr.open_array(zarr.storage.ObjectStore(store, read_only=True), path="model/0.weight", mode="r")
    w = torch.from_numpy(arr[:].view("uint16").copy()).view(torch.bfloat16)
    print(f"zarr-python alone read model/0.weight {arr.shape} {arr.dtype}: bit-exact={torch.equal(w, model[0].weight)}")


if __name__ == "__main__":
    main()
