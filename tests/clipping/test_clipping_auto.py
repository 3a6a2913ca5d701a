"""``clipping="auto"``, the default engine: resolved once by the mechanism's clipping norm (``mixed`` for l2,
``flat`` for l1), named with its reason in the start-up block, reported by its resolved name, and training exactly
as ``flat`` does wherever ``flat`` trains (every layer family, per-sample momentum, l1 noise)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import TinyRegressor, make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyEngine
from lightning_dp.clipping import AUTO, ENGINES, auto_engine
from lightning_dp.config import PrivacyConfig
from lightning_dp.hf import PrivacyArguments
from lightning_dp.lightning.callbacks import tracker_params
from lightning_dp.mechanisms import make_mechanism

L2_REASON = "clipping = 'mixed' with book-keeping (auto: the fastest exact engine for an l2 mechanism)"
NOISE = {
    "gaussian": {"noise_multiplier": 1.0},
    "laplace": {"noise": "laplace", "noise_params": {"noise_scale": 1.0}},
    "laplace-advanced": {"noise": "laplace-advanced", "noise_params": {"noise_scale": 1.0}},
    "lap2": {"noise": "lap2", "noise_params": {"noise_scale": 1.0}},
    "plrv": {"noise": "plrv", "noise_params": {"gamma_shape": 2.0, "gamma_scale": 0.5}},
}


@pytest.mark.parametrize("noise", sorted(NOISE))
def test_auto_is_the_default_and_resolves_by_the_clipping_norm(noise: str) -> None:
    expected = "flat" if noise == "laplace" else "mixed"  # l1 clipping: flat is the only engine that supports it
    config = PrivacyConfig(**NOISE[noise])
    assert config.clipping == AUTO and AUTO not in ENGINES
    assert config.resolved_clipping()[0] == expected and not config.randomized_clipping
    assert PrivacyEngine(config).clipping == expected
    assert DPStrategy(**NOISE[noise]).privacy_engine.clipping == expected
    assert PrivacyArguments(**NOISE[noise]).make_privacy_engine().clipping == expected


def test_a_mechanism_instance_resolves_by_its_own_clipping_norm() -> None:
    laplace = make_mechanism("laplace", noise_scale=1.0, max_grad_norm=1.0)
    expected = ("flat", "the only engine that clips in l1 norm, for an l1 mechanism")
    assert PrivacyConfig(noise=laplace).resolved_clipping() == auto_engine(1) == expected
    with pytest.raises(ValueError, match="norm must be 1 or 2"):
        auto_engine(3)


def test_a_named_engine_is_kept_and_adds_no_default() -> None:
    engine = _prepared(clipping="ghost")
    assert engine.clipping == "ghost" and not any(line.startswith("clipping") for line in engine.defaults_applied)
    with pytest.raises(ValueError, match=r"one of \('auto', .*got 'atuo' \(did you mean 'auto'\?\)"):
        PrivacyConfig(noise_multiplier=1.0, clipping="atuo")


def _prepared(**options) -> PrivacyEngine:
    engine = PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, **options)
    engine.attach(TinyRegressor())
    engine.prepare(num_samples=64, sample_rate=0.125, total_steps=None)
    return engine


def test_the_start_up_block_summary_and_trackers_name_the_resolved_engine() -> None:
    engine = _prepared()
    lines = engine.startup_lines()
    assert "  clipping                mixed" in lines
    assert lines[-1].strip() == L2_REASON  # the last default applied, after the accountant's
    engine.prepare(num_samples=64, sample_rate=0.125, total_steps=None)  # a second fit of the same strategy
    assert engine.defaults_applied.count(L2_REASON) == 1
    engine.record_step()
    assert engine.summary()["clipping"] == "mixed" and tracker_params(engine.summary())["dp/clipping"] == "mixed"


class EveryFamily(pl.LightningModule):
    """A tiny language model through every kind of layer the clipper handles: an embedding tied to the output head
    (cross terms), a convolution, a norm layer, an LSTM and a multi-head attention (both swapped for hooked
    proxies), and a linear layer; per-sample mean next-token cross-entropy."""

    def __init__(self, vocab: int = 12, width: int = 8, n: int = 32, seq: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.norm = nn.LayerNorm(width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.data = TensorDataset(torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1)))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        h = self.embed(ids)
        h = self.norm(h + self.conv(h.transpose(1, 2)).transpose(1, 2))
        h, _ = self.lstm(h)
        h = h + self.attention(h, h, h, need_weights=False)[0]
        logits = self.head(self.mix(torch.tanh(h)))
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        return losses.mean(1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


SETUPS = {
    "gaussian": ({"noise_multiplier": 1.0}, "mixed"),
    "lap2": (NOISE["lap2"], "mixed"),
    "laplace (l1)": (NOISE["laplace"], "flat"),
    "per-sample momentum": ({"noise_multiplier": 1.0, "momentum_length": 2}, "mixed"),
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_auto_trains_as_flat_does(setup: str) -> None:
    """Same seed, same Poisson batches and noise: the default engine's parameters after 3 steps are flat's up to
    float rounding (an exact engine), with C small enough that every example is clipped."""
    options, expected = SETUPS[setup]
    trained = {}
    for clipping in (AUTO, "flat"):
        strategy = DPStrategy(max_grad_norm=0.05, seed=0, clipping=clipping, **options)
        module = EveryFamily()
        make_trainer(strategy, max_steps=3).fit(module)
        assert strategy.privacy_engine.clipping == (expected if clipping == AUTO else "flat")
        trained[clipping] = {name: p.detach().clone() for name, p in module.named_parameters()}
    initial = dict(EveryFamily().named_parameters())
    assert trained[AUTO].keys() == trained["flat"].keys() == initial.keys()
    for name, value in trained[AUTO].items():
        assert not torch.equal(value, initial[name]), name  # it trained
        torch.testing.assert_close(value, trained["flat"][name], rtol=1e-4, atol=1e-5, msg=name)
