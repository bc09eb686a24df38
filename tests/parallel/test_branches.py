"""BranchParallel: same predictions and training as one device, per-device placement."""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import devices as devices_lib
from tfmgpu.parallel import branches as branches_lib
from tfmgpu.parallel import inspection
from tfmgpu.parallel import placed

BranchParallel = branches_lib.BranchParallel
BATCH = 8
STEPS = 3


def _tower(width, seed, name):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((6,)),
      keras.layers.Dense(width, activation="relu", name=f"{name}_hidden"),
      keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(1e-2),
                         name=f"{name}_out"),
  ], name=name)


def _data():
  rng = np.random.RandomState(2)
  return (rng.randn(STEPS * BATCH, 6).astype("float32"),
          rng.randint(0, 3, size=(STEPS * BATCH,)))


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _device_of(variable):
  return devices_lib.canonical_device(placed.variable_device(variable))


class Mix(keras.layers.Layer):
  """A trainable combine step: a learned weighted sum of the branch outputs."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(len(input_shape),), initializer="ones",
                             name="w")

  def call(self, outputs):
    return tf.add_n([self.w[i] * o for i, o in enumerate(outputs)])


_COMBINE_NP = {"concat": lambda o: np.concatenate(o, axis=-1),
               "mean": lambda o: np.mean(o, axis=0),
               "sum": lambda o: np.sum(o, axis=0)}


@pytest.mark.parametrize("combine", ["concat", "mean", "sum"])
def test_branches_load_their_own_files_and_match_one_device(
    combine, tmp_path, cpu_devices):
  paths = [str(tmp_path / "a.weights.h5"), str(tmp_path / "b.weights.h5")]
  _tower(5, 1, "a").save_weights(paths[0])
  _tower(7, 2, "b").save_weights(paths[1])
  x, _ = _data()

  # Builders run under each branch's device with a fresh initialisation;
  # the files must overwrite it.
  model = BranchParallel([lambda: _tower(5, 10, "a"), lambda: _tower(7, 20, "b")],
                         devices=cpu_devices[1:3], combine=combine,
                         weights_paths=paths)
  for branch, device in zip(model.branches, cpu_devices[1:3]):
    assert {_device_of(v) for v in branch.variables} == {device}

  # Reference: the same files, one model after the other, on one device.
  with tf.device(cpu_devices[0]):
    outputs = []
    for path, (width, name) in zip(paths, [(5, "a"), (7, "b")]):
      tower = _tower(width, 0, name)
      tower.load_weights(path)
      outputs.append(tower.predict(x, verbose=0))
  np.testing.assert_allclose(model.predict(x, verbose=0),
                             _COMBINE_NP[combine](outputs), rtol=1e-6,
                             atol=1e-6)


def _reference(towers, combine_layer):
  inputs = keras.Input((6,))
  return keras.Model(inputs, combine_layer([t(inputs) for t in towers]))


@pytest.mark.parametrize("combine", ["mean", "mix"])
def test_fit_matches_one_device_training(combine, cpu_devices):
  x, y = _data()
  towers = [_tower(5, 1, "a"), _tower(7, 2, "b")]
  model = BranchParallel(
      towers, devices=cpu_devices[1:3], combine_device=cpu_devices[3],
      combine="mean" if combine == "mean" else Mix(name="mix"))
  if combine == "mix":
    assert {_device_of(v) for v in model.combiner.variables} == {
        cpu_devices[3]}
  ref = _reference(towers, keras.layers.Average() if combine == "mean"
                   else Mix(name="mix"))
  for m in (model, ref):
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss=_loss())
  got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  want = ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

  np.testing.assert_allclose(got.history["loss"], want.history["loss"],
                             rtol=1e-5)
  for branch, tower in zip(model.branches, towers):  # towers trained in ref
    for u, v in zip(branch.get_weights(), tower.get_weights()):
      np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)
  if combine == "mix":
    np.testing.assert_allclose(model.combiner.get_weights()[0],
                               ref.get_layer("mix").get_weights()[0],
                               rtol=1e-5, atol=1e-6)
  # Optimizer slots sit with their variables (slot "adam/a_hidden_kernel_
  # momentum" belongs to branch "a").
  homes = {"a": cpu_devices[1], "b": cpu_devices[2], "mix": cpu_devices[3]}
  slots = [v for v in model.optimizer.variables
           if v.path.endswith(("_momentum", "_velocity"))]
  assert len(slots) == 2 * len(model.trainable_variables)
  for v in slots:
    owner = v.path.split("/")[-1].split("_")[0]
    assert _device_of(v) == homes[owner], v.path


_PART = re.compile(r"^(branch_(\d+)|combine)(_backward)?(?:_\d+)?$")


def test_each_branch_forward_and_backward_run_on_its_device(cpu_devices):
  x, y = _data()
  model = BranchParallel([_tower(5, 1, "a"), _tower(7, 2, "b")],
                         devices=cpu_devices[1:3],
                         combine_device=cpu_devices[3], combine=Mix())
  model.compile(optimizer=keras.optimizers.Adam(0.01), loss=_loss())
  fn = tf.function(lambda xb, yb: model.train_step((xb, yb)))
  concrete = fn.get_concrete_function(tf.TensorSpec((BATCH, 6)),
                                      tf.TensorSpec((BATCH,), tf.int64))
  want = {"branch_0": cpu_devices[1], "branch_1": cpu_devices[2],
          "combine": cpu_devices[3]}
  seen = collections.Counter()
  bad = []
  for p in inspection.op_placements(concrete):
    parts = p.name.split("/")
    for i, part in enumerate(parts):
      m = _PART.match(part)
      if m:
        backward = bool(m.group(3)) or "gradient_tape" in parts[:i]
        seen[(m.group(1), backward, p.type)] += 1
        if p.device != want[m.group(1)] and not (
            p.device == "" and p.type in ("Placeholder", "ReadVariableOp")):
          bad.append((p.name, p.device))
        break
  assert bad == []
  for part in ("branch_0", "branch_1"):
    assert seen[(part, False, "MatMul")] == 2  # Forward: two Dense layers.
    assert seen[(part, True, "MatMul")] >= 3   # Backward: kernels and input.
  assert seen[("combine", True, "Mul")] >= 1


# ------------------------------------------------------------------- errors


def test_bad_arguments(cpu_devices, tmp_path):
  towers = [_tower(3, 1, "a"), _tower(3, 2, "b")]
  with pytest.raises(ValueError, match=r"5 branches but only 4 device\(s\)"):
    BranchParallel(towers * 2 + towers[:1])
  with pytest.raises(ValueError, match=r"has 1 entries for 2 branches"):
    BranchParallel(towers, devices=cpu_devices[:1])
  with pytest.raises(ValueError, match=r"combine='max' is unknown; use one of "
                     r"concat, sum, mean"):
    BranchParallel(towers, combine="max")
  with pytest.raises(ValueError, match=r"combine='mean' needs equal output "
                     r"shapes.*\(3,\), \(4,\)"):
    BranchParallel([towers[0], keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4)])], combine="mean")
  with pytest.raises(ValueError, match=r"weights_paths has 1 entries for 2"):
    BranchParallel(towers, weights_paths=[str(tmp_path / "a.weights.h5")])
  with pytest.raises(ValueError, match=r"branches=\[\] is empty"):
    BranchParallel([])
  with pytest.raises(ValueError, match=r"index=2 is out of range"):
    BranchParallel(towers).load_branch_weights(2, "x.weights.h5")
  from tfmgpu import inference  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"exports one Keras model; "  # Keras:
                     r"'branch_parallel' \(BranchParallel\) runs several"):
    inference.export_saved_model(BranchParallel(towers),  # get_config().
                                 str(tmp_path / "saved"))


def combine_predictions(pred1, pred2):
  """The seed's style: one argument per branch."""
  return (pred1 + 2.0 * pred2) / 3.0


def test_combine_takes_a_list_or_one_argument_per_branch(cpu_devices):
  towers = [_tower(4, 0, "a"), _tower(5, 1, "b")]
  x, _ = _data()
  outputs = [t(x).numpy() for t in towers]
  per_branch = BranchParallel(towers, devices=cpu_devices[1:3],
                              combine=combine_predictions)
  np.testing.assert_allclose(per_branch(x).numpy(),
                             (outputs[0] + 2.0 * outputs[1]) / 3.0, rtol=1e-6)
  as_list = BranchParallel(towers, devices=cpu_devices[1:3],
                           combine=lambda outs: tf.reduce_max(
                               tf.stack(outs), axis=0))
  np.testing.assert_allclose(as_list(x).numpy(), np.maximum(*outputs),
                             rtol=1e-6)


def test_a_combine_that_cannot_take_the_outputs_fails_at_build(cpu_devices):
  towers = [_tower(4, 0, "a"), _tower(5, 1, "b")]

  def three(p1, p2, p3):
    return p1 + p2 + p3

  with pytest.raises(ValueError, match=r"combine='three' takes neither one "
                     r"list of outputs nor one argument per branch \(2 "
                     r"branches\): its signature is \(p1, p2, p3\)"):
    BranchParallel(towers, devices=cpu_devices[1:3], combine=three)
  with pytest.raises(ValueError, match=r"combine='<lambda>' fails when called "
                     r"with the list of branch outputs \(shapes \[\(None, 3\), "
                     r"\(None, 3\)\]\): IndexError: .*It must take one list"):
    BranchParallel(towers, devices=cpu_devices[1:3],
                   combine=lambda outs: outs[0] + outs[2])  # 2 branches.
