"""User-level privacy (``privacy_unit="user"``, :mod:`lightning_dp.data.users`): each sampled user's rows are folded
into one clipped unit, the clipped MEAN of their examples' gradients.

- the clipped sum of every exact engine against a torch.func oracle (per-example gradients, averaged per user,
  clipped, summed) on an MLP and an embedding model, and a Lightning step's update against the same oracle divided by
  ``q N`` (users);
- adaptive clipping counts the sampled users left unclipped, against an expected batch of ``q N`` users;
- a prolific user with large losses moves the clipped sum by at most C;
- Poisson sampling includes each user independently with rate q, and a collated batch carries all of a sampled
  user's rows;
- epsilon is accounted at the users' q and N (against dp-accounting), the start-up block names the unit;
- ``UserDataset``, ``UserCollate``, ``flatten_users``, ``user_losses``, ``read_user_ids`` and the options'
  validation on every surface;
- augmentation multiplicity on top of users: identical copies train exactly as one copy.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import make_trainer
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from lightning_dp import DPStrategy, augmentation_mean, repeat_for_multiplicity
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.config import PrivacyConfig
from lightning_dp.data import EmptyBatchCollate, PoissonBatchSampler
from lightning_dp.data.users import (
    UserBatch,
    UserCollate,
    UserDataset,
    UserDraws,
    flatten_users,
    read_user_ids,
    user_losses,
)
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.hf import PrivacyArguments

pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop", "ignore::UserWarning", "ignore::FutureWarning"
)

EXACT = ("flat", "ghost", "fgc", "mixed")
D, CLASSES, VOCAB, SEQ = 4, 3, 7, 5
#: the user of each example: users 0..5 in order of first appearance, with 3, 3, 2, 2, 1 and 1 examples.
USER_OF = [10, 11, 12, 10, 13, 11, 14, 12, 10, 15, 11, 13]
K = 3  # = the largest user's count: no random subsets


class Examples(Dataset):
    """Dict examples ``{"idx", "x" or "ids", "y", "user"}``; ``kind="dense"``: ``x [D]`` and a class label,
    ``kind="tokens"``: ``ids [SEQ]`` and per-token targets."""

    def __init__(
        self, users: list, kind: str = "dense", seed: int = 0, dtype: torch.dtype = torch.float64, scale=None
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        n = len(users)
        self.users, self.kind = list(users), kind
        if kind == "dense":
            self.x = torch.randn(n, D, generator=generator, dtype=dtype)
            if scale is not None:
                self.x = self.x * torch.as_tensor(scale, dtype=dtype)[:, None]
            self.y = torch.randint(0, CLASSES, (n,), generator=generator)
        else:
            self.x = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
            self.y = torch.randint(0, VOCAB, (n, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, i: int) -> dict:
        key = "x" if self.kind == "dense" else "ids"
        return {"idx": i, key: self.x[i], "y": self.y[i], "user": self.users[i]}


class TokenNet(nn.Module):
    """Embedding -> tanh -> Linear, per token (ids ``[N, SEQ]`` -> logits ``[N, SEQ, VOCAB]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).tanh())


def _dense_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


#: name -> (model factory, data kind, per-row loss, input key)
MODELS: dict[str, tuple[Callable[[], nn.Module], str, Callable, str]] = {
    "mlp": (lambda: nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, CLASSES)), "dense", _dense_loss, "x"),
    "tokens": (TokenNet, "tokens", _token_loss, "ids"),
}


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name][0]().double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.7)
    return model


def _example_grads(model: nn.Module, loss: Callable, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: [N, *shape]}``: each example's gradient (torch.func)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, xi, yi):
        return loss(functional_call(model, p, (xi[None],)), yi[None])[0]

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def _user_oracle(
    grads: dict[str, torch.Tensor], members: list[list[int]], bound: float, gamma: float | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each user's gradient (the mean of their examples'), its norm ``[U]`` and the clipped sum
    ``sum_u min(1, C / (n_u + 1e-6)) g_u`` per parameter (with ``gamma``, automatic clipping's ``C / (n_u +
    gamma)``)."""
    means = {n: torch.stack([g[rows].mean(0) for rows in members]) for n, g in grads.items()}
    norms = torch.cat([g.flatten(1) for g in means.values()], 1).norm(dim=1)
    factors = (bound / (norms + 1e-6)).clamp(max=1.0) if gamma is None else bound / (norms + gamma)
    return norms, {n: torch.einsum("u,u...->...", factors, g) for n, g in means.items()}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def _user_batch(data: Dataset, k: int | None, users: list[int] | None = None) -> tuple[UserDataset, UserBatch]:
    regrouped = UserDataset(data, read_user_ids(data, "user"), k, seed=0, drop_key="user")
    chosen = range(len(regrouped)) if users is None else users
    return regrouped, UserCollate(default_collate, regrouped)([regrouped[u] for u in chosen])


def _clipped_user_sum(model, loss, key, batch, engine, bound, **clip_function):
    rows, weights = flatten_users(batch)
    model.zero_grad(set_to_none=True)
    clipper = PerSampleClipper(
        model,
        clipping=engine,
        max_grad_norm=bound,
        sum_check_every=1,
        augmentation_multiplicity=weights.shape[1],
        **clip_function,
    )
    try:
        norms = clipper.backward(user_losses(loss(model(rows[key]), rows["y"]), weights))
    finally:
        clipper.detach()
    return norms, {n: p.grad.clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------ oracles
@pytest.mark.parametrize("engine", EXACT)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_clipped_sum_of_user_means_matches_oracle(name: str, engine: str) -> None:
    _, kind, loss, key = MODELS[name]
    data = Examples(USER_OF, kind)
    model = _model(name)
    regrouped, batch = _user_batch(data, K)
    assert batch["weights"].shape == (6, K) and batch["rows"][key].shape[:2] == (6, K)
    members = [m.tolist() for m in regrouped.members]
    norms_expected, _ = _user_oracle(_example_grads(model, loss, data.x, data.y), members, 1.0)
    bound = float(norms_expected.median())  # about half of the users clipped
    norms_expected, expected = _user_oracle(_example_grads(model, loss, data.x, data.y), members, bound)
    norms, grads = _clipped_user_sum(model, loss, key, batch, engine, bound)
    torch.testing.assert_close(norms, norms_expected, rtol=1e-9, atol=1e-12)  # the mean is formed in float64
    assert 0 < int((norms > bound).sum()) < len(members)
    for param_name, value in grads.items():
        torch.testing.assert_close(value, expected[param_name], rtol=1e-9, atol=1e-12, msg=param_name)


@pytest.mark.parametrize("engine", EXACT)
def test_automatic_clipping_scales_each_users_mean_by_c_over_its_norm_plus_gamma(engine: str) -> None:
    """Automatic clipping (docs/design.md section 4.11) of the user units: ``C / (n_u + gamma)`` on each user's mean."""
    _, kind, loss, key = MODELS["tokens"]
    data = Examples(USER_OF, kind)
    model = _model("tokens")
    regrouped, batch = _user_batch(data, K)
    members = [m.tolist() for m in regrouped.members]
    norms_expected, expected = _user_oracle(_example_grads(model, loss, data.x, data.y), members, 0.3, gamma=0.05)
    norms, grads = _clipped_user_sum(
        model, loss, key, batch, engine, 0.3, clipping_fn="automatic", automatic_clipping_gamma=0.05
    )
    torch.testing.assert_close(norms, norms_expected, rtol=1e-9, atol=1e-12)
    for param_name, value in grads.items():
        torch.testing.assert_close(value, expected[param_name], rtol=1e-9, atol=1e-12, msg=param_name)


@pytest.mark.parametrize("engine", EXACT)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_prolific_user_with_large_losses_moves_the_clipped_sum_by_at_most_c(name: str, engine: str) -> None:
    """User 0 has 50 examples (examples_per_user=None: all 50 rows used) with blown-up inputs; the others 1 to 3.
    Removing user 0 from the batch (the same other users, the same rows) moves the clipped sum by exactly its one
    clipped vector: norm C, never 50 C."""
    _, kind, loss, key = MODELS[name]
    others = [1, 2, 2, 3, 3, 3, 4, 5, 5, 6, 6, 6]
    users = [0] * 50 + others
    data = Examples(users, kind, seed=3)
    model = _model(name)
    # user 0's 50 examples: near copies of one input, all labelled with a class the model is pushed away from
    # (large losses whose gradients agree, so that their mean is large too)
    data.y[:50] = 0
    if kind == "dense":
        data.x[:50] = 3.0 * data.x[50] + 0.1 * data.x[:50]
        with torch.no_grad():
            model[2].bias[0] = -20.0
    else:
        data.x[:50] = data.x[50]
        with torch.no_grad():
            model.head.bias[0] = -20.0
    bound = 0.1
    regrouped, everyone = _user_batch(data, None)
    assert regrouped.examples_per_user == 50 and regrouped.counts.tolist() == [50, 1, 2, 3, 1, 2, 3]
    _, without = _user_batch(data, None, users=list(range(1, len(regrouped))))
    norms, with_user = _clipped_user_sum(model, loss, key, everyone, engine, bound)
    _, without_user = _clipped_user_sum(model, loss, key, without, engine, bound)
    assert float(norms[0]) > 5 * bound
    moved = float((_flat(with_user.values()) - _flat(without_user.values())).norm())
    assert bound * 0.99 < moved <= bound * (1 + 1e-9)
    # the same 50 examples as 50 example-level units would move it by far more than C
    rows, _ = flatten_users(everyone)
    model.zero_grad(set_to_none=True)
    clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=bound)
    clipper.backward(loss(model(rows[key][:50]), rows["y"][:50]))
    clipper.detach()
    assert float(_flat(p.grad for p in model.parameters()).norm()) > 20 * bound


# ------------------------------------------------------------------------------------- Lightning oracle
class UserClassifier(pl.LightningModule):
    """Linear -> tanh -> Linear on dict rows; records the ``idx`` of the rows of each training forward (train mode
    only: the checks' forwards run in eval mode). ``copies > 1``: the step makes (identical) copies of every row and
    returns each row's mean over them."""

    def __init__(self, data: Dataset, batch_size: int, copies: int = 1, lr: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, CLASSES))
        self.data, self.batch_size, self.copies, self.lr = data, batch_size, copies, lr
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        if self.training:
            self.seen.append(batch["idx"].clone())
        x, y = batch["x"], batch["y"]
        if self.copies > 1:
            x, y = repeat_for_multiplicity((x, y), self.copies)
        rows = F.cross_entropy(self.net(x), y, reduction="none")
        return augmentation_mean(rows, self.copies) if self.copies > 1 else rows

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _user_strategy(**options) -> DPStrategy:
    defaults = {"noise_multiplier": 1.0, "max_grad_norm": 0.5, "seed": 0, "privacy_unit": "user", "user_key": "user"}
    return DPStrategy(**{**defaults, **options})


@pytest.mark.parametrize("engine", ["flat", "ghost"])
def test_a_lightning_step_updates_by_the_oracle_over_q_n_users(engine: str) -> None:
    """No noise, one step, SGD with lr 1: the update is minus the oracle's clipped sum of the sampled users' mean
    gradients divided by q N = the loader's batch size (of users)."""
    data = Examples(USER_OF, "dense", dtype=torch.float32, seed=1)
    module = UserClassifier(data, batch_size=3)
    start = copy.deepcopy(module.net).double()
    strategy = _user_strategy(noise_multiplier=0.0, max_grad_norm=0.3, clipping=engine, examples_per_user=K, seed=2)
    make_trainer(strategy, max_steps=1).fit(module)
    engine_ = strategy.privacy_engine
    assert engine_.num_samples == 6 and engine_.sample_rate == pytest.approx(3 / 6)
    (seen,) = module.seen
    rows = seen.reshape(-1, K)
    assert 2 <= rows.shape[0] < 6  # a proper Poisson sample of users (fixed by the seed)
    members = []
    for user_rows in rows.tolist():
        real = sorted(set(user_rows))
        user = data.users[real[0]]
        assert real == [i for i, u in enumerate(data.users) if u == user]  # all of the user's examples
        assert user_rows[: len(real)] == real  # real rows first, in dataset order, then padding copies
        members.append(real)
    grads = _example_grads(start, _dense_loss, data.x.double(), data.y)
    _, expected = _user_oracle(grads, members, 0.3)
    for (name, before), after in zip(start.named_parameters(), module.net.parameters(), strict=True):
        update = after.detach().double() - before.detach()
        # float32 clip factors are C over the rounding bound of the norm (docs/design.md section 4.10), a relative
        # 1e-4 or less below the oracle's C / n here
        torch.testing.assert_close(update, -expected[name] / 3.0, rtol=1e-4, atol=1e-6, msg=name)


def test_adaptive_clipping_counts_the_unclipped_users() -> None:
    """Adaptive clipping with privacy_unit='user' (no noise on the sum or the count, one step): the count's expected
    batch is ``q N`` in USERS (3 of 6 users, not q x 12 examples), and the bound moves by the centred fraction of
    the sampled users whose clipped unit, the mean of their examples' gradients, was not clipped:
    ``C_1 = C_0 exp(-eta ((u - U / 2) / (q N) + 1/2 - gamma))`` for ``u`` unclipped of ``U`` sampled users."""
    data = Examples(USER_OF, "dense", dtype=torch.float32, seed=1)
    module = UserClassifier(data, batch_size=3)
    start = copy.deepcopy(module.net).double()
    grads = _example_grads(start, _dense_loss, data.x.double(), data.y)
    everyone = [[i for i, u in enumerate(data.users) if u == user] for user in dict.fromkeys(data.users)]
    norms, _ = _user_oracle(grads, everyone, 1.0)
    ordered = norms.sort().values
    initial = float(ordered[2] + ordered[3]) / 2  # 3 of the 6 users unclipped, none near the bound
    eta, gamma = 1.0, 0.5
    strategy = _user_strategy(
        noise_multiplier=0.0,
        max_grad_norm=initial,
        examples_per_user=K,
        seed=2,
        target_unclipped_quantile=gamma,
        clipbound_learning_rate=eta,
        unclipped_num_std=0.0,
    )
    make_trainer(strategy, max_steps=1).fit(module)
    engine = strategy.privacy_engine
    assert engine.num_samples == 6 and engine.adaptive.expected_batch_size == pytest.approx(3.0)
    (seen,) = module.seen
    sampled = {data.users[i] for i in seen.tolist()}
    users = list(dict.fromkeys(data.users))
    unclipped = sum(float(norms[users.index(user)]) <= initial for user in sampled)
    assert 2 <= len(sampled) < 6 and 0 < unclipped < len(sampled)  # a proper sample of users, some clipped
    fraction = (unclipped - len(sampled) / 2) / 3.0 + 0.5
    assert engine.adaptive.bound == pytest.approx(initial * math.exp(-eta * (fraction - gamma)), rel=1e-9)


# ------------------------------------------------------------------------------------------------ sampling
def _sampling_data(users: int = 20) -> Examples:
    """``users`` users with 1 to 3 examples each, interleaved."""
    counts = [1 + u % 3 for u in range(users)]
    order = [u for k in range(3) for u in range(users) if counts[u] > k]
    return Examples(order, "dense", dtype=torch.float32)


def test_poisson_sampling_includes_each_user_independently_with_rate_q() -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    data = _sampling_data()
    engine = PrivacyEngine(noise_multiplier=1.0, privacy_unit="user", user_key="user", seed=0)
    loader = engine.training_loader(DataLoader(data, batch_size=6), batch_size=6, micro_batches=1)
    assert isinstance(loader.batch_sampler, UserDraws) and isinstance(loader.dataset, UserDataset)
    sampler = loader.batch_sampler.batch_sampler
    assert isinstance(sampler, PoissonBatchSampler)
    assert engine.num_samples == sampler.num_samples == 20 and sampler.sample_rate == pytest.approx(0.3)
    q, steps = 0.3, 4000
    sampler.num_steps = steps
    included = torch.zeros(steps, 20, dtype=torch.bool)
    for step, users in enumerate(sampler):
        included[step, users] = True
    counts = included.sum(0)
    tests = 20 + 190
    for count in counts.tolist():  # each user's inclusions ~ Binomial(steps, q); Bonferroni over all tests
        assert scipy_stats.binomtest(count, steps, q).pvalue * tests > 1e-3
    joint = (included.double().T @ included.double()).long()
    for a in range(20):
        for b in range(a + 1, 20):  # two users together ~ Binomial(steps, q^2): independent inclusions
            assert scipy_stats.binomtest(int(joint[a, b]), steps, q * q).pvalue * tests > 1e-3
    sizes = included.sum(1).double()
    assert float(sizes.var()) == pytest.approx(20 * q * (1 - q), rel=0.1)  # binomial, not a fixed batch size

    # the collated batches: every sampled user with all of their rows, real rows weighted 1 / n_u, padding 0
    sampler.num_steps = 25
    user_of = dict(enumerate(data.users))
    members = Counter(data.users)
    seen_users = 0
    for batch in loader:
        weights, idx = batch["weights"], batch["rows"]["idx"]
        assert weights.shape[1] == 3 and idx.shape == weights.shape and batch["rows"]["x"].shape[:2] == idx.shape
        assert "user" not in batch["rows"]
        torch.testing.assert_close(weights.sum(1), torch.ones(len(weights), dtype=weights.dtype))
        for user_rows, user_weights in zip(idx.tolist(), weights.tolist(), strict=True):
            user = user_of[user_rows[0]]
            assert {user_of[i] for i in user_rows} == {user}
            n = members[user]
            assert len(set(user_rows)) == n and len(set(user_rows[:n])) == n
            assert user_weights == pytest.approx([1 / n] * n + [0.0] * (3 - n))
        seen_users += len(weights)
    assert seen_users > 0


# -------------------------------------------------------------------------------- accounting and start-up
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def user_fit():
    """One Lightning fit with privacy_unit='user' (10 users of 60 examples, 4 users per step, 3 steps), with what the
    ``lightning_dp`` logger said."""
    users = [i % 7 if i < 40 else 7 + i % 3 for i in range(60)]
    data = Examples(users, "dense", dtype=torch.float32)
    logger = logging.getLogger("lightning_dp")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        strategy = _user_strategy(examples_per_user=4)
        module = UserClassifier(data, batch_size=4, lr=0.1)
        before = [p.detach().clone() for p in module.parameters()]
        make_trainer(strategy, max_steps=3).fit(module)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return strategy, module, before, "\n".join(records.lines)


def test_epsilon_is_accounted_over_users(user_fit) -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting import pld, rdp

    strategy, module, before, _ = user_fit
    assert any(not torch.equal(p, q) for p, q in zip(module.parameters(), before, strict=True))
    summary = strategy.privacy_engine.summary()
    assert summary["privacy_unit"] == "user" and summary["num_users"] == 10 and summary["examples_per_user"] == 4
    assert summary["sample_rate"] == pytest.approx(4 / 10) and summary["steps"] == 3
    assert summary["delta"] == pytest.approx(1 / 10**1.1)  # the default delta is about N users
    sigma, q, steps, delta = summary["noise_multiplier"], summary["sample_rate"], summary["steps"], summary["delta"]
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    if summary["accountant"] == "pld":
        reference = pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        assert summary["accountant"] == "rdp"
        reference = rdp.RdpAccountant(orders=[1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)))
    reference.compose(event, steps)
    assert summary["epsilon"] == pytest.approx(reference.get_epsilon(delta), rel=1e-6)
    # the example-level accounting of the same loader (q = 4 / 60 examples) would report much less
    example_level = pld.PLDAccountant(value_discretization_interval=1e-4)
    example_level.compose(dp_accounting.PoissonSampledDpEvent(4 / 60, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert summary["epsilon"] > 2 * example_level.get_epsilon(delta)


def test_the_start_up_block_names_the_users(user_fit) -> None:
    *_, text = user_fit
    assert "DP training start-up:" in text
    lines = text.splitlines()
    assert any(line.split() == ["N", "(users)", "10"] for line in lines), text
    assert "N (training examples)" not in text
    assert any(line.split()[:2] == ["q", "(sample"] and line.split()[-1] == "0.4" for line in lines), text
    (unit,) = [line for line in lines if line.strip().startswith("privacy unit")]
    assert "user (column 'user'): a sampled user brings at most 4 of their examples (a random 4 of more)" in unit
    assert "60" not in unit and "median" not in unit  # no statistic of the users' examples is logged


# ------------------------------------------------------------------------------------- UserDataset etc.
def test_users_are_in_order_of_first_appearance() -> None:
    data = [{"v": i, "user": u} for i, u in enumerate(["b", "a", "b", "c", "a"])]
    regrouped = UserDataset(data, read_user_ids(data, "user"), 2)
    assert regrouped.users == ["b", "a", "c"] and len(regrouped) == 3
    assert [m.tolist() for m in regrouped.members] == [[0, 2], [1, 4], [3]]
    assert regrouped.counts.tolist() == [2, 2, 1]
    assert [e["v"] for e in regrouped[0].examples] == [0, 2]
    assert [e["user"] for e in regrouped[2].examples] == ["c", "c"]  # no drop_key: the column is kept


def test_a_user_with_more_than_k_examples_brings_a_fresh_random_subset() -> None:
    data = [{"v": i, "user": 0 if i < 6 else 1} for i in range(8)]
    ids = read_user_ids(data, "user")

    def draws(seed: int, count: int = 300) -> list[tuple[int, ...]]:
        regrouped = UserDataset(data, ids, 3, seed=seed, drop_key="user")
        out = []
        for draw in range(count):
            item = regrouped[(0, draw)]
            assert item.weights == pytest.approx([1 / 3] * 3)
            assert all("user" not in e for e in item.examples)
            out.append(tuple(e["v"] for e in item.examples))
        return out

    first = draws(0)
    assert all(len(set(d)) == 3 and set(d) <= set(range(6)) for d in first)  # 3 distinct real examples
    assert len(set(first)) > 10  # different subsets across draws
    assert draws(0) == first  # deterministic given the seed
    assert draws(1) != first
    assert UserDataset(data, ids, 3, seed=0)[0].examples == UserDataset(data, ids, 3, seed=0)[(0, 0)].examples
    frequency = Counter(v for d in first for v in d)  # each example in about K / n = 1/2 of the draws
    assert all(110 < frequency[v] < 190 for v in range(6)), frequency


def test_a_user_with_fewer_than_k_examples_is_padded_with_its_own_examples_at_weight_0() -> None:
    data = [{"v": i, "user": u} for i, u in enumerate([5, 6, 5, 6, 6, 6, 6])]
    regrouped = UserDataset(data, read_user_ids(data, "user"), 5, drop_key="user")
    item = regrouped[0]
    assert [e["v"] for e in item.examples] == [0, 2, 0, 2, 0]
    assert item.weights == pytest.approx([0.5, 0.5, 0.0, 0.0, 0.0])
    assert all(set(e) == {"v"} for e in item.examples)  # drop_key removed the user column
    exact = regrouped[1]
    assert [e["v"] for e in exact.examples] == [1, 3, 4, 5, 6] and exact.weights == pytest.approx([0.2] * 5)
    assert UserDataset(data, read_user_ids(data, "user")).examples_per_user == 5  # None: the largest user's count


def test_user_dataset_refuses_bad_arguments() -> None:
    data = [{"v": i, "user": 0} for i in range(3)]
    with pytest.raises(ValueError, match="need one user id per example, got 2 ids for 3 examples"):
        UserDataset(data, [0, 0])
    with pytest.raises(ValueError, match="examples_per_user must be an integer >= 1"):
        UserDataset(data, [0, 0, 0], 0)


def test_read_user_ids_from_a_column_a_function_and_a_hf_dataset() -> None:
    data = [{"x": torch.zeros(2), "user": torch.tensor(u)} for u in (3, 1, 3)]
    ids = read_user_ids(data, "user")
    assert ids == [3, 1, 3] and all(type(i) is int for i in ids)  # tensors turned into numbers
    tensors = TensorDataset(torch.zeros(4, 2), torch.tensor([7, 7, 8, 9]))
    assert read_user_ids(tensors, lambda example: example[1]) == [7, 7, 8, 9]
    assert read_user_ids(data, lambda example: f"u{int(example['user'])}") == ["u3", "u1", "u3"]
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"x": [[0.0, 1.0]] * 4, "user": ["a", "b", "a", "c"]})
    assert read_user_ids(hf, "user") == ["a", "b", "a", "c"]
    assert read_user_ids(hf, lambda example: example["user"].upper()) == ["A", "B", "A", "C"]
    with pytest.raises(ValueError, match=r"user_key='author': example 0 has no such column \(keys \['user', 'x'\]\)"):
        read_user_ids(data, "author")
    with pytest.raises(ValueError, match=r"user_key='user': example 0 has no such column \(tuple\)"):
        read_user_ids(tensors, "user")
    with pytest.raises(ValueError, match="user_key='author'.*no such column"):
        read_user_ids(hf, "author")
    with pytest.raises(ValueError, match="non-empty training set"):
        read_user_ids([], "user")


def test_user_collate_and_flatten_users_shapes() -> None:
    data = Examples([0, 1, 0, 2, 0], "tokens")
    regrouped, batch = _user_batch(data, 3)
    assert isinstance(batch, UserBatch) and set(batch) == {"rows", "weights"}
    assert batch["rows"]["ids"].shape == (3, 3, SEQ) and batch["rows"]["y"].shape == (3, 3, SEQ)
    assert batch["rows"]["idx"].tolist() == [[0, 2, 4], [1, 1, 1], [3, 3, 3]]
    assert batch["weights"].dtype == torch.float32 and batch["weights"].shape == (3, 3)
    rows, weights = flatten_users(batch)
    assert rows["ids"].shape == (9, SEQ) and rows["idx"].tolist() == [0, 2, 4, 1, 1, 1, 3, 3, 3]
    torch.testing.assert_close(rows["ids"][:3], data.x[[0, 2, 4]])
    assert weights is batch["weights"]
    assert flatten_users(dict(batch))[0]["ids"].shape == (9, SEQ)  # a plain dict, as a trainer may rebuild it

    # an empty Poisson batch: zero users, zero rows
    empty = EmptyBatchCollate(UserCollate(default_collate, regrouped), regrouped)([])
    rows, weights = flatten_users(empty)
    assert weights.shape == (0, 3) and rows["ids"].shape == (0, SEQ) and rows["y"].shape == (0, SEQ)
    assert user_losses(torch.zeros(0), weights).shape == (0,)

    with pytest.raises(ValueError, match="privacy_unit='user' expects the batches of the DP training loader"):
        flatten_users(batch["rows"])
    with pytest.raises(ValueError, match="got tuple"):
        flatten_users((rows, weights))


def test_user_losses_are_weighted_means_that_ignore_padding() -> None:
    weights = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0]])
    rows = torch.tensor([1.0, 3.0, float("nan"), 3.0, 6.0, 9.0, 4.0, float("inf"), float("nan")], requires_grad=True)
    losses = user_losses(rows, weights)
    torch.testing.assert_close(losses, torch.tensor([2.0, 6.0, 4.0]))
    losses.sum().backward()
    expected = torch.tensor([0.5, 0.5, 0.0, 1 / 3, 1 / 3, 1 / 3, 1.0, 0.0, 0.0])
    torch.testing.assert_close(rows.grad, expected)  # padding rows get a zero (finite) gradient
    with pytest.raises(
        ValueError, match=r"one loss per row of its batch, shape \[9\] \(3 users x 3 rows each\), got \(3,\)"
    ):
        user_losses(torch.zeros(3), weights)
    with pytest.raises(ValueError, match=r"got \(3, 3\)"):
        user_losses(torch.zeros(3, 3), weights)


def test_user_losses_are_exact_means_in_float64() -> None:
    data = [{"v": float(i), "user": 0} for i in range(3)]
    regrouped = UserDataset(data, read_user_ids(data, "user"), 3, drop_key="user")
    batch = UserCollate(default_collate, regrouped)([regrouped[0]])
    rows, weights = flatten_users(batch)
    values = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(user_losses(values, weights)[0], values.mean(), rtol=1e-15, atol=0)  # float64, not 32


def test_the_summary_of_an_engine_prepared_without_the_loader() -> None:
    engine = PrivacyEngine(noise_multiplier=1.0, privacy_unit="user", user_key="user", seed=0)
    engine.attach(nn.Linear(2, 1))
    engine.prepare(num_samples=100, sample_rate=0.1, total_steps=10)
    assert any("privacy unit" in line and "all of their examples" in line for line in engine.startup_lines())
    summary = engine.summary()
    assert summary["privacy_unit"] == "user" and summary["num_users"] == 100 and summary["examples_per_user"] == "all"


# ---------------------------------------------------------------------------------------------- options
BAD_OPTIONS = [
    ({"privacy_unit": "user"}, "privacy_unit='user' needs user_key"),
    ({"privacy_unit": "person", "user_key": "user"}, r"privacy_unit must be one of \('example', 'user'\)"),
    ({"user_key": "user"}, "user_key and examples_per_user apply to user-level privacy only"),
    ({"examples_per_user": 4}, "user_key and examples_per_user apply to user-level privacy only"),
    ({"privacy_unit": "user", "user_key": "user", "examples_per_user": 0}, "examples_per_user must be an integer >= 1"),
    ({"privacy_unit": "user", "user_key": "user", "examples_per_user": 2.5}, "examples_per_user must be an integer"),
    ({"privacy_unit": "user", "user_key": "user", "poisson_sampling": False}, "keep poisson_sampling=True"),
]


@pytest.mark.parametrize(
    ("options", "message"),
    BAD_OPTIONS,
    ids=["no_user_key", "unknown_unit", "user_key_alone", "examples_per_user_alone", "zero_k", "float_k", "no_poisson"],
)
def test_the_user_options_are_validated_on_every_surface(options: dict, message: str) -> None:
    for make in (
        lambda: PrivacyConfig(noise_multiplier=1.0, **options),
        lambda: DPStrategy(noise_multiplier=1.0, **options),
        lambda: PrivacyArguments(noise_multiplier=1.0, **options),
    ):
        with pytest.raises(ValueError, match=message):
            make()


def test_good_user_options_are_accepted() -> None:
    config = PrivacyConfig(noise_multiplier=1.0, privacy_unit="user", user_key=lambda e: e["author"])
    assert config.privacy_unit == "user" and config.examples_per_user is None
    arguments = PrivacyArguments(noise_multiplier=1.0, privacy_unit="user", user_key="user", examples_per_user=8)
    assert arguments.to_config().examples_per_user == 8
    assert PrivacyConfig(noise_multiplier=1.0).privacy_unit == "example"


# ------------------------------------------------------------------------------- augmentation multiplicity
def test_identical_copies_over_users_train_exactly_as_one_copy() -> None:
    """A user's K rows each repeated twice (no augmentation): the clipped unit is the user's 2 K rows, its mean
    gradient the same, so the same Poisson samples, subsets and noise give the parameters of one copy."""
    users = [u for u in range(8) for _ in range(1 + u % 4)]  # 1 to 4 examples: random subsets of 3 for some
    data = Examples(users, "dense", dtype=torch.float32, seed=4)
    states, seen = [], []
    for copies in (1, 2):
        module = UserClassifier(data, batch_size=4, copies=copies, lr=0.5)
        strategy = _user_strategy(examples_per_user=3, augmentation_multiplicity=copies)
        make_trainer(strategy, max_steps=3).fit(module)
        assert strategy.privacy_engine.rows_per_unit == 3 * copies
        states.append(module.state_dict())
        seen.append([s.tolist() for s in module.seen])
    assert seen[0] == seen[1] and len(seen[0]) == 3
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert any(
        not torch.equal(value, p)
        for value, p in zip(states[0].values(), UserClassifier(data, 4).state_dict().values(), strict=True)
    )


# ------------------------------------------------------------------------------------------ checks, paths
class MixingClassifier(UserClassifier):
    """Centres each row's input on a mean over rows before the forward: over the whole batch (``"batch"``: users
    mix, which must be refused) or over the user's own ``K`` rows (``"user"``: one unit, allowed)."""

    def __init__(self, data: Dataset, mixing: str, k: int) -> None:
        super().__init__(data, batch_size=4)
        self.mixing, self.k = mixing, k

    def training_step(self, batch, batch_idx):
        x = batch["x"]
        if self.mixing == "batch":
            x = x - x.mean(0, keepdim=True)
        else:
            by_user = x.reshape(-1, self.k, x.shape[-1])
            x = (by_user - by_user.mean(1, keepdim=True)).reshape(x.shape)
        return F.cross_entropy(self.net(x), batch["y"], reduction="none")


def test_mixing_across_users_is_refused_and_within_a_user_allowed() -> None:
    from lightning_dp.checks import BatchMixingError

    users = [u for u in range(10) for _ in range(2 + u % 2)]  # 2 or 3 examples each
    data = Examples(users, "dense", dtype=torch.float32, seed=5)
    module = MixingClassifier(data, "user", 3)
    strategy = _user_strategy(examples_per_user=3)
    make_trainer(strategy, max_steps=2).fit(module)
    assert strategy.privacy_engine.summary()["steps"] == 2
    with pytest.raises(BatchMixingError, match="batch-independence check"):
        make_trainer(_user_strategy(examples_per_user=3), max_steps=2).fit(MixingClassifier(data, "batch", 3))


class TupleRegressor(pl.LightningModule):
    """Linear on ``(x, y, user)`` tuples of a TensorDataset (the user column travels with the rows, unused)."""

    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 1))
        self.data = data

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return ((self.net(x).squeeze(-1) - y) ** 2) * 0.5

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def test_one_example_per_user_trains_exactly_as_example_level() -> None:
    """A user_key function on tuple examples, each user with one example: the same Poisson masks (N, q alike), one
    row of weight 1 per user and the same noise give the parameters of the example-level run."""
    generator = torch.Generator().manual_seed(6)
    data = TensorDataset(
        torch.randn(16, D, generator=generator), torch.randn(16, generator=generator), torch.arange(16)
    )
    states = []
    for options in ({}, {"privacy_unit": "user", "user_key": lambda example: int(example[2])}):
        module = TupleRegressor(data)
        strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.3, seed=0, **options)
        make_trainer(strategy, max_steps=3).fit(module)
        summary = strategy.privacy_engine.summary()
        assert summary["sample_rate"] == pytest.approx(0.25) and summary.get("num_users", 16) == 16
        states.append((module.state_dict(), summary["epsilon"]))
    (example_state, example_epsilon), (user_state, user_epsilon) = states
    assert user_epsilon == pytest.approx(example_epsilon, rel=1e-12)
    for name, value in example_state.items():
        torch.testing.assert_close(user_state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert any(
        not torch.equal(v, w)
        for v, w in zip(example_state.values(), TupleRegressor(data).state_dict().values(), strict=True)
    )


def _subsets_through_a_loader(workers: int) -> list[tuple[int, ...]]:
    """The subsets of 4 of user 0's 12 examples drawn over 8 steps (q = 1) by a loader with ``workers`` workers."""
    data = [{"v": i, "user": 0} for i in range(12)] + [{"v": 12, "user": 1}]
    regrouped = UserDataset(data, read_user_ids(data, "user"), 4, seed=0, drop_key="user")
    sampler = PoissonBatchSampler(len(regrouped), 1.0, num_steps=8, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(
        regrouped,
        batch_sampler=UserDraws(sampler),  # as the engine's loader: draws numbered in the main process
        collate_fn=EmptyBatchCollate(UserCollate(default_collate, regrouped), regrouped),
        num_workers=workers,
    )
    return [tuple(sorted(batch["rows"]["v"][0].tolist())) for batch in loader]


def test_a_loader_draws_fresh_subsets_for_every_step() -> None:
    subsets = _subsets_through_a_loader(0)
    assert len(set(subsets)) == len(subsets) == 8


def test_loader_workers_draw_fresh_subsets_for_every_step() -> None:
    subsets = _subsets_through_a_loader(2)
    assert len(set(subsets)) == len(subsets) == 8


@pytest.mark.parametrize("bad", [float("nan"), None, [1, 2], torch.tensor([1, 2])])
def test_user_ids_that_would_split_or_merge_people_are_refused(bad: object) -> None:
    data = [{"v": 0, "user": 1}, {"v": 1, "user": bad}]
    with pytest.raises(ValueError, match="example 1"):
        read_user_ids(data, "user")


def test_resume_refuses_example_level_steps_and_another_user_key() -> None:
    def engine(**options: object) -> PrivacyEngine:
        made = PrivacyEngine(noise_multiplier=1.0, seed=0, **options)
        made.attach(nn.Linear(2, 1))
        return made

    example = engine()
    example.prepare(num_samples=1000, sample_rate=0.01, total_steps=10)
    example.record_step()
    with pytest.raises(ValueError, match="privacy_unit='example'"):
        engine(privacy_unit="user", user_key="user").load_state_dict(example.state_dict())
    users = engine(privacy_unit="user", user_key="user")
    users.prepare(num_samples=100, sample_rate=0.1, total_steps=10)
    users.record_step()
    with pytest.raises(ValueError, match="grouped users by 'user', this run by 'author'"):
        engine(privacy_unit="user", user_key="author").load_state_dict(users.state_dict())
    resumed = engine(privacy_unit="user", user_key="user")
    resumed.load_state_dict(users.state_dict())  # the same unit and key: continues the ledger
    assert resumed.steps == 1
    engine().load_state_dict(users.state_dict())  # user-level steps are example-level private too


def test_a_step_returning_one_loss_per_user_is_told_to_return_one_per_row() -> None:
    class PerUser(UserClassifier):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)[::K]

    data = Examples(USER_OF, "dense", dtype=torch.float32, seed=1)
    strategy = _user_strategy(examples_per_user=K)
    with pytest.raises(ValueError, match="return one loss per row of the batch"):
        make_trainer(strategy, max_steps=1).fit(PerUser(data, batch_size=3))
