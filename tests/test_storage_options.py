"""``storage_options=`` on the entry points, ``--storage-option`` and
``TENSORCKPT_STORAGE_OPTIONS`` on the CLI, against a moto server that checks
credentials (IAM auth on after the fixture made its user): options override
the AWS environment variables key by key, wrong ones fail with an access
denied message, no secret appears in any message or repr, unknown option
names are refused listing the accepted ones."""

from __future__ import annotations

import itertools
import json
import os
import sys

import pytest
import torch

import tensorckpt
from tensorckpt import InvalidPathError, TensorckptError
from tensorckpt.cli import main
from tensorckpt.storage import location

sys.path.insert(0, os.path.dirname(__file__))
from s3server import REGION, MotoServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")
BUCKET = "tensorckpt-options"
WRONG_KEY, WRONG_SECRET = "AKIAWRONGWRONGWRONG1", "wrong-secret-do-not-print-me"
_n = itertools.count()


@pytest.fixture(scope="module")
def server():
    """A moto server that checks credentials: a user with an access key is
    made while it does not yet (INITIAL_NO_AUTH_ACTION_COUNT), then it does."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (the test extra)")
    import boto3

    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"
    try:
        s = MotoServer().start()  # the server process inherits the variable
    finally:
        del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
    try:
        s.make_bucket(BUCKET)
        iam = boto3.client("iam", endpoint_url=s.endpoint, region_name=REGION, aws_access_key_id="x",
                           aws_secret_access_key="x")
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        k = iam.create_access_key(UserName="trainer")["AccessKey"]
        s.key, s.secret = k["AccessKeyId"], k["SecretAccessKey"]
        yield s
    finally:
        s.stop()


@pytest.fixture
def env(monkeypatch):
    """Set the AWS environment (every other AWS variable removed)."""
    for k in [k for k in os.environ if k.startswith("AWS_")] + ["TENSORCKPT_STORAGE_OPTIONS"]:
        monkeypatch.delenv(k, raising=False)

    def set_env(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_env


def _url(name: str = "ckpt") -> str:
    return f"s3://{BUCKET}/t{os.getpid()}-{next(_n)}/{name}"


def _state() -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4), "h": torch.arange(5.0).to(torch.bfloat16), "step": 3}


def _empty() -> dict:
    return {"w": torch.zeros(3, 4), "h": torch.zeros(5, dtype=torch.bfloat16), "step": 0}


def _right(server) -> dict:
    return {"endpoint_url": server.endpoint, "key": server.key, "secret": server.secret}


def test_options_override_wrong_environment(server, env):
    env(AWS_ENDPOINT_URL_S3="http://127.0.0.1:9", AWS_ACCESS_KEY_ID=WRONG_KEY, AWS_SECRET_ACCESS_KEY=WRONG_SECRET)
    url, opts = _url(), _right(server)
    tensorckpt.save(_state(), url, storage_options=opts)
    out = tensorckpt.load(_empty(), url, storage_options=opts)
    assert torch.equal(out["w"], _state()["w"]) and torch.equal(out["h"], _state()["h"])
    assert torch.equal(tensorckpt.open(url, storage_options=opts).read("w", (slice(1, 2),)), _state()["w"][1:2])
    assert tensorckpt.verify(url, storage_options=opts).ok
    assert not tensorckpt.clean(url, storage_options=opts).leftovers
    mgr = tensorckpt.CheckpointManager(_url("run"), storage_options=opts)
    mgr.save(1, _state())
    assert mgr.latest() == 1
    tensorckpt.async_save(_state(), _url(), storage_options=opts).wait()


def test_wrong_options_over_right_environment_fail(server, env):
    env(AWS_ENDPOINT_URL_S3=server.endpoint, AWS_ACCESS_KEY_ID=server.key, AWS_SECRET_ACCESS_KEY=server.secret)
    url = _url()
    tensorckpt.save(_state(), url)  # the environment alone is right
    wrong = {"key": WRONG_KEY, "secret": WRONG_SECRET}
    with pytest.raises(TensorckptError, match="access denied|403") as e:
        tensorckpt.save(_state(), _url(), storage_options=wrong)
    assert WRONG_SECRET not in str(e.value) and WRONG_KEY not in str(e.value)
    with pytest.raises(TensorckptError, match="PERMISSION_DENIED|access denied|403") as e:
        tensorckpt.open(url, storage_options=wrong)
    assert WRONG_SECRET not in str(e.value)


def test_secrets_never_printed(server, env):
    env()
    loc = location.parse(_url(), {"key": "AKIAVISIBLE", "secret": WRONG_SECRET, "token": "tok-do-not-print"})
    for text in (repr(loc), str(loc), loc.url):
        assert WRONG_SECRET not in text and "tok-do-not-print" not in text and "AKIAVISIBLE" not in text
    spec = json.dumps(loc.kvstore())
    assert WRONG_SECRET not in spec and "tok-do-not-print" not in spec  # a private credentials file holds them
    with pytest.raises(InvalidPathError) as e:
        location.parse(_url(), {"secret": WRONG_SECRET, "bogus": WRONG_SECRET})
    assert WRONG_SECRET not in str(e.value)
    with pytest.raises(InvalidPathError) as e:
        location.parse(_url(), {"key": 12345678, "secret": WRONG_SECRET})
    assert WRONG_SECRET not in str(e.value) and "12345678" not in str(e.value)


def test_unknown_options_are_refused(env):
    env()
    with pytest.raises(InvalidPathError, match="unknown storage option.*'endpoint'.*accepted: endpoint_url, region"):
        tensorckpt.open(_url(), storage_options={"endpoint": "http://x"})
    with pytest.raises(InvalidPathError, match="local or memory:// path takes none"):
        tensorckpt.open("/tmp/nowhere", storage_options={"key": "x"})
    with pytest.raises(InvalidPathError, match="'request_concurrency' must be an int >= 1"):
        tensorckpt.open(_url(), storage_options={"request_concurrency": 0})
    with pytest.raises(InvalidPathError, match="'key' needs 'secret'"):
        tensorckpt.open(_url(), storage_options={"key": "x"})


def test_options_make_the_spec(env):
    env(AWS_REGION="eu-west-1", AWS_ENDPOINT_URL="http://env:1")
    spec = location.parse(_url(), {"endpoint_url": "http://opt:2/", "request_concurrency": "64"}).kvstore()
    assert spec["endpoint"] == "http://opt:2" and spec["aws_region"] == "eu-west-1"
    assert spec["s3_request_concurrency"] == {"limit": 64}
    assert location.parse(_url(), {"anon": "true"}).kvstore()["aws_credentials"] == {"type": "anonymous"}
    assert location.parse(_url(), {"profile": "p"}).kvstore()["aws_credentials"] == {"type": "default", "profile": "p"}
    assert location.parse(_url(), {"region": "ap-south-1"}).kvstore()["aws_region"] == "ap-south-1"


def test_convert_to_and_from_s3(server, env, tmp_path, capsys):
    env(AWS_ENDPOINT_URL_S3="http://127.0.0.1:9")
    tensorckpt.save(_state(), tmp_path / "local")
    url, opts = _url(), _right(server)
    tensorckpt.convert(tmp_path / "local", url, storage_options=opts, progress=False)
    out = tensorckpt.load(_empty(), url, storage_options=opts)
    assert torch.equal(out["w"], _state()["w"]) and torch.equal(out["h"], _state()["h"])
    flags = [f"--storage-option=endpoint_url={server.endpoint}", f"--storage-option=key={server.key}",
             f"--storage-option=secret={server.secret}"]
    assert main(["convert", url, str(tmp_path / "back"), "--quiet", *flags]) == 0
    assert torch.equal(tensorckpt.open(tmp_path / "back").read("w"), _state()["w"])


def test_cli_flag_and_environment_variable(server, env, capsys, monkeypatch):
    env(AWS_ENDPOINT_URL_S3="http://127.0.0.1:9")
    url = _url()
    tensorckpt.save(_state(), url, storage_options=_right(server))
    flags = [f"--storage-option=endpoint_url={server.endpoint}", "--storage-option", f"key={server.key}",
             "--storage-option", f"secret={server.secret}"]
    assert main(["inspect", url, *flags]) == 0 and "w" in capsys.readouterr().out
    assert main(["verify", url, *flags, "--quiet"]) == 0
    assert main(["clean", url, *flags]) == 0
    capsys.readouterr()
    monkeypatch.setenv("TENSORCKPT_STORAGE_OPTIONS", json.dumps(_right(server)))
    assert main(["inspect", url]) == 0
    assert main(["list", url.rsplit("/", 1)[0]]) == 0
    # a flag wins over the variable, key by key: a wrong secret fails, naming no secret
    capsys.readouterr()
    assert main(["inspect", url, f"--storage-option=secret={WRONG_SECRET}"]) == 2
    err = capsys.readouterr().err
    assert err and WRONG_SECRET not in err and server.secret not in err
    # the variable is for URLs: a local path ignores it; a flag for one is an error
    assert main(["clean", "/tmp/tensorckpt-no-such-dir", "--dry-run"]) == 0
    assert main(["inspect", "/tmp/x", "--storage-option", "key=v"]) == 2
    assert "takes none" in capsys.readouterr().err
    assert main(["inspect", url, "--storage-option", "novalue"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    monkeypatch.setenv("TENSORCKPT_STORAGE_OPTIONS", "{not json")
    assert main(["inspect", url]) == 2 and "TENSORCKPT_STORAGE_OPTIONS: not JSON" in capsys.readouterr().err
