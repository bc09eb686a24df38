"""Placements through the same loop and CLI as data parallelism."""

import os
import re

from absl import app
from absl.testing import flagsaver
import numpy as np
import pytest

import tfmgpu
from tfmgpu import models, train
from tfmgpu.parallel import partition, staged
from tfmgpu.training.loop import Trainer


pytestmark = pytest.mark.usefixtures("parsed_flags")


@pytest.mark.parametrize("num_stages", [2, 4])
def test_trainer_drives_a_staged_model_to_the_unsplit_weights(num_stages,
                                                             digits_arrays):
  x, y = digits_arrays.x_train[:128], digits_arrays.y_train[:128]

  def fit(model):
    Trainer(model, strategy=tfmgpu.get_strategy("default"), learning_rate=1e-3,
            steps_per_execution=2, verbose=0).fit(
                x, y, epochs=1, global_batch_size=32, seed=0)

  unsplit = models.build_model("deep_mlp", input_shape=(28, 28, 1),
                               num_classes=10, seed=0, depth=6, width=32)
  split = staged.StagedModel(unsplit, partition.plan_stages(unsplit,
                                                            num_stages))
  fit(unsplit)
  fit(split)
  back = split.to_unsplit()
  for a, b in zip(back.get_weights(), unsplit.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_plan_only_prints_the_plan_and_memory(capsys):
  with flagsaver.flagsaver(strategy="model_parallel", model="deep_mlp",
                           num_stages=4, plan_only=True):
    assert train.main(["train"]) == 0
  out = capsys.readouterr().out
  assert "StagePlan for 'deep_mlp': 4 stage(s), criterion=balanced" in out
  assert len(re.findall(r"^\d\s+/device:CPU:\d", out, re.M)) == 4
  assert re.search(r"^device\s+weights\s+grads\s+slots\s+activations\s+in "
                   r"flight\s+total$", out, re.M)
  assert len(re.findall(r"^/device:CPU:\d\s+[\d.]+ KiB", out, re.M)) == 4
  assert re.search(r"^max\s+[\d.]+ MiB$", out, re.M)
  # A data-parallel strategy has no plan: it says whose plan it prints (a
  # new user read mirrored's as a 2-stage split).
  with flagsaver.flagsaver(strategy="mirrored", model="deep_mlp",
                           plan_only=True):
    assert train.main(["train"]) == 0
  assert capsys.readouterr().out.startswith(
      "strategy='mirrored' has no stage plan: each replica holds the whole "
      "model. For comparison, the split --strategy=model_parallel "
      "--num_stages=2 would make:\nStagePlan for 'deep_mlp'")


def test_cli_trains_model_parallel(tmp_path, capsys):
  with flagsaver.flagsaver(strategy="model_parallel", model="deep_mlp",
                           num_stages=2, epochs=1, steps_per_epoch=4,
                           model_dir=str(tmp_path), verbose=0):
    assert train.main(["train"]) == 0
  out = capsys.readouterr().out
  assert "stage(s)" in out and "/device:CPU:1" in out
  assert (tmp_path / "model.keras").exists()  # Saved unsplit, servable.


def test_plan_only_auto_prints_the_candidates_and_the_choice(capsys):
  with flagsaver.flagsaver(strategy="auto", model="gpt", plan_only=True):
    assert train.main(["train"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"^strategy=auto: \d+ layouts weighed for 4 CPU "
                   r"device\(s\), 16 GB .* link cpu 10 GB/s", out, re.M)
  assert "predicted by the cost model, not measured" in out
  assert re.search(r"^pipeline K=4 M=\d+ \w+ .* yes$", out, re.M)
  assert re.search(r"^chosen: mirrored n=4\. Fastest predicted step", out,
                   re.M)


def test_cli_auto_trains_the_layout_that_fits(tmp_path, capsys):
  # deep_mlp's replicas need ~10 MiB each at batch 64: 6 MB fits them with
  # their state sharded (ZeRO stage 3: ~3.4 MiB), 3.4 MB forces a split.
  with flagsaver.flagsaver(strategy="auto", model="deep_mlp",
                           device_memory_gb=0.006, epochs=1,
                           steps_per_epoch=2, model_dir=str(tmp_path / "z"),
                           verbose=0):
    assert train.main(["train"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"^chosen: mirrored n=4 zero 3\.", out, re.M), out
  assert re.search(r"^zero\s+stage 3: weights, gradients and optimizer "
                   r"slots sharded", out, re.M)
  with flagsaver.flagsaver(strategy="auto", model="deep_mlp",
                           device_memory_gb=0.0034, epochs=1,
                           steps_per_epoch=2, model_dir=str(tmp_path),
                           verbose=0):
    assert train.main(["train"]) == 0
  out = capsys.readouterr().out
  # Pipelines, alone or copied (data 2 x pipeline K=2 ...): both fit.
  chosen = re.search(r"^chosen: (?:data \d x )?pipeline K=(\d) M=(\d+)", out,
                     re.M)
  assert chosen, out
  assert re.search(r"^strategy\s+auto: pipeline$", out, re.M)
  assert re.search(rf"^pipeline\s+{chosen.group(2)} micro-batches", out, re.M)
  assert (tmp_path / "model.keras").exists()


def test_cli_split_point_errors_are_clear(capsys):
  with flagsaver.flagsaver(strategy="model_parallel", model="convnet",
                           split_points=["nope"], verbose=0):
    assert train.main(["train"]) == 1
  assert "nope" in capsys.readouterr().err


def test_cli_trains_a_pipeline_like_the_unsplit_model(tmp_path, capsys):
  losses = {}
  for strategy in ("default", "pipeline"):
    with flagsaver.flagsaver(strategy=strategy, model="mlp", num_stages=2,
                             micro_batches=4, epochs=1, steps_per_epoch=4,
                             model_dir=str(tmp_path / strategy), verbose=0):
      assert train.main(["train"]) == 0
    out = capsys.readouterr().out
    losses[strategy] = re.search(r"train loss / accuracy\s+([\d.]+)",
                                 out).group(1)
  assert "stages" in out
  assert losses["pipeline"] == losses["default"]


def test_cli_trains_an_interleaved_pipeline_like_the_unsplit_model(
    tmp_path, capsys):
  losses = {}
  for strategy in ("default", "pipeline"):
    with flagsaver.flagsaver(strategy=strategy, model="deep_mlp",
                             num_stages=2, virtual_stages=2, schedule="1f1b",
                             micro_batches=4, epochs=1, steps_per_epoch=3,
                             model_dir=str(tmp_path / strategy), verbose=0):
      assert train.main(["train"]) == 0
    out = capsys.readouterr().out
    losses[strategy] = re.search(r"train loss / accuracy\s+([\d.]+)",
                                 out).group(1)
  assert "2 stages per device (interleaved), bubble 11%" in out
  assert losses["pipeline"] == losses["default"]


@pytest.mark.parametrize("flags,message", [
    ({"schedule": "gpipe"}, "virtual_stages=2 interleaves 1F1B; "
     "schedule='gpipe' cannot"),
    ({"schedule": "1f1b", "micro_batches": 3, "global_batch_size": 48},
     "micro_batches=3 must be a multiple of the 2 devices"),
])
def test_cli_interleaved_pipeline_errors(flags, message):
  with flagsaver.flagsaver(strategy="pipeline", num_stages=2,
                           virtual_stages=2, verbose=0, **flags):
    with pytest.raises(app.UsageError, match=re.escape(message)):
      train.main(["train"])


def test_cli_pipeline_batch_not_divisible_by_micro_batches(capsys):
  with flagsaver.flagsaver(strategy="pipeline", global_batch_size=30,
                           micro_batches=4, verbose=0):
    assert train.main(["train"]) == 1
  assert ("global_batch_size=30 is not divisible by micro_batches=4"
          in capsys.readouterr().err)


def test_branch_parallel_trains_saves_each_member_and_serves(tmp_path, capsys):
  from tfmgpu import predict
  with flagsaver.flagsaver(strategy="branch_parallel", model="mlp",
                           num_stages=2, epochs=1, steps_per_epoch=3,
                           model_dir=str(tmp_path), verbose=0):
    assert train.main(["train"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"branches\s+2 on /device:CPU:0, /device:CPU:1", out)
  paths = [str(tmp_path / f"model.branch{i}.keras") for i in range(2)]
  assert all(os.path.exists(p) for p in paths)
  with flagsaver.flagsaver(model_path=paths, strategy="branch_parallel"):
    assert predict.main(["predict"]) == 0
  assert "predicted  1000 rows with branch_parallel (on 2 devices)" in (
      capsys.readouterr().out)
  with flagsaver.flagsaver(model_path=paths * 3, strategy="branch_parallel"):
    assert predict.main(["predict"]) == 1  # 6 models, 4 devices.
  assert ("6 model paths but only 4 device(s) exist (/device:CPU:0, "
          "/device:CPU:1, /device:CPU:2, /device:CPU:3). Pass "
          "--virtual_devices=6" in capsys.readouterr().err)
