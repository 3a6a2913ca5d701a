"""What each entry point imports: ``import lightning_dp`` and the command line's help and argument errors leave the
heavy packages (Lightning, transformers, peft, datasets, matplotlib, scipy, torch) alone; public names still resolve,
on first use.

Each case runs in a fresh interpreter (``sys.modules`` of this test process is full of everything) and reads back
which of :data:`HEAVY` got imported. The start-up times these keep low are measured by ``bench/cli_startup.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_dp

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("lightning", "pytorch_lightning", "transformers", "peft", "datasets", "matplotlib", "scipy", "torch")


def imported_after(code: str) -> list[str]:
    """The modules of :data:`HEAVY` that ``code`` imports in a fresh interpreter (a ``SystemExit``, as from
    ``--help``, ends the code, not the check)."""
    probe = "\n".join(
        [
            "import json, sys",
            "try:",
            textwrap.indent(code, "    "),
            "except SystemExit:",
            "    pass",
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))",
        ]
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def cli(*argv: str) -> str:
    return f"from lightning_dp.cli.main import main; main({list(argv)!r})"


GAUSS = ["--noise", "gaussian", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5", "--max-grad-norm", "1"]
#: case -> (code, the modules of HEAVY it may import). The accountants need scipy; a tensor, torch.
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "import lightning_dp": ("import lightning_dp", ()),
    "lightning-dp --help": (cli("--help"), ()),
    "lightning-dp (unknown command)": (cli("fitt"), ()),
    "lightning-dp epsilon --help": (cli("epsilon", "--help"), ("scipy",)),
    "lightning-dp epsilon (misspelt noise)": (cli("epsilon", "--noise", "gausian"), ("scipy",)),
    "lightning-dp epsilon (Gaussian)": (cli("epsilon", *GAUSS, "--noise-multiplier", "1.1"), ("scipy",)),
    "lightning-dp demo --help": (cli("demo", "--help"), ()),
    "lightning-dp demo (misspelt clipping)": (cli("demo", "--clipping", "flt"), ()),
    "lightning-dp tune --help": (cli("tune", "--help"), ()),
    "lightning-dp tune (bad learning rate)": (cli("tune", "--lr", "0.1,-1"), ()),
    "from lightning_dp import PrivacyEngine": ("from lightning_dp import PrivacyEngine", ("scipy", "torch")),
    "import lightning_dp.hf": ("import lightning_dp.hf", ("scipy", "torch", "transformers", "peft", "datasets")),
}


@pytest.mark.parametrize("case", CASES)
def test_heavy_packages_stay_out(case):
    code, allowed = CASES[case]
    assert set(imported_after(code)) <= set(allowed)


def test_public_names_resolve_on_first_use():
    assert set(lightning_dp.__all__) <= set(dir(lightning_dp))
    for name in lightning_dp.__all__:
        assert getattr(lightning_dp, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'DPStrategyy'"):
        lightning_dp.DPStrategyy  # noqa: B018
    from lightning_dp import DPStrategy
    from lightning_dp.lightning.strategy import DPStrategy as defined

    assert DPStrategy is defined


def test_hf_conv1d_is_supported_when_transformers_comes_after_the_clipping_engines():
    """The ``Conv1D`` layer family registers once ``transformers`` is imported, not with the engines."""
    code = """
import lightning_dp.clipping
from lightning_dp.clipping.layers.registry import find_layer_family
assert "transformers" not in sys.modules
from transformers.pytorch_utils import Conv1D
assert find_layer_family(Conv1D(3, 5)) is not None
"""
    assert "transformers" in imported_after(code)


def test_the_strategies_register_after_a_reload_and_a_failing_setup_only_warns() -> None:
    """``importlib.reload(lightning_dp)`` before Lightning is imported (IPython's autoreload does this) leaves two
    import hooks on one name: Lightning still imports, once, with the strategies registered. A hook whose set-up
    fails turns the failure into a warning; the user's import succeeds."""
    code = "\n".join(
        [
            "import importlib, warnings",
            "import lightning_dp",
            "importlib.reload(lightning_dp)",
            "import lightning.pytorch",
            "from lightning.pytorch.strategies import StrategyRegistry",
            "assert 'dp' in StrategyRegistry, 'not registered'",
            "from lightning_dp.utils.import_hooks import when_imported",
            "def broken():",
            "    raise RuntimeError('broken set-up')",
            "when_imported('json.tool', broken)",
            "with warnings.catch_warnings(record=True) as caught:",
            "    warnings.simplefilter('always')",
            "    import json.tool",
            "assert any('broken set-up' in str(w.message) for w in caught), [str(w.message) for w in caught]",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
