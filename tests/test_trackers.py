"""logging.report_to: W&B (offline) and MLflow (local file store) receive the numbers metrics.jsonl gets."""
import glob
import json
import struct
import sys
import time

import pytest

from masrl.config import config_from_dict
from masrl.monitoring.logger import read_metrics
from masrl.trainer import Trainer


def _quick(tiny_cfg, **over):
    return tiny_cfg(**{"sft.steps": 0, "trainer.total_steps": 2, "trainer.batch_size": 2, "trainer.group_size": 2,
                       "eval.before_after": False, "logging.plots": False, **over})


def _wandb_records(path):
    """(record type, record) of an offline W&B run's .wandb file (a LevelDB-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, records = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # end of what the writer has flushed so far
            break
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST fragment: one record
            record = pb.Record()
            record.ParseFromString(buf)
            records.append((record.WhichOneof("record_type"), record))
            buf = b""
    return records


def _wandb_history(run_dir, deadline_s=60.0):
    """History rows of an offline W&B run, once its file holds the run's exit record.

    `run.finish()` returns when the W&B service has handled the exit; the service closes (flushes) the run's
    file after that, on its own thread, so the file is read again until its last record, `exit`, is there."""
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    start = time.monotonic()
    records = _wandb_records(path)
    while not any(kind == "exit" for kind, _ in records):
        assert time.monotonic() - start < deadline_s, f"{path}: no exit record {deadline_s:.0f} s after finish()"
        time.sleep(0.05)
        records = _wandb_records(path)
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for kind, record in records if kind == "history"]


def test_wandb_offline_and_mlflow_file_store_get_every_metric(tiny_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _clear_mlflow_env(monkeypatch)  # a file:// store without MLFLOW_ALLOW_FILE_STORE: masrl opts in
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
    with Trainer(cfg) as trainer, pytest.raises(ImportError, match=r"pip install 'masrl\[trackio\]'"):
        trainer.fit()


def test_tensorboard_flag_still_maps_onto_report_to(tiny_cfg):
    assert config_from_dict(tiny_cfg()).logging.sinks == ["tensorboard"]
    assert config_from_dict(tiny_cfg(**{"logging.tensorboard": False})).logging.sinks == []
    assert config_from_dict(tiny_cfg(**{"logging.report_to": ["mlflow"]})).logging.sinks == ["mlflow"]
    with pytest.raises(Exception, match="drop one of them"):
        config_from_dict(tiny_cfg(**{"logging.tensorboard": False, "logging.report_to": ["tensorboard"]}))


# MLflow's store: a default that works with mlflow-skinny, file:// without the opt-in, one line otherwise.

def _clear_mlflow_env(monkeypatch):
    """No MLflow settings from the environment; whatever masrl sets is undone after the test."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _start_mlflow(tmp_path, uri=None):
    from masrl.config import LoggingConfig
    from masrl.monitoring.trackers import make_trackers

    logging_cfg = LoggingConfig(report_to=["mlflow"], project="p", mlflow_tracking_uri=uri)
    (tmp_path / "run").mkdir(exist_ok=True)
    (tracker,) = make_trackers(logging_cfg, name="r", run_dir=tmp_path / "run", config={"a": 1}, resume=False)
    return tracker


def _mlflow_history(uri, run_id, key):
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)}


def test_mlflow_default_store_is_a_file_store_in_the_run_folder(tiny_cfg, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    _clear_mlflow_env(monkeypatch)
    monkeypatch.chdir(tmp_path)  # MLflow's own default would be ./mlflow.db here
    cfg = config_from_dict(_quick(tiny_cfg, **{"logging.report_to": ["mlflow"]}))
    with Trainer(cfg) as trainer:
        trainer.fit()
    train = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    run_id = json.loads((cfg.run_dir / "trackers.json").read_text())["mlflow"]
    uri = (cfg.run_dir / "mlruns").resolve().as_uri()
    assert _mlflow_history(uri, run_id, "team/reward") == pytest.approx({r["step"]: r["team/reward"] for r in train})
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


def test_mlflow_file_uri_works_without_the_opt_in(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    _clear_mlflow_env(monkeypatch)
    uri = (tmp_path / "store").as_uri()
    tracker = _start_mlflow(tmp_path, uri)
    tracker.log(1, {"team/reward": 0.5, "eval/t/avg@4": 0.25}, "train")
    tracker.close()
    assert _mlflow_history(uri, tracker.run_id, "team/reward") == {1: 0.5}
    assert _mlflow_history(uri, tracker.run_id, "eval/t/avg_at_4") == {1: 0.25}


@pytest.mark.parametrize("how", ["under_a_file", "file_uri_under_a_file"])
def test_mlflow_unusable_store_is_one_line_naming_it(tmp_path, monkeypatch, how):
    pytest.importorskip("mlflow")
    from masrl.errors import UserInputError

    _clear_mlflow_env(monkeypatch)
    (tmp_path / "a_file").write_text("x")
    uri = str(tmp_path / "a_file" / "mlruns")
    uri = uri if how == "under_a_file" else (tmp_path / "a_file").as_uri() + "/mlruns"
    with pytest.raises(UserInputError) as e:
        _start_mlflow(tmp_path, uri)
    message = str(e.value)
    assert "\n" not in message and uri in message and "logging.mlflow_tracking_uri" in message
    assert "Not a directory" in message


def test_mlflow_sqlite_store_without_sqlalchemy_says_what_to_install(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from masrl.errors import UserInputError

    _clear_mlflow_env(monkeypatch)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny: no SQLAlchemy
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///" + str(tmp_path / "m.db"))
    with pytest.raises(UserInputError, match=r"needs SQLAlchemy: pip install mlflow \(not mlflow-skinny\)") as e:
        _start_mlflow(tmp_path)
    assert "\n" not in str(e.value) and "(MLFLOW_TRACKING_URI)" in str(e.value)


def test_mlflow_file_store_refused_by_the_environment_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from masrl.errors import UserInputError

    _clear_mlflow_env(monkeypatch)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    with pytest.raises(UserInputError, match="MLFLOW_ALLOW_FILE_STORE=false refuses: set MLFLOW_ALLOW_FILE_STORE=true"):
        _start_mlflow(tmp_path)
    assert not (tmp_path / "run" / "trackers.json").exists()


def test_mlflow_store_error_through_the_cli_is_one_line_and_exit_2(tiny_cfg, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    import yaml

    from masrl.cli import main

    _clear_mlflow_env(monkeypatch)
    (tmp_path / "a_file").write_text("x")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_quick(tiny_cfg, **{"logging.report_to": ["mlflow"], "logging.progress": False})))
    assert main(["train", str(path), f"logging.mlflow_tracking_uri={tmp_path / 'a_file' / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("masrl:")] == [
        line for line in err.splitlines() if "MLflow cannot use the tracking store" in line], err
    assert "MLflow cannot use the tracking store" in err
