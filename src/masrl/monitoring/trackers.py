"""Experiment trackers of ``logging.report_to``: W&B, MLflow and trackio, through their own libraries.

Each tracker receives every number ``metrics.jsonl`` gets. RL steps are the x axis; SFT steps
are logged under ``sft/<metric>`` against their own ``sft/step`` axis (W&B) or their step (MLflow,
trackio), so that SFT and RL never fight over one monotonic step. A resumed run continues the
tracker run it started (its id is kept in ``RUN_DIR/trackers.json``). TensorBoard stays in
``masrl.monitoring.logger``.

MLflow's store is ``logging.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a file store in
``RUN_DIR/mlruns`` (MLflow's own default, ``sqlite:///mlflow.db``, needs SQLAlchemy, which mlflow-skinny
lacks). A store that cannot be opened stops the run at its start with one line saying what to set.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

from masrl.errors import UserInputError, missing_extra

EXTRAS = {"wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def _require(module: str, tracker: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing_extra(f"logging.report_to lists {tracker}, which is not installed (or remove it from "
                            "logging.report_to)", EXTRAS[tracker]) from None


def _scalars(metrics: Mapping[str, Any], phase: str) -> dict[str, float]:
    prefix = "sft/" if phase == "sft" else ""
    return {prefix + k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class WandbTracker:
    def __init__(self, *, project: str, name: str, run_dir: Path, config: dict, run_id: str | None,
                 init_kwargs: dict):
        wandb = _require("wandb", "wandb")
        kwargs = {"project": project, "name": name, "dir": str(run_dir), "config": config, **init_kwargs}
        if run_id:
            kwargs.update(id=run_id, resume="allow")
        self.run = wandb.init(**kwargs)
        self.run.define_metric("step")
        self.run.define_metric("sft/step")
        self.run.define_metric("sft/*", step_metric="sft/step")
        self.run.define_metric("*", step_metric="step")
        self.run_id = self.run.id

    def log(self, step: int, metrics: Mapping[str, Any], phase: str) -> None:
        values = _scalars(metrics, phase)
        values["sft/step" if phase == "sft" else "step"] = step
        self.run.log(values)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")
_SET_STORE = ("set logging.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) to a writable folder or file:///path "
              "(a file store) or http(s)://host:port (a tracking server)")


def mlflow_store(configured: str | None, run_dir: Path) -> tuple[str, str]:
    """The tracking URI MLflow gets, and where it comes from (named in errors)."""
    if configured:
        return configured, "logging.mlflow_tracking_uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI"
    return (Path(run_dir) / "mlruns").resolve().as_uri(), "the default store RUN_DIR/mlruns"


def _prepare_mlflow_store(uri: str, source: str) -> None:
    """What MLflow needs for ``uri`` before it opens it: a file store is opted into (MLflow 3 refuses one unless
    ``MLFLOW_ALLOW_FILE_STORE`` is true; an explicit false is kept); sqlite needs SQLAlchemy."""
    scheme = urlparse(uri).scheme.lower()
    if scheme in ("", "file") or len(scheme) == 1:  # a path, file://, or a Windows drive letter
        allowed = os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if allowed.strip().lower() not in ("true", "1"):
            raise UserInputError(f"MLflow tracking store {uri} ({source}) is a file store, which "
                                 f"MLFLOW_ALLOW_FILE_STORE={allowed} refuses: set MLFLOW_ALLOW_FILE_STORE=true (or unset "
                                 "it), or set logging.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) to "
                                 "http(s)://host:port or sqlite:///path.db (full mlflow)")
    elif scheme == "sqlite":
        try:
            import sqlalchemy  # noqa: F401
        except ImportError:
            raise UserInputError(f"MLflow tracking store {uri} ({source}) is a SQLite database, which needs "
                                 f"SQLAlchemy: pip install mlflow (not mlflow-skinny), or {_SET_STORE}") from None


def _mlflow_error(uri: str, source: str, error: Exception) -> UserInputError:
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if len(detail) > 240:
        detail = detail[:240].rsplit(" ", 1)[0] + " ..."
    return UserInputError(f"MLflow cannot use the tracking store {uri} ({source}): {type(error).__name__}"
                          f"{': ' + detail if detail else ''}; {_SET_STORE}, or sqlite:///path.db with the full "
                          "mlflow package")


class MlflowTracker:
    """Through ``MlflowClient`` (no global active run). Metric names keep ``/``; other characters MLflow
    refuses (``@`` of ``avg@4``) become ``_at_`` / ``_``."""

    def __init__(self, *, project: str, name: str, run_dir: Path, config: dict, run_id: str | None,
                 tracking_uri: str | None, init_kwargs: dict):
        _require("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        uri, source = mlflow_store(tracking_uri, run_dir)
        _prepare_mlflow_store(uri, source)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            if run_id:
                self.client.update_run(run_id, status="RUNNING")
            else:
                exp = self.client.get_experiment_by_name(project)
                exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
                run_id = self._create_run(exp_id, name, init_kwargs)
                self.client.log_dict(run_id, config, "config.json")
        except UserInputError:
            raise
        except Exception as e:  # MlflowException, a missing backend, OSError: the store, not masrl
            raise _mlflow_error(uri, source, e) from None
        self.tracking_uri, self.run_id = uri, run_id

    def _create_run(self, exp_id: str, name: str, init_kwargs: dict) -> str:
        try:
            return self.client.create_run(exp_id, run_name=name, **init_kwargs).info.run_id
        except TypeError as e:  # a key create_run does not take
            raise UserInputError(f"logging.init_kwargs.mlflow: {e} (MlflowClient.create_run takes experiment_id, "
                                 "start_time, tags, run_name)") from None

    @staticmethod
    def key(name: str) -> str:
        return _MLFLOW_BAD.sub("_", name.replace("@", "_at_"))

    def log(self, step: int, metrics: Mapping[str, Any], phase: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(self.key(k), v, now, step) for k, v in _scalars(metrics, phase).items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    def __init__(self, *, project: str, name: str, run_dir: Path, config: dict, run_id: str | None,
                 init_kwargs: dict):
        self.trackio = _require("trackio", "trackio")
        self.run = self.trackio.init(project=project, name=run_id or name, config=config,
                                     resume="allow" if run_id else "never", **init_kwargs)
        self.run_id = run_id or name

    def log(self, step: int, metrics: Mapping[str, Any], phase: str) -> None:
        self.trackio.log(_scalars(metrics, phase), step=step)

    def close(self) -> None:
        self.trackio.finish()


def make_trackers(logging_cfg, *, name: str, run_dir: Path, config: dict, resume: bool) -> list:
    """The trackers of ``logging_cfg.sinks`` other than TensorBoard, started (or continued on resume)."""
    wanted = [s for s in logging_cfg.sinks if s != "tensorboard"]
    if not wanted:
        return []
    ids_path = Path(run_dir) / "trackers.json"
    ids = json.loads(ids_path.read_text()) if resume and ids_path.is_file() else {}
    project = logging_cfg.project or "masrl"
    trackers = {}
    try:
        for kind in wanted:
            common = dict(project=project, name=name, run_dir=Path(run_dir), config=config, run_id=ids.get(kind),
                          init_kwargs=logging_cfg.init_kwargs.get(kind, {}))
            if kind == "wandb":
                trackers[kind] = WandbTracker(**common)
            elif kind == "mlflow":
                trackers[kind] = MlflowTracker(**common, tracking_uri=logging_cfg.mlflow_tracking_uri)
            else:
                trackers[kind] = TrackioTracker(**common)
    except BaseException:
        for tracker in trackers.values():  # the ones already started end cleanly
            tracker.close()
        raise
    ids_path.write_text(json.dumps({k: t.run_id for k, t in trackers.items()}))
    return list(trackers.values())
