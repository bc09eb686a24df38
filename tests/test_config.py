"""`TrainConfig` validation: every rule's error message, without TensorFlow."""

import pytest

from tfmgpu.config import TrainConfig


def test_defaults_are_valid_and_replace_validates_again():
  config = TrainConfig()
  assert (config.strategy, config.dataset) == ("mirrored", "digits")
  assert config.replace(epochs=2).epochs == 2
  with pytest.raises(ValueError, match=r"epochs=0 must be a positive integer"):
    config.replace(epochs=0)


@pytest.mark.parametrize("field,value", [
    ("model", "resnet9000"), ("dataset", "mnits"), ("optimizer", "lamb"),
    ("input_mode", "disk"), ("schedule", "zigzag"),
])
def test_unknown_names_list_the_choices(field, value):
  with pytest.raises(ValueError, match=rf"{field}='{value}' is unknown\. "
                     r"(Did you mean '\w+'\? )?Choose one of .+"):
    TrainConfig(**{field: value})


def test_unknown_strategy_lists_the_registered_names():
  with pytest.raises(ValueError, match=r"Unknown strategy name='bogus'. "
                     r"Available names: .*mirrored, model_parallel, "):
    TrainConfig(strategy="bogus")


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_global_batch_must_divide_over_the_virtual_devices(strategy):
  with pytest.raises(ValueError, match=(
      rf"global_batch_size=30 is not divisible by the 4 replicas of "
      rf"'{strategy}' \(virtual_devices=4\). Use a multiple of 4, e.g. 28")):
    TrainConfig(strategy=strategy, virtual_devices=4, global_batch_size=30)
  with pytest.raises(ValueError, match=r"Use a multiple of 8, e.g. 8"):
    TrainConfig(strategy=strategy, virtual_devices=8, global_batch_size=6)
  assert TrainConfig(strategy=strategy, virtual_devices=4,
                     global_batch_size=32).global_batch_size == 32


def test_npz_needs_a_data_path():
  with pytest.raises(ValueError,
                     match=r"dataset='npz' needs data_path='file.npz'"):
    TrainConfig(dataset="npz")
  assert TrainConfig(dataset="npz", data_path="d.npz").dataset_options() == {
      "path": "d.npz"}


@pytest.mark.parametrize("chosen", [
    dict(devices=("/cpu:0",), num_gpus=1),
    dict(num_gpus=1, num_replicas=2),
    dict(devices=("/cpu:0",), num_replicas=2),
])
def test_only_one_device_selector(chosen):
  names = ", ".join(repr(n) for n in chosen)
  with pytest.raises(ValueError, match=rf"Set only one of \[{names}\]: each "
                     r"chooses the devices."):
    TrainConfig(**chosen)


@pytest.mark.parametrize("field", [
    "global_batch_size", "epochs", "num_packs", "steps_per_execution",
    "num_stages", "micro_batches", "virtual_devices", "num_gpus",
    "num_replicas", "steps_per_epoch",
])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_counts_must_be_positive_integers(field, value):
  with pytest.raises(ValueError,
                     match=rf"{field}={value!r} must be a positive integer."):
    TrainConfig(**{field: value})


@pytest.mark.parametrize("field", ["virtual_devices", "num_gpus",
                                   "num_replicas", "steps_per_epoch"])
def test_optional_counts_accept_none(field):
  assert getattr(TrainConfig(**{field: None}), field) is None


@pytest.mark.parametrize("value", [0, -1e-3])
def test_learning_rate_must_be_positive(value):
  with pytest.raises(ValueError, match=rf"learning_rate={value} must be > 0."):
    TrainConfig(learning_rate=value)


def test_clip_norm_and_bytes_per_pack():
  with pytest.raises(ValueError, match=r"clip_norm=0 must be > 0 \(or None\)"):
    TrainConfig(clip_norm=0)
  with pytest.raises(ValueError, match=r"bytes_per_pack=-1 must be >= 0."):
    TrainConfig(bytes_per_pack=-1)
  assert TrainConfig(clip_norm=1.0, bytes_per_pack=0).clip_norm == 1.0


def test_a_model_reads_its_own_dataset_unless_one_is_named():
  assert TrainConfig().dataset == "digits"
  gpt = TrainConfig(model="gpt")
  assert gpt.dataset == "stdlib_text"
  assert gpt.dataset_options()["seq_len"] == 64  # tiny's context.
  big = TrainConfig(model="gpt", model_size="gpt2_small")
  assert big.dataset_options()["seq_len"] == 1024  # GPT-2's context.
  named = TrainConfig(model="gpt", dataset="synthetic")
  assert named.dataset == "synthetic" and "seq_len" not in (
      named.dataset_options())


def test_defaults_follow_a_replaced_model_and_sizes_are_named():
  gpt = TrainConfig().replace(model="gpt")
  assert (gpt.dataset, gpt.model_size) == ("stdlib_text", "tiny")
  assert gpt.replace(model="convnet").dataset == "digits"
  assert gpt.replace(model="convnet").model_size is None
  assert TrainConfig(model="gpt", model_size="tiny") == TrainConfig(model="gpt")
  kept = TrainConfig(dataset="synthetic").replace(model="gpt")
  assert kept.dataset == "synthetic"


def test_another_strategys_options_are_said_to_be_ignored(caplog,
                                                         monkeypatch):
  """`--strategy=mirrored --num_stages=3 --schedule=1f1b` trained mirrored
  without a word."""
  from tfmgpu import config as config_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(config_lib, "_SAID_UNUSED", set())
  # global_batch_size is also an option of auto's, and every run's own.
  TrainConfig(strategy="mirrored", num_stages=3, schedule="1f1b",
              global_batch_size=8).replace(epochs=2)
  said = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
  assert said == [
      "num_stages=3 is an option of model_parallel, branch_parallel, "
      "pipeline, not of strategy='mirrored': this run ignores it.",
      "schedule='1f1b' is an option of pipeline, not of "
      "strategy='mirrored': this run ignores it."], said


def test_zero_stage_a_strategy_cannot_shard_is_refused_not_ignored(
    caplog, monkeypatch):
  """`--strategy=pipeline --zero_stage=1` warned that the run ignores it,
  then refused it."""
  from tfmgpu import config as config_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(config_lib, "_SAID_UNUSED", set())
  with pytest.raises(ValueError, match=r"zero_stage=1 is not supported by "
                     r"strategy='pipeline'"):
    TrainConfig(strategy="pipeline", zero_stage=1)
  assert not [r for r in caplog.records if "zero_stage" in r.getMessage()]


def test_layout_sizes_belong_to_the_layouts_that_take_them():
  with pytest.raises(ValueError, match=(
      r"tensor_parallel=2 is not an option of strategy='mirrored'; it shapes "
      r"the layouts of model_parallel, pipeline, tensor_parallel")):
    TrainConfig(strategy="mirrored", tensor_parallel=2)
  with pytest.raises(ValueError, match=r"data_parallel=2 is not an option"):
    TrainConfig(strategy="branch_parallel", data_parallel=2)
  with pytest.raises(ValueError, match=r"tensor_parallel=1 splits nothing"):
    TrainConfig(strategy="tensor_parallel")
  with pytest.raises(ValueError, match=(
      r"virtual_devices=4 is fewer than the 8 devices of data_parallel=2 x "
      r"stages=2 x tensor_parallel=2")):
    TrainConfig(strategy="pipeline", num_stages=2, data_parallel=2,
                tensor_parallel=2, virtual_devices=4)
  with pytest.raises(ValueError, match=(
      r"global_batch_size=30 is not divisible by data_parallel=2 x "
      r"micro_batches=4")):
    TrainConfig(strategy="pipeline", data_parallel=2, global_batch_size=30)
  options = TrainConfig(strategy="pipeline", num_stages=2, data_parallel=2,
                        tensor_parallel=2, virtual_devices=8).options
  assert (options.data_parallel, options.tensor_parallel,
          options.devices_needed) == (2, 2, 8)
