"""Leaks the clipping hooks cannot see (docs/design.md section 9): embedding max_norm, buffers written in the forward,
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


class DataCopiedMean(RunningMean):
    """Written through ``.data``: that alias has its own version counter, only the contents show the write."""

    def forward(self, x):
        self.running.data.copy_(x.detach().mean(0))
        return self.lin(x)


class DataAssignedMean(RunningMean):
    def forward(self, x):
        self.running.data = x.detach().mean(0)
        return self.lin(x)


class FrozenStatistic(nn.Module):
    """A frozen parameter written from the data under ``no_grad``."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 1)
        self.stat = nn.Parameter(torch.zeros(d), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.stat.copy_(x.mean(0))
        return self.lin(x)


@pytest.mark.parametrize("embedding", [nn.Embedding(10, 4, max_norm=1.0), nn.EmbeddingBag(10, 4, max_norm=1.0)])
@pytest.mark.parametrize("frozen", [False, True])
def test_embedding_max_norm_is_rejected_trainable_or_frozen(embedding, frozen):
    model = nn.Sequential(embedding, nn.Linear(4, 1))
    embedding.weight.requires_grad_(not frozen)
    with pytest.raises(UnsupportedModuleError, match=r"'0'.*max_norm=1\.0.*in place.*max_norm=None"):
        PerSampleClipper(model, max_grad_norm=1.0)


@pytest.mark.parametrize(
    ("body", "name"),
    [
        (RunningMean(), "running"),
        (ReassignedMean(), "running"),
        (DataCopiedMean(), "running"),
        (DataAssignedMean(), "running"),
        (FrozenStatistic(), "stat"),
    ],
)
@pytest.mark.parametrize("check_independence", [True, False])
def test_buffer_or_frozen_parameter_written_in_training_forward_is_rejected(body, name, check_independence):
    strategy = DPStrategy(noise_multiplier=1.0, check_batch_independence=check_independence)
    trainer = make_trainer(strategy, max_steps=2)
    with pytest.raises(UnsupportedModuleError, match=rf"'{name}' of module 'body'.*running mean"):
        trainer.fit(ClassifierWith(body))


@pytest.mark.parametrize("exact_up_to", [2**16, 0])
def test_data_writes_are_caught_by_exact_compare_and_by_checksum(monkeypatch, exact_up_to):
    import lightning_dp.clipping.guard as guard

    monkeypatch.setattr(guard, "EXACT_COMPARE_NUMEL", exact_up_to)
    body = DataCopiedMean()
    watch = guard.BufferWatch(body)
    watch.start(contents=True)
    body(torch.randn(4, 6))
    with pytest.raises(UnsupportedModuleError, match="'running' of module '<root>'"):
        watch.check()
    watch.start()  # ids, versions and addresses only: a write through .data is not seen
    body(torch.randn(4, 6))
    watch.check()


def test_buffer_watch_is_silent_for_unchanged_buffers_and_frozen_parameters():
    body = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 1))
    body[0].requires_grad_(False)
    body.register_buffer("constant", torch.tensor([1.0, float("nan")]))
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


def test_independence_check_that_cannot_run_warns(caplog):
    x = torch.randn(4, 3, requires_grad=True)
    with caplog.at_level("WARNING", logger="lightning_dp"):
        check_batch_independence((x @ torch.randn(3)).detach(), {"x": (x, x.shape)})
        check_batch_independence((x @ torch.randn(3)) ** 2, {"x": (x[:2], torch.Size([2, 3]))})
    assert "could not run (the per-sample loss has no gradient)" in caplog.text
    assert "no hooked layer output or float input has the batch size 4" in caplog.text


def test_guard_warns_once_when_the_batch_size_is_unknown(caplog):
    model = nn.Linear(6, 1)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    guard = TrainingGuard(model, clipper.output_targets)
    with caplog.at_level("WARNING", logger="lightning_dp"):
        for _ in range(2):
            guard.after_forward(model(guard.before_forward(torch.randn(1, 6), None)).squeeze(-1))
            clipper._hooks.clear()
    assert caplog.text.count("batch size could not be read") == 1


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


def test_hf_frozen_parameter_written_through_data_is_caught(tmp_path):
    """A frozen final layer norm whose weight a forward hook overwrites from the data through ``.data``."""
    model = tiny_gpt2()
    model.transformer.ln_f.requires_grad_(False)

    def write(module, args, output):
        module.weight.data.copy_(output.detach().mean((0, 1)))

    model.transformer.ln_f.register_forward_hook(write)
    trainer = make_hf_trainer(model, tmp_path, TokenDataset(), args={"max_steps": 1})
    with pytest.raises(UnsupportedModuleError, match="'weight' of module 'transformer.ln_f'"):
        trainer.train()


class DetachedCentered(Centered):
    """``h - h.mean(0).detach()``: no gradient path between examples, so only the leave-half-out forward sees it."""

    def forward(self, x):
        h = self.a(x)
        return self.b(h - h.mean(0).detach())


class BatchNormalisedLoss(ClassifierWith):
    """Per-sample losses divided by the batch's total "token count" (a common LM pattern that mixes examples)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        tokens = torch.ones_like(x)  # every feature a "token"
        err = (self.body(x) - y.expand(-1, 1)) ** 2
        return (err * tokens).sum(1) / tokens.sum()


@pytest.mark.parametrize("module", [ClassifierWith(DetachedCentered()), BatchNormalisedLoss(nn.Linear(6, 1))])
def test_mixing_without_a_gradient_path_is_caught_by_the_leave_half_out_forward(module):
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=2)
    with pytest.raises(BatchMixingError, match=r"leave-half-out check: the loss of example \d+ .*per-example mean"):
        trainer.fit(module)


def test_leave_half_out_runs_once_in_eval_mode_without_logging(monkeypatch):
    import lightning_dp.clipping.guard as guard

    calls, modes = [], []
    original = guard.check_leave_half_out

    def spy(compute_loss, batch, batch_size, module):
        calls.append(batch_size)
        return original(lambda b: modes.append(module.training) or compute_loss(b), batch, batch_size, module)

    monkeypatch.setattr(guard, "check_leave_half_out", spy)
    module = TinyRegressor()
    make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=3).fit(module)
    assert len(calls) == 1 and calls[0] >= 2 and modes == [False, False] and module.training
