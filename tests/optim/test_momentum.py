"""Per-sample momentum (DP-PMLF seed, Algorithm 1 lines 1, 5, 6): the clipped per-sample momentum and the clipped sum
against torch.func per-sample gradients at stored iterates, k = 1 equal to DP-SGD, checkpoint round trip, options."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TinyRegressor, make_trainer
from torch import nn
from torch.func import functional_call, grad, vmap

from lightning_dp import DPStrategy, PrivacyEngine
from lightning_dp.checks.leave_half_out import LEAVE_HALF_OUT_FORWARDS
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.hf import PrivacyArguments
from lightning_dp.optim.momentum import PerSampleMomentum, momentum_weights

VOCAB, DIM, SEQ, BATCH = 11, 6, 5, 7


class TiedModel(nn.Module):
    """Embedding -> Conv1d -> Linear -> head tied to the embedding (a parameter used by two layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.conv = nn.Conv1d(DIM, DIM, 3, padding=1)
        self.lin = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2).tanh()
        return self.head(self.lin(h).tanh())


def per_sample_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)


def oracle_grads(model: nn.Module, params: dict[str, torch.Tensor], ids, targets) -> torch.Tensor:
    """Per-sample gradients at ``params``, flattened over all parameters: ``[B, d]`` (torch.func)."""

    def loss_one(p, x, y):
        return per_sample_loss(lambda z: functional_call(model, p, (z,)), x[None], y[None])[0]

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, ids, targets)
    return torch.cat([grads[name].flatten(1) for name in params], 1)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


_CASES = [(clipping, k, steps) for clipping in ("flat", "ghost") for k, steps in ((1, 2), (2, 3), (4, 2), (4, 5))] + [
    (clipping, k, steps) for clipping in ("fgc", "mixed") for k, steps in ((1, 1), (4, 5))
]


@pytest.mark.parametrize(("clipping", "k", "steps"), _CASES)
def test_clipped_momentum_matches_torch_func(clipping, k, steps):
    torch.manual_seed(0)
    model = TiedModel().double()
    ids, targets = _batch()
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0)
    momentum = PerSampleMomentum(k, 0.7)
    momentum.bind(clipper)
    params = dict(model.named_parameters())
    iterates = []  # newest first, as the oracle sees them
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):  # simulated optimizer steps: record x_t, then move to x_{t+1}
        momentum.record()
        iterates.insert(0, {n: p.detach().clone() for n, p in params.items()})
        with torch.no_grad():
            for p in params.values():
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    used = iterates[: k - 1]
    weights = momentum_weights(len(used), 0.7)
    current = {n: p.detach() for n, p in params.items()}
    momentum_grad = sum(
        w * oracle_grads(model, it, ids, targets) for w, it in zip(weights, [current, *used], strict=True)
    )
    norms = momentum_grad.norm(dim=1)
    clip = float(norms.median())  # about half the examples clipped
    clipper.max_grad_norm = clip
    expected = ((clip / (norms + 1e-6)).clamp(max=1.0)[:, None] * momentum_grad).sum(0)

    momentum.add_past_iterates(clipper, lambda: per_sample_loss(model, ids, targets))
    got_norms = clipper.backward(per_sample_loss(model, ids, targets), weight=momentum.current_weight)

    torch.testing.assert_close(got_norms, norms, rtol=1e-9, atol=1e-12)
    got = torch.cat([p.grad.flatten() for p in params.values()])
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    for name, p in params.items():  # the parameters are back at the current iterate
        assert torch.equal(p.detach(), current[name])
    assert len(momentum.history) == min(k - 1, steps)


def test_randomized_engine_runs_with_momentum():
    torch.manual_seed(0)
    model = TiedModel().double()
    ids, targets = _batch()
    gen = torch.Generator().manual_seed(0)
    clipper = PerSampleClipper(model, clipping="hutchpp", max_grad_norm=1.0, generator_for=lambda device: gen)
    momentum = PerSampleMomentum(3, 0.5)
    momentum.bind(clipper)
    momentum.record()
    momentum.add_past_iterates(clipper, lambda: per_sample_loss(model, ids, targets))
    norms = clipper.backward(per_sample_loss(model, ids, targets), weight=momentum.current_weight)
    assert norms.shape == (BATCH,) and torch.isfinite(norms).all()


def test_empty_batch_and_frozen_parameters():
    model = TiedModel().double()
    model.lin.requires_grad_(False)
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    momentum = PerSampleMomentum(3, 0.5)
    momentum.bind(clipper)
    momentum.record()
    assert [t.shape for t in momentum.history[0]] == [p.shape for p in clipper.trainable_parameters]
    assert len(momentum.history[0]) == 4  # emb (= head) weight, conv weight and bias, head bias; not lin
    ids = torch.zeros(0, SEQ, dtype=torch.long)
    momentum.add_past_iterates(clipper, lambda: per_sample_loss(model, ids, ids))
    norms = clipper.backward(per_sample_loss(model, ids, ids), weight=momentum.current_weight)
    assert norms.shape == (0,)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in clipper.trainable_parameters)
    assert model.lin.weight.grad is None


def test_weights_follow_the_paper():
    assert momentum_weights(0, 0.9) == [1.0]
    w = momentum_weights(2, 0.5)
    assert w == pytest.approx([1 / 1.75, 0.5 / 1.75, 0.25 / 1.75])
    assert momentum_weights(3, 1.0) == pytest.approx([0.25] * 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"momentum_length": 0}, "momentum_length must be an integer >= 1"),
        ({"momentum_length": 2.0}, "momentum_length must be an integer >= 1"),
        ({"momentum_beta": 0.0}, r"momentum_beta must lie in \(0, 1\]"),
        ({"momentum_beta": 1.5}, r"momentum_beta must lie in \(0, 1\]"),
    ],
)
def test_bad_options_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, **kwargs)
    with pytest.raises(ValueError, match=match):
        DPStrategy(noise_multiplier=1.0, **kwargs)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_hf_trainer_runs_momentum_and_checkpoints_its_iterates(tmp_path):
    pytest.importorskip("transformers")
    from hf_helpers import make_trainer as make_hf_trainer
    from hf_helpers import tiny_gpt2

    from lightning_dp.hf.callbacks import TENSOR_STATE_NAMES

    def privacy(k=3):
        return PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=0, momentum_length=k)

    args = dict(max_steps=3, save_strategy="steps", save_steps=3)
    first = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy(), args=args)
    calls = []
    forward = first.compute_per_example_loss
    first.compute_per_example_loss = lambda *a, **k: calls.append(1) or forward(*a, **k)
    first.train()
    # forwards per step: 1, 2, 3 (the stored iterates fill up to k - 1 = 2), plus the row check's 2 and the guard's
    # leave-half-out forwards on the first non-empty batch; empty Poisson batches have none
    assert 5 + LEAVE_HALF_OUT_FORWARDS <= len(calls) <= 8 + LEAVE_HALF_OUT_FORWARDS
    history = first.privacy_engine.momentum.history
    assert len(history) == 2
    saved = torch.load(tmp_path / "checkpoint-3" / TENSOR_STATE_NAMES["momentum"], weights_only=True)
    assert len(saved["iterates"]) == 2
    for iterate, live in zip(saved["iterates"], history, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(iterate.values(), live, strict=True))
    resumed = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy(), args={**args, "max_steps": 4})
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.privacy_engine.steps == 4 and len(resumed.privacy_engine.momentum.history) == 2
    other = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy(k=2), args={**args, "max_steps": 4})
    with pytest.raises(ValueError, match="momentum_length=3"):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_k1_equals_dpsgd_exactly():
    torch.manual_seed(0)
    plain, momentum = TinyRegressor(), TinyRegressor()
    momentum.load_state_dict(plain.state_dict())
    make_trainer(DPStrategy(noise_multiplier=0.5, seed=3), max_steps=5).fit(plain)
    strategy = DPStrategy(noise_multiplier=0.5, seed=3, momentum_length=1, momentum_beta=0.3)
    make_trainer(strategy, max_steps=5).fit(momentum)
    for a, b in zip(_params(plain), _params(momentum), strict=True):
        assert torch.equal(a, b)
    assert "momentum" not in strategy.privacy_engine.state_dict()


def _strategy(k: int) -> DPStrategy:
    return DPStrategy(noise_multiplier=0.0, max_grad_norm=0.3, poisson_sampling=False, momentum_length=k)


def test_snapshots_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    full, first = TinyRegressor(), TinyRegressor()
    first.load_state_dict(full.state_dict())
    initial = full.state_dict()
    make_trainer(_strategy(3), max_epochs=3).fit(full)  # 8 batches per epoch

    trainer = make_trainer(_strategy(3), max_epochs=1)
    trainer.fit(first)
    assert len(trainer.strategy.privacy_engine.momentum.history) == 2
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = TinyRegressor()
    strategy = _strategy(3)
    make_trainer(strategy, max_epochs=3).fit(resumed, ckpt_path=tmp_path / "epoch1.ckpt")
    for a, b in zip(_params(full), _params(resumed), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    plain = TinyRegressor()  # the momentum changes the trajectory (the test above is not vacuous)
    plain.load_state_dict(initial)
    make_trainer(_strategy(1), max_epochs=3).fit(plain)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(_params(full), _params(plain), strict=True))

    with pytest.raises(ValueError, match="momentum_length=3, momentum_beta=0.9; this run uses 2"):
        make_trainer(_strategy(2), max_epochs=3).fit(TinyRegressor(), ckpt_path=tmp_path / "epoch1.ckpt")
    saved = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    iterate = saved["lightning_dp"]["momentum"]["iterates"][0]
    iterate[next(iter(iterate))] = [0.0]  # not a tensor
    torch.save(saved, tmp_path / "corrupted.ckpt")
    strategy = _strategy(3)
    with pytest.raises(ValueError, match="per-sample momentum state is corrupted"):
        make_trainer(strategy, max_epochs=3).fit(TinyRegressor(), ckpt_path=tmp_path / "corrupted.ckpt")
    assert strategy.privacy_engine.steps == 0  # refused before the ledger changed


def test_accumulation_equals_large_batch_with_momentum():
    torch.manual_seed(0)
    big, small = TinyRegressor(batch_size=16), TinyRegressor(batch_size=8)
    small.load_state_dict(big.state_dict())
    make_trainer(_strategy(3), max_steps=4).fit(big)
    make_trainer(_strategy(3), max_steps=4, accumulate_grad_batches=2).fit(small)
    for a, b in zip(_params(big), _params(small), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class DropoutRegressor(TinyRegressor):
    def __init__(self) -> None:
        super().__init__(lr=0.3)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss.mean())
        return loss


def test_dp_strategy_with_momentum_trains():
    torch.manual_seed(0)
    module = DropoutRegressor()
    x, y = module.data.tensors
    with torch.no_grad():
        before = float(F.mse_loss(module.net.eval()(x), y))
    module.train()
    strategy = DPStrategy(noise_multiplier=0.3, max_grad_norm=1.0, seed=0, momentum_length=2, momentum_beta=0.9)
    make_trainer(strategy, max_epochs=6).fit(module)
    with torch.no_grad():
        after = float(F.mse_loss(module.net.eval()(x), y))
    assert after < 0.5 * before
    assert strategy.privacy_engine.epsilon() > 0
    assert len(strategy.privacy_engine.momentum.history) == 1


class _RowShuffler(TinyRegressor):
    """A step that permutes its rows with numpy: each run of it on one batch puts other examples in other rows."""

    rng = np.random.default_rng(0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        order = torch.as_tensor(self.rng.permutation(len(x)))
        return ((self.net(x[order]) - y[order]) ** 2).squeeze(-1)


def test_a_step_that_reorders_rows_outside_torch_rng_is_rejected():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, momentum_length=2)
    with pytest.raises(ValueError, match="same example in the same row"):
        make_trainer(strategy, max_steps=2).fit(_RowShuffler())


def test_abandoned_past_reruns_leave_the_current_iterate_with_weight_one():
    model = nn.Linear(3, 1)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    momentum = PerSampleMomentum(3, 0.5)
    momentum.bind(clipper)
    momentum.record()
    momentum.record()
    assert momentum.current_weight == pytest.approx(1 / 1.75)
    x = torch.randn(4, 3)
    momentum.add_past_iterates(clipper, lambda: None)  # the step skips this batch at the past iterates
    assert momentum.current_weight == 1.0
    momentum.add_past_iterates(clipper, lambda: model(x).squeeze(-1) ** 2)
    assert momentum.current_weight == pytest.approx(1 / 1.75)
    clipper.discard_past_iterates()


def test_stored_iterates_follow_the_model_to_another_dtype():
    model = nn.Linear(3, 1)
    momentum = PerSampleMomentum(2, 0.9)
    momentum.bind(PerSampleClipper(model, max_grad_norm=1.0))
    momentum.record()
    model.double()
    momentum.bind(PerSampleClipper(model, max_grad_norm=1.0))
    assert all(value.dtype == torch.float64 for value in momentum.history[0])


def test_iterates_are_stored_at_the_dp_updates_only():
    """The iterate is stored right before each update the DPOptimizer takes; a step() of the user's optimizer alone
    (torch's sharded state helpers run one at learning rate 0 to create a missing optimizer state, at checkpoint
    saves and loads) stores nothing."""
    model = nn.Linear(3, 1)
    engine = PrivacyEngine(max_grad_norm=1.0, noise_multiplier=0.0, momentum_length=3, check_batch_independence=False)
    engine.attach(model)
    engine.prepare(num_samples=4, sample_rate=1.0, total_steps=2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = engine.wrap_optimizer(sgd)
    before = [p.detach().clone() for p in model.parameters()]
    sgd.step()  # as torch.distributed.checkpoint.state_dict's _init_optim_state does
    assert len(engine.momentum.history) == 0
    x = torch.randn(4, 3)
    engine.clip(model(x).squeeze(1))
    optimizer.step()
    (stored,) = engine.momentum.history
    assert all(torch.equal(a, b) for a, b in zip(stored, before, strict=True))
