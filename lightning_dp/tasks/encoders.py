"""Encoder classifiers shared by the GLUE recipe and the SST-2 example:
:class:`MeanPoolingBertForSequenceClassification` and :func:`freeze_below`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput


class MeanPoolingBertForSequenceClassification(BertForSequenceClassification):
    """``BertForSequenceClassification`` whose head reads the mean of the last hidden states over the attention mask
    instead of the pooler (Reimers & Gurevych 2019, Sentence-BERT; docs/design.md section 12.7). The pooler is dropped
    (neither trained nor noised).
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert.pooler = None

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        pooled: torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        """``[B, T]`` token inputs, or ``pooled`` ``[B, hidden]`` precomputed mean states -> ``[B, num_labels]`` logits
        (and HF's batch loss when ``labels`` are given).
        """
        if pooled is None:
            pooled = self.mean_pool(input_ids, attention_mask, token_type_ids)
        logits = self.classifier(self.dropout(pooled))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def mean_pool(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[B, T]`` tokens -> ``[B, hidden]`` mean of the encoder's last hidden states over the attention mask."""
        hidden = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).unsqueeze(-1)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)


def freeze_below(model: PreTrainedModel, train_layers: int) -> None:
    """Freeze the embeddings and all but the top ``train_layers`` encoder layers of a BERT-style encoder (frozen layers
    get no hooks and no noise).

    Raises:
        ValueError: no ``embeddings`` / ``encoder.layer``, or ``train_layers`` exceeds the layers.
    """
    encoder = model.base_model
    if not hasattr(encoder, "embeddings") or not hasattr(getattr(encoder, "encoder", None), "layer"):
        raise ValueError(
            f"train_layers needs a BERT-style encoder (embeddings, encoder.layer); {type(model).__name__} is not: "
            "unset train_layers or use LoRA (lora_rank > 0)"
        )
    layers = encoder.encoder.layer
    if train_layers > len(layers):
        raise ValueError(f"train_layers must be at most the model's {len(layers)} layers, got {train_layers}")
    for module in [encoder.embeddings, *layers[: len(layers) - train_layers]]:
        module.requires_grad_(False)
