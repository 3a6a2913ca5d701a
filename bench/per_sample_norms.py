"""Per-example gradient norms of a GLUE recipe's trained parameters at its start, and the new head's share of them:
what a clipping bound is set against (docs/recipes/sst2_full.md, "Why clip at 1").

    python bench/per_sample_norms.py --record sst2_full    # measure, then render docs/recipes/sst2_full.md
    python bench/per_sample_norms.py --render              # only re-render from docs/bench/per_sample_norms/*.json

The recipe's configuration (``--config``, default ``configs/glue_sst2_full_offline.yaml``) builds its model exactly as
``recipes/glue.py`` does (seeded by ``--seed``: the new head and LoRA adapters at their initialisation) and its
training set; ``--examples`` training examples, drawn with a generator seeded by ``--seed``, each get one forward and
backward pass alone, in train mode as in training (dropout on, seeded), and the l2 norm of that example's gradient
over all trained parameters, and over the head's (names containing ``--head``), is kept: the exact per-example
gradient, computed independently of the library's clipping engines, with the probability ``p_y`` the model gives the
example's label. Reported: quantiles of both norms, the head's share of the squared norm, the fraction of examples a
bound ``C`` clips at the start, and how confident an example must become before its head gradient falls below ``C``:
for a linear head under cross-entropy on two classes the head's gradient is ``(p - e_y) [h; 1]^T``, of norm
``sqrt(2) (1 - p_y) sqrt(|h|^2 + 1)``, so with the head's input ``h`` as it is the example leaves the bound's reach
once ``p_y > 1 - C (1 - p_y) / |head gradient|`` (the median of that threshold over the examples is reported). Data:
the recipe's data root (``--data_dir`` or ``LIGHTNING_DP_DATA``, docs/recipes.md "Local data").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from records import add_record_options, render_records, run_or_render
from transformers import DataCollatorWithPadding

from lightning_dp.recipes import glue, run
from lightning_dp.tasks import pretrained
from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "per_sample_norms"
PAGE = ROOT / "docs" / "recipes" / "sst2_full.md"
START, END = "<!-- norms:start -->", "<!-- norms:end -->"
QUANTILES = (10, 50, 90)
BOUNDS = (0.1, 1.0)


def per_example_norms(args: argparse.Namespace) -> dict[str, list[float]]:
    """For ``args.examples`` training examples: the l2 norms of their gradients over every trained parameter
    (``totals``) and over the head's (names containing ``args.head``, ``heads``), and the probability of their label
    (``p_label``); the model and data as ``recipes/glue.py`` builds them.

    Raises:
        ValueError: no trained parameter's name contains ``args.head``, or the task has more than two classes.
    """
    with tempfile.TemporaryDirectory() as output_dir:
        flags = ["--config", args.config, "--output_dir", output_dir, "--seed", str(args.seed)]
        if args.data_dir is not None:
            flags += ["--data_dir", args.data_dir]
        recipe, _, _ = run.parse_recipe(glue.GlueArguments, flags)  # seeds every generator, as the recipe does
    classes = len(glue.TASKS[recipe.task].label_names)
    if classes != 2:
        raise ValueError(f"the confidence threshold is derived for two classes; {recipe.task} has {classes}")
    train_examples, _ = glue.load_examples(recipe)
    model = glue.load_model(recipe, classes)
    tokenizer = pretrained.load_tokenizer(recipe.model_name_or_path, recipe.cache_dir)
    dataset = glue.GlueDataset(train_examples, tokenizer, recipe.max_length)
    collate = DataCollatorWithPadding(tokenizer)
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not any(args.head in name for name, _ in trained):
        raise ValueError(f"no trained parameter name contains {args.head!r}")
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))[: args.examples]
    model.train()
    measured: dict[str, list[float]] = {"totals": [], "heads": [], "p_label": []}
    for index in chosen.tolist():
        model.zero_grad(set_to_none=True)
        batch = collate([dataset[index]])
        output = model(**batch)
        output.loss.backward()
        squares = {name: float(p.grad.double().pow(2).sum()) for name, p in trained}
        measured["totals"].append(sum(squares.values()) ** 0.5)
        measured["heads"].append(sum(v for name, v in squares.items() if args.head in name) ** 0.5)
        measured["p_label"].append(float(output.logits.double().softmax(-1)[0, int(batch["labels"][0])]))
    return measured


def _quantile(values: list[float], percent: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[percent - 1]


def markdown(record: dict[str, Any]) -> str:
    """A record as the page shows it: the command, then the quantiles of the two norms, the head's share and the
    fraction of examples each bound clips."""
    totals, heads, args = record["totals"], record["heads"], record["args"]
    shares = [(h / t) ** 2 for h, t in zip(heads, totals, strict=True)]
    thresholds = {
        c: statistics.median(1 - c * (1 - p) / h for p, h in zip(record["p_label"], heads, strict=True)) for c in BOUNDS
    }
    quantiles = " / ".join(f"{q}%" for q in QUANTILES)
    lines = [
        f"{len(totals)} training examples of `{args['config']}` at the start of training (seed {args['seed']}):",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        f"| gradient norm over | quantiles {quantiles} |",
        "|---|---|",
        f"| every trained parameter | {' / '.join(f'{_quantile(totals, q):.3g}' for q in QUANTILES)} |",
        f"| the new head (`{args['head']}`) | {' / '.join(f'{_quantile(heads, q):.3g}' for q in QUANTILES)} |",
        "",
        f"The head's share of an example's squared norm: median {statistics.median(shares):.1%}, smallest "
        f"{min(shares):.1%}.",
        "",
        "| bound C | examples clipped at the start | median confidence p_y above which an example's head gradient "
        "falls below C |",
        "|---|---|---|",
        *(f"| {c:g} | {sum(t > c for t in totals) / len(totals):.0%} | {thresholds[c]:.4f} |" for c in BOUNDS),
    ]
    return "\n".join(lines)


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)


def report_lines(record: dict[str, Any]) -> list[str]:
    return markdown(record).splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", default="configs/glue_sst2_full_offline.yaml", help="a GLUE recipe config")
    parser.add_argument("--data_dir", default=None, help="the data root (default: $LIGHTNING_DP_DATA)")
    parser.add_argument("--examples", type=int, default=200, help="training examples measured")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation and the examples drawn")
    parser.add_argument("--head", default="classifier", help="what the head's parameter names contain")
    add_record_options(parser, RECORDS)
    args = parser.parse_args()
    run_or_render(
        args, per_example_norms, render, script="bench/per_sample_norms.py", records=RECORDS, report_lines=report_lines
    )


if __name__ == "__main__":
    main()
