"""bench/users_paths.py's records as text: the plain report of a run and the "Whole step through the users' paths"
section of docs/performance.md, rendered from the JSON records in docs/bench/users_paths/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from records import plural, render_records

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "users_paths"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- users_paths:start -->", "<!-- users_paths:end -->"
#: The engine parts the breakdown times (bench/users_paths.py's ``patch_engine``), in the order the tables show them.
PARTS = ("user forward", "check forwards", "per_sample_loss rest", "clip (backward)", "privatise (noise)", "opt step")


def round_range(row: dict[str, Any]) -> str:
    """``"lowest-highest"`` of a DP variant's per-round ratios, ``"-"`` for a plain variant or a record made before
    they were kept."""
    rounds = row.get("round_ratios")
    return f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"


def report_lines(record: dict[str, Any]) -> list[str]:
    """The plain-text report of one run (``record``: the JSON this script writes)."""
    args, out = record["args"], record
    timed_by = "cpu" if args["device"] == "cpu" else "wall"
    size = f"T={args['seq_len']} " if args["model"] == "gpt2" else ""
    lines = [
        f"model={args['model']} {size}B={args['batch_size']} device={args['device']} threads={args['threads']} "
        f"rounds={args['rounds']} x {args['steps_per_round']} steps (first {args['skip_first']} of each left out); "
        f"ratio from {timed_by} time",
        f"{'variant':<22} {'steps':>5} {'cpu ms/ex':>10} {'wall ms/ex':>11} {'x plain':>8} {'rounds':>11}",
    ]
    for name in out["order"]:
        row = out["results"][name]
        if "error" in row:
            lines.append(f"{name:<22} {row['error']}")
            continue
        ratio = f"{row['ratio']:>8.2f}" if "ratio" in row else f"{'-':>8}"
        lines.append(
            f"{name:<22} {row['steps']:>5} {row['cpu_per_example'] * 1e3:>10.3f} "
            f"{row['wall_per_example'] * 1e3:>11.3f} {ratio} {round_range(row):>11}"
        )
    for name, parts in out["breakdown"].items():
        plain = out["results"].get(name.split("-")[0] + "-plain", {}).get(f"{timed_by}_per_example")
        lines.append(f"\nbreakdown of {name} ({timed_by} ms per step, mean; B={parts['examples']:.0f})")
        for part in (*PARTS, "rest (framework, adapter)", "step"):
            lines.append(f"  {part:<28} {parts[part] * 1e3:>10.2f} {parts[part] / parts['step']:>7.1%}")
        if plain is not None:
            lines.append(f"  {'plain step (median)':<28} {plain * parts['examples'] * 1e3:>10.2f}")
    for name, profiled in out.get("profile", {}).items():
        lines.append(f"\n{profile_title(name, profiled, args['device'])}")
        for key, dp, plain, dp_calls, plain_calls in profiled["rows"]:
            calls = f"calls {dp_calls:g} / {plain_calls:g}"
            lines.append(f"  {dp - plain:>9.1f} ms  ({dp:.1f} against {plain:.1f}; {calls})  {key}")
    return lines


def profile_title(name: str, profiled: dict[str, Any], device: str) -> str:
    """The heading line of one variant's profile."""
    kind = "CPU self" if device == "cpu" else "device"
    return (
        f"{name}: the operators it spends the most {kind} time on beyond its plain step (ms per step; profiled "
        f"totals {profiled['dp_ms']:.4g} ms against {profiled['plain_ms']:.4g} ms, "
        f"{profiled['dp_ms'] / profiled['plain_ms']:.2f}x)"
    )


def markdown(record: dict[str, Any]) -> str:
    """One recorded run as the docs show it: the command, the ratios table and the breakdown table."""
    args, env = record["args"], record["environment"]
    timed_by = "cpu" if args["device"] == "cpu" else "wall"
    size = f", T={args['seq_len']}" if args["model"] == "gpt2" else ""
    kernels = f", {env['cpu_capability']} kernels" if args["device"] == "cpu" and env.get("cpu_capability") else ""
    commit = f", at {env['commit']}" if env.get("commit") else ""
    lines = [
        f"**{args['model']}{size}, B={args['batch_size']}** ({env['device_name']}{kernels}, torch {env['torch']}, "
        f"{plural(args['threads'], 'intra-op thread')}, "
        f"load average {env['load_before']:.2f} before / {env['load_after']:.2f} after{commit}; "
        f"ratios of {timed_by} time)",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        "| variant | steps | cpu ms / example | wall ms / example | x plain of its path | rounds' range |",
        "|---|---|---|---|---|---|",
    ]
    for name in record["order"]:
        row = record["results"][name]
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | | | |")
            continue
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
        lines.append(
            f"| {name} | {row['steps']} | {row['cpu_per_example'] * 1e3:.4g} | {row['wall_per_example'] * 1e3:.4g} "
            f"| {ratio} | {round_range(row)} |"
        )
    if record["breakdown"]:
        names = list(record["breakdown"])
        lines += ["", f"Where a DP step's {timed_by} time goes (ms per step, mean):", ""]
        lines.append("| part | " + " | ".join(names) + " |")
        lines.append("|---" * (len(names) + 1) + "|")
        for part in (*PARTS, "rest (framework, adapter)", "step"):
            shares = [(record["breakdown"][n][part], record["breakdown"][n]["step"]) for n in names]
            cells = [f"{value * 1e3:.4g} ({value / step:.1%})" for value, step in shares]
            lines.append(f"| {part} | " + " | ".join(cells) + " |")
        plains = []
        for n in names:
            plain = record["results"].get(n.split("-")[0] + "-plain", {}).get(f"{timed_by}_per_example")
            plains.append("-" if plain is None else f"{plain * record['breakdown'][n]['examples'] * 1e3:.4g}")
        lines.append("| plain step of the path (median) | " + " | ".join(plains) + " |")
    for name, profiled in record.get("profile", {}).items():
        lines += ["", profile_title(name, profiled, args["device"]) + ":", ""]
        lines += ["| operator [input shapes] | extra | DP | plain | calls DP / plain |", "|---|---|---|---|---|"]
        for key, dp, plain, dp_calls, plain_calls in profiled["rows"]:
            lines.append(f"| `{key}` | {dp - plain:.1f} | {dp:.1f} | {plain:.1f} | {dp_calls:g} / {plain_calls:g} |")
    return "\n".join(lines)


def render() -> None:
    """Re-render docs/performance.md's users'-path section from the JSON records in docs/bench/users_paths/."""
    render_records(RECORDS, markdown, PAGE, START, END)
