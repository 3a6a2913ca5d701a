"""Subclasses of supported layers and flattened sequences, exact against the torch.func oracle under every engine:
a forward wrapping the parent's (scaled and offset embeddings, a channels-first LayerNorm: swaps/inner_call.py), a
forward re-implementing the parent's maths (matched by a probe), other maths (the fallback), and linear layers on
``[B T, d]`` rows (OPT's MLP); a token-major flattening is reported by the batch-independence check."""

from __future__ import annotations

import pytest
import torch
from clipping_helpers import ENGINES, check_against_oracle, rand, randomise, sin_loss
from torch import nn

from lightning_dp.checks.independence import BatchMixingError, check_batch_independence
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError, find_layer_family
from lightning_dp.clipping.layers.fallback import FALLBACK
from lightning_dp.clipping.layers.registry import probed_family
from lightning_dp.clipping.swaps.inner_call import INNER, ParentCallSwap
from lightning_dp.clipping.validation import hooked_modules

B = 3


class ScaledEmbedding(nn.Embedding):
    """Gemma's and BART's word embedding: the parent's output times a constant."""

    def __init__(self, num: int, dim: int, scale: float) -> None:
        super().__init__(num, dim, padding_idx=0)
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale.to(self.weight.dtype)


class OffsetPositions(nn.Embedding):
    """OPT's learned positions: ids computed from an attention mask, offset by 2."""

    def __init__(self, num: int, dim: int) -> None:
        self.offset = 2
        super().__init__(num + self.offset, dim)

    def forward(self, attention_mask: torch.Tensor, past: int = 0) -> torch.Tensor:
        positions = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()[:, past:]
        return super().forward(positions + self.offset)


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """ConvNext's LayerNorm over the channels of ``[B, C, H, W]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class MatmulLinear(nn.Linear):
    """Falcon's linear layer: ``x @ W.T + b``, the parent's maths without calling it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class DoubledLinear(nn.Linear):
    """Other maths than the parent's: ``2 (x W^T + b)``; served by the fallback."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * (x @ self.weight.T + self.bias)


class TinyDecoder(nn.Module):
    """Scaled word embeddings plus offset positions, and an MLP on the rows ``[B T, d]`` as OPT runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.words = ScaledEmbedding(12, 6, scale=2.5)
        self.positions = OffsetPositions(8, 6)
        self.norm = nn.LayerNorm(6)
        self.fc1, self.fc2 = MatmulLinear(6, 10), nn.Linear(10, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).long()
        h = self.words(ids) + self.positions(mask)
        rows = h.reshape(-1, h.shape[-1])  # [B T, d]
        rows = rows + self.fc2(torch.tanh(self.fc1(self.norm(rows))))
        return self.head(rows.view(h.shape))


class TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.norm = ChannelsFirstLayerNorm(4)
        self.out = DoubledLinear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.conv(x)).mean((2, 3)))


def _ids() -> torch.Tensor:
    ids = torch.randint(1, 12, (B, 5), generator=torch.Generator().manual_seed(2))
    ids[0, 3:] = 0  # padding
    return ids


@pytest.mark.parametrize("clipping", ENGINES)
def test_wrapped_and_reimplemented_embeddings_and_flattened_rows(clipping: str) -> None:
    check_against_oracle(randomise(TinyDecoder()), (_ids(),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_channels_first_layer_norm_and_other_maths(clipping: str) -> None:
    check_against_oracle(randomise(TinyConvNet()), (rand(B, 2, 5, 5),), clipping)


def test_each_subclass_gets_the_cheapest_exact_route() -> None:
    decoder, convnet = TinyDecoder(), TinyConvNet()
    assert find_layer_family(decoder.fc1) is None and probed_family(decoder.fc1) is find_layer_family(nn.Linear(1, 1))
    assert probed_family(convnet.out) is None  # other maths
    assert hooked_modules(convnet)["out"][1] is FALLBACK
    state = decoder.state_dict()
    clippers = [PerSampleClipper(decoder, max_grad_norm=1.0), PerSampleClipper(convnet, max_grad_norm=1.0)]
    for module, parent in (
        (decoder.words, nn.Embedding),
        (decoder.positions, nn.Embedding),
        (convnet.norm, nn.LayerNorm),
    ):
        assert isinstance(module, ParentCallSwap) and type(getattr(module, INNER)).__mro__[2] is parent
    assert decoder.state_dict().keys() == state.keys(), "the proxy saves nothing"
    for clipper in clippers:
        clipper.detach()
    assert type(decoder.words) is ScaledEmbedding and not hasattr(decoder.words, INNER)
    assert decoder.state_dict().keys() == state.keys()


class TokenMajor(nn.Module):
    """Flattens ``[B, T, d]`` token-major (``transpose`` first): rows are not grouped by example."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.fc(x.transpose(0, 1).reshape(-1, 4))  # [T B, 2]
        return rows.view(x.shape[1], x.shape[0], 2).transpose(0, 1)


def test_a_token_major_flattening_is_refused_by_the_clipper_and_reported_as_mixing() -> None:
    model = TokenMajor().double()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    loss = sin_loss(model, (rand(B, 4, 4),))
    with pytest.raises(BatchMixingError, match="module 'fc'"):
        check_batch_independence(loss, clipper.output_targets())
    with pytest.raises(UnsupportedModuleError, match=r"module 'fc' saw a batch dimension of 12.*reshape of a \[B"):
        clipper.backward(sin_loss(model, (rand(B, 4, 4),)))


class SharedTable(nn.Module):
    """A Linear applied both to the examples and to a parameter table ``[2 B, d]`` shared by all of them (DeBERTa's
    relative embeddings): the table's rows are not examples' rows, whatever their count."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * B, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.proj(self.table.detach())  # [2 B, 4], folded-looking rows
        return self.proj(x) @ keys.T


def test_a_table_that_looks_like_folded_rows_is_refused_by_the_clipper_itself() -> None:
    model = SharedTable().double()
    model.table.requires_grad_(False)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match="module 'proj' saw a batch dimension of 6"):
        clipper.backward(sin_loss(model, (rand(B, 4),)))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(UnsupportedModuleError, match="module 'proj' saw a batch dimension of 6"):
        clipper.backward(sin_loss(model, (rand(1, 4),)))  # one example too: not a batch-dependent outcome


class Windows(nn.Module):
    """Swin's layout: each example's ``[H, W]`` grid cut into windows folded into the batch, ``[B nW, N, C]``, then
    a linear layer and a learned per-window-position bias (the fallback) on the windows."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.bias = LearnedBias()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 4, 4, 3]
        b = x.shape[0]
        windows = x.view(b, 2, 2, 2, 2, 3).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 4, 3)  # [B 4, 4, 3]
        return self.bias(self.proj(windows)).view(b, -1)


class LearnedBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


@pytest.mark.parametrize("clipping", ENGINES)
def test_windows_folded_into_the_batch_are_exact(clipping: str) -> None:
    check_against_oracle(randomise(Windows()), (rand(B, 4, 4, 3),), clipping)


def test_a_sequence_first_layer_is_refused_whatever_its_length() -> None:
    model = nn.Linear(4, 2).double()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    x = rand(2 * B, B, 4)  # [T, B, d] with T a multiple of B
    with pytest.raises(UnsupportedModuleError, match="batch dimension of 6"):
        clipper.backward(model(x).sin().sum((0, 2)))


class ReadsRowZero(nn.Module):
    """Position ids ``[1, T]`` expanded to the batch by the embedding's pre-hook, but the model reads row 0 of the
    lookup only: every example's gradient would reach example 0's row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.pos = nn.Linear(4, 4), nn.Embedding(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + self.pos(torch.arange(x.shape[1]).unsqueeze(0))[0])


def test_an_expanded_broadcast_input_read_by_row_zero_is_refused_by_the_clipper_itself() -> None:
    model = ReadsRowZero().double()
    clipper = PerSampleClipper(model, clipping="flat", max_grad_norm=1.0)
    with pytest.raises(BatchMixingError, match="module 'pos'"):
        clipper.per_sample_norms(model(rand(B, 5, 4)).sin().sum((1, 2)))


class SelectedTokens(nn.Module):
    """A head on the tokens a mask selects, ``h[mask]``: rows grouped by example, but as many as the data says."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x))[mask])


def test_rows_selected_by_a_mask_are_refused_whatever_their_count() -> None:
    """Two examples of two selected tokens each would fold evenly, three and one would not: neither is folded."""
    model = SelectedTokens().double()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    x = rand(2, 3, 3)
    for mask in ([[1, 1, 0], [1, 1, 0]], [[1, 1, 1], [1, 0, 0]]):
        out = model(x, torch.tensor(mask, dtype=torch.bool))
        with pytest.raises(UnsupportedModuleError, match="module 'head' saw a batch dimension of 4"):
            clipper.backward(torch.stack([out[:2].sum(), out[2:].sum()]))


class FoldedMlp(nn.Module):
    """OPT's layout: a norm on ``h.reshape(-1, d)``, then ``fc2(dropout(relu(fc1(.))))`` on the same rows."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(4), nn.Linear(4, 6), nn.Linear(6, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = self.norm(h.reshape(-1, 4))
        return self.fc2(torch.relu(self.fc1(rows)) * 0.5).view(h.shape)


@pytest.mark.parametrize("clipping", ENGINES)
def test_rows_folded_by_a_reshape_stay_folded_through_element_wise_operations(clipping: str) -> None:
    check_against_oracle(randomise(FoldedMlp()), (rand(B, 5, 4),), clipping)
