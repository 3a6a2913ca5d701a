"""bench/gpu.py's records as text: the plain report of a run and the docs section "GPU at real model sizes" of
docs/performance.md, rendered from the JSON records in docs/bench/gpu/ (and a plain statement that the GPU table has
not been recorded yet when there is none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from records import render_records
from timing import timed_by

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "gpu"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"
COMMAND = "python bench/gpu.py"
NO_RECORD = (
    "**The GPU table has not been recorded yet**: no GPU was lent while this bench was written, so there are no "
    f"numbers here, and none are estimated. On one H100 or H200, `{COMMAND}` (under 8 minutes) writes "
    "`docs/bench/gpu/real.json` and re-renders this section from it. The code paths were run only in the toy mode "
    "on a CPU (`python bench/gpu.py --toy --device cpu`, tests/bench/test_gpu_bench.py)."
)
#: The ratio columns: (JSON key suffix, header).
AGAINST = (("non_private", "non-private"), ("opacus_flat", "Opacus flat"), ("opacus_ghost", "Opacus ghost"))
GIB = 2**30


def _ratio(row: dict[str, Any], kind: str, against: str) -> str:
    value = row.get(f"{kind}_vs_{against}")
    return "-" if value is None else f"{value:.2f}"


def _gib(size: float) -> str:
    """Bytes in GiB: two decimals from 1 GiB, three significant digits under it (the toy's few MiB)."""
    return f"{size / GIB:.2f}" if size >= GIB else f"{size / GIB:.3g}"


def _memory(row: dict[str, Any]) -> str:
    """``peak GiB (extra GiB)``, with the second step's own extra where it was measured (``; 2nd step GiB``: without
    the first step's one-off checks), the memory error, or ``-``."""
    if "peak_total_bytes" in row:
        steady = f"; 2nd step {_gib(row['steady_peak_bytes'])}" if "steady_peak_bytes" in row else ""
        return f"{_gib(row['peak_total_bytes'])} ({_gib(row['peak_bytes'])}{steady})"
    return row.get("memory_error", "-")


def _status(row: dict[str, Any]) -> str:
    return row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"


def row_cells(row: dict[str, Any], device: str) -> list[str]:
    """A variant's cells: status, ms per step (timed steps; the time the ratios use on ``device``), the time ratios,
    the memory and the memory ratios."""
    if "seconds" not in row:
        return [_status(row), *["-"] * 8]
    time_key = timed_by(device)
    return [
        "ok",
        f"{row[time_key] * 1e3:.4g} ({row.get('timed_steps', '?')})",
        *(_ratio(row, "time", against) for against, _ in AGAINST),
        _memory(row),
        *(_ratio(row, "memory", against) for against, _ in AGAINST),
    ]


def describe_model(name: str, model: dict[str, Any]) -> str:
    """The model's line above its table: shape, batch, dtype, checkpointing, LoRA and the engine ``auto`` ran."""
    spec, config = model["spec"], model["spec"]["config"]
    shape = f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}"
    if spec["kind"] == "image-classifier":
        data = f"{config['image_size']} px, patches of {config['patch_size']}"
    else:
        data = f"vocabulary {config['vocab_size']}, T={spec['seq_len']}"
    extras = [spec["dtype"], *(["activation checkpointing"] if spec["checkpointing"] else [])]
    extras += ["LoRA r=16"] if spec["lora"] else []
    auto = model.get("engines", {}).get("dp-auto")
    ran = f"; `auto` ran `{auto}`" if auto else ""
    return f"**{name}** ({spec['kind']}: {shape}, {data}, B={spec['batch_size']}; {', '.join(extras)}{ran})"


def _probe_lines(probe: dict[str, Any]) -> list[str]:
    lines = [
        f"**Largest physical batch that fits** ({probe['model']}, `{probe['variant']}`, doubling, each size in its "
        f"own process; stopped: {probe['stopped']}): **{probe['largest_fits']}**",
        "",
        "| physical batch | status | peak GiB (extra) |",
        "|---|---|---|",
    ]
    for entry in probe["probes"]:
        lines.append(f"| {entry['batch_size']} | {_status(entry)} | {_memory(entry)} |")
    return lines


def _checkpointing_lines(saving: dict[str, Any], with_it: dict[str, Any] | None) -> list[str]:
    """The peak memory of the model without activation checkpointing against its rows with it."""
    lines = [
        f"**What activation checkpointing saves** ({saving['model']}, each variant in its own process)",
        "",
        "| variant | peak GiB (extra) without checkpointing | with checkpointing |",
        "|---|---|---|",
    ]
    for variant, row in saving["results"].items():
        checkpointed = "-" if with_it is None else _memory(with_it["results"].get(variant, {}))
        lines.append(f"| {variant} | {_memory(row) if 'peak_bytes' in row else _status(row)} | {checkpointed} |")
    return lines


def profile_lines(profile: dict[str, Any], device: str) -> list[str]:
    """A model's profile (bench/step_profile.py): the operators ``dp-auto`` spends the most time on beyond the
    non-private step, per step, in ms."""
    if "error" in profile:
        return [f"Profile: failed ({profile['error']})"]
    kind = "CPU self time" if device == "cpu" else "device time"
    lines = [
        f"Where `dp-auto`'s extra {kind} goes (ms per profiled step; totals {profile['dp_ms']:.4g} against "
        f"{profile['plain_ms']:.4g} non-private):",
        "",
        "| operator [input shapes] | extra | dp-auto | non-private | calls |",
        "|---|---|---|---|---|",
    ]
    for key, dp, plain, dp_calls, plain_calls in profile["rows"]:
        lines.append(f"| `{key}` | {dp - plain:.3g} | {dp:.3g} | {plain:.3g} | {dp_calls:g} / {plain_calls:g} |")
    return lines


def markdown(record: dict[str, Any]) -> str:
    """One recorded run as the docs show it: the set-up, the command, a table per model and the batch probe."""
    args, env = record["args"], record["environment"]
    on_cpu = args["device"] == "cpu"
    clock = "CPU time (not a GPU run)" if on_cpu else "wall time between `torch.cuda.synchronize` calls"
    versions = ", ".join(f"{name} {env[name]}" for name in ("torch", "transformers", "opacus", "peft") if name in env)
    lines = [
        f"**{args['size']} sizes on {env['device_name']}** ({versions}; budget {args['budget']:.0f} s, took "
        f"{record.get('elapsed_seconds', 0):.0f} s; median of at most {args['steps']} interleaved steps after "
        f"{args['warmup']} left out; times are {clock})",
        "",
        "```bash",
        record["command"],
        "```",
        "",
    ]
    header = ["variant", "status", "ms / step (steps)", *(f"time x {h}" for _, h in AGAINST), "peak GiB (extra)",
              *(f"memory x {h}" for _, h in AGAINST)]  # fmt: skip
    for name, model in record["models"].items():
        lines += [describe_model(name, model), "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        for variant, row in model["results"].items():
            lines.append(f"| {variant} | " + " | ".join(row_cells(row, args["device"])) + " |")
        lines.append("")
        if "profile" in model:
            lines += [*profile_lines(model["profile"], args["device"]), ""]
    if "batch_probe" in record:
        lines += _probe_lines(record["batch_probe"])
    if "checkpointing_memory" in record:
        saving = record["checkpointing_memory"]
        lines += ["", *_checkpointing_lines(saving, record["models"].get(saving["model"]))]
    return "\n".join(lines).rstrip("\n")


def report_lines(record: dict[str, Any]) -> list[str]:
    """The plain-text report of one run: per model, one line per variant."""
    args = record["args"]
    lines = [f"size={args['size']} device={args['device']} elapsed={record.get('elapsed_seconds', 0):.0f}s "
             f"budget={args['budget']:.0f}s"]  # fmt: skip
    for name, model in record["models"].items():
        lines.append(describe_model(name, model).replace("**", ""))
        for variant, row in model["results"].items():
            cells = row_cells(row, args["device"])
            if cells[0] != "ok":
                lines.append(f"  {variant:<13} {cells[0]}")
                continue
            lines.append(f"  {variant:<13} {cells[1]:>14} ms  x non-private {cells[2]:>5}  x opacus-flat {cells[3]:>5}"
                         f"  x opacus-ghost {cells[4]:>5}  peak GiB (extra) {cells[5]}")  # fmt: skip
        if "profile" in model:
            lines += ["  " + line.replace("`", "") for line in profile_lines(model["profile"], args["device"])]
    if "batch_probe" in record:
        probe = record["batch_probe"]
        tried = ", ".join(f"{p['batch_size']}: {p['status']}" for p in probe["probes"])
        lines.append(f"largest physical batch of {probe['model']} ({probe['variant']}): {probe['largest_fits']} "
                     f"[{tried}; stopped: {probe['stopped']}]")  # fmt: skip
    if "checkpointing_memory" in record:
        saving = record["checkpointing_memory"]
        table = _checkpointing_lines(saving, record["models"].get(saving["model"]))
        lines += [line.replace("**", "") for line in table]
    return lines


def render() -> None:
    """Re-render the "GPU at real model sizes" section of docs/performance.md from docs/bench/gpu/*.json (the
    statement :data:`NO_RECORD` when there is none)."""
    render_records(RECORDS, markdown, PAGE, START, END, empty=NO_RECORD)
