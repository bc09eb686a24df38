"""`EpochProgress`: plain lines off a terminal, a rewritten line on one."""

import io
import re

import pytest

import tfmgpu
from tfmgpu import models
from tfmgpu.training import progress
from tfmgpu.training.loop import Trainer

DIGITS_ROWS = 128  # For the `digits` fixture.


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_off_a_terminal_an_epoch_is_one_plain_line():
  """Issue 29 item 16: logs held ANSI codes, and `examples/s: 309.4456`."""
  out = io.StringIO()
  bar = progress.EpochProgress(2, 5, 10, stream=out)
  assert not bar.interactive
  for done in range(1, 11):
    bar.update(done, {"loss": 0.123456, "accuracy": 0.5}, 309.4456 * done)
  bar.end()
  text = out.getvalue()
  assert re.fullmatch(r"Epoch 2/5: 10/10 - \d+s - loss: 0\.1235 - accuracy: "
                      r"0\.5000 - examples/s: 3,094\n", text), repr(text)


def test_on_a_terminal_the_line_is_rewritten_without_colour_codes():
  out = _Terminal()
  bar = progress.EpochProgress(1, 1, 3, stream=out)
  assert bar.interactive
  for done in (1, 2, 3):
    bar.update(done, {"loss": 2e-5}, 12.6)
  bar.end()
  text = out.getvalue()
  assert text.startswith("Epoch 1/1\n\r1/3 - ")
  assert text.endswith("3/3 - 0s - loss: 2.000e-05 - examples/s: 13\n")
  assert "\x1b" not in text


@pytest.mark.parametrize("verbose", [0, 1])
def test_a_fit_off_a_terminal_prints_a_line_per_epoch(digits, capsys, verbose):
  model = models.build_model("mlp", input_shape=(28, 28, 1), num_classes=10,
                             seed=0)
  trainer = Trainer(model, strategy=tfmgpu.get_strategy("default"),
                    verbose=verbose)
  trainer.fit(*digits, epochs=2, global_batch_size=32, steps_per_epoch=3)
  lines = capsys.readouterr().out.splitlines()
  epochs = [l for l in lines if l.startswith("Epoch ")]
  if not verbose:
    assert not epochs
    return
  assert len(epochs) == 2, lines
  assert re.fullmatch(r"Epoch 1/2: 3/3 - \d+s - loss: \d\.\d{4} - accuracy: "
                      r"\d\.\d{4} - examples/s: [\d,]+", epochs[0]), epochs
