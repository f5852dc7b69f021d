"""Tied weights (an embedding and the output projection sharing one
Parameter) are stored once, the other name as ``<fqn>/tied_to``
(training-state.md 3.3); loading restores the tie, or fills both tensors of
a model that does not tie them."""

from __future__ import annotations

import torch
from torch import nn

import tensorckpt


class LM(nn.Module):
    def __init__(self, tied: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(5, 3)
        self.body = nn.Linear(3, 3)
        self.lm_head = nn.Linear(3, 5, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.body(self.embed(ids))))


def trained(model: LM):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.tensor([0, 3, 4])).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_tied_weight_is_stored_once_and_the_tie_restored(tmp_path):
    model = LM(tied=True, seed=0)
    opt = trained(model)
    tensorckpt.save({"model": model, "optim": opt}, tmp_path / "c")
    ck = tensorckpt.open(tmp_path / "c")
    assert "model/lm_head.weight" not in ck.keys() and ck.read("model/lm_head.weight/tied_to") == "embed.weight"
    assert sorted(k for k in ck.index.tensors if k.startswith("model/")) == [
        "model/body.bias", "model/body.weight", "model/embed.weight"]
    assert not any(k.startswith("optim/state/lm_head") for k in ck.keys())  # the optimizer has it once, as embed

    target = LM(tied=True, seed=1)
    topt = torch.optim.AdamW(target.parameters(), lr=0.5)
    tensorckpt.load({"model": target, "optim": topt}, tmp_path / "c")
    assert target.lm_head.weight is target.embed.weight and torch.equal(target.embed.weight, model.embed.weight)
    assert torch.equal(topt.state[target.embed.weight]["exp_avg"], opt.state[model.embed.weight]["exp_avg"])


def test_tied_checkpoint_into_an_untied_model_fills_both(tmp_path):
    model = LM(tied=True, seed=0)
    trained(model)
    tensorckpt.save({"model": model}, tmp_path / "c")
    target = LM(tied=False, seed=1)
    tensorckpt.load({"model": target}, tmp_path / "c")
    assert target.lm_head.weight is not target.embed.weight
    assert torch.equal(target.lm_head.weight, model.embed.weight) and torch.equal(target.embed.weight, model.embed.weight)


def test_untied_and_old_checkpoints_into_a_tied_model(tmp_path):
    untied = LM(tied=False, seed=0)
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.embed.weight)  # equal values, two tensors
    tensorckpt.save({"model": untied}, tmp_path / "untied")
    assert tensorckpt.open(tmp_path / "untied").info("model/lm_head.weight").shape == (5, 3)  # not tied: both stored
    tied = LM(tied=True, seed=0)
    tensorckpt.save({"model": tied.state_dict()}, tmp_path / "old")  # a plain state dict: stored twice, as before 1.2
    for name in ("untied", "old"):
        target = LM(tied=True, seed=2)
        tensorckpt.load({"model": target}, tmp_path / name)
        assert target.lm_head.weight is target.embed.weight
        assert torch.equal(target.embed.weight, untied.embed.weight if name == "untied" else tied.embed.weight)
