"""A user's own model and data for `python -m tfmgpu.train`: two inputs.

An image and a row of tabular features per example, fed as a dict, into a
functional Keras model with two input branches. Train it from a checkout:

  python -m tfmgpu.train --model=scripts/examples/two_input.py:build \
      --dataset=scripts/examples/two_input.py:load \
      --strategy=mirrored --virtual_devices=2

(or `PYTHONPATH=scripts/examples python -m tfmgpu.train
--model=two_input:build --dataset=two_input:load ...`).

What tfmgpu asks of the two functions:

* `load()` returns `((x_train, y_train), (x_test, y_test))`, as
  `keras.datasets` loaders do; each `x` may be an array or a dict (or list)
  of arrays, one per model input, with one row per example. It may take
  `seed=` (and `path=`), which tfmgpu passes from `--seed` (`--data_path`).
* `build(input_shape, num_classes)` returns a Keras model. `input_shape` is
  the shape of one example, nested like `x` (here
  `{"image": (28, 28, 1), "tabular": (56,)}`); `num_classes` is
  `max(y) + 1` for integer labels (`None` otherwise). With the default loss
  (sparse categorical cross-entropy from logits) the model outputs logits;
  another output needs `--loss` (and `--metrics`).

tfmgpu reads this file (without running it) to check both functions before
TensorFlow loads, and imports it to train.
"""

import keras
import numpy as np

from tfmgpu import data


def tabular_features(images: np.ndarray) -> np.ndarray:
  """56 numbers per image: the mean of each of its 28 rows and 28 columns."""
  pixels = images[..., 0]
  return np.concatenate([pixels.mean(axis=2), pixels.mean(axis=1)],
                        axis=1).astype(np.float32)


def load(seed: int = 0):
  """The shipped digits (offline) as `{"image", "tabular"}` inputs.

  Returns:
    `((x_train, y_train), (x_test, y_test))`: each `x` a dict with
    `"image"` (n, 28, 28, 1) and `"tabular"` (n, 56), float32; each `y`
    the integer digit labels.
  """
  digits = data.load_dataset("digits", seed=seed)

  def inputs(images):
    return {"image": images, "tabular": tabular_features(images)}

  return ((inputs(digits.x_train), digits.y_train),
          (inputs(digits.x_test), digits.y_test))


def build(input_shape, num_classes):
  """A small convnet on the image beside a dense layer on the tabular row.

  Args:
    input_shape: `{"image": (28, 28, 1), "tabular": (56,)}`.
    num_classes: logits to output.

  Returns:
    A functional `keras.Model` taking a dict of the two inputs.
  """
  image = keras.Input(input_shape["image"], name="image")
  tabular = keras.Input(input_shape["tabular"], name="tabular")
  x = keras.layers.Conv2D(16, 3, activation="relu")(image)
  x = keras.layers.MaxPooling2D()(x)
  x = keras.layers.Conv2D(32, 3, activation="relu")(x)
  x = keras.layers.MaxPooling2D()(x)
  x = keras.layers.Flatten()(x)
  t = keras.layers.Dense(32, activation="relu")(tabular)
  h = keras.layers.Concatenate()([x, t])
  h = keras.layers.Dense(64, activation="relu")(h)
  logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(h)
  return keras.Model({"image": image, "tabular": tabular}, logits,
                     name="two_input")
