"""nn.RNN / nn.LSTM / nn.GRU under per-sample clipping: the in-place swap keeps parameters, state_dict and outputs,
and per-sample norms and clipped sums match a torch.func oracle of the original (fused) module."""

from __future__ import annotations

import pytest
import torch
from clipping_helpers import ENGINES, LossFn, check_against_oracle, rand, randomise, sin_loss
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.swaps.recurrent import DPGRU, DPLSTM, DPRNN

B, T, D_IN, H = 3, 5, 4, 5
LENGTHS = torch.tensor([5, 2, 4])


def loop_oracle(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: LossFn = sin_loss
) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{name: [B, *shape]}`` of the original (fused-kernel) module by autograd, one sample
    at a time: ``torch.func`` has no batching rule for the fused GRU/RNN kernels and cannot differentiate them on
    packed sequences."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    per_sample = []
    for i in range(inputs[0].shape[0]):
        loss = loss_fn(model, tuple(x[i : i + 1] for x in inputs)).sum()
        per_sample.append(torch.autograd.grad(loss, list(params.values())))
    return {n: torch.stack([g[k] for g in per_sample]) for k, n in enumerate(params)}


class Recurrent(nn.Module):
    """A recurrent layer whose outputs and final states all enter the loss; optional packing and initial state.

    Inputs: ``x`` ``[B, T, d_in]``, then optionally ``lengths`` ``[B]`` (packed) and/or an initial state
    ``[B, L * D, H]`` (for an LSTM, ``h0`` is its first ``proj_size or H`` features and ``c0`` its cosine).
    """

    def __init__(self, rnn: nn.Module, packed: bool = False, initial: bool = False) -> None:
        super().__init__()
        self.rnn, self.packed, self.initial = rnn, packed, initial

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        extra = list(extra)
        lengths = extra.pop(0) if self.packed else None
        hx = extra.pop(0).transpose(0, 1).contiguous() if self.initial else None
        if isinstance(self.rnn, nn.LSTM) and hx is not None:
            hx = (hx[..., : self.rnn.proj_size or H], hx.cos())  # h0 [L * D, B, proj_size or H], c0 [.., H]
        inp = x if self.rnn.batch_first else x.transpose(0, 1)
        if lengths is not None:
            inp = pack_padded_sequence(inp, lengths, batch_first=self.rnn.batch_first, enforce_sorted=False)
        out, state = self.rnn(inp, hx)
        if lengths is not None:
            out, _ = pad_packed_sequence(out, batch_first=self.rnn.batch_first, total_length=x.shape[1])
        out = out if self.rnn.batch_first else out.transpose(0, 1)
        states = state if isinstance(state, tuple) else (state,)
        return torch.cat([out.flatten(1), *(s.transpose(0, 1).flatten(1) for s in states)], dim=1)


CASES = {
    "rnn_tanh": lambda: nn.RNN(D_IN, H, batch_first=True),
    "rnn_relu_2layer_bidir_seq_first": lambda: nn.RNN(D_IN, H, 2, nonlinearity="relu", bidirectional=True),
    "lstm_2layer_bidir": lambda: nn.LSTM(D_IN, H, 2, batch_first=True, bidirectional=True),
    "lstm_proj_no_bias_seq_first": lambda: nn.LSTM(D_IN, H, proj_size=3, bias=False),
    "gru_2layer": lambda: nn.GRU(D_IN, H, 2, batch_first=True),
    "gru_bidir_seq_first": lambda: nn.GRU(D_IN, H, bidirectional=True),
}


def _inputs(rnn: nn.Module, packed: bool = False, initial: bool = False) -> tuple[torch.Tensor, ...]:
    inputs = [rand(B, T, D_IN)]
    if packed:
        inputs.append(LENGTHS)
    if initial:
        inputs.append(rand(B, rnn.num_layers * (1 + rnn.bidirectional), H, seed=4))
    return tuple(inputs)


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_recurrent_matches_oracle(case: str, clipping: str) -> None:
    model = randomise(Recurrent(CASES[case]()))
    check_against_oracle(model, _inputs(model.rnn), clipping, oracle=loop_oracle)


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_recurrent_packed_with_initial_state_matches_oracle(case: str, clipping: str) -> None:
    model = randomise(Recurrent(CASES[case](), packed=True, initial=True))
    check_against_oracle(model, _inputs(model.rnn, packed=True, initial=True), clipping, oracle=loop_oracle)


@pytest.mark.parametrize("make", [CASES["lstm_2layer_bidir"], CASES["gru_bidir_seq_first"], CASES["rnn_tanh"]])
def test_swap_preserves_parameters_state_dict_and_outputs(make) -> None:
    torch.manual_seed(0)
    rnn = make()
    params = dict(rnn.named_parameters())
    state = {k: v.clone() for k, v in rnn.state_dict().items()}
    x = torch.randn(T, B, D_IN) if not rnn.batch_first else torch.randn(B, T, D_IN)
    packed = pack_padded_sequence(x, LENGTHS, batch_first=rnn.batch_first, enforce_sorted=False)
    with torch.no_grad():
        before = [rnn(x), rnn(packed)]
    clipper = PerSampleClipper(rnn, clipping="ghost", max_grad_norm=1.0)
    assert type(rnn) in (DPLSTM, DPGRU, DPRNN) and isinstance(rnn, type(make()))
    assert dict(rnn.named_parameters()) == params
    assert list(rnn.state_dict()) == list(state)
    with torch.no_grad():
        after = [rnn(x), rnn(packed)]
    for b, a in zip(before, after, strict=True):
        for tb, ta in zip(torch.utils._pytree.tree_leaves(b), torch.utils._pytree.tree_leaves(a), strict=True):
            torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-6)
    assert torch.equal(after[1][0].batch_sizes, before[1][0].batch_sizes)
    rnn.load_state_dict(state)  # strict
    clipper.detach()
    assert type(rnn) is type(make()) and not hasattr(rnn, "dp_proxies")
    assert list(rnn.state_dict()) == list(state)


def test_dropout_between_layers() -> None:
    model = randomise(Recurrent(nn.LSTM(D_IN, H, 3, batch_first=True, dropout=0.5))).eval()
    check_against_oracle(model, (rand(B, T, D_IN),), "ghost", oracle=loop_oracle)  # eval: no dropout
    model.train()
    x = rand(B, T, D_IN)
    torch.manual_seed(0)
    first = model(x)
    torch.manual_seed(1)
    assert not torch.equal(first, model(x))  # dropout active in training
    model.rnn.dropout = 0.0
    torch.testing.assert_close(model(x), model.eval()(x))


def test_unbatched_input_rejected() -> None:
    rnn = nn.GRU(D_IN, H)
    PerSampleClipper(rnn, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="batched recurrent input"):
        rnn(torch.randn(T, D_IN))
