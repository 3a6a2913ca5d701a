"""The model zoo: tiny configs (no weights) of the architectures people fine-tune, and tiny plain-torch models of
Opacus's per-sample layers, each with a batch of ``B`` examples and a per-sample loss ``[B]``.

HF models: hidden 32, 2 layers, vocab 100, dropout 0, eager attention; text batches carry an attention mask with
padding on example 1. Every entry's :attr:`ZooEntry.batch` is a dict of tensors with a leading batch dimension and
``labels``; :attr:`ZooEntry.loss` maps ``(forward, batch)`` to the per-example loss (mean token cross-entropy for
LMs, cross-entropy for classifiers, a nonlinear function of the output for the layer models).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

B = 3
SEQ = 8
VOCAB = 100
IMAGE = 16
#: a Swin classifier on IMAGE x IMAGE images whose first stage folds 4 windows per image into the rows (dropout and
#: drop path 0); tests/hf_helpers.py's tiny_swin builds it too.
TINY_SWIN: dict[str, Any] = dict(
    image_size=IMAGE,
    patch_size=2,
    num_channels=3,
    embed_dim=16,
    depths=[1, 1],
    num_heads=[2, 4],
    window_size=4,
    mlp_ratio=2.0,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    drop_path_rate=0.0,
    num_labels=3,
)
NUM_LABELS = 3

Task = Literal["causal_lm", "seq2seq_lm", "sequence_classification", "image_classification", "layer"]
Forward = Callable[..., Any]
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ZooEntry:
    """One architecture of the zoo.

    Attributes:
        name: the row's name.
        build: a fresh float32 model (seeded).
        batch: ``n -> {name: [n, ...]}``, the inputs and ``labels`` of ``n`` examples (seeded).
        loss: ``(forward, batch) -> [n]`` per-example losses; ``forward`` takes the model's keyword inputs.
        task: the head (the DPTrainer's loss), or ``"layer"`` for a plain-torch model.
        lora_targets: the modules peft's LoRA adapts (empty: no LoRA variant).
        lora_parameters: parameters peft's LoRA adapts as well (``LoraConfig(target_parameters=...)``: the fused
            experts' 3-D weights of the MoE models).
        eval_mode: check in eval mode (else train mode, dropout 0).
        float32_internals: the model computes parts in float32 even when float64 (Gemma's RMSNorm, T5LayerNorm):
            the clipped sum is compared at a float32 tolerance.
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[[Forward, Mapping[str, torch.Tensor]], torch.Tensor]
    task: Task
    lora_targets: tuple[str, ...] = ()
    eval_mode: bool = False
    float32_internals: bool = False
    lora_parameters: tuple[str, ...] = ()

    @property
    def is_hf(self) -> bool:
        return self.task != "layer"


# --------------------------------------------------------------------------------------------------------- inputs
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mask(n: int) -> torch.Tensor:
    """Ones, with the last 3 positions of example 1 padding (right padding)."""
    mask = torch.ones(n, SEQ, dtype=torch.long)
    if n > 1:
        mask[1, -3:] = 0
    return mask


def text_batch(n: int, seed: int = 0) -> Batch:
    """Token ids (from 2: 0 and 1 are pad/special), the padding mask and class labels."""
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=_gen(seed))
    return {"input_ids": ids, "attention_mask": _mask(n), "labels": torch.arange(n) % NUM_LABELS}


def lm_batch(n: int, seed: int = 0) -> Batch:
    """Token ids, the padding mask and LM labels (the ids, -100 at padding)."""
    batch = text_batch(n, seed)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def seq2seq_batch(n: int, seed: int = 0) -> Batch:
    """Encoder ids and mask, decoder inputs (labels shifted right after start token 0) and labels (-100 at padding)."""
    batch = text_batch(n, seed)
    labels = torch.randint(2, VOCAB, (n, SEQ - 2), generator=_gen(seed + 1))
    if n > 2:
        labels[2, -2:] = -100
    decoder = torch.cat([torch.zeros(n, 1, dtype=torch.long), labels[:, :-1].clamp(min=0)], dim=1)
    return {**batch, "decoder_input_ids": decoder, "labels": labels}


def image_batch(n: int, seed: int = 0) -> Batch:
    return {"pixel_values": torch.randn(n, 3, IMAGE, IMAGE, generator=_gen(seed)), "labels": torch.arange(n) % 3}


# --------------------------------------------------------------------------------------------------------- losses
def _model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean cross-entropy over each example's labelled tokens (labels -100 ignored)."""
    tokens = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    keep = labels != -100
    return (tokens * keep).sum(1) / keep.sum(1).clamp(min=1)


def causal_lm_loss(forward: Forward, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy per example."""
    logits = forward(**_model_inputs(batch)).logits
    return token_loss(logits[:, :-1], batch["labels"][:, 1:])


def seq2seq_loss(forward: Forward, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean decoder-token cross-entropy per example."""
    return token_loss(forward(**_model_inputs(batch)).logits, batch["labels"])


def classification_loss(forward: Forward, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the class logits per example."""
    return F.cross_entropy(forward(**_model_inputs(batch)).logits, batch["labels"], reduction="none")


def output_loss(forward: Forward, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A nonlinear per-example function of a plain model's output (``sum sin``)."""
    out = forward(batch["x"])
    return out.flatten(1).sin().sum(1)


# ----------------------------------------------------------------------------------------------------- HF configs
def _hf(config_name: str, model_name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    """A builder of ``transformers.<model_name>(transformers.<config_name>(**kwargs))``, eager attention."""

    def build() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**kwargs)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
        return getattr(transformers, model_name)(config)

    return build


TEXT: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
ENCODER: dict[str, Any] = dict(
    **TEXT,
    intermediate_size=64,
    max_position_embeddings=32,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=NUM_LABELS,
)
DECODER: dict[str, Any] = dict(
    **TEXT,
    intermediate_size=64,
    num_key_value_heads=2,
    max_position_embeddings=32,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
)
MOE: dict[str, Any] = dict(num_experts_per_tok=2)


def _encoder(name: str, config: str, model: str, lora: tuple[str, ...], **kwargs: Any) -> ZooEntry:
    return ZooEntry(
        name, _hf(config, model, **kwargs), text_batch, classification_loss, "sequence_classification", lora
    )


def _decoder(
    name: str,
    config: str,
    model: str,
    lora: tuple[str, ...],
    f32: bool = False,
    lora_parameters: tuple[str, ...] = (),
    **kwargs: Any,
) -> ZooEntry:
    build = _hf(config, model, **kwargs)
    return ZooEntry(name, build, lm_batch, causal_lm_loss, "causal_lm", lora, False, f32, lora_parameters)


QKV = ("query", "value")
QV_PROJ = ("q_proj", "v_proj")
#: the fused experts' weights, adapted by LoRA through ``target_parameters`` (clipping/layers/experts.py)
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

HF_ENTRIES: list[ZooEntry] = [
    # encoders: sequence classification
    _encoder("bert", "BertConfig", "BertForSequenceClassification", QKV, **ENCODER),
    _encoder("roberta", "RobertaConfig", "RobertaForSequenceClassification", QKV, **ENCODER, pad_token_id=1),
    _encoder(
        "distilbert",
        "DistilBertConfig",
        "DistilBertForSequenceClassification",
        ("q_lin", "v_lin"),
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
        num_labels=NUM_LABELS,
    ),
    _encoder(
        "deberta-v2",
        "DebertaV2Config",
        "DebertaV2ForSequenceClassification",
        ("query_proj", "value_proj"),
        **ENCODER,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=16,
        pos_att_type=["p2c", "c2p"],
        pooler_dropout=0.0,
        pooler_hidden_size=32,
    ),
    _encoder(
        "electra",
        "ElectraConfig",
        "ElectraForSequenceClassification",
        QKV,
        **{**ENCODER, "hidden_size": 32},
        embedding_size=16,
    ),
    _encoder(
        "albert",
        "AlbertConfig",
        "AlbertForSequenceClassification",
        QKV,
        **ENCODER,
        embedding_size=16,
        classifier_dropout_prob=0.0,
    ),
    _encoder("xlm-roberta", "XLMRobertaConfig", "XLMRobertaForSequenceClassification", QKV, **ENCODER, pad_token_id=1),
    _encoder(
        "modernbert",
        "ModernBertConfig",
        "ModernBertForSequenceClassification",
        ("Wqkv",),
        **TEXT,
        intermediate_size=64,
        max_position_embeddings=32,
        local_attention=8,  # a window of 4 leaves padded queries no key: NaN gradients in HF's eager attention
        global_attn_every_n_layers=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        cls_token_id=1,
        sep_token_id=1,
        num_labels=NUM_LABELS,
    ),
    # decoders: causal LM
    _decoder(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        ("c_attn",),
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
    ),
    _decoder(
        "gpt-neox",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        ("query_key_value",),
        **TEXT,
        intermediate_size=64,
        max_position_embeddings=32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    ),
    _decoder(
        "opt",
        "OPTConfig",
        "OPTForCausalLM",
        QV_PROJ,
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        word_embed_proj_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    ),
    _decoder(
        "falcon",
        "FalconConfig",
        "FalconForCausalLM",
        ("query_key_value",),
        **TEXT,
        num_kv_heads=2,
        new_decoder_architecture=True,
        max_position_embeddings=32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    ),
    _decoder("llama", "LlamaConfig", "LlamaForCausalLM", QV_PROJ, **DECODER),
    _decoder("mistral", "MistralConfig", "MistralForCausalLM", QV_PROJ, **DECODER, sliding_window=4),
    _decoder("qwen2", "Qwen2Config", "Qwen2ForCausalLM", QV_PROJ, **DECODER),
    _decoder("qwen3", "Qwen3Config", "Qwen3ForCausalLM", QV_PROJ, **DECODER, head_dim=8),
    _decoder("gemma", "GemmaConfig", "GemmaForCausalLM", QV_PROJ, **DECODER, f32=True, head_dim=8),
    _decoder(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        QV_PROJ,
        f32=True,
        **DECODER,
        head_dim=8,
        sliding_window=4,
        query_pre_attn_scalar=8,
    ),
    _decoder(
        "gemma3-text",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        QV_PROJ,
        f32=True,
        **DECODER,
        head_dim=8,
        sliding_window=4,
        query_pre_attn_scalar=8,
    ),
    _decoder("phi3", "Phi3Config", "Phi3ForCausalLM", ("qkv_proj",), **DECODER, resid_pdrop=0.0, embd_pdrop=0.0),
    _decoder(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        QV_PROJ,
        lora_parameters=EXPERT_WEIGHTS,
        **DECODER,
        **MOE,
        num_local_experts=4,
    ),
    _decoder(
        "qwen2-moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        QV_PROJ,
        lora_parameters=EXPERT_WEIGHTS,
        **DECODER,
        **MOE,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
    ),
    # encoder-decoders: seq2seq LM
    ZooEntry(
        "t5",
        _hf(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            pad_token_id=0,
            decoder_start_token_id=0,
            eos_token_id=1,
        ),
        seq2seq_batch,
        seq2seq_loss,
        "seq2seq_lm",
        ("q", "v"),
        float32_internals=True,
    ),
    ZooEntry(
        "bart",
        _hf(
            "BartConfig",
            "BartForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            classifier_dropout=0.0,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
            decoder_start_token_id=0,
            forced_eos_token_id=None,
        ),
        seq2seq_batch,
        seq2seq_loss,
        "seq2seq_lm",
        QV_PROJ,
    ),
    # vision: image classification
    ZooEntry(
        "vit",
        _hf(
            "ViTConfig",
            "ViTForImageClassification",
            image_size=IMAGE,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=3,
        ),
        image_batch,
        classification_loss,
        "image_classification",
        QV_PROJ,
    ),
    ZooEntry(
        "convnext",
        _hf(
            "ConvNextConfig",
            "ConvNextForImageClassification",
            image_size=IMAGE,  # the attach probe's inputs: 224 px by default, a 12544-position Gram under ghost
            num_channels=3,
            patch_size=2,
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            drop_path_rate=0.0,
            layer_scale_init_value=0.5,
            num_labels=3,
        ),
        image_batch,
        classification_loss,
        "image_classification",
        ("pwconv1", "pwconv2"),
    ),
    ZooEntry(
        "swin",
        _hf("SwinConfig", "SwinForImageClassification", **TINY_SWIN),
        image_batch,
        classification_loss,
        "image_classification",
        QV_PROJ,
    ),
    ZooEntry(
        "resnet",
        _hf(
            "ResNetConfig",
            "ResNetForImageClassification",
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=3,
        ),
        image_batch,
        classification_loss,
        "image_classification",
        ("convolution",),
    ),
]


# --------------------------------------------------------------------------------------------- plain-torch layers
class _Sequence(nn.Module):
    """``layer`` on ``[B, T, D]`` inputs, its output (the first, for tuple outputs) through a linear read-out."""

    def __init__(self, layer: nn.Module, out_dim: int = 6) -> None:
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(out_dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        if isinstance(out, tuple):
            out = out[0]
        return self.head(torch.tanh(out))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.attn(x, x, x, need_weights=False)[0]))


class _LearnedScale(nn.Module):
    """A module with its own ``nn.Parameter``: ``x * scale + shift`` (no layer family covers it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.shift = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class _Tokens(nn.Module):
    """An embedding (or embedding bag) of ``x`` (ids) and a linear read-out."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embedding(x)))


def _layer(name: str, build: Callable[[], nn.Module], shape: tuple[int, ...], ids: bool = False) -> ZooEntry:
    """A plain-torch entry; ``shape``: one example's input (ids in ``[0, 7)`` when ``ids``)."""

    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build()

    def batch(n: int) -> Batch:
        x = torch.randint(0, 7, (n, *shape), generator=_gen(0)) if ids else torch.randn(n, *shape, generator=_gen(0))
        return {"x": x, "labels": torch.zeros(n, dtype=torch.long)}

    return ZooEntry(name, seeded, batch, output_loss, "layer")


def _conv(layer: nn.Module) -> nn.Module:
    return nn.Sequential(layer, nn.Tanh(), nn.Flatten())


def _lin_then(norm: nn.Module, dim: int = 6) -> nn.Module:
    return nn.Sequential(nn.Linear(4, dim), norm, nn.Tanh(), nn.Linear(dim, 2))


def _channels_then(norm: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv1d(2, 4, 3), norm, nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5, 2))


LAYER_ENTRIES: list[ZooEntry] = [
    _layer("nn.Conv1d", lambda: _conv(nn.Conv1d(2, 3, 3, stride=2, padding=1)), (2, 7)),
    _layer("nn.Conv2d", lambda: _conv(nn.Conv2d(2, 4, 3, padding=1, groups=2)), (2, 5, 5)),
    _layer("nn.Conv3d", lambda: _conv(nn.Conv3d(2, 2, 2)), (2, 3, 3, 3)),
    _layer("nn.ConvTranspose1d", lambda: _conv(nn.ConvTranspose1d(2, 3, 3, stride=2)), (2, 4)),
    _layer("nn.ConvTranspose2d", lambda: _conv(nn.ConvTranspose2d(2, 3, 2, stride=2)), (2, 3, 3)),
    _layer("nn.Linear", lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)), (3, 4)),
    _layer("nn.Embedding", lambda: _Tokens(nn.Embedding(7, 6)), (5,), ids=True),
    _layer("nn.EmbeddingBag", lambda: _Tokens(nn.EmbeddingBag(7, 6, mode="mean")), (5,), ids=True),
    _layer("nn.LayerNorm", lambda: _lin_then(nn.LayerNorm(6)), (3, 4)),
    _layer("nn.GroupNorm", lambda: _channels_then(nn.GroupNorm(2, 4)), (2, 7)),
    _layer("nn.InstanceNorm1d", lambda: _channels_then(nn.InstanceNorm1d(4, affine=True)), (2, 7)),
    _layer("nn.RMSNorm", lambda: _lin_then(nn.RMSNorm(6)), (3, 4)),
    _layer("nn.MultiheadAttention", _Attention, (4, 6)),
    _layer("nn.RNN", lambda: _Sequence(nn.RNN(4, 6, batch_first=True)), (5, 4)),
    _layer("nn.GRU", lambda: _Sequence(nn.GRU(4, 6, batch_first=True)), (5, 4)),
    _layer("nn.LSTM", lambda: _Sequence(nn.LSTM(4, 6, num_layers=2, batch_first=True)), (5, 4)),
    _layer("nn.PReLU", lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.PReLU(4), nn.Flatten()), (2, 7)),
    _layer("custom nn.Parameter", lambda: _lin_then(_LearnedScale(6)), (3, 4)),
    _layer("nn.BatchNorm1d", lambda: _lin_then(nn.BatchNorm1d(3)), (3, 4)),
]


ENTRIES: dict[str, ZooEntry] = {entry.name: entry for entry in HF_ENTRIES + LAYER_ENTRIES}
