"""DPStrategy end to end with swapped modules (LSTM, MultiheadAttention): the optimizer Lightning builds before the
clipper attaches trains them, without noise and clipping it equals plain training, and fit restores the classes."""

import pytest
import torch
from helpers import ClassifierWith, make_trainer
from torch import nn

from lightning_dp import DPStrategy


class SequenceBody(nn.Module):
    """``[B, 6]`` features as a sequence of 3 steps of 2 -> LSTM -> self-attention -> linear head on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(2, 4, batch_first=True, bidirectional=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x.view(x.shape[0], 3, 2))
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h[:, -1])


class PlainClassifier(ClassifierWith):
    """Non-private reference: the mean loss."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx).mean()


@pytest.mark.parametrize("clipping", ["flat", "ghost"])
def test_swapped_modules_train_like_plain_training(clipping: str) -> None:
    torch.manual_seed(0)
    plain = PlainClassifier(SequenceBody())
    private = ClassifierWith(SequenceBody())
    private.load_state_dict(plain.state_dict())
    keys = list(private.state_dict())
    make_trainer("auto", max_steps=4).fit(plain)
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1e6, clipping=clipping, poisson_sampling=False)
    make_trainer(strategy, max_steps=4).fit(private)
    assert type(private.body.rnn) is nn.LSTM and type(private.body.attn) is nn.MultiheadAttention
    assert list(private.state_dict()) == keys
    for (name, a), b in zip(plain.state_dict().items(), private.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert not torch.equal(plain.body.rnn.weight_hh_l0, SequenceBody().rnn.weight_hh_l0)
