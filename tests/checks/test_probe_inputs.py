"""The attach probe's inputs (checks/probe_inputs.py): an HF model whose ``dummy_inputs`` it does not take (vision,
audio) gets inputs built from its config, an encoder-decoder gets decoder inputs, so the probe runs for them and what
only a forward shows is refused when the trainer is built; the inputs come from a generator of their own; a model
that cannot be probed says so once at INFO."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lightning_dp.checks.attach_probe import probe_at_attach
from lightning_dp.checks.probe_inputs import example_inputs
from lightning_dp.clipping import PerSampleClipper

transformers = pytest.importorskip("transformers")
from hf_helpers import tiny_swin  # noqa: E402 (after the skip: it imports transformers)

VISION: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=3,
)
SEQ2SEQ: dict[str, Any] = dict(
    vocab_size=100,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=32,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
)


def _swin_output_projections_frozen() -> nn.Module:
    model = tiny_swin()
    for name, param in model.named_parameters():
        param.requires_grad_("attention.o_proj" not in name)
    return model


def _whisper() -> nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=100,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "vit": lambda: transformers.ViTForImageClassification(
        transformers.ViTConfig(image_size=16, patch_size=4, **VISION)
    ),
    "deit": lambda: transformers.DeiTForImageClassification(
        transformers.DeiTConfig(image_size=16, patch_size=4, **VISION)
    ),
    "convnext": lambda: transformers.ConvNextForImageClassification(
        transformers.ConvNextConfig(
            image_size=32, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
        )
    ),
    "swin, attention output projections frozen": _swin_output_projections_frozen,
    # without SpecAugment masking: the masked_spec_embed it adds is refused (read outside a family's forward)
    "wav2vec2": lambda: transformers.Wav2Vec2ForSequenceClassification(
        transformers.Wav2Vec2Config(
            vocab_size=20,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            conv_dim=(8, 8),
            conv_kernel=(10, 3),
            conv_stride=(5, 2),
            num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            feat_proj_dropout=0.0,
            layerdrop=0.0,
            mask_time_prob=0.0,
            num_labels=3,
        )
    ),
    "whisper": _whisper,
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=100,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            pad_token_id=0,
            decoder_start_token_id=0,
            eos_token_id=1,
        )
    ),
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(**SEQ2SEQ)),
    "marian": lambda: transformers.MarianMTModel(transformers.MarianConfig(**SEQ2SEQ)),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_the_probe_runs_on_vision_audio_and_encoder_decoder_models(name: str) -> None:
    model = build(name)
    assert probe_at_attach(model, PerSampleClipper(model, max_grad_norm=1.0))
    assert all(p.grad is None for p in model.parameters())


def test_built_inputs_follow_the_config() -> None:
    assert example_inputs(build("vit"))["pixel_values"].shape == (3, 3, 16, 16)
    assert example_inputs(build("convnext"))["pixel_values"].shape == (3, 3, 32, 32)
    # convolutions (kernel 10 stride 5, kernel 3 stride 2) map 330 = ((32 - 1) 2 + 3 - 1) 5 + 10 samples to 32 frames
    assert example_inputs(build("wav2vec2"))["input_values"].shape == (3, 330)
    whisper = example_inputs(build("whisper"))
    assert whisper["input_features"].shape == (3, 8, 32)
    assert whisper["decoder_input_ids"].shape == (3, 4) and (whisper["decoder_input_ids"][:, 0] == 1).all()
    bart = example_inputs(build("bart"))  # the model's own dummy_inputs, with its ids shifted right for the decoder
    assert torch.equal(bart["decoder_input_ids"][:, 1:], bart["input_ids"][:, :-1])
    assert (bart["decoder_input_ids"][:, 0] == 2).all()
    assert set(example_inputs(build("t5"))) == {"input_ids", "decoder_input_ids", "decoder_attention_mask"}


def test_built_inputs_come_from_a_generator_of_their_own() -> None:
    model = build("vit")
    state = torch.random.get_rng_state()
    first, second = example_inputs(model), example_inputs(model)
    assert torch.equal(torch.random.get_rng_state(), state), "the global RNG is not drawn from"
    assert torch.equal(first["pixel_values"], second["pixel_values"])


def test_a_lightning_example_input_array_comes_first() -> None:
    model = build("vit")
    model.example_input_array = {"pixel_values": torch.zeros(2, 3, 16, 16)}
    assert example_inputs(model) is model.example_input_array


def test_swin_is_probed_when_the_trainer_is_built(tmp_path, caplog) -> None:
    """Its window attention's output projections are enclosed by their layers at attach (checks/enclosing.py)."""
    from hf_helpers import make_trainer

    from lightning_dp.hf import PrivacyArguments

    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        make_trainer(tiny_swin(), tmp_path, privacy=PrivacyArguments(noise_multiplier=1.0, dp_seed=0))
    assert "'swin.encoder.layers.0.blocks.0' (SwinLayer" in caplog.text
    assert "enclosing 'attention.o_proj'" in caplog.text


class Unprobeable(nn.Module):
    """An HF-like model whose main input the config does not describe."""

    main_input_name = "input_features"

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.proj = nn.Linear(4, 2)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.proj(input_features)


def test_a_model_that_cannot_be_probed_says_so_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    model = Unprobeable()
    assert example_inputs(model) is None
    with caplog.at_level(logging.DEBUG, logger="lightning_dp"):
        assert not probe_at_attach(model, PerSampleClipper(model, max_grad_norm=1.0))
    infos = [
        r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "first training step" in r.getMessage()
    ]
    assert len(infos) == 1 and "example_input_array" in infos[0]


class NumpyDraws(nn.Module):
    """Draws from numpy's global RNG in its forward (as HF audio models' SpecAugment and layer drop do)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 2)
        self.example_input_array = torch.randn(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * float(np.random.rand() >= 0.0)  # noqa: NPY002 (the global RNG, on purpose)


def test_the_probe_restores_numpy_and_python_rngs() -> None:
    import random

    model = NumpyDraws()
    numpy_state, python_state = np.random.get_state()[1].copy(), random.getstate()  # noqa: NPY002
    assert probe_at_attach(model, PerSampleClipper(model, max_grad_norm=1.0))
    assert np.array_equal(np.random.get_state()[1], numpy_state) and random.getstate() == python_state  # noqa: NPY002


class AuxLossFirst(nn.Module):
    """Returns a scalar auxiliary loss before the per-example output (as MoE heads with router losses do)."""

    def __init__(self, sequence_first: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 2)
        self.sequence_first = sequence_first
        self.example_input_array = torch.randn(3, 5, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.proj(x)
        return out.square().mean(), out.transpose(0, 1) if self.sequence_first else out


def test_the_probe_clips_the_first_output_with_one_row_per_example() -> None:
    model = AuxLossFirst()
    assert probe_at_attach(model, PerSampleClipper(model, max_grad_norm=1.0))
    model = AuxLossFirst(sequence_first=True)  # [T, B, ...]: no output has the examples' rows, not probed
    assert not probe_at_attach(model, PerSampleClipper(model, max_grad_norm=1.0))
