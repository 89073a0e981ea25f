"""logging.report_to: W&B (offline) and MLflow (local file store) receive the numbers metrics.jsonl gets."""
import glob
import json
import struct
import sys

import pytest

from masrl.config import config_from_dict
from masrl.monitoring.logger import read_metrics
from masrl.training.trainer import Trainer


def _quick(tiny_cfg, **over):
    return tiny_cfg(**{"sft.steps": 0, "trainer.total_steps": 2, "trainer.batch_size": 2, "trainer.group_size": 2,
                       "eval.before_after": False, "logging.plots": False, **over})


def _wandb_history(run_dir):
    """History rows of an offline W&B run, read from its .wandb file (a LevelDB-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, buf, rows = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST fragment: one record
            record = pb.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            buf = b""
        elif kind == 0:
            break
    return rows


def test_wandb_offline_and_mlflow_file_store_get_every_metric(tiny_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    cfg = config_from_dict(_quick(tiny_cfg, **{"logging.report_to": ["wandb", "mlflow"], "logging.project": "t",
                                               "logging.mlflow_tracking_uri": uri}))
    with Trainer(cfg) as trainer:
        trainer.fit()
    run_dir = cfg.run_dir
    train = [r for r in read_metrics(run_dir) if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert not (run_dir / "tensorboard").exists()  # report_to replaces the tensorboard default

    rows = {r["step"]: r for r in _wandb_history(run_dir) if "step" in r}
    assert sorted(rows) == [1, 2]
    for r in train:
        numbers = {k: v for k, v in r.items() if isinstance(v, float) and k not in ("step", "phase")}
        assert len(numbers) > 20 and "policy/shared/grad_norm" in numbers
        assert {k: rows[r["step"]][k] for k in numbers} == pytest.approx(numbers)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.run_name == "test" and run.info.status == "FINISHED"
    for key in ("team/reward", "agent/Verifier/response_length"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == pytest.approx({r["step"]: r[key] for r in train}), key
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids["mlflow"] == run.info.run_id and ids["wandb"]


def test_missing_tracker_library_names_the_extra(tiny_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # import trackio -> ImportError
    cfg = config_from_dict(_quick(tiny_cfg, **{"logging.report_to": ["trackio"]}))
    with Trainer(cfg) as trainer, pytest.raises(ImportError, match=r"pip install masrl\[trackio\]"):
        trainer.fit()


def test_tensorboard_flag_still_maps_onto_report_to(tiny_cfg):
    assert config_from_dict(tiny_cfg()).logging.sinks == ["tensorboard"]
    assert config_from_dict(tiny_cfg(**{"logging.tensorboard": False})).logging.sinks == []
    assert config_from_dict(tiny_cfg(**{"logging.report_to": ["mlflow"]})).logging.sinks == ["mlflow"]
    with pytest.raises(Exception, match="drop one of them"):
        config_from_dict(tiny_cfg(**{"logging.tensorboard": False, "logging.report_to": ["tensorboard"]}))
