"""Leaks the clipping hooks cannot see (issue 10, item 5): embedding max_norm, buffers written in the forward,
operations that mix examples."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.clipping.guard import BatchMixingError, TrainingGuard, check_batch_independence, input_leaves
from lightning_dp.lightning import DPStrategy
from tests.helpers import ClassifierWith, TinyRegressor, make_trainer
from tests.hf_helpers import TokenDataset, tiny_bert_classifier, tiny_gpt2, tiny_llama
from tests.hf_helpers import make_trainer as make_hf_trainer


class Centered(nn.Module):
    """``h - h.mean(0)`` between two linear layers: no parameter, but every example moves every other's loss."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.a(x)
        return self.b(h - h.mean(0))


class InputCentered(nn.Module):
    """Mixing before any layer: only the float-input leaf can see it."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 1)

    def forward(self, x):
        return self.lin(x - x.mean(0))


class RunningMean(nn.Module):
    """A hand-written running mean, stored in a buffer from the data."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 1)
        self.register_buffer("running", torch.zeros(d))

    def forward(self, x):
        if self.training:
            self.running.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x)


class ReassignedMean(RunningMean):
    def forward(self, x):
        self.running = 0.9 * self.running + 0.1 * x.detach().mean(0)
        return self.lin(x)


@pytest.mark.parametrize("embedding", [nn.Embedding(10, 4, max_norm=1.0), nn.EmbeddingBag(10, 4, max_norm=1.0)])
@pytest.mark.parametrize("frozen", [False, True])
def test_embedding_max_norm_is_rejected_trainable_or_frozen(embedding, frozen):
    model = nn.Sequential(embedding, nn.Linear(4, 1))
    embedding.weight.requires_grad_(not frozen)
    with pytest.raises(UnsupportedModuleError, match=r"'0'.*max_norm=1\.0.*in place.*max_norm=None"):
        PerSampleClipper(model, max_grad_norm=1.0)


@pytest.mark.parametrize("body", [RunningMean(), ReassignedMean()])
def test_buffer_written_in_training_forward_is_rejected(body):
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=2)
    with pytest.raises(UnsupportedModuleError, match=r"'running' of module 'body'.*running mean"):
        trainer.fit(ClassifierWith(body))


def test_buffer_watch_is_silent_for_unchanged_buffers():
    body = nn.Sequential(nn.Linear(6, 1))
    body.register_buffer("constant", torch.ones(3))
    make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=2).fit(ClassifierWith(body))


@pytest.mark.parametrize("body", [Centered(), InputCentered()])
def test_batch_mixing_fails_on_the_first_step(body):
    module = ClassifierWith(body)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=2)
    with pytest.raises(BatchMixingError, match=r"example \d+'s .*h - h\.mean\(0\).*check_batch_independence=False"):
        trainer.fit(module)
    for key, value in module.state_dict().items():  # failed before any update
        torch.testing.assert_close(value, before[key])


def test_batch_mixing_check_can_be_switched_off():
    strategy = DPStrategy(noise_multiplier=1.0, check_batch_independence=False)
    make_trainer(strategy, max_steps=2).fit(ClassifierWith(Centered()))
    assert strategy.privacy_engine.steps == 2


def test_normal_models_pass_and_the_check_runs_once(monkeypatch):
    import lightning_dp.clipping.guard as guard

    calls = []
    original = guard.check_batch_independence
    monkeypatch.setattr(guard, "check_batch_independence", lambda *a: calls.append(1) or original(*a))
    make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=3).fit(TinyRegressor())
    assert calls == [1]


def test_every_pair_is_tested():
    """A coupling of only the last two examples (indices 6 and 7 of 8) is found."""
    x = torch.randn(8, 3, requires_grad=True)
    w = torch.randn(3)
    out = x @ w
    coupled = torch.cat([out[:6], out[6:].sum().expand(2)])
    with pytest.raises(BatchMixingError, match="example [67]'s x"):
        check_batch_independence(coupled**2, {"x": (x, x.shape)})
    check_batch_independence((x @ w) ** 2, {"x": (x, x.shape)})  # independent: passes


def test_input_leaves_only_float_batch_tensors():
    x, ids, y = torch.randn(4, 2), torch.arange(4), torch.randn(3)
    batch, leaves = input_leaves({"x": x, "ids": ids, "other": y}, 4)
    assert list(leaves) == ["input 0"] and leaves["input 0"].requires_grad
    assert batch["ids"] is ids and batch["other"] is y and batch["x"].grad_fn is not None


def test_guard_skips_single_example_batches_until_a_larger_one():
    model = Centered()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    guard = TrainingGuard(model, clipper.output_targets)
    x = guard.before_forward(torch.randn(1, 6), 1)
    guard.after_forward(model(x).squeeze(-1))
    assert guard.independence_pending
    clipper._hooks.clear()
    x = guard.before_forward(torch.randn(4, 6), 4)
    with pytest.raises(BatchMixingError):
        guard.after_forward(model(x).squeeze(-1))


@pytest.mark.parametrize("factory", [tiny_gpt2, tiny_llama, tiny_bert_classifier])
def test_hf_tiny_models_pass(tmp_path, factory, monkeypatch):
    import lightning_dp.clipping.guard as guard

    calls = []
    original = guard.check_batch_independence
    monkeypatch.setattr(guard, "check_batch_independence", lambda *a: calls.append(len(a[1])) or original(*a))
    task = "cls" if factory is tiny_bert_classifier else "lm"
    trainer = make_hf_trainer(factory(), tmp_path, TokenDataset(task=task), args={"max_steps": 2})
    trainer.train()
    assert trainer.privacy_engine.steps == 2
    assert len(calls) == 1 and calls[0] > 3  # ran once, over the hooked layer outputs


def test_hf_batch_mixing_is_caught(tmp_path):
    """Mixing after the embeddings (in the dropout that follows them, a module without parameters)."""
    model = tiny_gpt2()

    def mix(module, args, output):
        return output - output.mean(0, keepdim=True)

    model.transformer.drop.register_forward_hook(mix)
    trainer = make_hf_trainer(model, tmp_path, TokenDataset(), args={"max_steps": 1})
    with pytest.raises(BatchMixingError, match="example .*'s output of module 'transformer.w[tp]e'"):
        trainer.train()
