"""phalanx.integrations.loggers writing real TensorBoard, W&B (offline) and MLflow runs."""

from __future__ import annotations

import json
import struct
import time

import pytest
import torch

from phalanx.integrations.loggers import (
    MLflowMembers,
    TensorBoardMembers,
    WandbMembers,
    member_rows,
)

N = 4
LRS = [1e-3, 1e-2, 1e-1, 1.0]
LOSSES = [torch.tensor([1.0, 2.0, 3.0, 4.0]) * (s + 1) for s in range(5)]


def test_member_rows_splits_and_repeats():
    rows = member_rows(
        {"lr": torch.tensor(LRS), "w": 32, "wd": [0, 1, 2, 3], "t": torch.tensor(0.5)}, N, "x"
    )
    assert rows[2] == {"lr": pytest.approx(0.1), "w": 32, "wd": 2, "t": 0.5}
    with pytest.raises(
        ValueError, match=r"'lr' has shape \(3,\); expected one value per member \(4,\)"
    ):
        member_rows({"lr": torch.ones(3)}, N, "x")
    with pytest.raises(ValueError, match=r"'lr' has 2 values; expected 4"):
        member_rows({"lr": [1, 2]}, N, "x")


def test_tensorboard_one_run_per_member_with_its_hparams(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TensorBoardMembers(tmp_path, N, hparams={"lr": torch.tensor(LRS), "width": 16})
    for step, loss in enumerate(LOSSES):
        log.log({"train/loss": loss}, step=step)
    log.close({"hparam/final_loss": LOSSES[-1]})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"member_{i:02d}" for i in range(N)]
    for i in range(N):
        acc = EventAccumulator(str(tmp_path / f"member_{i:02d}"))
        acc.Reload()
        got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
        assert got == [(s, float(loss[i])) for s, loss in enumerate(LOSSES)]
        # add_hparams(run_name=".") writes the hparams summary into the member's own run
        plugin = acc.PluginTagToContent("hparams")
        session = next(v for k, v in plugin.items() if k.endswith("session_start_info"))
        from tensorboard.plugins.hparams import plugin_data_pb2

        info = plugin_data_pb2.HParamsPluginData.FromString(session).session_start_info
        assert info.hparams["lr"].number_value == pytest.approx(LRS[i])
        assert info.hparams["width"].number_value == 16
        assert acc.Scalars("hparam/final_loss")[0].value == float(LOSSES[-1][i])


def wandb_records(path):
    """The protobuf records of an offline run's .wandb file (LevelDB log framing: 32 KiB
    blocks of records, each a 7-byte header crc32 / length / kind; wandb 0.31 ships no
    Python reader)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + n > len(data):  # the end, or a record still being written
            break
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def finished_records(path, timeout=60.0):
    """The records once wandb-core, which writes the file from its own process after
    run.finish() returns, has written the run's last ("exit") record."""
    deadline = time.monotonic() + timeout
    while True:
        recs = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def test_wandb_offline_grouped_runs(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = WandbMembers(
        N, group="sweep-0", hparams={"lr": LRS}, project="phalanx-test", dir=str(tmp_path)
    )
    assert [r.group for r in log.runs] == ["sweep-0"] * N
    assert [r.config["lr"] for r in log.runs] == LRS
    assert all(r.offline for r in log.runs)
    ids = [r.id for r in log.runs]
    for step, loss in enumerate(LOSSES):
        log.log({"train/loss": loss}, step=step)
    log.close({"final_loss": LOSSES[-1]})
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == N and {r.name.rsplit("-", 1)[1] for r in runs} == set(ids)
    for i, run_id in enumerate(ids):
        (path,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
        recs = finished_records(path)
        (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
        assert run.run_group == "sweep-0" and run.display_name == f"sweep-0-member_{i}"
        config = {u.key: json.loads(u.value_json) for u in run.config.update}
        assert config["lr"] == LRS[i] and config["member"] == i
        history = []
        for r in recs:
            if r.WhichOneof("record_type") == "history":
                items = {"/".join(it.nested_key) or it.key: it.value_json for it in r.history.item}
                if "train/loss" in items:
                    history.append(float(items["train/loss"]))
        assert history == [float(loss[i]) for loss in LOSSES], f"member {i}"
    assert wandb.run is None  # no global run left behind
    wandb.teardown()  # stops wandb's service threads (tests/test_lbfgs.py counts threads)


def test_mlflow_child_runs_logged_in_batches(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store opt-in
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no telemetry thread left running
    uri = f"file:{tmp_path / 'mlruns'}"
    log = MLflowMembers(
        N, "sweep", hparams={"lr": LRS, "width": 16}, tracking_uri=uri, flush_every=2
    )
    calls = []
    real = log.client.log_batch
    monkeypatch.setattr(
        log.client, "log_batch", lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    )
    for step, loss in enumerate(LOSSES):
        log.log({"train/loss": loss, "lr": torch.tensor(LRS)}, step=step)
    assert len(calls) == 2 * N  # flushed after steps 1 and 3, one call per member each
    log.close({"final_loss": LOSSES[-1]})

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("sweep")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.info.run_id == log.parent_id)
    assert parent.data.params == {"num_members": str(N)} and parent.info.status == "FINISHED"
    for i, run_id in enumerate(log.run_ids):
        run = client.get_run(run_id)
        assert run.data.tags["mlflow.parentRunId"] == log.parent_id
        assert run.data.params == {"lr": str(LRS[i]), "width": "16", "member": str(i)}
        history = client.get_metric_history(run_id, "train/loss")
        assert sorted((m.step, m.value) for m in history) == [
            (s, float(x[i])) for s, x in enumerate(LOSSES)
        ]
        assert run.data.metrics["final_loss"] == float(LOSSES[-1][i])
        assert run.info.status == "FINISHED"
