"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` through hooked linear layers: in-place, weight-preserving swaps
(:mod:`~lightning_dp.clipping.swaps.base`).

The recurrence is unrolled in Python with the PyTorch documentation's cell equations (Elman RNN; LSTM, Hochreiter &
Schmidhuber 1997, with ``proj_size``; GRU, Cho et al. 2014), each weight used through a ``SharedLinear`` proxy in
``dp_proxies``: ``ih_l{k}{_reverse}`` once per layer and direction on ``[B, T, d_in]``; ``hh_l{k}{_reverse}`` and
``hr_l{k}{_reverse}`` (LSTM, ``proj_size > 0``) at every step (``T`` uses of one parameter). Supports
``num_layers``, ``bidirectional``, ``batch_first``, ``bias``, ``dropout``, ``hx`` and ``PackedSequence``; unbatched
inputs are rejected. Costs a Python loop over time steps.
"""

from __future__ import annotations

from typing import Any, cast, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from lightning_dp.clipping.swaps.base import SharedLinear, SwappedModule, register_swap

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class _DPRecurrent(SwappedModule):
    """Shared unrolled forward of the swapped recurrent classes; subclasses define :meth:`cell`."""

    # set by the recurrent module this class is mixed into (nn.RNNBase), and by add_proxies
    num_layers: int
    bidirectional: bool
    hidden_size: int
    batch_first: bool
    dropout: float
    dp_proxies: nn.ModuleDict

    def add_proxies(self) -> list[str]:
        """Add the ``dp_proxies`` container of :class:`SharedLinear` proxies (see the module docstring)."""
        proxies = nn.ModuleDict()
        for layer in range(self.num_layers):
            for suffix in ("", "_reverse")[: 1 + self.bidirectional]:
                for kind in ("ih", "hh", "hr"):
                    weight = getattr(self, f"weight_{kind}_l{layer}{suffix}", None)
                    if weight is not None:
                        bias = getattr(self, f"bias_{kind}_l{layer}{suffix}", None)
                        proxies[f"{kind}_l{layer}{suffix}"] = SharedLinear(weight, bias)
        self.add_module("dp_proxies", proxies)
        return ["dp_proxies"]

    def cell(self, gates_x: torch.Tensor, state: Any, proxies: dict[str, nn.Module]) -> Any:
        """One step: input gates ``[B, G * H]`` and the previous state (``h``, or ``(h, c)`` for LSTM) -> the new
        state."""
        raise NotImplementedError

    def _initial_state(self, hx: Hidden | None, batch: int, like: torch.Tensor) -> list[Hidden]:
        """Per layer and direction, the initial state (zeros when ``hx`` is None)."""
        count = self.num_layers * (1 + self.bidirectional)
        out_size = getattr(self, "proj_size", 0) or self.hidden_size
        if isinstance(self, nn.LSTM):
            h0, c0 = hx if hx is not None else (None, None)
            h0 = like.new_zeros(count, batch, out_size) if h0 is None else h0
            c0 = like.new_zeros(count, batch, self.hidden_size) if c0 is None else c0
            return [(h0[i], c0[i]) for i in range(count)]
        h0 = like.new_zeros(count, batch, out_size) if hx is None else hx
        return [h0[i] for i in range(count)]

    def _scan(
        self,
        gates_x: torch.Tensor,
        state: Hidden,
        proxies: dict[str, nn.Module],
        mask: torch.Tensor | None,
        reverse: bool,
    ) -> tuple[torch.Tensor, Hidden]:
        """One layer and direction: input gates ``[B, T, G * H]`` -> outputs ``[B, T, H_out]`` and the final state; with
        ``mask`` ``[B, T]`` padded steps keep the state and output zeros.
        """
        steps = gates_x.shape[1]
        out: list[torch.Tensor] = [gates_x] * steps  # placeholders, all overwritten
        for t in range(steps - 1, -1, -1) if reverse else range(steps):
            new = self.cell(gates_x[:, t], state, proxies)
            keep = None if mask is None else mask[:, t : t + 1]
            state = new if keep is None else _where(keep, new, state)
            h = state[0] if isinstance(state, tuple) else state
            out[t] = h if keep is None else h * keep
        return torch.stack(out, dim=1), state

    # the state's type depends on the subclass (h or (h, c)), as in the originals' own overloads
    @overload
    def forward(self, input: torch.Tensor, hx: Any = None) -> tuple[torch.Tensor, Any]: ...
    @overload
    def forward(self, input: PackedSequence, hx: Any = None) -> tuple[PackedSequence, Any]: ...
    def forward(
        self, input: torch.Tensor | PackedSequence, hx: Hidden | None = None
    ) -> tuple[torch.Tensor | PackedSequence, Hidden]:
        """As the original ``forward`` (batched or packed input).

        Raises:
            ValueError: an unbatched (2-D) input: per-sample clipping needs a sample dimension.
        """
        mask = None
        if isinstance(input, PackedSequence):
            x, lengths = pad_packed_sequence(input, batch_first=True)  # original sample order, as hx and h_n
            mask = torch.arange(x.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)  # [B, T]
            mask = mask.to(x.device)
        elif input.dim() != 3:
            raise ValueError(
                f"per-sample clipping needs a batched recurrent input (3-D), got shape {tuple(input.shape)}"
            )
        else:
            x = input if self.batch_first else input.transpose(0, 1)
        states = self._initial_state(hx, x.shape[0], x)
        finals: list[Hidden] = []
        for layer in range(self.num_layers):
            outputs = []
            for direction, suffix in enumerate(("", "_reverse")[: 1 + self.bidirectional]):
                proxies = {
                    kind: self.dp_proxies[f"{kind}_l{layer}{suffix}"]
                    for kind in ("hh", "hr")
                    if f"{kind}_l{layer}{suffix}" in self.dp_proxies
                }
                gates_x = self.dp_proxies[f"ih_l{layer}{suffix}"](x)  # [B, T, G * H], one call
                state = states[layer * (1 + self.bidirectional) + direction]
                out, state = self._scan(gates_x, state, proxies, mask, reverse=bool(direction))
                outputs.append(out)
                finals.append(state)
            x = torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        if isinstance(input, PackedSequence):
            order = input.sorted_indices  # repack in the input's order, so that the structure is identical
            if order is not None:
                x, lengths = x.index_select(0, order), lengths[order.cpu()]
            packed = pack_padded_sequence(x, lengths, batch_first=True)
            output: torch.Tensor | PackedSequence = PackedSequence(
                packed.data, packed.batch_sizes, input.sorted_indices, input.unsorted_indices
            )
        else:
            output = x if self.batch_first else x.transpose(0, 1)
        if isinstance(self, nn.LSTM):
            return output, (torch.stack([s[0] for s in finals]), torch.stack([s[1] for s in finals]))
        return output, torch.stack(cast(list[torch.Tensor], finals))  # RNN, GRU: each final state is h


def _where(keep: torch.Tensor, new: Hidden, old: Hidden) -> Hidden:
    """Per sample, ``new`` where ``keep`` else ``old`` (both ``h``, or both ``(h, c)``: one form throughout a scan)."""
    if isinstance(new, tuple):
        h, c = cast(tuple[torch.Tensor, torch.Tensor], old)
        return torch.where(keep, new[0], h), torch.where(keep, new[1], c)
    return torch.where(keep, new, cast(torch.Tensor, old))


@register_swap(nn.RNN)
class DPRNN(_DPRecurrent, nn.RNN):
    """``nn.RNN`` unrolled: ``h' = act(W_ih x + b_ih + W_hh h + b_hh)``, ``act`` tanh or ReLU."""

    def cell(self, gates_x: torch.Tensor, state: torch.Tensor, proxies: dict[str, nn.Module]) -> torch.Tensor:
        pre = gates_x + proxies["hh"](state)
        return torch.tanh(pre) if self.nonlinearity == "tanh" else torch.relu(pre)


@register_swap(nn.LSTM)
class DPLSTM(_DPRecurrent, nn.LSTM):
    """``nn.LSTM`` unrolled (gates i, f, g, o; ``h' = W_hr (o * tanh(c'))`` with ``proj_size > 0``)."""

    def cell(
        self, gates_x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], proxies: dict[str, nn.Module]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, c = state
        i, f, g, o = (gates_x + proxies["hh"](h)).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (proxies["hr"](h) if "hr" in proxies else h), c


@register_swap(nn.GRU)
class DPGRU(_DPRecurrent, nn.GRU):
    """``nn.GRU`` unrolled (gates r, z, n; ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``)."""

    def cell(self, gates_x: torch.Tensor, state: torch.Tensor, proxies: dict[str, nn.Module]) -> torch.Tensor:
        r_x, z_x, n_x = gates_x.chunk(3, dim=-1)
        r_h, z_h, n_h = proxies["hh"](state).chunk(3, dim=-1)
        r = torch.sigmoid(r_x + r_h)
        z = torch.sigmoid(z_x + z_h)
        n = torch.tanh(n_x + r * n_h)
        return (1 - z) * n + z * state
