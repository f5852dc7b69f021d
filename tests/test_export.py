"""Export from tensorckpt (``tensorckpt.convert(..., to_format=...)``): the
model part of a training checkpoint becomes a Hugging Face directory that
``transformers`` loads (logits equal), sharded by ``max_shard_size`` with
``model.safetensors.index.json``, cast to bfloat16; a DCP directory that
``torch.distributed.checkpoint.load`` reads; a torch.save file. About 10 s.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import tensorckpt
from tensorckpt import cli

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return cfg, model.eval(), opt


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    cfg, model, opt = _llama()
    tensorckpt.save({"model": model, "optim": opt, "step": 1}, base / "ck")
    return base, cfg, model


def test_model_part_becomes_a_directory_transformers_loads(trained):
    base, cfg, model = trained
    out = base / "hf"
    assert cli.main(["convert", str(base / "ck"), str(out), "--to", "safetensors", "--only", "model/",
                     "--strip-prefix", "model/", "--quiet"]) == 0
    cfg.save_pretrained(out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_sharded_bf16_export_with_index(trained):
    base, cfg, model = trained
    out = base / "hf-bf16"
    names = tensorckpt.convert(base / "ck", out, to_format="safetensors", only="model/", strip_prefix="model/",
                               dtype=torch.bfloat16, max_shard_size="40KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors" and set(names) >= set(shards)
    sd = model.state_dict()
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in sd.values())
    for shard in shards:  # each shard is within the limit unless it holds one bigger tensor
        part = safetensors_torch.load_file(str(out / shard))
        assert sum(v.numel() * 2 for v in part.values()) <= 40_000 or len(part) == 1
        for k, v in part.items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, sd[k].to(torch.bfloat16)), k
    cfg.save_pretrained(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16)
    assert torch.equal(loaded.model.embed_tokens.weight, sd["model.embed_tokens.weight"].to(torch.bfloat16))
    # and back in: the same bytes
    tensorckpt.convert(out, base / "back", progress=False, add_prefix="model/")
    back = tensorckpt.open(base / "back")
    assert torch.equal(back.read("model/lm_head.weight"), sd["lm_head.weight"].to(torch.bfloat16))


def test_export_to_dcp_is_read_by_dcp_load(trained, tmp_path):
    import torch.distributed.checkpoint as dcp

    base, _, model = trained
    tensorckpt.convert(base / "ck", tmp_path / "dcp", to_format="dcp", memory_bytes=20_000, progress=False)
    sd = model.state_dict()
    target = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    for k, v in sd.items():
        assert torch.equal(target["model"][k], v), k
    assert target["step"] == 1
    # the optimizer state round-trips through DCP back into tensorckpt's layout
    tensorckpt.convert(tmp_path / "dcp", tmp_path / "again", progress=False)
    a, b = tensorckpt.open(base / "ck"), tensorckpt.open(tmp_path / "again")
    assert a.keys() == b.keys()
    for k in a.keys():  # noqa: SIM118 (Checkpoint.keys(), not a dict)
        va, vb = a.read(k), b.read(k)
        assert (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb), k


def test_export_to_torch_save(trained, tmp_path):
    base, cfg, model = trained
    tensorckpt.convert(base / "ck", tmp_path / "model.pt", only="model/", strip_prefix="model/", progress=False)
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(sd) == set(model.state_dict())
    fresh = transformers.LlamaForCausalLM(cfg)
    fresh.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    with pytest.raises(tensorckpt.CheckpointExistsError):
        tensorckpt.convert(base / "ck", tmp_path / "model.pt", progress=False)


def test_tensorckpt_to_tensorckpt_selects_and_casts(trained, tmp_path):
    base, _, model = trained
    tensorckpt.convert(base / "ck", tmp_path / "bf16", only="model/", dtype=torch.bfloat16, progress=False,
                       memory_bytes=20_000, shard_bytes=8192)  # the larger tensors in slabs of stored objects
    ck = tensorckpt.open(tmp_path / "bf16")
    sd = model.state_dict()
    assert ck.keys() == sorted(f"model/{k}" for k in sd)
    for k, v in sd.items():
        assert torch.equal(ck.read(f"model/{k}"), v.to(torch.bfloat16)), k
    assert tensorckpt.verify(tmp_path / "bf16").ok
    assert ck.index.tensors["model/model.embed_tokens.weight"].chunk_shape[0] < 128  # several stored objects
