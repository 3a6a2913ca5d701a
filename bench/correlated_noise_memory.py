"""The memory correlated noise keeps between steps, per model size (docs/correlated_noise.md, "Memory"): the state of
the library's own streams for banded noise (``b - 1`` vectors) and BLT noise (``d`` buffers), each vector the size of
the trainable parameters, in float32 for 16-bit ones.

    python bench/correlated_noise_memory.py               # measure and render between the page's memory markers
    python bench/correlated_noise_memory.py --print       # print the table only
    python bench/correlated_noise_memory.py --size toy    # the same models as tiny configs (what the tests run)

Each model of bench/gpu_models.py is built from its config on the ``meta`` device (shapes and dtypes, no memory
allocated), and the streams (``correlated_noise.streaming.noise_stream``) of a banded strategy of each band and a BLT
strategy of each buffer count are stepped on ``meta`` tensors shaped like its trainable parameters until their state is
warm; the table gives the bytes that state holds (``nbytes`` of its tensors). The coefficients do not change the
memory; the same command gives the same table. Beside it, for scale: the bytes of the model's weights and of AdamW's
two moments for the trainable parameters (in their dtype, as torch keeps them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from gpu_models import MODELS, SIZES, build_model, model_spec
from records import replace_between_markers

from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz, Strategy
from lightning_dp.correlated_noise.streaming import noise_stream
from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "correlated_noise.md"
START, END = "<!-- memory:start -->", "<!-- memory:end -->"
BANDS = (2, 4, 8)
BUFFERS = (2, 4)
META = torch.device("meta")


def strategies() -> dict[str, Strategy]:
    """One strategy per column: ``band b`` for :data:`BANDS`, ``BLT d`` for :data:`BUFFERS`."""
    banded = {f"band {b}": BandedToeplitz((1.0, *[0.5**k for k in range(1, b)])) for b in BANDS}
    blt = {f"BLT d = {d}": BufferedToeplitz(tuple(0.9**j for j in range(1, d + 1)), (0.1,) * d) for d in BUFFERS}
    return {**banded, **blt}


def state_bytes(strategy: Strategy, trainable: list[torch.Tensor]) -> int:
    """Bytes of the stream's state once warm, stepped on ``meta`` tensors shaped like ``trainable``."""
    stream = noise_stream(strategy)
    z = [torch.empty(p.shape, dtype=p.dtype, device=META) for p in trainable]
    for _ in range(stream.num_buffers + 1):
        stream.correlate(z)
    return sum(t.nbytes for vector in stream.state_dict()["state"] for t in vector)


def measure(name: str, size: str) -> dict[str, Any]:
    """The row of model ``name`` (see the module docstring)."""
    model = build_model(model_spec(name, size), META)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {
        "model": name,
        "trainable": sum(p.numel() for p in trainable),
        "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in trainable}),
        "weights_bytes": sum(p.nbytes for p in model.parameters()),
        "adamw_bytes": 2 * sum(p.nbytes for p in trainable),
        "state_bytes": {column: state_bytes(strategy, trainable) for column, strategy in strategies().items()},
    }


def _count(count: int) -> str:
    return f"{count / 1e9:.3g} B" if count >= 1e9 else f"{count / 1e6:.3g} M"


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The table of ``rows`` (:func:`measure`), under the command that printed it."""
    columns = list(rows[0]["state_bytes"])
    lines = [
        f"```bash\n{command}\n```\n",
        "| model | trainable parameters (dtype) | weights | AdamW's moments | "
        + " | ".join(f"{column} state" for column in columns)
        + " |",
        "|---" * (4 + len(columns)) + "|",
    ]
    for row in rows:
        cells = [
            f"`{row['model']}`",
            f"{_count(row['trainable'])} ({', '.join(row['dtypes'])})",
            _size(row["weights_bytes"]),
            _size(row["adamw_bytes"]),
            *(_size(row["state_bytes"][column]) for column in columns),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="real", help="the models' size (default: %(default)s)")
    parser.add_argument("--print", action="store_true", help="print the table instead of rendering it into the page")
    args = parser.parse_args(argv)
    rows = [measure(name, args.size) for name in MODELS]
    command = "python bench/correlated_noise_memory.py" + ("" if args.size == "real" else f" --size {args.size}")
    text = markdown(rows, command)
    if args.print or args.size != "real":
        print(text)
    else:
        replace_between_markers(PAGE, text, START, END)
        print(f"rendered into {PAGE}")


if __name__ == "__main__":
    main(sys.argv[1:])
