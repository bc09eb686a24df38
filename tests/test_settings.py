"""One declaration per option: a toy option reaches the flag, the config and
the placement's options (tfmgpu.settings, tfmgpu.flags.define_settings,
tfmgpu.config.make_train_config). No TensorFlow."""

import dataclasses

from absl import flags
import pytest

from tfmgpu import config as config_lib
from tfmgpu import flags as flags_lib
from tfmgpu import settings
from tfmgpu.placements import model_parallel
from tfmgpu.placements import pipeline
from tfmgpu.settings import setting
from tfmgpu.strategies import registry


@dataclasses.dataclass(frozen=True)
class ToyOptions(pipeline.PipelineOptions):
  toy_knob: int = setting(3, "A toy knob, declared once.", lower_bound=1)


class ToyPipeline(pipeline.Pipeline):
  name = "toy_pipeline"
  Options = ToyOptions


@pytest.fixture
def toy_registered():
  registry.register(ToyPipeline)
  yield
  registry.unregister(ToyPipeline.name)


def _parse(cls, *args):
  values = flags.FlagValues()
  flags_lib.define_settings(cls, module_name="toy_cli", flag_values=values)
  values(["toy_cli", *args])
  return values


@pytest.mark.usefixtures("toy_registered")
def test_a_toy_option_is_one_field_that_reaches_flag_config_and_options():
  cls = config_lib.make_train_config()
  values = _parse(cls, "--strategy=toy_pipeline", "--toy_knob=7",
                  "--micro_batches=2")
  assert (values["toy_knob"].default, values["toy_knob"].help) == (
      3, "A toy knob, declared once.")
  config = cls(**flags_lib.config_values(cls, values))
  assert config.toy_knob == 7
  assert config.options == ToyOptions(toy_knob=7, micro_batches=2)
  assert registry.lookup("toy_pipeline").options_from(config).toy_knob == 7
  assert "toy_knob: A toy knob, declared once." in cls.__doc__
  assert cls().toy_knob == 3  # The declared default, without flags.
  with pytest.raises(flags.IllegalFlagValueError, match="toy_knob"):
    _parse(cls, "--toy_knob=0")
  with pytest.raises(ValueError, match="toy_knob=0 must be a positive"):
    cls(strategy="toy_pipeline", toy_knob=0)


def test_an_undeclared_option_is_named():
  @dataclasses.dataclass(frozen=True)
  class Bare(model_parallel.StageOptions):
    bare_knob: int = 1

  class BarePlacement(model_parallel.ModelParallel):
    name = "bare_placement"
    Options = Bare

  registry.register(BarePlacement)
  try:
    with pytest.raises(TypeError, match=r"'bare_knob' of strategy "
                       r"'bare_placement'.*tfmgpu.settings.setting"):
      config_lib.make_train_config()
  finally:
    registry.unregister(BarePlacement.name)


def test_recorded_options_keep_run_json_order():
  options = pipeline.PipelineOptions(split_points=("a",), data_parallel=2,
                                     tensor_rules="x=row")
  assert settings.recorded(options) == [
      ("num_stages", 2), ("partition", "balanced"), ("split_points", ("a",)),
      ("data_parallel", 2), ("tensor_rules", "x=row")]


def test_run_defaults_may_differ_from_the_python_api():
  fields = {f.name: f for f in dataclasses.fields(config_lib.TrainConfig)}
  assert fields["single_replica"].default == "default"  # MirroredOptions:
  assert fields["connect_timeout_s"].default is None    # "mirrored", 300.
  assert fields["tensor_parallel"].default == 1  # TensorOptions: 2.
