"""Epsilon and the privacy summary in real experiment trackers, read back from each tracker's own store.

Lightning (``PrivacyAccountantCallback`` with ``TensorBoardLogger``, ``CSVLogger``, ``MLFlowLogger`` and
``WandbLogger`` in offline mode): epsilon per epoch equals the callback's history, the summary reaches every
tracker as metrics (``dp/epsilon``...) and as hyperparameters, and the privacy-curve image reaches TensorBoard and
MLflow. HF (``DPTrainer`` with ``report_to`` TensorBoard, MLflow and W&B offline): epsilon at every logging step and
the summary's numbers with the final training metrics. The stores are read with each tracker's reader:
TensorBoard's ``EventAccumulator``, ``mlflow.tracking.MlflowClient`` on a local file store, the CSV files, and the
records of W&B's offline run file. Each tracker is an optional extra (``pip install 'lightning_dp[tracking]'``);
a missing one skips its test with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TinyRegressor, make_trainer
from process_helpers import SCRIPTS

from lightning_dp import DPStrategy, PrivacyAccountantCallback

EPOCHS = 3
SUMMARY_NUMBERS = ("epsilon", "delta", "noise_multiplier", "steps", "sample_rate")


def _event_accumulator(folder: Path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    accumulator = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.IMAGES: 0})
    accumulator.Reload()
    return accumulator


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the event files under ``folder``: ``[(step, value)]``."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in sorted({path.parent for path in folder.rglob("events.out.tfevents.*")}):
        accumulator = _event_accumulator(events)
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


def _tensorboard_hparams(folder: Path) -> dict[str, object]:
    """The hyperparameters of the TensorBoard hparams plugin's session-start record."""
    plugin_data = pytest.importorskip("tensorboard.plugins.hparams.plugin_data_pb2")
    params: dict[str, object] = {}
    for events in {path.parent for path in folder.rglob("events.out.tfevents.*")}:
        for content in _event_accumulator(events).PluginTagToContent("hparams").values():
            data = plugin_data.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                for key, value in data.session_start_info.hparams.items():
                    params[key] = getattr(value, value.WhichOneof("kind"))
    return params


def _wandb_records(run_file: Path) -> list[dict]:
    """The records of a W&B offline run file (``run-<id>.wandb``: a 7-byte ``:W&B`` header, then LevelDB-log
    records of 32 KiB blocks holding ``wandb_internal_pb2.Record`` messages), as dictionaries."""
    records_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    from google.protobuf.json_format import MessageToDict

    data, block, position, pending, records = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if left < 7 or (length == 0 and kind == 0):  # block trailer or zero padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            records.append(MessageToDict(records_pb2.Record.FromString(pending)))
            pending = b""
    return records


def _wandb_items(records: list[dict], kind: str, field: str) -> list[dict[str, object]]:
    """For each record of ``kind`` (``history``, ``config``): its items, ``{key: value}``; a nested key's value is a
    dictionary under its first part (an image: ``{"privacy/epsilon_curve": {"filenames": [...], ...}}``)."""
    rows = []
    for record in records:
        if kind not in record:
            continue
        row: dict[str, object] = {}
        for item in record[kind][field]:
            first, *rest = [item["key"]] if item.get("key") else item["nestedKey"]
            value = json.loads(item["valueJson"])
            if rest:
                row.setdefault(first, {})["/".join(rest)] = value  # type: ignore[index]
            else:
                row[first] = value
        rows.append(row)
    return rows


def _wandb_run_file(folder: Path) -> Path:
    (run_file,) = folder.rglob("offline-run-*/run-*.wandb")
    return run_file


# -------------------------------------------------------------------------------------------- Lightning
def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory) -> tuple[PrivacyAccountantCallback, Path, dict]:
    """One DP fit of 3 epochs with the CSV logger and whichever of the TensorBoard, MLflow and W&B loggers are
    installed; the callback, the log folder and the loggers by name."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    folder = tmp_path_factory.mktemp("trackers")
    loggers = {"csv": CSVLogger(folder / "csv", name="run")}
    if _installed("tensorboard"):
        loggers["tensorboard"] = TensorBoardLogger(folder / "tb", name="run")
    if _installed("mlflow"):
        loggers["mlflow"] = MLFlowLogger(experiment_name="dp", tracking_uri=(folder / "mlruns").as_uri())
    if _installed("wandb"):
        loggers["wandb"] = WandbLogger(project="dp", save_dir=str(folder / "wandb"), offline=True)
    callback = PrivacyAccountantCallback()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    trainer = make_trainer(strategy, max_epochs=EPOCHS, callbacks=[callback], logger=list(loggers.values()))
    trainer.fit(TinyRegressor())
    if "wandb" in loggers:
        loggers["wandb"].experiment.finish()
    return callback, folder, loggers


@pytest.fixture(scope="module", autouse=True)
def _offline_stores():
    """MLflow's local file store (kept in maintenance by MLflow, so opted into) and W&B without a server."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        yield


def _epochs(callback: PrivacyAccountantCallback) -> list[float]:
    return [epsilon for _, _, epsilon in callback.history]


def test_csv_logger_holds_epsilon_per_epoch_and_the_summary(lightning_run) -> None:
    callback, folder, _ = lightning_run
    (metrics,) = folder.rglob("csv/**/metrics.csv")
    rows = [line.split(",") for line in metrics.read_text().splitlines()]
    header, rows = rows[0], rows[1:]
    column = header.index("epsilon")
    logged = [float(row[column]) for row in rows if row[column]]
    assert logged == pytest.approx(_epochs(callback), rel=1e-6)
    final = next(row for row in rows if row[header.index("dp/epsilon")])
    assert float(final[header.index("dp/epsilon")]) == pytest.approx(callback.summary["epsilon"], rel=1e-6)
    (hparams,) = folder.rglob("csv/**/hparams.yaml")
    params = yaml.safe_load(hparams.read_text())
    assert params["dp/noise"] == "gaussian" and params["dp/accountant"] == callback.summary["accountant"]
    assert params["dp/delta"] == pytest.approx(callback.summary["delta"]) and "dp/epsilon" not in params
    assert params["dp/clipping"] == "mixed"  # the engine clipping="auto" (the default) resolved to


def test_tensorboard_holds_epsilon_per_epoch_the_summary_and_the_curve(lightning_run) -> None:
    pytest.importorskip("tensorboard")
    callback, folder, _ = lightning_run
    scalars = _tensorboard_scalars(folder / "tb")
    assert [value for _, value in scalars["epsilon"]] == pytest.approx(_epochs(callback), rel=1e-6)
    assert scalars["dp/epsilon"][-1][1] == pytest.approx(callback.summary["epsilon"], rel=1e-6)
    params = _tensorboard_hparams(folder / "tb")
    assert params["dp/noise"] == "gaussian"
    assert params["dp/noise_multiplier"] == pytest.approx(1.0)
    images = set()
    for events in {path.parent for path in (folder / "tb").rglob("events.out.tfevents.*")}:
        images |= set(_event_accumulator(events).Tags()["images"])
    assert PrivacyAccountantCallback.plot_tag in images


def test_mlflow_holds_epsilon_per_epoch_the_summary_and_the_curve(lightning_run) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    callback, folder, loggers = lightning_run
    logger = loggers["mlflow"]
    client = MlflowClient(tracking_uri=(folder / "mlruns").as_uri())
    history = client.get_metric_history(logger.run_id, "epsilon")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(_epochs(callback), rel=1e-6)
    run = client.get_run(logger.run_id)
    assert run.data.metrics["dp/epsilon"] == pytest.approx(callback.summary["epsilon"], rel=1e-6)
    assert run.data.params["dp/noise"] == "gaussian"
    assert float(run.data.params["dp/sample_rate"]) == pytest.approx(callback.summary["sample_rate"])
    artifacts = [a.path for a in client.list_artifacts(logger.run_id, "privacy")]
    assert f"{PrivacyAccountantCallback.plot_tag}.png" in artifacts


def test_wandb_offline_run_holds_epsilon_per_epoch_and_the_summary(lightning_run) -> None:
    pytest.importorskip("wandb")
    callback, folder, _ = lightning_run
    records = _wandb_records(_wandb_run_file(folder / "wandb"))
    history = _wandb_items(records, "history", "item")
    logged = [row["epsilon"] for row in history if "epsilon" in row]
    assert logged == pytest.approx(_epochs(callback), rel=1e-6)
    assert any(row.get("dp/epsilon") == pytest.approx(callback.summary["epsilon"]) for row in history)
    config = {k: v for update in _wandb_items(records, "config", "update") for k, v in update.items()}
    assert config["dp/noise"] == {"value": "gaussian"} or config["dp/noise"] == "gaussian"
    images = [row[PrivacyAccountantCallback.plot_tag] for row in history if PrivacyAccountantCallback.plot_tag in row]
    assert images and images[0]["_type"] == "images/separated"  # the curve, through log_image


# ------------------------------------------------------------------------------------------------ HF
@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> tuple[dict, Path]:
    """``hf_trackers_script.py`` in its own process (4 steps, a log every step) with whichever of TensorBoard,
    MLflow and W&B are installed: its log history and summary, and the folder of the stores."""
    folder = tmp_path_factory.mktemp("hf_trackers")
    report_to = [name for name in ("tensorboard", "mlflow", "wandb") if _installed(name)]
    if not report_to:
        pytest.skip("none of tensorboard, mlflow, wandb is installed (pip install 'lightning_dp[tracking]')")
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    script = SCRIPTS / "hf_trackers_script.py"
    done = subprocess.run(
        [sys.executable, str(script), str(folder), *report_to], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "run.json").read_text()), folder


def _hf_epsilons(run: dict) -> list[float]:
    """The epsilon of every step's log, as the Trainer logged it."""
    return [row["epsilon"] for row in run["log_history"] if "loss" in row]


def test_hf_tensorboard_holds_epsilon_per_step_and_the_summary(hf_run) -> None:
    pytest.importorskip("tensorboard")
    run, folder = hf_run
    scalars = _tensorboard_scalars(folder / "tb")
    logged = [value for _, value in sorted(scalars["train/epsilon"])]
    assert logged[: len(_hf_epsilons(run))] == pytest.approx(_hf_epsilons(run), rel=1e-6)
    final = run["summary"]
    assert scalars["train/dp/epsilon"][-1][1] == pytest.approx(final["epsilon"], rel=1e-6)
    assert scalars["train/dp/noise_multiplier"][-1][1] == pytest.approx(1.0)


def test_hf_mlflow_holds_epsilon_per_step_and_the_summary(hf_run) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run, folder = hf_run
    client = MlflowClient(tracking_uri=(folder / "mlruns").as_uri())
    (stored,) = client.search_runs([client.get_experiment_by_name("dp").experiment_id])
    history = sorted(client.get_metric_history(stored.info.run_id, "epsilon"), key=lambda m: m.step)
    assert [m.value for m in history][: len(_hf_epsilons(run))] == pytest.approx(_hf_epsilons(run), rel=1e-6)
    for name in SUMMARY_NUMBERS:
        assert stored.data.metrics[f"dp/{name}"] == pytest.approx(float(run["summary"][name]), rel=1e-6), name


def test_hf_wandb_offline_run_holds_epsilon_per_step_and_the_summary(hf_run) -> None:
    pytest.importorskip("wandb")
    run, folder = hf_run
    history = _wandb_items(_wandb_records(_wandb_run_file(folder)), "history", "item")
    logged = [row["train/epsilon"] for row in history if "train/loss" in row]
    assert logged == pytest.approx(_hf_epsilons(run), rel=1e-6)
    final = run["summary"]
    assert any(math.isclose(row.get("train/dp/epsilon", math.nan), final["epsilon"], rel_tol=1e-6) for row in history)


def test_a_second_fit_logging_into_the_same_mlflow_run_works(tmp_path) -> None:
    """MLflow refuses to change a logged parameter: only the run's fixed settings are parameters, so a second fit
    (or a resume) logging into the same run does not fail."""
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name="refit", tracking_uri=(tmp_path / "mlruns").as_uri())
    for _ in range(2):
        callback = PrivacyAccountantCallback(plot=False)
        strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
        make_trainer(strategy, max_epochs=1, callbacks=[callback], logger=logger).fit(TinyRegressor())
    assert callback.summary["steps"] == 8
