"""How ``DPTrainer`` honours ``TrainingArguments.train_sampling_strategy`` under Poisson sampling.

``"random"`` (default): Poisson sampling. ``"group_by_length"``: each Poisson batch is split into micro-batches of
similar lengths (only with ``gradient_accumulation_steps > 1``); HF's grouping across batches is not used, since it
makes batches depend on each other. ``"sequential"`` and ``"batch_rebalance"``: ignored with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase, TrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler

log = logging.getLogger("lightning_dp")


def sampling_strategy(args: TrainingArguments) -> str:
    """The Trainer's training sampling strategy, ``args.train_sampling_strategy``."""
    return str(args.train_sampling_strategy)


def poisson_batch_lengths(
    args: TrainingArguments, dataset: Dataset, processing_class: PreTrainedTokenizerBase | Any | None
) -> list[int] | None:
    """The examples' lengths that group each Poisson batch's micro-batches, or ``None`` (keep the data order).

    Found as for the Trainer's ``LengthGroupedSampler``: the ``length_column_name`` column, else the length of each
    example's first model input.

    Args:
        args: the Trainer's arguments.
        dataset: the training set as given to the Trainer (with its length column).
        processing_class: the Trainer's tokenizer or processor, or ``None``.

    Returns:
        ``[N]`` lengths with ``"group_by_length"`` and ``gradient_accumulation_steps > 1``, else ``None``.

    Raises:
        ValueError: ``"group_by_length"`` on a dataset whose examples are not mappings holding the model input, and
            with no length column.
    """
    strategy = sampling_strategy(args)
    if strategy == "random":
        return None
    if strategy != "group_by_length":
        log.warning(
            "train_sampling_strategy=%r is ignored under DP: batches are Poisson samples (the sampling the "
            "accountant assumes); 'group_by_length' is the strategy DPTrainer keeps (micro-batches of similar "
            "lengths within each Poisson batch)",
            strategy,
        )
        return None
    if args.gradient_accumulation_steps == 1:
        return None
    column = None
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None and args.length_column_name in column_names:
        column = list(dataset[args.length_column_name])
    input_names = getattr(processing_class, "model_input_names", None)
    sampler = LengthGroupedSampler(
        1, dataset=dataset, lengths=column, model_input_name=input_names[0] if input_names else None
    )
    return [int(length) for length in sampler.lengths]
