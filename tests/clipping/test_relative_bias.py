"""Relative position biases shared by the examples: T5's, looked up per example (clipping/swaps/relative_bias.py),
and Swin's, computed from parameters alone and expanded to the windows it is added to (the fallback; windows folded
into the batch): HF T5 and Swin exact against a loop over examples under every exact engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import check_against_oracle
from test_experts import loop_oracle
from torch import nn

from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.clipping.swaps.relative_bias import PerExampleRelativeBias

transformers = pytest.importorskip("transformers")


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(
            vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=2, dropout_rate=0.0
        )
        torch.manual_seed(0)
        self.model = transformers.T5ForConditionalGeneration(config)

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=decoder_ids).logits


def _loss(forward, inputs) -> torch.Tensor:
    logits = forward(*inputs)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), inputs[1][:, 1:], reduction="none").mean(1)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randint(0, 40, (3, 6), generator=generator), torch.randint(0, 40, (3, 4), generator=generator)


@pytest.mark.parametrize("clipping", ["flat", "ghost", "fgc", "mixed"])
def test_t5_relative_position_bias_is_exact(clipping: str) -> None:
    check_against_oracle(Seq2Seq().double(), _inputs(), clipping, loss_fn=_loss, atol=1e-9, oracle=loop_oracle)


def test_only_the_attention_owning_a_trainable_table_is_swapped_and_detach_restores_it() -> None:
    model = Seq2Seq()
    swapped = [name for name, m in model.named_modules() if isinstance(m, PerExampleRelativeBias)]
    assert swapped == []
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    swapped = [name for name, m in model.named_modules() if isinstance(m, PerExampleRelativeBias)]
    assert swapped == ["model.encoder.block.0.layer.0.SelfAttention", "model.decoder.block.0.layer.0.SelfAttention"]
    clipper.detach()
    assert not any(isinstance(m, PerExampleRelativeBias) for m in model.modules())
    frozen = Seq2Seq()
    for m in frozen.modules():
        if isinstance(m, nn.Embedding) and m.num_embeddings == 32:  # the relative attention buckets
            m.requires_grad_(False)
    PerSampleClipper(frozen, max_grad_norm=1.0)
    assert not any(isinstance(m, PerExampleRelativeBias) for m in frozen.modules())


@pytest.mark.parametrize("clipping", ["flat", "ghost", "fgc", "mixed"])
def test_swin_windows_and_its_relative_position_bias_are_exact_the_attention_output_refused(clipping: str) -> None:
    """The query/key/value projections see the windows as a reshape of ``[B, ...]`` and the bias is expanded to them;
    the attention's output projection sees rows made by the attention itself, which nothing shows to be folded."""
    config = transformers.SwinConfig(
        image_size=8,
        patch_size=2,
        embed_dim=8,
        depths=[2],
        num_heads=[2],
        window_size=2,
        mlp_ratio=2.0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        num_labels=3,
    )
    torch.manual_seed(0)
    pixels = torch.randn(3, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss = lambda f, x: f(*x).logits.sin().sum(1)  # noqa: E731
    model = transformers.SwinForImageClassification(config).double()
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=r"attention\.o_proj' saw a batch dimension of 12"):
        clipper.backward(loss(model, (pixels,)))
    clipper.detach()
    for name, module in model.named_modules():
        if name.endswith("attention.o_proj"):
            module.requires_grad_(False)
    check_against_oracle(model, (pixels,), clipping, loss_fn=loss, atol=1e-9, oracle=loop_oracle)


def test_long_t5_local_attention_with_a_trainable_table_is_refused_at_attach() -> None:
    """LongT5's local attention computes a blocked bias, ``compute_bias(block_length)``, shared by the examples."""
    config = transformers.LongT5Config(
        vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_heads=2, encoder_attention_type="local"
    )
    model = transformers.LongT5ForConditionalGeneration(config)
    with pytest.raises(UnsupportedModuleError, match=r"SelfAttention' \(LongT5LocalAttention\).*per block.*freeze"):
        PerSampleClipper(model, max_grad_norm=1.0)
    assert not any(isinstance(m, PerExampleRelativeBias) for m in model.modules()), "nothing left swapped"
    model.encoder.block[0].layer[0].LocalSelfAttention.relative_attention_bias.requires_grad_(False)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    swapped = [name for name, m in model.named_modules() if isinstance(m, PerExampleRelativeBias)]
    assert swapped == ["decoder.block.0.layer.0.SelfAttention"]
    clipper.detach()
