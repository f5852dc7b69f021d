"""Loading into models built on the meta device (``torch.device("meta")``,
then ``fully_shard`` / ``parallelize_module``): tensorckpt allocates their
tensors with the same layout (a DTensor keeps its mesh and placements, its
local tensor on the mesh's device type; a plain tensor goes to the CPU),
reads the checkpoint into them and hands them to the module with
``load_state_dict(..., assign=True)``. A bare meta tensor in a plain dict is
refused: a load is never a silent no-op.

Here, in this process (about 2 s): a plain module built on meta, loaded
(values bit for bit, trainable Parameters, forward and backward); a module
with tied embeddings (the tie kept, its non-persistent buffer named in a
warning); and the refusals. ``TENSORCKPT_FULL=1`` adds a tiny transformers
Llama with tied embeddings and rotary buffers (15 s: the import). The distributed cases run inside tests/test_strided_dist.py's
spawns (to save process start-up), through :func:`load_meta`: its FSDP2 x TP
checkpoint loaded into FSDP2 and TP models built on meta at world 2, and
FSDP2 x TP 2x2 and TP on 4 at world 4 (more with ``TENSORCKPT_FULL=1``).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

from test_strided_dist import Net, build, check_equal, reference  # noqa: E402

import tensorckpt  # noqa: E402
from tensorckpt.errors import TensorckptError  # noqa: E402


def _check_materialised(m: torch.nn.Module, like: torch.nn.Module, what: str) -> None:
    from torch.distributed.tensor import DTensor

    mine, theirs = dict(m.named_parameters()), dict(like.named_parameters())
    assert mine.keys() == theirs.keys()
    for k, p in mine.items():
        q = theirs[k]
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad, f"{what}: {k} is no trainable Parameter"
        assert not p.is_meta, f"{what}: {k} still on meta"
        assert isinstance(p, DTensor) == isinstance(q, DTensor), f"{what}: {k} DTensor or not"
        if isinstance(q, DTensor):
            assert p.placements == q.placements and p.device_mesh == q.device_mesh, f"{what}: {k} layout"
            assert p.to_local().device.type == "cpu" and p.to_local().shape == q.to_local().shape


def _forward_backward(m: torch.nn.Module, what: str) -> None:
    """FSDP2 gathers the assigned parameters and reduces their gradients."""
    x = torch.arange(12.0).reshape(2, 6) / 10
    ref = Net()
    ref.load_state_dict(reference())
    y = m(x)
    assert torch.allclose(y, ref(x)), what
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters()), what


def load_meta(world: int, path: str, layouts: list[str]) -> None:
    """In a spawned rank: load ``path`` into each layout built on meta and
    check it (materialised like a CPU-built model, values equal)."""
    for layout in layouts:
        m = build(layout, device="meta")
        assert all(p.is_meta for p in m.parameters())
        tensorckpt.load({"model": m}, path)
        _check_materialised(m, build(layout, values=False), layout)
        check_equal(m, f"meta {layout} at world {world}")
        if layout == "fsdp":
            _forward_backward(m, f"meta {layout} at world {world}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("meta") / "plain")
    m = Net()
    m.load_state_dict(reference())
    tensorckpt.save({"model": m}, path)
    return path


def test_plain_module_on_meta(ckpt):
    with torch.device("meta"):
        m = Net()
    tensorckpt.load({"model": m}, ckpt)
    _check_materialised(m, Net(), "plain")
    check_equal(m, "meta plain")
    _forward_backward(m, "meta plain")


def test_bare_meta_tensor_refused(ckpt):
    state = {"model": {k: torch.empty(v.shape, device="meta") for k, v in reference().items()}}
    with pytest.raises(TensorckptError, match=r"'model/a\.weight'.*meta device.*to_empty.*torch\.nn\.Module"):
        tensorckpt.load(state, ckpt)
    with pytest.raises(TensorckptError, match=r"'w'.*meta device"):
        tensorckpt.save({"w": torch.empty(2, device="meta")}, ckpt + "-meta", overwrite=True)


class Tied(torch.nn.Module):
    """Tied input/output embeddings and a non-persistent buffer, like a language model's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.out = torch.nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("freq", torch.arange(3.0), persistent=False)


def test_tied_module_on_meta(tmp_path):
    """The tie is kept; the non-persistent buffer (in no checkpoint) is named in a warning."""
    torch.manual_seed(0)
    src = Tied()
    tensorckpt.save({"model": src}, str(tmp_path / "tied"))
    with torch.device("meta"):
        m = Tied()
    with pytest.warns(UserWarning, match=r"'model': loaded, but \['freq'\] are still on the meta device"):
        tensorckpt.load({"model": m}, str(tmp_path / "tied"))
    assert m.out.weight is m.emb.weight and isinstance(m.emb.weight, torch.nn.Parameter)
    assert torch.equal(m.emb.weight, src.emb.weight) and not m.emb.weight.is_meta


@pytest.mark.skipif(os.environ.get("TENSORCKPT_FULL") != "1", reason="TENSORCKPT_FULL=1 (imports transformers: 15 s)")
def test_tiny_llama_on_meta(tmp_path):
    """A transformers Llama with tied embeddings built on meta: tensors
    loaded bit for bit, the tie kept, and the rotary frequencies (a
    non-persistent buffer, in no checkpoint) named in a warning."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(cfg)
    tensorckpt.save({"model": src}, str(tmp_path / "llama"))
    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(cfg)
    with pytest.warns(UserWarning, match=r"'model': loaded, but \['model\.rotary_emb\.inv_freq'.*meta device"):
        tensorckpt.load({"model": m}, str(tmp_path / "llama"))
    want = src.state_dict()
    got = m.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert not got[k].is_meta and torch.equal(got[k], v), k
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert all(p.requires_grad for p in m.parameters())
