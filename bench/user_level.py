"""User-level against example-level privacy: what each guarantee covers, measured (docs/user_level.md).

    python bench/user_level.py --seeds 0 1 2 --record cpu    # both parts, then render docs/user_level.md
    python bench/user_level.py --render                      # only re-render from docs/bench/user_level/*.json

Two parts, each run with ``--seeds`` and both privacy units (``privacy_unit="example"``, ``"user"``):

- **Audit** (the one-run audit of docs/audit.md, Steinke, Nasr and Jagielski 2023, with input canaries): the white-box
  linear setup of ``lightning-dp audit`` (1,000 examples, each its own user) plus 200 canary USERS, each with
  ``--canary-examples`` identical examples (the orthogonal input canary ``10 e_j`` with a random label, a feature no
  other example uses). Each canary user joins the training set with probability 1/2; the noise is calibrated for
  epsilon ``--audit-epsilon`` at delta 1e-5 in the run's own unit. After training, each canary user is scored by its
  loss decrease and the audit bounds epsilon for users (95% confidence). Under example-level DP a canary user's
  examples are sampled and clipped one by one, so the user moves the model by up to ``copies x C`` per step: the
  bound can exceed the example-level epsilon. Under user-level DP the user moves it by at most ``C``.
- **Utility**: a synthetic text set with a skewed number of examples per user (token ids; 1,500 training users with
  Pareto-distributed counts, 1 to 100 examples; each user has a sentiment bias and a personal vocabulary), a bag of
  embeddings classifier, epsilon ``--epsilon`` at delta ``1 / N^1.1`` (N in the run's unit), and the test accuracy on
  500 unseen users. The example-level run's guarantee for a user with ``k`` examples is only group privacy,
  ``k epsilon`` (reported for the largest user).

A record keeps every run's numbers with the command and environment.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from records import add_record_options, mean_std, plural, render_records_and_figure, run_or_render, value_range
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp import DPStrategy
from lightning_dp.audit.inputs import InputCanaries
from lightning_dp.audit.report import report_for
from lightning_dp.audit.setups import make_setup
from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "user_level"
PAGE = ROOT / "docs" / "user_level.md"
START, END = "<!-- users:start -->", "<!-- users:end -->"
UNITS = ("example", "user")
CANARY_USERS = 200


class Rows(Dataset):
    """Examples as ``{"x", "y", "user"}`` dicts (``x`` a float vector or token ids)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, users: torch.Tensor) -> None:
        self.x, self.y, self.users = x, y, users

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": self.x[index], "y": self.y[index], "user": int(self.users[index])}


class Classifier(pl.LightningModule):
    """``net`` on ``batch["x"]``, per-sample cross-entropy, SGD at ``lr``."""

    def __init__(self, net: nn.Module, lr: float) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch["x"]), batch["y"], reduction="none")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BagOfEmbeddings(nn.Module):
    """Token ids ``[B, T]`` -> mean of their embeddings -> linear, ``[B, classes]``."""

    def __init__(self, vocab: int, width: int, classes: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(1))


def _strategy(unit: str, seed: int, **options: Any) -> DPStrategy:
    users = {"privacy_unit": "user", "user_key": "user", "examples_per_user": options.pop("examples_per_user")}
    return DPStrategy(seed=seed, **(users if unit == "user" else {}), **options)


def _fit(module: pl.LightningModule, strategy: DPStrategy, data: Dataset, batch_size: int, epochs: int) -> None:
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=batch_size))


def audit_run(unit: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One audited run (module docstring): the canary users' inclusion, training, the bound for users."""
    setup = make_setup("linear", seed=seed, num_candidates=CANARY_USERS, input_candidates="orthogonal")
    x, y = setup.train_set.tensors
    canaries = InputCanaries(setup.candidates, seed=seed)
    chosen = torch.nonzero(canaries.included).flatten()
    copies = args.canary_examples
    cx, cy = setup.candidates.tensors
    data = Rows(
        torch.cat([x, cx[chosen].repeat_interleave(copies, 0)]),
        torch.cat([y, cy[chosen].repeat_interleave(copies, 0)]),
        torch.cat([torch.arange(len(y)), (len(y) + chosen).repeat_interleave(copies)]),
    )
    module = Classifier(setup.module.layer, lr=setup.module.lr)

    def loss(batch: Any) -> torch.Tensor:
        return module.training_step({"x": batch[0], "y": batch[1]}, 0)

    initial = canaries.scores(loss)
    strategy = _strategy(
        unit,
        seed,
        target_epsilon=args.audit_epsilon,
        target_delta=1e-5,
        max_grad_norm=1.0,
        examples_per_user=args.audit_examples_per_user,
    )
    _fit(module, strategy, data, args.audit_batch, args.audit_epochs)
    module.eval()
    scores = canaries.scores(loss) - initial
    report = report_for(strategy.privacy_engine, scores, canaries.included.numpy(), "input", 0.95, None)
    summary = strategy.privacy_engine.summary()
    return {
        "unit": unit,
        "seed": seed,
        "reported_epsilon": report.reported_epsilon,
        "user_bound": report.audit.epsilon_lower_bound,
        "guesses": report.audit.guesses,
        "correct": report.audit.correct,
        "steps": summary["steps"],
        "noise_multiplier": summary["noise_multiplier"],
        "sample_rate": summary["sample_rate"],
        "training_rows": len(data),
    }


def skewed_text(seed: int, users: int, *, vocab: int = 500, length: int = 12) -> tuple[Rows, torch.Tensor]:
    """The synthetic text set (module docstring): ``users`` users with Pareto(1.2) counts capped at 100; returns the
    examples and each user's count. Tokens 0-19 lean positive, 20-39 negative, the rest are filler; each user writes
    4 of their 8 personal tokens in every example and leans to one label (70% of their examples)."""
    generator = torch.Generator().manual_seed(seed)
    counts = (torch.rand(users, generator=generator).pow(-1 / 1.2)).floor().clamp(1, 100).long()
    rows_x, rows_y, rows_user = [], [], []
    for user, count in enumerate(counts.tolist()):
        personal = 40 + torch.randperm(vocab - 40, generator=generator)[:8]
        lean = int(torch.randint(2, (1,), generator=generator))
        labels = torch.where(torch.rand(count, generator=generator) < 0.7, lean, 1 - lean)
        for label in labels.tolist():
            cue_set = label if float(torch.rand(1, generator=generator)) < 0.8 else 1 - label
            cues = 20 * cue_set + torch.randint(20, (2,), generator=generator)
            own = personal[torch.randperm(8, generator=generator)[:4]]
            filler = 40 + torch.randint(vocab - 40, (length - 6,), generator=generator)
            rows_x.append(torch.cat([cues, own, filler]))
            rows_y.append(label)
            rows_user.append(user)
    return Rows(torch.stack(rows_x), torch.tensor(rows_y), torch.tensor(rows_user)), counts


def utility_run(unit: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run on the skewed text set (module docstring): the test accuracy on unseen users and the guarantees."""
    train, counts = skewed_text(1000 + seed, 1500)
    test, _ = skewed_text(2000 + seed, 500)
    torch.manual_seed(seed)
    module = Classifier(BagOfEmbeddings(500, 16, 2), lr=args.lr)
    batch = args.batch_users if unit == "user" else args.batch_examples
    strategy = _strategy(
        unit, seed, target_epsilon=args.epsilon, max_grad_norm=1.0, examples_per_user=args.examples_per_user
    )
    _fit(module, strategy, train, batch, args.epochs)
    module.eval()
    with torch.no_grad():
        accuracy = float((module.net(test.x).argmax(1) == test.y).float().mean())
    summary = strategy.privacy_engine.summary()
    largest = int(counts.max())
    return {
        "unit": unit,
        "seed": seed,
        "test_acc": accuracy,
        "epsilon": summary["epsilon"],
        "delta": summary["delta"],
        "noise_multiplier": summary["noise_multiplier"],
        "steps": summary["steps"],
        "sample_rate": summary["sample_rate"],
        "examples": len(train),
        "users": len(counts),
        "largest_user": largest,
        "median_user": int(counts.median()),
        # the example-level run's guarantee for the largest user: group privacy over its examples
        "largest_user_epsilon": summary["epsilon"] * (largest if unit == "example" else 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "audit": [audit_run(unit, seed, args) for seed in args.seeds for unit in UNITS],
        "utility": [utility_run(unit, seed, args) for seed in args.seeds for unit in UNITS],
    }


def _spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    mean, std = mean_std(values)
    return f"{mean * scale:.{digits}f} +- {std * scale:.{digits}f}"


def markdown(record: dict[str, Any]) -> str:
    """The two tables of a record: the audit's bound for users and the utility, per privacy unit; a value each seed
    has its own of (the training set's size, steps, noise multiplier, delta) is given as its range over the seeds."""
    args, utility = record["args"], record["utility"]
    seeds = plural(len(args["seeds"]), "seed")
    threads = plural(record["environment"].get("threads", "?"), "thread")
    lines = [f"Command ({seeds}; {threads}):", "", "```bash", record["command"], "```", "",
             "`a +- b`: the mean and standard deviation over the seeds; `a to b`: the smallest and the largest value "
             "over the seeds (each seed draws its own canaries, training set and samples).", "",
             f"Audit: 200 canary users of {args['canary_examples']} examples each, epsilon "
             f"{args['audit_epsilon']:g} in the run's unit, delta 1e-5, 95% confidence.", "",
             "| privacy unit | reported epsilon | audit's lower bound on epsilon for users | bound > reported "
             "| steps | noise multiplier |", "|---|---|---|---|---|---|"]  # fmt: skip
    for unit in UNITS:
        runs = [r for r in record["audit"] if r["unit"] == unit]
        exceeded = sum(r["user_bound"] > r["reported_epsilon"] for r in runs)
        lines.append(
            f"| {unit} | {_spread([r['reported_epsilon'] for r in runs], digits=3)} | "
            f"{_spread([r['user_bound'] for r in runs])} | {exceeded} of {len(runs)} | {value_range(runs, 'steps')} | "
            f"{value_range(runs, 'noise_multiplier', '.4g')} |"
        )
    lines += ["", f"Utility: {value_range(utility, 'users')} training users with {value_range(utility, 'examples')} "
              f"examples (median {value_range(utility, 'median_user')} per user, largest "
              f"{value_range(utility, 'largest_user')}), "
              f"epsilon {args['epsilon']:g}; test accuracy on 500 unseen users.", "",
              "| privacy unit | test accuracy (%) | epsilon | delta | group privacy for the largest user: epsilon "
              "(its delta exceeds 1 at example level) | steps | noise multiplier |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for unit in UNITS:
        runs = [r for r in utility if r["unit"] == unit]
        lines.append(
            f"| {unit} | {_spread([r['test_acc'] for r in runs], 100, 1)} | {value_range(runs, 'epsilon', '.3f')} | "
            f"{value_range(runs, 'delta', '.2g')} | {value_range(runs, 'largest_user_epsilon', '.3g')} | "
            f"{value_range(runs, 'steps')} | {value_range(runs, 'noise_multiplier', '.4g')} |"
        )
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> None:
    """Two panels per privacy unit, one dot per seed: the audit's bound for users against the reported epsilon, and
    the test accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (audit, utility) = plt.subplots(1, 2, figsize=(9, 3.5))
    for position, unit in enumerate(UNITS):
        bounds = [r["user_bound"] for r in record["audit"] if r["unit"] == unit]
        accuracies = [100 * r["test_acc"] for r in record["utility"] if r["unit"] == unit]
        audit.scatter([position] * len(bounds), bounds, color=f"C{position}")
        utility.scatter([position] * len(accuracies), accuracies, color=f"C{position}")
    audit.axhline(record["args"]["audit_epsilon"], color="black", linestyle="--", label="reported epsilon")
    audit.set_ylabel("audit's lower bound on epsilon for users")
    audit.legend()
    utility.set_ylabel("test accuracy, unseen users (%)")
    for axis, title in ((audit, "canary users"), (utility, "skewed text set")):
        axis.set_xticks(range(len(UNITS)), [f"privacy_unit={unit!r}" for unit in UNITS])
        axis.set_xlim(-0.5, len(UNITS) - 0.5)
        axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render() -> None:
    render_records_and_figure(RECORDS, markdown, PAGE, START, END, plot, PAGE.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--canary-examples", type=int, default=20, help="examples per canary user")
    parser.add_argument("--audit-epsilon", type=float, default=1.0)
    parser.add_argument("--audit-epochs", type=int, default=10)
    parser.add_argument("--audit-batch", type=int, default=100, help="expected batch, in the run's unit")
    parser.add_argument("--audit-examples-per-user", type=int, default=4)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-examples", type=int, default=256, help="expected batch of the example-level run")
    parser.add_argument("--batch-users", type=int, default=64, help="expected batch of the user-level run (users)")
    parser.add_argument("--examples-per-user", type=int, default=8, help="rows per sampled user (cap)")
    parser.add_argument("--lr", type=float, default=2.0)
    add_record_options(parser, RECORDS)
    run_or_render(
        parser.parse_args(),
        run,
        render,
        script="bench/user_level.py",
        records=RECORDS,
        report_lines=lambda record: [json.dumps(row) for row in record["audit"] + record["utility"]],
    )


if __name__ == "__main__":
    main()
