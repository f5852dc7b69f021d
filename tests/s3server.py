"""A real S3-compatible HTTP server for the tests: moto in server mode on
127.0.0.1, on a free port, in a process of its own (``python -m moto.server``
of the interpreter running the tests), with buckets made through boto3.
Used by tests/test_s3.py (its session fixture starts one and stops it at the
end); a benchmark can start one the same way."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing", "us-east-1"
BUCKET = "tensorckpt-test"  # made by the tests' moto fixture (conftest.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """``with MotoServer() as s3: s3.endpoint, s3.make_bucket(name)``."""

    def __init__(self, startup_s: float = 30.0) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._startup_s = startup_s
        self._proc: subprocess.Popen | None = None
        self.command = [sys.executable, "-m", "moto.server"]  # the server's command line, less host and port

    def start(self) -> MotoServer:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        self._proc = subprocess.Popen(
            [*self.command, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + self._startup_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode} before it answered")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {self._startup_s} s") from None
                time.sleep(0.1)

    def client(self):  # noqa: ANN201 - a boto3 client (boto3 has no stubs here)
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def env(self) -> dict[str, str]:
        """The AWS environment variables that point a client at this server."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_REGION": REGION,
                "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
