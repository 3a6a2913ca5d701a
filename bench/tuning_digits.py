"""A private hyper-parameter search against one run and against a naive best-of-K, on the digits demo
(docs/tuning.md, "Measured example").

    python bench/tuning_digits.py --record digits     # the runs (1 thread), then render docs/tuning.md
    python bench/tuning_digits.py --render            # only re-render from docs/bench/tuning/*.json

Per seed, each arm trains the demo's CNN (:func:`lightning_dp.cli.tune.digits_candidate`: 15 epochs, expected batch
128, Gaussian noise) and reports the test accuracy of what it releases:

- **search**: :func:`lightning_dp.tuning.private_search` over the learning rate and the clipping bound, geometric number
  of candidates of mean 3, the noise calibrated so that the whole search has epsilon 3 (RDP);
- **one run**: the demo's default hyper-parameters (learning rate 1, ``C = 1``) at epsilon 3 (RDP, the same
  accountant);
- **naive best-of-3**: three candidates drawn from the same space, each at epsilon 3, the best by validation
  accuracy; its true cost (the three runs composed, RDP) is recorded beside it, and it is what a search that ignores
  tuning would claim as epsilon 3.

The number of candidates each search drew is recorded: a bench is an experiment with a known seed, not a release.
Torch runs on one thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

from demo_variants import record_heading
from records import add_record_options, mean_std, render_records, run_or_render

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "tuning"
PAGE = ROOT / "docs" / "tuning.md"
START, END = "<!-- tuning:start -->", "<!-- tuning:end -->"
SPACE = {"lr": [0.5, 1.0, 2.0, 4.0], "max_grad_norm": [0.5, 1.0, 2.0], "momentum": [0.5]}
DEFAULT = {"lr": 1.0, "max_grad_norm": 1.0, "momentum": 0.5}
DELTA = 1e-5


def test_accuracy(weights: dict[str, Any], batch_size: int) -> float:
    """The accuracy of ``DigitsCNN`` with ``weights`` on the digits' test split."""
    import torch

    from lightning_dp.tasks.digits import DigitsCNN, DigitsDataModule

    model, data = DigitsCNN(), DigitsDataModule(batch_size=batch_size)
    model.load_state_dict(weights)
    data.setup()
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in data.test_dataloader():
            correct += int((model(x).argmax(dim=1) == y).sum())
    return correct / len(data.test_set)


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The three arms of one seed."""
    from lightning_dp.cli.tune import digits_candidate, digits_schedule
    from lightning_dp.mechanisms import make_mechanism
    from lightning_dp.mechanisms.calibration import calibrate, mechanism_epsilon
    from lightning_dp.tuning import Candidate, RepetitionDistribution, SearchPlan, private_search
    from lightning_dp.tuning.randomness import SearchRandomness
    from lightning_dp.tuning.space import draw_candidate

    sample_rate, steps = digits_schedule(args.batch_size, args.epochs)
    schedule = {"sample_rate": sample_rate, "steps": steps, "target_delta": DELTA}
    train = digits_candidate(epochs=args.epochs, batch_size=args.batch_size, target_delta=DELTA)
    repetitions = RepetitionDistribution(args.mean, 1.0)
    plan = SearchPlan.for_target_epsilon(args.target_epsilon, repetitions=repetitions, **schedule)
    single = calibrate("gaussian", target_epsilon=args.target_epsilon, max_grad_norm=1.0, accountant="rdp", **schedule)
    sigma = single.noise_multiplier
    drawn: list[Candidate] = []

    def counted(candidate: Candidate) -> tuple[float, Any]:
        drawn.append(candidate)
        return train(candidate)

    with tempfile.TemporaryDirectory() as folder:
        result = private_search(counted, SPACE, plan, folder, seed=seed)
    search = {
        "test_acc": test_accuracy(result.artifact, args.batch_size) if result.released else None,
        "val_acc": result.score,
        "hparams": result.hparams,
        "epsilon": result.epsilon,
        "candidate_epsilon": result.candidate_epsilon,
        "noise_multiplier": plan.noise_multiplier,
        "candidates": len(drawn),
    }
    others = SearchRandomness(seed + 1000)  # the other arms' draws and run seeds
    score, weights = train(Candidate(DEFAULT, sigma, sample_rate, steps, others.candidate_seed(0)))
    one_run = {"test_acc": test_accuracy(weights, args.batch_size), "val_acc": score, "noise_multiplier": sigma}
    naive_runs = []
    for index in range(1, round(args.mean) + 1):
        hparams = draw_candidate(SPACE, others)
        score, weights = train(Candidate(hparams, sigma, sample_rate, steps, others.candidate_seed(index)))
        naive_runs.append((score, hparams, weights))
    score, hparams, weights = max(naive_runs, key=lambda run: run[0])
    naive = {
        "test_acc": test_accuracy(weights, args.batch_size),
        "val_acc": score,
        "hparams": hparams,
        "claimed_epsilon": args.target_epsilon,
        "true_epsilon": mechanism_epsilon(
            make_mechanism("gaussian", max_grad_norm=1.0, noise_multiplier=sigma),
            sample_rate=sample_rate,
            steps=steps * len(naive_runs),
            delta=DELTA,
            accountant="rdp",
        ),
        "noise_multiplier": sigma,
    }
    row = {"seed": seed, "search": search, "one_run": one_run, "naive": naive}
    print(json.dumps(row), flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_dp.cli.args import quiet_lightning

    torch.set_num_threads(1)
    quiet_lightning()
    logging.getLogger("lightning_dp").setLevel(logging.WARNING)
    return {"seeds": [run_seed(args, seed) for seed in args.seeds]}


def _cell(values: list[float]) -> str:
    mean, std = mean_std(values)
    return f"{100 * mean:.1f} +- {100 * std:.1f}"


def markdown(record: dict[str, Any]) -> str:
    """A record as a table: one row per arm, test accuracy over the seeds (mean +- std) and epsilon."""
    args, rows = record["args"], record["seeds"]
    searches = [row["search"] for row in rows]
    naive = [row["naive"] for row in rows]
    released = [s["test_acc"] for s in searches if s["test_acc"] is not None]
    setting = f"{args['epochs']} epochs, total epsilon {args['target_epsilon']:g} (RDP, delta {DELTA:g})"
    lines = [
        *record_heading(record, setting),
        "| arm | test accuracy (mean +- std) | epsilon | noise multiplier | candidates per seed |",
        "|---|---|---|---|---|",
        f"| search (geometric, mean {args['mean']:g}) | {_cell(released)} | {searches[0]['epsilon']:.3f} | "
        f"{searches[0]['noise_multiplier']:.4g} | {', '.join(str(s['candidates']) for s in searches)} |",
        f"| one run (lr 1, C 1) | {_cell([row['one_run']['test_acc'] for row in rows])} | "
        f"{args['target_epsilon']:g} | {rows[0]['one_run']['noise_multiplier']:.4g} | 1 |",
        f"| naive best-of-{round(args['mean'])}, each at epsilon {args['target_epsilon']:g} | "
        f"{_cell([n['test_acc'] for n in naive])} | {args['target_epsilon']:g} claimed, "
        f"{statistics.mean(n['true_epsilon'] for n in naive):.3f} composed | {naive[0]['noise_multiplier']:.4g} | "
        f"{round(args['mean'])} |",
    ]
    return "\n".join(lines)


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--mean", type=float, default=3.0, help="the search's expected number of candidates")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add_record_options(parser, RECORDS)
    run_or_render(
        parser.parse_args(),
        run,
        render,
        script="bench/tuning_digits.py",
        records=RECORDS,
        report_lines=lambda record: [json.dumps(row) for row in record["seeds"]],
    )


if __name__ == "__main__":
    main()
