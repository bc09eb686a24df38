"""What a run's summary says (`tfmgpu.runs.RunSummary`): the layout of each
placement, and no figure that reads as failure when nothing failed."""

from __future__ import annotations

import logging
import re

import pytest

from tfmgpu import cluster
from tfmgpu import runs
from tfmgpu.config import TrainConfig


def _run(tmp_path, strategy="default", name="run", **kw):
  config = TrainConfig(strategy=strategy, model="mlp", epochs=1,
                       steps_per_epoch=4, global_batch_size=32,
                       steps_per_execution=4, verbose=0,
                       model_dir=str(tmp_path / name), **kw)
  return config


def test_a_rerun_into_a_finished_model_dir_says_so(digits_arrays, tmp_path):
  config = _run(tmp_path)
  first = runs.run_training(config, arrays=digits_arrays)
  assert "nan" not in str(first)
  again = runs.run_training(config, arrays=digits_arrays)
  text = str(again)
  assert again.result.epochs_run == 0
  assert re.search(r"train loss / accuracy\s+not trained: .* already held 1 "
                   r"epoch\(s\)", text), text
  assert "nan" not in text and "0 examples/s" not in text
  assert again.test_accuracy == pytest.approx(first.test_accuracy)


def test_an_epoch_of_one_call_reports_its_throughput(digits_arrays, tmp_path):
  summary = runs.run_training(_run(tmp_path), arrays=digits_arrays)
  # Issue 29 item 16: the summary did not say how to open TensorBoard.
  assert re.search(rf"^tensorboard\s+tensorboard --logdir "
                   rf"{re.escape(str(tmp_path / 'run' / 'summaries'))}$",
                   str(summary), re.M), str(summary)
  assert summary.result.steps == 4  # One call of steps_per_execution=4.
  assert summary.examples_per_sec > 0
  assert summary.result.history["examples_per_sec"][0] > 0


def test_the_pipeline_summary_names_micro_batches_schedule_and_bubble(
    digits_arrays, tmp_path):
  summary = runs.run_training(
      _run(tmp_path, "pipeline", micro_batches=4, schedule="1f1b"),
      arrays=digits_arrays)
  text = str(summary)
  assert re.search(r"stages\s+2 on /device:CPU:0, /device:CPU:1", text), text
  assert re.search(r"pipeline\s+4 micro-batches, 1f1b schedule, bubble 20%",
                   text), text


def test_branch_parallel_says_where_its_branch_count_comes_from(
    digits_arrays, tmp_path):
  summary = runs.run_training(_run(tmp_path, "branch_parallel", num_stages=2),
                              arrays=digits_arrays)
  assert re.search(r"branches\s+2 on /device:CPU:0, /device:CPU:1 "
                   r"\(num_stages=2: ", str(summary)), str(summary)


def test_multi_worker_without_a_cluster_warns_that_it_trains_alone(caplog):
  with caplog.at_level(logging.WARNING):
    role = cluster.preflight(
        TrainConfig(strategy="multi_worker_mirrored").cluster_target, {})
  assert role.task_type is None
  assert re.search(r"strategy='multi_worker_mirrored' without TF_CONFIG or a "
                   r"SLURM job: this process trains alone", caplog.text)


@pytest.mark.parametrize("strategy", ["pipeline", "model_parallel"])
def test_a_placed_run_prints_its_predicted_and_measured_step(
    digits_arrays, tmp_path, monkeypatch, strategy):
  """Issue 30: the cost model's step (the layout's accounting on the
  calibrated devices) beside the measured median step (the loop's clock,
  first call left out), and their ratio."""
  import statistics  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import accounting  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import calibration  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import controller  # pylint: disable=g-import-not-at-top
  fixed = calibration.Calibration(
      devices=("/device:CPU:0", "/device:CPU:1"), flops_per_s=1e9,
      task_overhead_s=1e-4, send_overhead_s=1e-5, link_bytes_per_s=1e9,
      concurrency=1.0, source="cached")
  monkeypatch.setattr(calibration, "calibrate", lambda devices: fixed)
  accounts, calls = [], []
  account = accounting.LayoutCosts.account
  monkeypatch.setattr(accounting.LayoutCosts, "account", lambda self, **kw: (
      accounts.append(account(self, **kw)) or accounts[-1]))
  add = controller._Clock.add  # pylint: disable=protected-access
  monkeypatch.setattr(controller._Clock, "add", lambda self, n, s, k=1: (  # pylint: disable=protected-access
      calls.append(s / k), add(self, n, s, k))[-1])
  summary = runs.run_training(
      _run(tmp_path, strategy).replace(steps_per_execution=1),
      arrays=digits_arrays)
  predicted = accounts[-1].step(fixed.hardware(2)).total_s
  measured = statistics.median(calls[1:])
  assert summary.predicted_step_seconds == pytest.approx(predicted)
  assert summary.step_seconds == pytest.approx(measured)
  assert accounts[-1].global_batch_size == 32
  row = re.search(r"^step time\s+(.*)$", str(summary), re.M).group(1)
  assert f"measured {measured * 1e3:.1f} ms" in row, row
  assert f"predicted {predicted * 1e3:.1f} ms" in row, row
  assert f"x{measured / predicted:.2f} of predicted" in row, row
  assert "1.0 GFLOP/s a device" in row and "cached on this host" in row, row


def test_a_data_parallel_run_prints_no_predicted_step(digits_arrays,
                                                      tmp_path):
  summary = runs.run_training(_run(tmp_path), arrays=digits_arrays)
  assert summary.predicted_step_seconds is None
  assert "step time" not in str(summary)


def test_a_keras_hub_model_in_stages_of_shards_lists_and_prices_every_device(
    cpu_devices, tmp_path, monkeypatch):
  """A keras_hub llama cut in 2 stages of 2 shards (its layout map splits
  kernels inside its blocks): the run's devices are all 4, and the summary
  predicts its step. The split shards were missed (2 devices listed) and
  the prediction raised IndexError after training, failing the run."""
  pytest.importorskip("keras_hub")
  from tfmgpu.parallel import calibration  # pylint: disable=g-import-not-at-top
  fixed = calibration.Calibration(
      devices=tuple(cpu_devices[:4]), flops_per_s=1e9, task_overhead_s=1e-4,
      send_overhead_s=1e-5, link_bytes_per_s=1e9, concurrency=1.0,
      source="cached")
  seen = []
  monkeypatch.setattr(calibration, "calibrate",
                      lambda devices: seen.append(list(devices)) or fixed)
  summary = runs.run_training(TrainConfig(
      strategy="pipeline", model="llama", model_size="tiny", num_stages=2,
      tensor_parallel=2, micro_batches=2, epochs=1, steps_per_epoch=2,
      verbose=0,
      model_dir=str(tmp_path / "run")))
  assert seen == [cpu_devices[:4]]
  assert summary.predicted_step_seconds > 0
