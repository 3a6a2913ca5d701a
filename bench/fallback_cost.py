"""Step time and peak memory of the exact torch.func fallback against a layer family on the same layers, against
non-private training and against Opacus, in one run.

Model: ``--blocks`` residual blocks ``x + Linear(GELU(Linear(LayerNorm(x))))`` (width ``--dim``, hidden ``--hidden``)
and a final LayerNorm on ``[B, T, d]`` inputs; per-sample loss: the mean squared error to a fixed random target.
SGD; the private variants clip to C=1 and add Gaussian noise (sigma=1).

Variants (identical weights): ``non-private``; ``family`` (``PerSampleClipper`` with ``--clipping``, default
``mixed``: every layer through its family); ``fallback-norm`` (every LayerNorm a module of its own that calls
``F.layer_norm``: no family matches it, the exact fallback serves it); ``fallback-linear`` (the Linear layers too, so
the fallback serves every parameter); ``opacus`` (``GradSampleModule`` on the ``family`` model: its LayerNorm and
Linear samplers); ``opacus-functorch-norm`` (``GradSampleModule`` on the ``fallback-norm`` model: Opacus's functorch
path for the norms); ``opacus-functorch`` (``GradSampleModule(force_functorch=True)``: functorch for every layer).
The ratios ``x opacus`` compare a variant with Opacus on the same layers (``family``: ``opacus``; ``fallback-norm``:
``opacus-functorch-norm``; ``fallback-linear``: ``opacus-functorch``).

Time and memory are measured as by bench/clipping_engines.py (bench/timing.py): interleaved steps in one process,
the median over ``--steps``, CPU time with ``--threads`` threads on CPU, wall time on CUDA; each variant's peak extra
memory alone in a fresh process.

Usage: ``python bench/fallback_cost.py [--dim 256 --seq-len 64 --batch-size 16 --blocks 4] [--device cuda] [--json]``;
``--record NAME`` also writes the run to ``docs/bench/fallback_cost/NAME.json`` and re-renders the section of
docs/performance.md between the ``fallback_cost`` markers from all records; ``--render`` only re-renders.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from records import add_record_options, environment, finish, plural, render_records
from timing import Step, clipper_step, opacus_step, plain_step, ratios, time_and_memory, timed_by
from torch import nn

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "fallback_cost"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- fallback_cost:start -->", "<!-- fallback_cost:end -->"

#: The layers each variant's model is built of: ``nn`` (torch's), ``norm`` (own LayerNorm), ``linear`` (own both).
LAYERS = {
    "non-private": "nn",
    "family": "nn",
    "fallback-norm": "norm",
    "fallback-linear": "linear",
    "opacus": "nn",
    "opacus-functorch-norm": "norm",
    "opacus-functorch": "nn",
}
VARIANTS = tuple(LAYERS)
#: Opacus on the same layers as each of our private variants (the ``x opacus`` ratios).
OPACUS_COUNTERPART = {
    "family": "opacus",
    "fallback-norm": "opacus-functorch-norm",
    "fallback-linear": "opacus-functorch",
}


class OwnLayerNorm(nn.Module):
    """``nn.LayerNorm``'s maths and parameters in a module no layer family matches."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class OwnLinear(nn.Module):
    """``nn.Linear``'s maths and parameters in a module no layer family matches."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.empty(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Block(nn.Module):
    """``x + down(GELU(up(norm(x))))``."""

    def __init__(self, dim: int, hidden: int, norm: type[nn.Module], linear: type[nn.Module]) -> None:
        super().__init__()
        self.norm, self.up, self.down = norm(dim), linear(dim, hidden), linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPStack(nn.Module):
    """Residual MLP blocks and a final norm on ``[B, T, d]``."""

    def __init__(self, args: argparse.Namespace, layers: str) -> None:
        super().__init__()
        norm = nn.LayerNorm if layers == "nn" else OwnLayerNorm
        linear = OwnLinear if layers == "linear" else nn.Linear
        self.blocks = nn.ModuleList(Block(args.dim, args.hidden, norm, linear) for _ in range(args.blocks))
        self.norm = norm(args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build_models(args: argparse.Namespace, device: torch.device, kinds: Iterable[str]) -> dict[str, nn.Module]:
    """The model of each of ``kinds`` (values of ``LAYERS``), all with the weights of the seeded ``nn`` model (the
    norms' weights and biases drawn too, so that they are not the identity)."""
    torch.manual_seed(0)
    reference = MLPStack(args, "nn")
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)
    models = {}
    for layers in kinds:
        model = MLPStack(args, layers)
        model.load_state_dict(reference.state_dict())
        models[layers] = model.to(device).train()
    return models


def _data(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.seq_len, args.dim)
    return torch.randn(shape, generator=generator).to(device), torch.randn(shape, generator=generator).to(device)


def check_no_family(model: nn.Module) -> None:
    """Raise unless every own-parameter layer of ``model`` is left to the fallback (no family, none by probe)."""
    from lightning_dp.clipping import find_layer_family
    from lightning_dp.clipping.layers.registry import probed_family

    for name, module in model.named_modules():
        if isinstance(module, OwnLayerNorm | OwnLinear) and (find_layer_family(module) or probed_family(module)):
            raise RuntimeError(f"{name} ({type(module).__name__}) has a layer family: the fallback would not serve it")


def make_step(variant: str, model: nn.Module, inputs: torch.Tensor, target: torch.Tensor, clipping: str) -> Step:
    """One training step of ``variant`` on ``model`` (which it may hook or wrap)."""

    def per_sample_loss(module: nn.Module) -> torch.Tensor:
        return (module(inputs) - target).pow(2).mean(dim=(1, 2))

    batch = inputs.shape[0]
    if variant == "non-private":
        return plain_step(model, per_sample_loss)
    if variant.startswith("opacus"):
        return opacus_step(model, per_sample_loss, batch, force_functorch=variant == "opacus-functorch")
    if variant.startswith("fallback"):
        check_no_family(model)
    return clipper_step(model, per_sample_loss, batch, clipping=clipping)


def _build(variant: str, args: argparse.Namespace) -> Step:
    """``variant``'s step on a model and data of its own (the memory measurement's process)."""
    device = torch.device(args.device)
    model = build_models(args, device, [LAYERS[variant]])[LAYERS[variant]]
    return make_step(variant, model, *_data(args, device), args.clipping)


#: The ratios of a row: time, then peak extra memory, over non-private, ``family`` and the Opacus counterpart.
RATIOS = tuple(f"{kind}_{base}" for kind in ("time", "memory") for base in ("ratio", "vs_family", "vs_opacus"))
_HEADER = ("x non-private", "x family", "x opacus")


def _row_cells(row: dict[str, Any]) -> list[str]:
    """Wall and CPU milliseconds, the time ratios, the peak extra MiB and the memory ratios of a row that ran."""
    ratio = [f"{row[key]:.2f}" if key in row else "-" for key in RATIOS]
    memory = f"{row['peak_bytes'] / 2**20:.1f}" if "peak_bytes" in row else "-"
    return [f"{row['seconds'] * 1e3:.4g}", f"{row['cpu_seconds'] * 1e3:.4g}", *ratio[:3], memory, *ratio[3:]]


def _columns(cells: list[str], widths: list[int]) -> str:
    """The first cell left-aligned, the others right-aligned, each to its width."""
    return " ".join([f"{cells[0]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:], strict=True))])


def report_lines(record: dict[str, Any]) -> list[str]:
    """The plain-text report of one run (``record``: the JSON this script writes)."""
    args = record["args"]
    header = ["variant", "wall ms", "cpu ms", *_HEADER, "peak MiB", *_HEADER]
    widths = [22, 8, 8, 13, 9, 9, 9, 13, 9, 9]
    lines = [
        f"d={args['dim']} hidden={args['hidden']} blocks={args['blocks']} T={args['seq_len']} B={args['batch_size']} "
        f"clipping={args['clipping']} device={args['device']} threads={args['threads']} steps={args['steps']}; "
        f"time ratios from {timed_by(args['device']).replace('_', ' ')}",
        _columns(header, widths),
    ]
    for variant in record["order"]:
        row = record["results"][variant]
        if "seconds" not in row:
            lines.append(f"{variant:<22} {row.get('error', '')}")
            continue
        lines.append(_columns([variant, *_row_cells(row)], widths))
    return lines


def markdown(record: dict[str, Any]) -> str:
    """One recorded run as the docs show it: the set-up, the command and the table of times and memory."""
    args, env = record["args"], record["environment"]
    cpu = timed_by(args["device"]) == "cpu_seconds"
    threads = f", {plural(args['threads'], 'intra-op thread')}" if cpu else ""
    load = f"load average {env['load_before']:.2f} before / {env['load_after']:.2f} after"
    lines = [
        f"**d={args['dim']}, hidden {args['hidden']}, {plural(args['blocks'], 'block')}, T={args['seq_len']}, "
        f"B={args['batch_size']}, clipping={args['clipping']}** ({env['device_name']}, torch {env['torch']}{threads}, "
        f"{load}; median of {args['steps']} interleaved steps after {args['warmup']} left out; time ratios of "
        f"{'cpu' if cpu else 'wall'} time)",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        "| variant | wall ms | cpu ms | " + " | ".join(_HEADER) + " | peak extra MiB | " + " | ".join(_HEADER) + " |",
        "|---" * 10 + "|",
    ]
    for variant in record["order"]:
        row = record["results"][variant]
        cells = _row_cells(row) if "seconds" in row else [row.get("error", ""), *[""] * 8]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render() -> None:
    """Re-render docs/performance.md's recorded fallback runs from the JSON records in docs/bench/fallback_cost/."""
    render_records(RECORDS, markdown, PAGE, START, END)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every variant interleaved, then (unless ``--no-memory``) each variant's memory in its own process; the
    ratios over non-private, ``family`` and the Opacus counterpart."""
    device = torch.device(args.device)
    models = build_models(args, device, {LAYERS[variant] for variant in args.variants})
    inputs, target = _data(args, device)

    def build(variant: str) -> Step:
        return make_step(variant, copy.deepcopy(models[LAYERS[variant]]), inputs, target, args.clipping)

    results = time_and_memory(args, build, _build)
    for variant, row in results.items():
        row.update(ratios(row, results["non-private"], args.device, "ratio"))
        if "family" in results:
            row.update(ratios(row, results["family"], args.device, "vs_family"))
        if variant in OPACUS_COUNTERPART and OPACUS_COUNTERPART[variant] in results:
            row.update(ratios(row, results[OPACUS_COUNTERPART[variant]], args.device, "vs_opacus"))
    return {"order": list(args.variants), "results": results}


def main() -> None:
    from lightning_dp.clipping import ENGINES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--clipping", choices=list(ENGINES), default="mixed", help="our variants' engine")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--max-step-seconds", type=float, default=60.0)
    parser.add_argument("--no-memory", action="store_true", help="skip the per-process memory measurement")
    add_record_options(parser, RECORDS.relative_to(ROOT))
    args = parser.parse_args()
    if args.render:
        render()
        return
    if "non-private" not in args.variants:
        args.variants.insert(0, "non-private")
    torch.set_num_threads(args.threads)
    env = environment(args.device)
    out = run(args)
    finish(args, out, env, script="bench/fallback_cost.py", records=RECORDS, render=render, report_lines=report_lines)


if __name__ == "__main__":
    main()
