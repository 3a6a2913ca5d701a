"""Two of De et al. 2022's techniques measured on the CIFAR-10 recipe's local data (docs/de_techniques.md):
augmentation multiplicity (Section 3.2) and parameter averaging (an exponential moving average of the weights).

    LIGHTNING_DP_DATA=ROOT python bench/de_techniques.py --seeds 0 1 2 --record cpu   # the runs, then render
    LIGHTNING_DP_DATA=ROOT python bench/de_techniques.py --seeds 0 1 2 --missing --record cpu  # only the runs
                                                     # docs/bench/de_techniques/cpu.json lacks, merged into it
    python bench/de_techniques.py --render           # only re-render from docs/bench/de_techniques/*.json
    LIGHTNING_DP_DATA=ROOT python bench/de_techniques.py --steps 2 --ks 1 2 --seeds 0 --eval-size 1000  # smoke run

One DP training per variant and seed, for ``K`` in ``--ks`` (1, 4, 8), ``K = 1`` once more with augmentation
(``--augmented-k1``, on by default) and the seeds (0, 1, 2): the docs setup of
``configs/cifar10_offline.yaml`` (WRN-10-1 with GroupNorm, no weight standardisation: the model's default; the local
5,000-image training subset and the 10,000 test images; SGD lr 2 without momentum; clipping norm 1, ``flat``
engine; Gaussian noise calibrated for ``--target-epsilon`` 3 at delta 1e-5 with the PLD accountant) except the
expected batch, ``--batch-size`` 128 instead of 256 (the cost: ``K`` multiplies the rows through the network), for
``--steps`` 40. ``K`` copies of each sampled image, each randomly cropped (4-pixel reflect padding) and flipped, the
copies' gradients averaged before the example is clipped (the recipe's ``augmentation_multiplicity``, the same ``K``
for the model and the strategy); ``K = 1`` is the recipe without augmentation, and ``K = 1`` augmented (the models'
``augment: true``) one cropped and flipped copy per example, De et al.'s ``K = 1``: it separates the effect of
augmenting from that of more copies. Neither changes the sensitivity or the accounting, so every run has the same
noise multiplier and epsilon.

Every run trains with Lightning's ``EMAWeightAveraging`` (``--ema-decay`` 0.9, averaging from step ``--ema-start``,
by default a quarter of the steps), and the same run is evaluated twice on the test images: with its last iterate
(the raw weights, kept just before the callback copies the average into the model) and with the average. The seed
sets ``seed_everything`` (initialisation, the crops and flips) and the DP strategy's ``seed`` (Poisson sampling,
noise); the data split stays the recipe's (``split_seed`` 0).

Recorded per run: ``K``, whether it augments, the seed, the test accuracy of the raw and of the averaged weights, the
L2 distance between the two, epsilon, the noise multiplier, the steps, the training seconds (first to last step) and
the run's seconds (set-up, calibration, training and both evaluations), each as wall-clock time and as the process's
CPU time (all its threads: on a shared machine the wall-clock time grows with the other jobs' load, the CPU time much
less). Rendered: one row per variant (the accuracies' mean and sample standard deviation over the seeds, the
averaged-minus-raw difference paired by run, epsilon, the noise multiplier, the mean wall-clock seconds) between the
``<!-- de:start -->`` and ``<!-- de:end -->`` lines of docs/de_techniques.md, and docs/de_techniques.png (accuracy
against ``K``, raw and averaged, each seed's run and the means) from the last record.

``--missing`` with ``--record NAME`` completes an existing record instead of replacing it: it runs only the
``(K, augmentation, seed)`` runs of the command that the record lacks, refuses a record of another setup (steps,
batch, epsilon, EMA, test images), of another environment (versions, threads, CPU kernels: they change a run as a
seed does) or holding runs the command would not make, stops at the first new run whose privacy quantities (noise
multiplier, epsilon, sample rate, steps: the same for every run of a record) differ from the recorded runs' (the
record was made by other code or data), and merges the new runs in the command's order. The record then
states the command without ``--missing``, which makes every run of it, and lists the completions (their command,
runs and environment) under ``additions``. Each run seeds all it draws from (``seed_everything``, the strategy's
``seed``), so its numbers do not depend on the runs made before it in the process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from records import (
    add_record_options,
    environment,
    mean_std,
    plural,
    render_records_and_figure,
    reproducing_argv,
    run_or_render,
)

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "de_techniques"
PAGE = ROOT / "docs" / "de_techniques.md"
FIGURE = ROOT / "docs" / "de_techniques.png"
START, END = "<!-- de:start -->", "<!-- de:end -->"
SCRIPT = "bench/de_techniques.py"
#: The docs setup of configs/cifar10_offline.yaml that this comparison keeps (the expected batch is an option).
DEPTH, WIDTH, GROUPS, LR, MAX_GRAD_NORM, DELTA, CLIPPING = 10, 1, 16, 2.0, 1.0, 1e-5, "flat"
#: The arguments a completed record (``--missing``) must share with the command: the setup of every run.
SETUP = ("steps", "batch_size", "target_epsilon", "ema_decay", "ema_start", "eval_size")
#: The environment entries a completed record must share with the process: what a run's numbers depend on.
SAME_ENVIRONMENT = ("python", "torch", "numpy", "threads", "cpu_capability", "device_name")
#: The entries of a run that every run of a record shares (one calibration and accounting for all): a new run of a
#: completion (``--missing``) must equal the recorded runs' in each, else the code or the data differ.
SAME_PRIVACY = ("noise_multiplier", "epsilon", "sample_rate", "steps")
#: What :func:`differing` reports for an entry an older record lacks (no value of an argument or environment entry).
ABSENT = "(not recorded)"
#: The figure draws the un-augmented runs at ``K`` times this, apart from the augmented ones at the same ``K``.
PLAIN_SHIFT = 0.88


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8], help="augmentation multiplicities K")
    parser.add_argument("--augmented-k1", action=argparse.BooleanOptionalAction, default=True,
                        help="also run K = 1 with augmentation: one cropped and flipped copy per example")  # fmt: skip
    parser.add_argument("--missing", action="store_true",
                        help="with --record NAME: run only the runs NAME.json lacks, merged into it")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each run")
    parser.add_argument("--batch-size", type=int, default=128, help="expected (Poisson) batch size, in examples")
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--ema-decay", type=float, default=0.9, help="decay of the weights' moving average")
    parser.add_argument("--ema-start", type=int, default=None,
                        help="first step (0-based) the average takes in (default: a quarter of --steps)")  # fmt: skip
    parser.add_argument("--eval-size", type=int, default=None, help="test images evaluated (default: all 10,000)")
    parser.add_argument("--data-dir", default=None, help="the data root holding cifar10/ (default: $LIGHTNING_DP_DATA)")
    add_record_options(parser, RECORDS.relative_to(ROOT))
    args = parser.parse_args(argv)
    if args.ema_start is None:
        args.ema_start = args.steps // 4
    if not 0 < args.ema_decay < 1:
        parser.error(f"--ema-decay must be in (0, 1), got {args.ema_decay}")
    if not 0 <= args.ema_start < args.steps:
        parser.error(f"--ema-start must be a step of the run, in [0, {args.steps}), got {args.ema_start}")
    if args.missing and (args.record is None or args.render):
        parser.error("--missing completes a record: give it --record NAME (and no --render)")
    return args


def variants(args: argparse.Namespace) -> list[tuple[int, bool]]:
    """The ``(K, augment)`` pairs of the command, in the order of the runs (by ``K``, the un-augmented ``K = 1``
    first): ``(K, K > 1)`` for each of ``--ks`` (the recipe's default), and ``(1, True)`` with ``--augmented-k1``."""
    pairs = {(k, k > 1) for k in args.ks} | ({(1, True)} if args.augmented_k1 else set())
    return sorted(pairs)


def planned(args: argparse.Namespace) -> list[tuple[int, bool, int]]:
    """The command's runs as ``(K, augment, seed)``, in the order it makes them: seeds outermost, then
    :func:`variants`."""
    return [(k, augment, seed) for seed in args.seeds for k, augment in variants(args)]


def augmented(run: dict[str, Any]) -> bool:
    """Whether a recorded run cropped and flipped its rows: its ``augment`` entry (runs recorded before the entry
    existed: ``K > 1``, the recipe's default)."""
    return run.get("augment", run["k"] > 1)


def label(k: int, augment: bool) -> str:
    """The table's name of a variant: ``K``, with ``K = 1`` saying whether it augments."""
    return str(k) if k > 1 else f"1, {'augmented' if augment else 'no augmentation'}"


# --------------------------------------------------------------------------------------------------------- runs
def raw_weights_keeper() -> Any:
    """A callback, listed BEFORE ``EMAWeightAveraging``: times the training (``train_seconds``, and the process's CPU
    time ``train_cpu_seconds``), keeps a copy of the last iterate (``raw``) at the end of training, before the
    averaging callback copies the average into the model, and at the end of fit (the averaged weights in the model)
    evaluates both on the test loader (``results``: ``raw_acc``, ``ema_acc`` in percent, ``ema_raw_distance`` the L2
    norm of their difference), leaving the averaged weights in the model."""
    import lightning.pytorch as pl
    import torch

    class RawWeightsKeeper(pl.Callback):
        def __init__(self) -> None:
            self.start = self.cpu_start = 0.0
            self.train_seconds = self.train_cpu_seconds = 0.0
            self.raw: dict[str, torch.Tensor] = {}
            self.results: dict[str, float] = {}

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.train_seconds = time.perf_counter() - self.start
            self.train_cpu_seconds = time.process_time() - self.cpu_start
            self.raw = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}

        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            loader = trainer.datamodule.test_dataloader()
            averaged = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
            ema_accuracy = pl_module.accuracy(loader)["accuracy"]
            pl_module.load_state_dict(self.raw)
            raw_accuracy = pl_module.accuracy(loader)["accuracy"]
            pl_module.load_state_dict(averaged)
            distance = sum(float((averaged[n].double() - self.raw[n].double()).square().sum()) for n in averaged)
            self.results = {"raw_acc": raw_accuracy, "ema_acc": ema_accuracy, "ema_raw_distance": distance**0.5}

    return RawWeightsKeeper()


def run_one(args: argparse.Namespace, k: int, augment: bool, seed: int) -> dict[str, Any]:
    """One DP training of the docs setup with ``K = k``, the crops and flips on or off (``augment``; off refused at
    ``K > 1``) and ``seed``, evaluated with its raw and averaged weights."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_dp import DPStrategy
    from lightning_dp.recipes.cifar import CifarDataModule, WideResNetClassifier

    start, cpu_start = time.perf_counter(), time.process_time()
    pl.seed_everything(seed, verbose=False)
    strategy = DPStrategy(
        target_epsilon=args.target_epsilon,
        target_delta=DELTA,
        max_grad_norm=MAX_GRAD_NORM,
        noise="gaussian",
        clipping=CLIPPING,
        augmentation_multiplicity=k,
        seed=seed,
        device="cpu",
    )
    model = WideResNetClassifier(
        depth=DEPTH, width=WIDTH, groups=GROUPS, lr=LR, augmentation_multiplicity=k, augment=augment
    )
    data = CifarDataModule(data_dir=args.data_dir, batch_size=args.batch_size, eval_size=args.eval_size)
    keeper = raw_weights_keeper()
    ema = EMAWeightAveraging(decay=args.ema_decay, update_starting_at_step=args.ema_start)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        strategy=strategy,
        callbacks=[keeper, ema],  # the keeper first: it copies the raw weights before EMA replaces them
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    summary = strategy.privacy_engine.summary()
    return {
        "k": k,
        "augment": augment,
        "seed": seed,
        **keeper.results,
        "epsilon": summary["epsilon"],
        "noise_multiplier": summary["noise_multiplier"],
        "steps": summary["steps"],
        "sample_rate": summary["sample_rate"],
        "train_seconds": round(keeper.train_seconds, 2),
        "run_seconds": round(time.perf_counter() - start, 2),
        "train_cpu_seconds": round(keeper.train_cpu_seconds, 2),
        "run_cpu_seconds": round(time.process_time() - cpu_start, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every run of the command (:func:`planned`), or with ``--missing`` those the record lacks, each checked against
    the recorded runs as it ends (:func:`check_privacy`) and merged into the record (:func:`completed`); each run is
    printed as one JSON line as it ends."""
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dp").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    env = environment("cpu")
    record = recorded(args, env) if args.missing else None
    done = {(run["k"], augmented(run), run["seed"]) for run in record["runs"]} if record else set()
    runs = []
    for k, augment, seed in planned(args):
        if (k, augment, seed) not in done:
            runs.append(run_one(args, k, augment, seed))
            print(json.dumps(runs[-1]), flush=True)
            if record is not None:
                check_privacy(args, record, runs[-1])
    return {"runs": runs} if record is None else completed(args, record, runs, env)


# -------------------------------------------------------------------------------------------------- completion
def differing(recorded: dict[str, Any], current: dict[str, Any], keys: tuple[str, ...]) -> dict[str, tuple[Any, Any]]:
    """The ``keys`` whose value in ``recorded`` (:data:`ABSENT` where an older record lacks the entry) is not that in
    ``current``, each with ``(recorded value, current value)``."""
    pairs = {key: (recorded.get(key, ABSENT), current[key]) for key in keys}
    return {key: pair for key, pair in pairs.items() if key not in recorded or pair[0] != pair[1]}


def recorded(args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    """The record ``--missing`` completes, checked against the command and the process's environment ``env``
    (:data:`SETUP`, :data:`SAME_ENVIRONMENT`, every recorded run one the command makes).

    Raises:
        SystemExit: no such record, or one the command cannot complete (the reason in the message).
    """
    path = RECORDS / f"{args.record}.json"
    if not path.is_file():
        raise SystemExit(f"--missing: {path.relative_to(ROOT)} does not exist; make it without --missing")
    record = json.loads(path.read_text(encoding="utf-8"))
    setup = differing(record.get("args", {}), vars(args), SETUP)
    environment_differs = differing(record.get("environment", {}), env, SAME_ENVIRONMENT)
    order = planned(args)
    extra = [(run["k"], augmented(run), run["seed"]) for run in record["runs"]]
    extra = [run for run in extra if run not in order]
    for problem, found in (
        ("another setup", setup),
        ("another environment", environment_differs),
        ("other runs", extra),
    ):
        if found:
            raise SystemExit(f"--missing: {path.relative_to(ROOT)} holds {problem} than this command: {found}")
    return record


def check_privacy(args: argparse.Namespace, record: dict[str, Any], run: dict[str, Any]) -> None:
    """Refuse a new ``run`` of a completion whose :data:`SAME_PRIVACY` entries are not exactly the recorded runs'.
    The setup, the environment and the accountant's inputs being the same (:func:`recorded`), they differ only when
    the code or the data do: the record cannot take the run.

    Raises:
        SystemExit: an entry differs (the entries, the recorded values and the run's in the message).
    """
    recorded_values = {key: sorted({old[key] for old in record["runs"] if key in old}) for key in SAME_PRIVACY}
    found = {key: (values, run[key]) for key, values in recorded_values.items() if values and values != [run[key]]}
    if found:
        path = (RECORDS / f"{args.record}.json").relative_to(ROOT)
        raise SystemExit(
            f"--missing: the new run {(run['k'], run['augment'], run['seed'])} differs from the runs of {path} in "
            f"{found} (recorded, new): the record was made by other code or data; re-run the whole record without "
            "--missing"
        )


def completed(
    args: argparse.Namespace, record: dict[str, Any], runs: list[dict[str, Any]], env: dict[str, Any]
) -> dict[str, Any]:
    """``record`` with the new ``runs`` merged in the command's order (:func:`planned`), the command and arguments
    without ``--missing`` (they make every run), the record's environment, and this completion (its command, its runs,
    its environment ``env`` with ``load_after``) appended to ``additions`` when it made a run. These keys replace
    those ``records.finish`` would derive from this process."""
    order = planned(args)
    merged = sorted([*record["runs"], *runs], key=lambda run: order.index((run["k"], augmented(run), run["seed"])))
    addition = {
        "command": shlex.join(["python", SCRIPT, *[arg for arg in sys.argv[1:] if arg != "--json"]]),
        "runs": [[run["k"], run["augment"], run["seed"]] for run in runs],
        "environment": {**env, "load_after": os.getloadavg()[0]},
    }
    return {
        "command": shlex.join(["python", SCRIPT, *reproducing_argv(sys.argv[1:], drop=("--missing",))]),
        "args": {**vars(args), "missing": False},
        "environment": record["environment"],
        "additions": [*record.get("additions", []), *([addition] if runs else [])],
        "runs": merged,
    }


# ------------------------------------------------------------------------------------------------------ render
def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant ``(K, augment)`` (in the order of the first runs): the raw and averaged accuracies' and
    their per-run differences' mean and standard deviation over the seeds, the first run's epsilon and noise
    multiplier (one calibration for every variant), the mean training and run seconds, the seed count, and
    ``added``: whether the runs came from a completion (``--missing``, the record's ``additions``)."""
    added = {tuple(run) for addition in record.get("additions", []) for run in addition["runs"]}
    out = []
    for k, augment in dict.fromkeys((run["k"], augmented(run)) for run in record["runs"]):
        runs = [run for run in record["runs"] if (run["k"], augmented(run)) == (k, augment)]
        raw, ema = mean_std([r["raw_acc"] for r in runs]), mean_std([r["ema_acc"] for r in runs])
        gain = mean_std([r["ema_acc"] - r["raw_acc"] for r in runs])
        out.append(
            {
                "k": k,
                "augment": augment,
                "raw_acc": raw[0],
                "raw_acc_std": raw[1],
                "ema_acc": ema[0],
                "ema_acc_std": ema[1],
                "ema_gain": gain[0],
                "ema_gain_std": gain[1],
                "epsilon": runs[0]["epsilon"],
                "noise_multiplier": runs[0]["noise_multiplier"],
                "train_seconds": statistics.mean(r["train_seconds"] for r in runs),
                "run_seconds": statistics.mean(r["run_seconds"] for r in runs),
                "seeds": len(runs),
                "added": any((k, augment, r["seed"]) in added for r in runs),
            }
        )
    return out


def addition_lines(record: dict[str, Any]) -> list[str]:
    """A sentence per completion of the record (``--missing``): its command, the runs it added and its load average
    against the record's (the seconds of its runs, marked ``*`` in the table, were measured under it: on a shared
    2-core machine they grow with the load; the accuracies do not change)."""
    lines = []
    for addition in record.get("additions", []):
        variants_added = dict.fromkeys(label(k, augment) for k, augment, _ in addition["runs"])
        seeds = sorted({seed for *_, seed in addition["runs"]})
        lines += [
            "",
            f"\\* Added to the record by `{addition['command']}`: only the runs it lacked (K = "
            f"{'; '.join(variants_added)}; seeds {seeds}), in the record's environment (the same versions, threads "
            f"and CPU kernels), under a load average of {addition['environment']['load_before']:.1f} (the record's "
            f"runs: {record['environment']['load_before']:.1f}): their seconds are not comparable with the others', "
            "nor is the total.",
        ]
    return lines


def markdown(record: dict[str, Any]) -> str:
    """A record rendered: the setting, the command that made it, one table line per variant (accuracies in
    percent, mean +- std over the seeds), and the completions of the record (:func:`addition_lines`)."""
    env, args = record["environment"], record["args"]
    eval_size = "all 10,000" if args["eval_size"] is None else f"{args['eval_size']:,}"
    lines = [
        f"**WRN-10-1, {args['steps']} steps of expected batch {args['batch_size']}, target epsilon "
        f"{args['target_epsilon']:g}, EMA decay {args['ema_decay']:g} from step {args['ema_start']}** "
        f"(seeds {args['seeds']}; test images: {eval_size}; torch {env['torch']}, {plural(env['threads'], 'thread')})",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        "| K | raw weights: accuracy | EMA weights: accuracy | EMA - raw (paired) | epsilon | noise multiplier "
        "| train s | run s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(record):
        mark = "\\*" if row["added"] else ""
        lines.append(
            f"| {label(row['k'], row['augment'])} | {row['raw_acc']:.2f} +- {row['raw_acc_std']:.2f} | "
            f"{row['ema_acc']:.2f} +- {row['ema_acc_std']:.2f} | {row['ema_gain']:+.2f} +- {row['ema_gain_std']:.2f} | "
            f"{row['epsilon']:.3f} | {row['noise_multiplier']:.4g} | {row['train_seconds']:.0f}{mark} | "
            f"{row['run_seconds']:.0f}{mark} |"
        )
    total = sum(run["run_seconds"] for run in record["runs"])
    lines += ["", f"Test accuracy in percent, mean +- sample std over the seeds; {total / 60:.1f} minutes in all."]
    return "\n".join(lines + addition_lines(record))


def write_figure(record: dict[str, Any], path: Path) -> None:
    """Accuracy against ``K``, raw and averaged weights: each seed's run (dots), the means of the augmented variants
    (lines) and of the un-augmented ``K = 1`` (hollow squares, a little left of ``K = 1``: :data:`PLAIN_SHIFT`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows(record)
    ks = sorted({row["k"] for row in table})
    fig, ax = plt.subplots(figsize=(8.6, 4.0))
    for key, name, color, shift in (
        ("raw_acc", "raw weights", "tab:blue", 0.97),
        ("ema_acc", "EMA", "tab:orange", 1.03),
    ):
        for augment, marker in ((True, "o"), (False, "s")):
            runs = [run for run in record["runs"] if augmented(run) == augment]
            ax.scatter(
                [run["k"] * shift * PLAIN_SHIFT ** (not augment) for run in runs], [run[key] for run in runs],
                color=color, alpha=0.4, s=16, marker=marker, label=f"{name} (one run per seed)" if augment else None,
            )  # fmt: skip
        means = [row for row in table if row["augment"]]
        ax.plot([row["k"] * shift for row in means], [row[key] for row in means], "o-", color=color,
                label=f"{name}, augmented (mean)")  # fmt: skip
        plain = [row for row in table if not row["augment"]]
        ax.plot([row["k"] * shift * PLAIN_SHIFT for row in plain], [row[key] for row in plain], "s", color=color,
                mfc="none", ms=8, mew=1.5, label=f"{name}, no augmentation (mean)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("augmentation multiplicity K (K = 1: one copy, augmented or not)")
    ax.set_ylabel("test accuracy (%)")
    args = record["args"]
    ax.set_title(
        f"CIFAR-10 subset, WRN-10-1, {args['steps']} steps, expected batch {args['batch_size']}, "
        f"epsilon {args['target_epsilon']:g}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no run hidden
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render() -> None:
    render_records_and_figure(RECORDS, markdown, PAGE, START, END, write_figure, FIGURE)


def main(argv: list[str] | None = None) -> None:
    run_or_render(
        parse_args(argv),
        run,
        render,
        script=SCRIPT,
        records=RECORDS,
        report_lines=lambda record: [json.dumps(row) for row in rows(record)] + ["", markdown(record)],
    )


if __name__ == "__main__":
    main()
