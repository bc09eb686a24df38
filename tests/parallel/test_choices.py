"""The partition and schedule names: one list each, read before TF loads."""

import subprocess
import sys

from tfmgpu.parallel import choices
from tfmgpu.parallel import cost
from tfmgpu.parallel import schedule
from tfmgpu.placements import model_parallel
from tfmgpu.placements import pipeline


def test_the_enums_are_the_choices_in_order():
  assert tuple(c.value for c in cost.Criterion) == choices.PARTITION_CHOICES
  assert tuple(s.value for s in schedule.Schedule) == choices.SCHEDULE_CHOICES


def test_the_placements_read_the_same_lists():
  assert model_parallel.PARTITION_CHOICES is choices.PARTITION_CHOICES
  assert pipeline.SCHEDULE_CHOICES is choices.SCHEDULE_CHOICES


def test_importing_the_choices_and_the_simulator_does_not_load_tensorflow():
  code = ("import sys, tfmgpu.parallel.choices, tfmgpu.parallel.schedule, "
          "tfmgpu.parallel.timeline; "
          "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60, check=True)
  assert out.stdout.split() == ["False", "False"]
