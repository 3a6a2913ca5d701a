"""Write docs/models.json and docs/models.md: which architectures of the model zoo train exactly, and which the
library refuses and why, for full fine-tuning and LoRA, with and without activation checkpointing.

Usage (from the repository root): ``python scripts/models_table.py [--train] [--render-only]``. Each entry of
``tests/models/zoo.py`` is checked by ``check_entry`` of ``tests/models/test_model_zoo.py`` (per-sample norms and
clipped sum against the float64 ``torch.func`` oracle) under every clipping of ``CLIPPINGS``, fully trainable and with
LoRA, and under "auto" with HF's activation checkpointing and with bfloat16 autocast; ``--train`` adds 2 DP steps of
DPTrainer (``train_dp_steps``) per HF architecture, full and LoRA. The outcomes are recorded in docs/models.json, which
is rendered to docs/models.md (``--render-only``: render the recorded JSON again). Exit status 1 when an outcome differs
from the test's ``EXPECTED*`` tables.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import re
import sys
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "tests", ROOT / "tests" / "models"):
    sys.path.insert(0, str(folder))

JSON_PATH = ROOT / "docs" / "models.json"
MD_PATH = ROOT / "docs" / "models.md"

HEADER = """# Supported models

Which architectures train under per-sample clipping exactly, and which the library refuses (with its message), as
Opacus's list of per-sample layers but for whole models. Each model is built from a tiny config (hidden size 32, 2
layers, vocabulary 100, dropout 0, eager attention; no weights downloaded) in `tests/models/zoo.py`, made float64 with
random parameters, and its per-sample gradient norms and clipped sum (bound: the median norm) are compared with a
float64 oracle from `torch.func` (`grad` of `functional_call` on each example alone) on a batch of 3 with a
per-example loss (mean token cross-entropy for LMs, cross-entropy for classifiers), under `clipping` = {clippings}.
**exact**: norms and clipped sum match (rtol {rtol}, atol {atol} of the largest gradient entry; {atol_f32} for the
models marked \\*, which compute their norms in float32 even in float64); **refused**: the library raised
`UnsupportedModuleError` or `ValueError` (message below). "via fallback" names the modules served by the exact
`torch.func` fallback (`lightning_dp/clipping/layers/fallback.py`), which reruns their forward per example. **LoRA**:
peft adapters (r 4) on the modules named, and on the parameters named (`mlp.experts.*`: the MoE models' fused expert
weights, through `target_parameters`), the rest frozen. **checkpointed**: the same check under "auto" with HF's
non-reentrant activation checkpointing (`use_reentrant=False` to `activation_checkpointing_enable`; the oracle without
it), which must also recompute at least one module in the clipper's backward. **bf16**: under "auto", float32
parameters and the forward under bfloat16 CPU autocast, against the same oracle in float32 with each example's forward
alone under that autocast: norms and clipped sum within {rtol_autocast} relative.
{train_note}
`tests/models/test_model_zoo.py` asserts every outcome below (its `EXPECTED*` tables); this page
is generated, do not edit it by hand. Produced by:

    {command}

with {versions}.

"""

TRAIN_NOTE = """**DPTrainer**: 2 DP steps of `lightning_dp.DPTrainer` (noise multiplier 1, Poisson batches of 4 expected
out of 8 examples, float32): trained (trainable parameters moved and finite, frozen ones unchanged), or refused
("as the check": with the check's message, up to the batch's sizes).
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _gist(message: str) -> str:
    """The message up to its first ';' (the what, not the how-to)."""
    return _cell(message.split("; ")[0])


def _outcome_cell(outcomes: dict[str, dict[str, Any]] | None, notes: dict[str, int]) -> str:
    """One cell for the outcomes under each clipping: merged when they agree, else one line per clipping."""
    if not outcomes:
        return "—"
    parts = []
    for clipping, outcome in outcomes.items():
        text = outcome["status"]
        if outcome["status"] != "exact":
            key = _cell(outcome["message"])
            notes.setdefault(key, len(notes) + 1)
            text = f"{outcome['status']}: {_gist(outcome['message'])} [{notes[key]}]"
        elif outcome.get("fallback"):
            text += " via fallback (" + ", ".join(f"`{kind}`" for kind in outcome["fallback"]) + ")"
        parts.append((clipping, text))
    if len({text for _, text in parts}) == 1:
        return parts[0][1]
    return "<br>".join(f"{clipping}: {text}" for clipping, text in parts)


def _masked(message: str) -> str:
    return re.sub(r"\d+", "N", message)


def _trained_cell(outcome: dict[str, Any] | None, check: dict[str, Any] | None, notes: dict[str, int]) -> str:
    """A DPTrainer outcome; a refusal with the message of the oracle check (``check``, under "auto") is "as the
    check"."""
    if outcome is None:
        return "—"
    if outcome["status"] == "exact":
        return "trained"
    if check is not None and (check["status"], _masked(check["message"])) == (
        outcome["status"],
        _masked(outcome["message"]),
    ):
        return f"{outcome['status']}, as the check"
    key = _cell(outcome["message"])
    notes.setdefault(key, len(notes) + 1)
    return f"{outcome['status']} [{notes[key]}]"


def _number(value: float) -> str:
    """``1e-09`` as ``1e-9``."""
    return f"{value:.0e}".replace("e-0", "e-")


def _hf_rows(entries: list[dict[str, Any]], train: bool, notes: dict[str, int]) -> list[str]:
    columns = ["architecture", "model class", "full fine-tuning", "LoRA targets", "LoRA"]
    columns += ["checkpointed (full)", "checkpointed (LoRA)", "bf16 (full)", "bf16 (LoRA)"]
    columns += ["DPTrainer (full)", "DPTrainer (LoRA)"] if train else []
    rows = [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]
    for entry in entries:
        name = entry["name"] + ("\\*" if entry["float32_internals"] else "")
        cells = [name, f"`{entry['model']}`", _outcome_cell(entry["full"], notes)]
        cells += [", ".join(f"`{t}`" for t in entry["lora_targets"]), _outcome_cell(entry["lora"], notes)]
        for key in ("checkpointed", "checkpointed_lora", "bf16", "bf16_lora"):
            cells.append(_outcome_cell(entry.get(key) and {"auto": entry[key]}, notes))
        if train:
            full, lora = (entry[key] or {} for key in ("full", "lora"))
            cells.append(_trained_cell(entry["dp_trainer"], full.get("auto"), notes))
            cells.append(_trained_cell(entry["dp_trainer_lora"], lora.get("auto"), notes))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _simple_rows(entries: list[dict[str, Any]], first: str, notes: dict[str, int]) -> list[str]:
    rows = [f"| {first} | full fine-tuning |", "|---|---|"]
    for entry in entries:
        name = entry["name"] + ("\\*" if entry["float32_internals"] else "")
        rows.append(f"| {name} | {_outcome_cell(entry['full'], notes)} |")
    return rows


def render(record: dict[str, Any]) -> str:
    """docs/models.md from the recorded JSON."""
    train = record["train"]
    header = HEADER.format(
        clippings=", ".join(f'"{c}"' for c in record["clippings"]),
        train_note=TRAIN_NOTE if train else "",
        **{key: _number(value) for key, value in record["tolerances"].items()},
        command=record["command"],
        versions=", ".join(f"{name} {version}" for name, version in record["versions"].items()),
    )
    notes: dict[str, int] = {}
    by_kind = {kind: [e for e in record["entries"] if e["kind"] == kind] for kind in ("hf", "layer")}
    sections = [
        "## HF transformers models\n\n" + "\n".join(_hf_rows(by_kind["hf"], train, notes)),
        "## Opacus's per-sample layers, one model each\n\n" + "\n".join(_simple_rows(by_kind["layer"], "layer", notes)),
        "## Why refused\n\n" + "\n".join(f"- **{name}**: {why}" for name, why in record["why_refused"].items()),
        "## Messages\n\n" + "\n".join(f"{number}. {text}" for text, number in notes.items()),
    ]
    return header + "\n\n".join(sections) + "\n"


def _versions() -> dict[str, str]:
    import peft
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def measure(train: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Run the checks of every zoo entry; the records and the outcomes that differ from the test's tables."""
    import torch
    from test_model_zoo import (
        CLIPPINGS,
        EXPECTED,
        EXPECTED_BF16,
        EXPECTED_BF16_LORA,
        EXPECTED_CHECKPOINTED,
        EXPECTED_CHECKPOINTED_LORA,
        EXPECTED_LORA,
        check_entry,
        expected_outcome,
        matches,
        train_dp_steps,
    )
    from zoo import ENTRIES

    entries, surprises = [], []
    for name, entry in ENTRIES.items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        record: dict[str, Any] = {
            "name": name,
            "kind": "hf" if entry.is_hf else "layer",
            "model": type(entry.build()).__name__,
            "task": entry.task,
            "float32_internals": entry.float32_internals,
            "lora_targets": list(entry.lora_targets) + list(entry.lora_parameters),
        }
        for key, lora, table in (("full", False, EXPECTED), ("lora", True, EXPECTED_LORA)):
            if lora and not entry.lora_targets:
                record[key] = None
                continue
            record[key] = {}
            for clipping in CLIPPINGS:
                outcome = check_entry(entry, clipping, lora=lora)
                record[key][clipping] = {**asdict(outcome), "seconds": round(outcome.seconds, 2)}
                expected = expected_outcome(table, name, clipping)
                if not matches(outcome, expected):
                    surprises.append(f"{name} ({key}, {clipping}): expected {expected!r}, got {outcome.describe()}")
        for key, lora, table, options in (
            ("checkpointed", False, EXPECTED_CHECKPOINTED, {"checkpointing": True}),
            ("checkpointed_lora", True, EXPECTED_CHECKPOINTED_LORA, {"checkpointing": True}),
            ("bf16", False, EXPECTED_BF16, {"autocast": torch.bfloat16}),
            ("bf16_lora", True, EXPECTED_BF16_LORA, {"autocast": torch.bfloat16}),
        ):
            if not entry.is_hf or (lora and not entry.lora_targets):
                record[key] = None
                continue
            outcome = check_entry(entry, "auto", lora=lora, **options)
            record[key] = {**asdict(outcome), "seconds": round(outcome.seconds, 2)}
            expected = expected_outcome(table, name, "auto")
            if not matches(outcome, expected):
                surprises.append(f"{name} ({key}): expected {expected!r}, got {outcome.describe()}")
        if train and entry.is_hf:
            for key, lora in (("dp_trainer", False), ("dp_trainer_lora", True)):
                with tempfile.TemporaryDirectory() as output_dir, contextlib.redirect_stdout(io.StringIO()):
                    outcome = train_dp_steps(entry, output_dir, lora=lora)  # the Trainer prints its logs
                record[key] = {**asdict(outcome), "seconds": round(outcome.seconds, 2)}
        entries.append(record)
    return entries, surprises


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="also run 2 DPTrainer steps per HF architecture")
    parser.add_argument("--render-only", action="store_true", help="render the recorded docs/models.json again")
    parser.add_argument("--json", type=Path, default=JSON_PATH)
    parser.add_argument("--out", type=Path, default=MD_PATH)
    args = parser.parse_args()
    surprises: list[str] = []
    if not args.render_only:
        warnings.simplefilter("ignore")
        import transformers

        transformers.logging.set_verbosity_error()
        from clipping_helpers import RTOL
        from test_model_zoo import CLIPPINGS, RTOL_AUTOCAST, RTOL_F32, RTOL_F64, WHY_REFUSED

        entries, surprises = measure(args.train)
        command = "python scripts/models_table.py" + (" --train" if args.train else "")
        record = {
            "command": command,
            "versions": _versions(),
            "clippings": list(CLIPPINGS),
            "tolerances": {"rtol": RTOL, "atol": RTOL_F64, "atol_f32": RTOL_F32, "rtol_autocast": RTOL_AUTOCAST},
            "differs_from_tables": surprises,
            "why_refused": WHY_REFUSED,
            "train": args.train,
            "entries": entries,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {len(entries)} entries to {args.json}", file=sys.stderr)
    record = json.loads(args.json.read_text())
    args.out.write_text(render(record))
    print(f"wrote {args.out}", file=sys.stderr)
    for line in surprises:
        print(f"differs from the test's table: {line}", file=sys.stderr)
    return 1 if surprises else 0


if __name__ == "__main__":
    raise SystemExit(main())
