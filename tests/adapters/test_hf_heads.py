"""DPTrainer's built-in per-example losses for every standard HF head (image, audio, sequence and token
classification, seq2seq LMs on text and on audio features), found from what the model is; each tiny model trains two
DP steps with the first-step checks on, and its per-example losses equal the model's own loss on each example alone."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_helpers import make_trainer, trainable_snapshot  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset, default_collate  # noqa: E402

from lightning_dp.hf.losses import head_kind  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

VOCAB = 50


class Rows(Dataset):
    """``n`` examples ``{name: make(i, generator)}``."""

    def __init__(self, n: int, **make: Any) -> None:
        gen = torch.Generator().manual_seed(0)
        self.rows = [{name: fn(i, gen) for name, fn in make.items()} for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def tiny_vit(num_labels: int) -> transformers.ViTForImageClassification:
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        num_labels=num_labels,
    )
    return transformers.ViTForImageClassification(config)


def tiny_wav2vec2() -> transformers.Wav2Vec2ForSequenceClassification:
    """Its positional convolution is frozen (the clipper refuses its weight-norm parametrization, whose input has no
    example dimension). Its feature encoder sets ``requires_grad`` on a view of ``input_values`` in training."""
    config = transformers.Wav2Vec2Config(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        conv_dim=(8, 8),
        conv_stride=(4, 2),
        conv_kernel=(4, 2),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer",
        mask_time_prob=0.0,  # SpecAugment draws from numpy's RNG, which the checks do not restore
        classifier_proj_size=8,
        num_labels=3,
    )
    model = transformers.Wav2Vec2ForSequenceClassification(config)
    model.wav2vec2.encoder.pos_conv_embed.requires_grad_(False)
    return model


def tiny_ast() -> transformers.ASTForAudioClassification:
    config = transformers.ASTConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        patch_size=4,
        frequency_stride=4,
        time_stride=4,
        max_length=16,
        num_mel_bins=8,
        num_labels=3,
    )
    return transformers.ASTForAudioClassification(config)


def tiny_bert_tagger() -> transformers.BertForTokenClassification:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=3,
    )
    return transformers.BertForTokenClassification(config)


def tiny_bart() -> transformers.BartForConditionalGeneration:
    """Its learned positional embeddings are frozen (looked up with positions shared by the batch, ``[1, T]``, which
    the clipper refuses)."""
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=16,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    model = transformers.BartForConditionalGeneration(config)
    model.model.encoder.embed_positions.requires_grad_(False)
    model.model.decoder.embed_positions.requires_grad_(False)
    return model


def tiny_whisper() -> transformers.WhisperForConditionalGeneration:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_source_positions=8,
        max_target_positions=16,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    return transformers.WhisperForConditionalGeneration(config)


def _image(i: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(3, 8, 8, generator=gen)


def _class(i: int, gen: torch.Generator) -> torch.Tensor:
    return torch.tensor(i % 3)


def _tokens(length: int, low: int = 3):
    return lambda i, gen: torch.randint(low, VOCAB, (length,), generator=gen)


def _padded_tags(i: int, gen: torch.Generator) -> torch.Tensor:
    tags = torch.randint(0, 3, (8,), generator=gen)
    tags[8 - i % 3 :] = -100  # 0 to 2 unlabelled positions
    return tags


def _padded_targets(i: int, gen: torch.Generator) -> torch.Tensor:
    targets = torch.randint(3, VOCAB, (6,), generator=gen)
    targets[6 - i % 3 :] = -100
    return targets


#: id -> (model factory, head, dataset columns).
HEADS: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "vit-single-label": (
        lambda: tiny_vit(3),
        "image_classification",
        dict(pixel_values=_image, labels=_class),
    ),
    "vit-multi-label": (
        lambda: tiny_vit(3),
        "image_classification",
        dict(pixel_values=_image, labels=lambda i, gen: (torch.rand(3, generator=gen) > 0.5).float()),
    ),
    "vit-regression": (
        lambda: tiny_vit(1),
        "image_classification",
        dict(pixel_values=_image, labels=lambda i, gen: torch.randn((), generator=gen)),
    ),
    "wav2vec2-audio": (
        tiny_wav2vec2,
        "audio_classification",
        dict(input_values=lambda i, gen: torch.randn(64, generator=gen), labels=_class),
    ),
    "ast-audio": (
        tiny_ast,
        "audio_classification",
        dict(input_values=lambda i, gen: torch.randn(16, 8, generator=gen), labels=_class),
    ),
    "bert-tokens": (tiny_bert_tagger, "token_classification", dict(input_ids=_tokens(8, 1), labels=_padded_tags)),
    "bart-seq2seq": (tiny_bart, "seq2seq_lm", dict(input_ids=_tokens(8), labels=_padded_targets)),
    "whisper-seq2seq": (
        tiny_whisper,
        "seq2seq_lm",
        dict(input_features=lambda i, gen: torch.randn(8, 16, generator=gen), labels=_padded_targets),
    ),
}


@pytest.mark.parametrize("case", list(HEADS))
def test_each_head_trains_with_per_example_losses_equal_to_the_models_own(case, tmp_path) -> None:
    factory, kind, columns = HEADS[case]
    torch.manual_seed(0)
    model = factory()
    assert head_kind(model) == kind
    dataset = Rows(16, **columns)
    trainer = make_trainer(model, tmp_path, dataset, args=dict(max_steps=2))
    model.eval()  # no dropout: the same forward for the batch and for each example alone
    batch = default_collate([dataset[i] for i in range(4)])
    per_example = trainer.compute_per_example_loss(model, batch)
    assert per_example.shape == (4,)
    for i in range(4):
        alone = {name: value[i : i + 1] for name, value in batch.items()}
        torch.testing.assert_close(per_example[i], model(**alone).loss, rtol=1e-5, atol=1e-6, msg=case)
    before = trainable_snapshot(model)
    trainer.train()  # the first step runs the batch-independence and leave-half-out checks
    assert trainer.privacy_engine.steps == 2
    for name, param in model.named_parameters():
        assert torch.equal(before[name], param) == (not param.requires_grad), name


class MyNetForImageClassification(nn.Module):
    """A class in no HF mapping, known by its name's suffix."""


class DecoderOnlyForConditionalGeneration(nn.Module):
    def forward(self, input_ids: torch.Tensor) -> Any: ...


class EncoderDecoderForConditionalGeneration(nn.Module):
    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> Any: ...


def test_head_kind_from_the_class_name_and_the_model_structure() -> None:
    assert head_kind(MyNetForImageClassification()) == "image_classification"
    assert head_kind(type("Sub", (transformers.ViTForImageClassification,), {})(tiny_vit(2).config)) == (
        "image_classification"
    )
    # an LM is seq2seq when it is an encoder-decoder (its config; without one, its forward's decoder_input_ids)
    assert head_kind(DecoderOnlyForConditionalGeneration()) == "causal_lm"
    assert head_kind(EncoderDecoderForConditionalGeneration()) == "seq2seq_lm"
    bart_decoder = transformers.BartForCausalLM(tiny_bart().config)  # BART's config says encoder-decoder
    assert head_kind(bart_decoder) == "causal_lm"


def test_an_unknown_head_fails_at_construction_in_one_line(tmp_path) -> None:
    qa = transformers.BertForQuestionAnswering(tiny_bert_tagger().config)
    with pytest.raises(ValueError, match="BertForQuestionAnswering.*override compute_per_example_loss") as raised:
        make_trainer(qa, tmp_path)
    assert "\n" not in str(raised.value)


def test_a_token_head_with_logits_not_aligned_to_its_labels_fails_in_one_line(tmp_path) -> None:
    model = tiny_bert_tagger()
    trainer = make_trainer(model, tmp_path, Rows(4, input_ids=_tokens(8, 1), labels=_padded_tags))
    batch = default_collate([trainer.train_dataset[i] for i in range(2)])
    batch["labels"] = batch["labels"][:, :5]
    with pytest.raises(ValueError, match=r"logits \[2, 8, 3\] and labels \[2, 5\].*compute_per_example_loss"):
        trainer.compute_per_example_loss(model, batch)
