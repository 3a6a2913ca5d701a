"""The exact fallback through both adapters under every engine: a GPT-2 whose final norm is a module of its own
parameters (no family) trains through DPTrainer, and the fallback's modules are named at attach."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from hf_helpers import VOCAB, make_trainer, tiny_gpt2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.clipping import ENGINES, UnsupportedModuleError
from lightning_dp.hf import PrivacyArguments


class ScaledTanhNorm(nn.Module):
    """``tanh(x) * weight + bias`` with its own parameters: no layer family matches it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.weight + self.bias


@pytest.mark.parametrize("clipping", ENGINES)
def test_a_module_of_its_own_parameters_trains_through_dp_trainer(clipping: str, tmp_path, caplog) -> None:
    model = tiny_gpt2()
    model.transformer.ln_f = ScaledTanhNorm(model.config.n_embd)
    before = model.transformer.ln_f.weight.detach().clone()
    privacy = PrivacyArguments(noise_multiplier=1.0, clipping=clipping, dp_seed=0)
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        trainer = make_trainer(model, tmp_path, privacy=privacy, args={"max_steps": 2})
        trainer.train()
    assert trainer.privacy_engine.steps == 2 and trainer.privacy_engine.epsilon() > 0
    assert not torch.equal(model.transformer.ln_f.weight, before)
    assert any("'transformer.ln_f' (ScaledTanhNorm" in r.getMessage() for r in caplog.records)


class MixesUnderAutocast(ScaledTanhNorm):
    """Per-sample without autocast; under CPU autocast it adds half the batch mean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + 0.5 * y.mean(0) if torch.is_autocast_enabled("cpu") else y


def _raised_by_the_probe(excinfo: pytest.ExceptionInfo) -> bool:  # at attach, not at a training step
    return any(entry.name == "probe_at_attach" for entry in excinfo.traceback)


def test_dp_trainer_probes_under_its_autocast_and_refuses_at_construction(tmp_path) -> None:
    model = tiny_gpt2()
    model.transformer.ln_f = MixesUnderAutocast(model.config.n_embd)
    with pytest.raises(UnsupportedModuleError, match="an operation mixes examples of the batch") as e:
        make_trainer(model, tmp_path, privacy=PrivacyArguments(noise_multiplier=1.0), args={"bf16": True})
    assert _raised_by_the_probe(e)


class LanguageModel(pl.LightningModule):
    """A causal LM's per-example mean token loss on 8 random sequences in batches of 4, SGD."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        logits = self.model(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(len(ids), -1).mean(1)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_dp_strategy_probes_under_its_autocast_and_refuses_before_the_first_step() -> None:
    from helpers import make_trainer as make_lightning_trainer

    from lightning_dp import DPStrategy

    model = tiny_gpt2()
    model.transformer.ln_f = MixesUnderAutocast(model.config.n_embd)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    trainer = make_lightning_trainer(strategy, max_steps=1, precision="bf16-mixed")
    with pytest.raises(UnsupportedModuleError, match="an operation mixes examples of the batch") as e:
        trainer.fit(LanguageModel(model))
    assert _raised_by_the_probe(e) and strategy.privacy_engine.steps == 0


class Images(torch.utils.data.Dataset):
    """8 random 16 x 16 images with 3 classes (the tiny Swin's inputs)."""

    def __init__(self) -> None:
        self.pixels = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[i], "labels": torch.tensor(i % 3)}


@pytest.mark.parametrize("bf16", [False, True])
def test_an_enclosure_only_autocast_shows_is_used_in_training_through_dp_trainer(bf16: bool, tmp_path) -> None:
    """LoRA on Swin under bfloat16: peft casts the bfloat16 input of the adapters to their float32, a copy whose rows
    the hooks cannot trace to the windows that fold them. The probe runs under accelerate's autocast, finds it and
    gives the adapters their Swin layer's exact fallback, which training then uses (it was refused at the first step
    while the probe ran without autocast). In float32 the adapters need no enclosure."""
    import peft
    from hf_helpers import tiny_swin
    from transformers import TrainerCallback

    model = peft.get_peft_model(
        tiny_swin(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    )
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n}
    enclosed: list[dict] = []

    class Enclosures(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            enclosed.append(dict(trainer.privacy_engine.state.clipper.enclosing))

    privacy = PrivacyArguments(noise_multiplier=0.0, dp_seed=0)  # no noise: the adapters move by their clipped sum
    trainer = make_trainer(model, tmp_path, Images(), privacy=privacy, args={"bf16": bf16, "max_steps": 2})
    trainer.add_callback(Enclosures())
    trainer.train()
    assert trainer.privacy_engine.steps == 2
    adapters_enclosed = {
        "base_model.model.swin.encoder.layers.0.blocks.0": tuple(
            f"attention.{p}_proj.lora_{x}.default" for p in "qv" for x in "AB"
        )
    }
    assert enclosed == [adapters_enclosed if bf16 else {}] * 2
    assert all(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if n in adapters)
