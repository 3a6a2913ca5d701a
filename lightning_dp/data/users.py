"""User-level privacy: the unit of privacy is a person, not one example (McMahan, Ramage, Talwar and Zhang 2018,
Section 2; docs/privacy.md, "User-level privacy"; how and why: docs/design.md section 4.9).

With ``privacy_unit="user"`` the data is regrouped by user before Poisson sampling: :class:`UserDataset` has one
item per user (``N`` users, ``q = batch_size / N``: the batch size counts users); each sampled user brings ``K =
examples_per_user`` rows (padded at weight 0, or a fresh random ``K``-subset); :class:`UserCollate` returns
:class:`UserBatch` ``{"rows": [U, K, ...], "weights": [U, K]}``; the step sees the rows flattened to ``[U K, ...]``
(:func:`flatten_users`) and returns ``[U K]``; :func:`user_losses` gives user ``u``'s loss, the mean over their real
rows, whose gradient is clipped once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import Dataset, Sampler

from lightning_dp.data.example_lists import (
    EXAMPLE_SEQUENCES,
    Path,
    ValueSequence,
    find_example_paths,
    mark_examples,
)

#: the values of the ``privacy_unit`` option.
PRIVACY_UNITS = ("example", "user")

UserKey = str | Callable[[Any], Hashable]


def validate_user_options(privacy_unit: object, user_key: object, examples_per_user: object) -> None:
    """Check the user-level options together.

    Raises:
        ValueError: ``privacy_unit`` not one of :data:`PRIVACY_UNITS`; ``"user"`` without ``user_key`` (a column
            name or a function of an example); ``user_key`` or ``examples_per_user`` with ``privacy_unit="example"``;
            ``examples_per_user`` neither ``None`` nor an integer ``>= 1``.
    """
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
    integer = isinstance(examples_per_user, numbers.Integral) and not isinstance(examples_per_user, bool)
    if examples_per_user is not None and not (integer and cast(int, examples_per_user) >= 1):  # an Integral
        raise ValueError(
            "examples_per_user must be an integer >= 1 (the cap on a sampled user's examples per step) or None (all "
            f"of them), got {examples_per_user!r}"
        )
    if privacy_unit == "user":
        if user_key is None or not (isinstance(user_key, str) or callable(user_key)):
            raise ValueError(
                "privacy_unit='user' needs user_key: the name of the column (key of each example) holding the user, "
                f"or a function example -> user; got {user_key!r}"
            )
    elif user_key is not None or examples_per_user is not None:
        raise ValueError(
            "user_key and examples_per_user apply to user-level privacy only: set privacy_unit='user', or remove them"
        )


def read_user_ids(dataset: Any, user_key: UserKey) -> list[Hashable]:
    """The user of every example of ``dataset``, in index order.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``); a HF ``datasets.Dataset`` whose columns include
            ``user_key`` is read as one column.
        user_key: a column name (the key of a mapping example) or a function ``example -> user`` (any hashable).

    Returns:
        ``N`` user ids (plain Python values: tensors are turned into numbers).

    Raises:
        ValueError: an empty dataset; an example that is not a mapping holding ``user_key``; an id that is ``None``,
            NaN, a tensor of several elements or unhashable.
    """
    if len(dataset) == 0:
        raise ValueError("user-level privacy needs a non-empty training set")
    if isinstance(user_key, str) and user_key in (getattr(dataset, "column_names", None) or ()):
        ids = list(dataset[user_key])
    else:
        ids = []
        for index in range(len(dataset)):
            example = dataset[index]
            if callable(user_key):
                ids.append(user_key(example))
            elif isinstance(example, Mapping) and user_key in example:
                ids.append(example[user_key])
            else:
                kind = f"keys {sorted(example)}" if isinstance(example, Mapping) else type(example).__name__
                raise ValueError(
                    f"user_key={user_key!r}: example {index} has no such column ({kind}); give the column holding "
                    "each example's user, or a function example -> user"
                )
    return [_user_id(value, index) for index, value in enumerate(ids)]


def _user_id(value: Any, index: int) -> Hashable:
    """A plain, hashable id for example ``index``'s user.

    Raises:
        ValueError: ``None``, NaN (two NaN ids never compare equal, so one person would become many users), a
            tensor of more than one element, or an unhashable value.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"example {index}'s user id is a tensor of shape {tuple(value.shape)}: give one value")
        value = value.item()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(
            f"example {index} has no user id ({value!r}): every example needs its user (NaN ids would each be a "
            "different user, so one person could contribute several times); fill or drop such examples"
        )
    try:
        hash(value)
    except TypeError as error:
        raise ValueError(f"example {index}'s user id {value!r} is not hashable: give a number or a string") from error
    return value


@dataclass
class UserExamples:
    """One sampled user's rows: ``K`` examples (real ones first, then padding) and their loss weights ``[K]``
    (``1 / n`` for the ``n`` real rows, 0 for padding)."""

    examples: list[Any]
    weights: list[float]


class UserDataset(Dataset):
    """A dataset with one item per user (module docstring); users in order of first appearance.

    Args:
        dataset: the example-level map-style dataset.
        user_ids: ``[N]`` the user of every example (:func:`read_user_ids`).
        examples_per_user: ``K``, the rows each sampled user brings; ``None``: the largest user's count.
        seed: seeds the random subsets of users with more than ``K`` examples.
        drop_key: a key removed from mapping examples before collation (the user column), or ``None``.

    Raises:
        ValueError: ``user_ids`` not of ``len(dataset)`` entries; an empty dataset; ``examples_per_user < 1``.
    """

    def __init__(
        self,
        dataset: Any,
        user_ids: Sequence[Hashable],
        examples_per_user: int | None = None,
        *,
        seed: int = 0,
        drop_key: str | None = None,
    ) -> None:
        if len(user_ids) != len(dataset) or len(dataset) == 0:
            raise ValueError(f"need one user id per example, got {len(user_ids)} ids for {len(dataset)} examples")
        validate_user_options("user", "user_ids", examples_per_user)  # only the cap is checked here
        members: dict[Hashable, list[int]] = {}
        for index, user in enumerate(user_ids):
            members.setdefault(user, []).append(index)
        self.dataset = dataset
        #: the users, in order of first appearance (item ``u`` is ``users[u]``).
        self.users = list(members)
        self.members = [torch.tensor(indices) for indices in members.values()]
        #: ``[U]`` each user's number of examples.
        self.counts = torch.tensor([len(indices) for indices in members.values()])
        self.examples_per_user = int(examples_per_user or int(self.counts.max()))
        self.seed = int(seed)
        self.drop_key = drop_key

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, index: int | tuple[int, int]) -> UserExamples:
        """User ``index``'s rows, or with ``index = (user, draw)`` that user's ``draw``-th draw (:class:`UserDraws`
        numbers them in the loader's main process); a plain index is draw 0."""
        user, draw = index if isinstance(index, tuple) else (index, 0)
        indices = self.members[user]
        k = self.examples_per_user
        if len(indices) > k:
            generator = torch.Generator().manual_seed(hash((self.seed, user, draw)) & (2**63 - 1))
            indices = indices[torch.randperm(len(indices), generator=generator)[:k]]
        real = len(indices)
        padded = torch.cat([indices, indices.repeat(k)[: k - real]]) if real < k else indices
        examples = [self.example(int(i)) for i in padded]
        return UserExamples(examples, [1.0 / real] * real + [0.0] * (k - real))

    def example(self, index: int) -> Any:
        """Example ``index`` of the example-level data set as the collator receives it (``drop_key`` removed)."""
        example = self.dataset[index]
        if self.drop_key is not None and isinstance(example, Mapping) and self.drop_key in example:
            example = {key: value for key, value in example.items() if key != self.drop_key}
        return example


class UserDraws(Sampler[list[tuple[int, int]]]):
    """Wrap a batch sampler of user indices to yield ``(user, draw)`` pairs, ``draw`` counting the user's earlier draws.

    Runs in the loader's main process, so each draw of a user gets a fresh subset across epochs and workers.

    Args:
        batch_sampler: yields lists of user indices (e.g. :class:`~lightning_dp.data.PoissonBatchSampler`).
    """

    def __init__(self, batch_sampler: Sampler[list[int]]) -> None:
        self.batch_sampler = batch_sampler
        self._draws: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for users in self.batch_sampler:
            batch = []
            for user in users:
                draw = self._draws.get(user, 0)
                self._draws[user] = draw + 1
                batch.append((user, draw))
            yield batch


class UserBatch(dict):
    """A collated batch of ``U`` users: ``{"rows": <collated examples, tensors [U, K, ...]>, "weights": [U, K]}``.

    A dict (so trainers move it to the device and read its batch size, ``U``, from its first tensor)."""


class UserCollate:
    """Collate :class:`UserExamples` into a :class:`UserBatch` with the loader's own ``collate_fn`` (picklable).

    Every collated tensor whose first dimension is ``U K`` is reshaped to ``[U, K, ...]``, others kept: a collator
    must not add a tensor of ``U K`` first entries that is not one entry per row. The lists and tuples that hold one
    entry per row (found once, at construction, from the collates of the first example once and twice,
    :func:`~lightning_dp.data.example_lists.per_example_paths`) are grouped into a marked sequence of ``U`` tuples of
    ``K`` entries; other lists are kept whole.

    Args:
        collate_fn: the example-level collator (e.g. ``default_collate`` or a HF data collator).
        users: the data regrouped by user, whose first example shows where the per-row lists are.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], users: UserDataset) -> None:
        self.collate_fn = collate_fn
        #: Where the collated rows hold a list or tuple of one entry per row.
        self.example_paths: tuple[Path, ...] = find_example_paths(collate_fn, users.example(0))[1]

    def __call__(self, users: Sequence[UserExamples]) -> UserBatch:
        count, k = len(users), len(users[0].examples)
        rows = self.collate_fn([example for user in users for example in user.examples])

        def by_user(value: torch.Tensor | ValueSequence) -> Any:
            if not isinstance(value, torch.Tensor):  # a per-row sequence: grouped, what it holds not looked into
                if len(value) != count * k:
                    return value
                return type(value)(tuple(value[u * k : (u + 1) * k]) for u in range(count))
            if value.ndim == 0 or value.shape[0] != count * k:
                return value
            return value.reshape(count, k, *value.shape[1:])

        weights = torch.tensor([user.weights for user in users], dtype=torch.float32)
        rows = mark_examples(rows, self.example_paths)
        return UserBatch(rows=apply_to_collection(rows, (torch.Tensor, *EXAMPLE_SEQUENCES), by_user), weights=weights)


def flatten_users(batch: Any) -> tuple[Any, torch.Tensor]:
    """The rows of a user batch as the training step expects them, and their weights.

    Args:
        batch: a :class:`UserBatch` (or a mapping with its keys): ``"rows"`` ``[U, K, ...]``, ``"weights"`` ``[U, K]``.

    Returns:
        ``(rows, weights)``: every ``[U, K, ...]`` tensor reshaped to ``[U K, ...]`` (user ``u``'s rows ``u K .. u K +
        K - 1``), every marked sequence of ``U`` groups of ``K`` entries flattened the same way, and ``weights``
        ``[U, K]``.

    Raises:
        ValueError: ``batch`` is not a user batch (a loader other than the engine's under ``privacy_unit="user"``).
    """
    if not isinstance(batch, Mapping) or set(batch) != {"rows", "weights"}:
        raise ValueError(
            "privacy_unit='user' expects the batches of the DP training loader (one UserBatch of {'rows', 'weights'} "
            f"per step), got {type(batch).__name__}: train with the loader the strategy or DPTrainer builds"
        )
    weights = batch["weights"]
    count, k = weights.shape

    def flat(value: torch.Tensor | ValueSequence) -> Any:
        if isinstance(value, torch.Tensor):
            if value.ndim < 2 or tuple(value.shape[:2]) != (count, k):
                return value
            return value.reshape(count * k, *value.shape[2:])
        if len(value) != count or any(not isinstance(group, tuple) or len(group) != k for group in value):
            return value
        return type(value)(entry for group in value for entry in group)

    return apply_to_collection(batch["rows"], (torch.Tensor, *EXAMPLE_SEQUENCES), flat), weights


def user_losses(row_losses: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each user's loss, ``L_u = sum_k w_uk loss_uk``, the mean over their real rows (padding left out even if not
    finite).

    Args:
        row_losses: ``[U K]``, one loss per row of the flattened batch (user-major).
        weights: ``[U, K]`` (``1 / n_u`` per real row, 0 for padding).

    Returns:
        ``[U]`` (differentiable).

    Raises:
        ValueError: ``row_losses`` not of shape ``[U K]``.
    """
    count, k = weights.shape
    if not isinstance(row_losses, torch.Tensor) or tuple(row_losses.shape) != (count * k,):
        shape = tuple(row_losses.shape) if isinstance(row_losses, torch.Tensor) else type(row_losses).__name__
        raise ValueError(
            f"with privacy_unit='user' the training step must return one loss per row of its batch, shape "
            f"[{count * k}] ({count} users x {k} rows each), got {shape}"
        )
    rows = row_losses.reshape(count, k)
    real = (weights > 0).to(rows.device)  # the mean in the loss's dtype (the weights are float32 1 / n_u)
    total = torch.where(real, rows, torch.zeros_like(rows)).sum(1)
    return total / real.sum(1).clamp(min=1).to(rows.dtype)
