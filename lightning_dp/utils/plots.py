"""Privacy curves (epsilon against optimizer steps) as matplotlib figures (the optional ``plot`` extra), built with
``matplotlib.figure.Figure``, never ``pyplot``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: ``(steps, epsilons)`` of one curve: equal-length sequences, steps increasing.
Curve = tuple[Sequence[int], Sequence[float]]

MISSING_MATPLOTLIB = "privacy plots need matplotlib: pip install 'lightning_dp[plot]'"


def matplotlib_available() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def epsilon_curve_figure(curves: Mapping[str, Curve], *, delta: float, title: str | None = None) -> Figure:
    """One line per curve: epsilon (at ``delta``) against the number of optimizer steps.

    Args:
        curves: label (e.g. the accountant name) -> ``(steps, epsilons)``; infinite epsilons are left out.
        delta: the delta every epsilon is reported at (shown on the y axis label).
        title: figure title.

    Raises:
        ImportError: matplotlib is not installed (the message names the ``plot`` extra).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(MISSING_MATPLOTLIB) from err
    figure = Figure(figsize=(7.0, 4.5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    for label, (steps, epsilons) in curves.items():
        x, y = np.asarray(steps, dtype=float), np.asarray(epsilons, dtype=float)
        finite = np.isfinite(y)
        axes.plot(x[finite], y[finite], marker="." if finite.sum() < 40 else None, label=label)
    axes.set_xlabel("optimizer steps")
    axes.set_ylabel(f"epsilon (delta = {delta:.3g})")
    axes.set_ylim(bottom=0.0)
    axes.grid(True, alpha=0.3)
    if len(curves) > 1:
        axes.legend(fontsize="small")
    if title:
        axes.set_title(title, fontsize="medium")
    return figure


def save_epsilon_curves(
    path: str | Path, curves: Mapping[str, Curve], *, delta: float, title: str | None = None
) -> Path:
    """Write :func:`epsilon_curve_figure` to ``path`` (format from the suffix, e.g. ``.png``, ``.pdf``, ``.svg``).

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: the directory of ``path`` does not exist.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"cannot write the plot to {path}: directory {path.parent} does not exist")
    epsilon_curve_figure(curves, delta=delta, title=title).savefig(path)
    return path


def figure_to_rgb(figure: Figure) -> np.ndarray:
    """The rendered figure as a ``uint8`` array of shape ``[H, W, 3]`` (for loggers' ``log_image``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def log_figure(logger: Any, tag: str, figure: Figure, step: int) -> bool:
    """Send ``figure`` to a Lightning logger that takes images (TensorBoard, MLflow, any with ``log_image``); return
    whether it did.
    """
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_figure(tag, figure, global_step=step)
        return True
    if isinstance(logger, MLFlowLogger):
        logger.experiment.log_figure(logger.run_id, figure, f"{tag}.png")
        return True
    if callable(getattr(logger, "log_image", None)):
        logger.log_image(key=tag, images=[figure_to_rgb(figure)], step=step)
        return True
    return False
