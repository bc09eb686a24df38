"""Each shim of `tfmgpu._compat` works on the installed Keras and TensorFlow,
and no other module of the package touches their private API.

When a Keras or TensorFlow upgrade breaks tfmgpu, the failing test here
names the private name that moved.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmgpu import _compat

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tfmgpu"

# What only `_compat.py` may use: private modules and private attributes of
# Keras and TensorFlow objects.
PRIVATE = re.compile(
    r"keras\.src|tensorflow\.python|__internal__|\b(" + "|".join((
        "_keras_history", "_inbound_nodes", "_operations", "_flatten_layers",
        "_compile_loss", "_loss_tracker", "_num_workers",
        "_in_multi_worker_mode", "_context_handle", "_distribution_strategy",
        "_learning_rate", "_all_reduce_sum_gradients", "_get_variable_index",
        "_momentums", "_velocities", "keras_masking", "global_state",
        "_seed_generators")) + r")\b")


def test_no_private_keras_or_tf_use_outside_compat():
  found = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
           for path in sorted(PACKAGE.rglob("*.py"))
           if path.name != "_compat.py"
           for number, line in enumerate(path.read_text().splitlines(), 1)
           if PRIVATE.search(line)]
  assert not found, ("Private Keras/TF use outside tfmgpu/_compat.py; add a "
                     "shim there and call it:\n  " + "\n  ".join(found))


def test_the_private_pattern_sees_each_kind_of_use():
  for line in ("from keras.src.losses import loss",
               "from tensorflow.python.eager import context",
               "op, i, _ = tensor._keras_history",
               "class T(tf.__internal__.tracking.Trackable):",
               'getattr(strategy, "_num_workers", 1)'):
    assert PRIVATE.search(line), line
  for line in ("def _learning_rate_variable(optimizer):",
               "self.num_workers = 2", "keras.ops.add(a, b)"):
    assert not PRIVATE.search(line), line


def test_installed_versions_are_the_checked_ones():
  assert _compat.check_versions() == []


def test_versions_outside_the_checked_range_are_named():
  problems = _compat.check_versions({"keras": "3.99.0",
                                     "tensorflow": "2.21.0"})
  assert len(problems) == 1
  assert "keras 3.99.0 is outside 3.15..3.15" in problems[0]
  assert _compat.check_versions({"keras": "nightly",
                                 "tensorflow": "2.21.1"})[0].startswith(
                                     "keras nightly")


def test_other_versions_warn_with_what_to_do(monkeypatch):
  monkeypatch.setitem(_compat.CHECKED, "tensorflow", ((2, 30), (2, 31)))
  with pytest.warns(RuntimeWarning, match=r"tensorflow .* is outside "
                    r"2\.30\.\.2\.31.*pytest tests/test_compat\.py"):
    _compat._warn_outside_checked_versions()  # pylint: disable=protected-access


def test_checked_versions_do_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _compat._warn_outside_checked_versions()  # pylint: disable=protected-access


# TensorFlow.


def test_runtime_initialized_after_an_op():
  tf.constant(1.0)
  assert _compat.runtime_initialized() is True


def test_rekey_collectives_finds_the_strategys_all_reduces(cpu_devices):
  keys = _compat.collective_keys(1 << 20)
  default = tf.distribute.MirroredStrategy(cpu_devices[:2])
  assert _compat.rekey_collectives(default, keys) == 1
  # TF keeps a collective all-reduce for XLA beside the one it was given.
  to_one = tf.distribute.MirroredStrategy(
      cpu_devices[:2], cross_device_ops=tf.distribute.ReductionToOneDevice())
  assert _compat.rekey_collectives(to_one, keys) == 1
  launchers = default.extended._collective_ops._launchers  # pylint: disable=protected-access
  assert {l._group_key for l in launchers} == {1 << 20}  # pylint: disable=protected-access
  assert all(l._collective_keys is keys for l in launchers)  # pylint: disable=protected-access


def test_functions_traced_before_a_rekey_never_reuse_an_instance_key(
    cpu_devices):
  strategy = tf.distribute.MirroredStrategy(cpu_devices[:2])

  def all_reduces(gather):
    def replica():
      context = tf.distribute.get_replica_context()
      total = context.all_reduce("sum", tf.ones([5 if gather else 7]))
      if gather:  # A second collective of another shape.
        return total, context.all_gather(tf.ones([5]), axis=0)
      return total
    return tf.function(lambda: strategy.run(replica))

  before, after = all_reduces(gather=True), all_reduces(gather=False)
  before()
  before()
  _compat.rekey_collectives(strategy, _compat.collective_keys(1 << 21))
  # Unraised counters would give `before` (still group 1) the keys its
  # earlier calls used for other shapes.
  for fn in (after, before, after, before):
    fn()


def test_in_multi_worker_mode(cpu_devices):
  assert _compat.in_multi_worker_mode(tf.distribute.get_strategy()) is False
  mirrored = tf.distribute.MirroredStrategy(cpu_devices[:2])
  # The private method exists (the shim does not fall back to False).
  assert callable(mirrored.extended._in_multi_worker_mode)  # pylint: disable=protected-access
  assert _compat.in_multi_worker_mode(mirrored) is False
  from tensorflow.python.distribute import collective_all_reduce_strategy as c  # pylint: disable=g-import-not-at-top
  assert "_in_multi_worker_mode" in vars(c.CollectiveAllReduceExtended)


def test_parameter_server_workers():
  # A ParameterServerStrategy needs a running cluster (tests/cluster covers
  # one); here: the attribute the shim reads is still set when it connects.
  source = inspect.getsource(tf.distribute.experimental.ParameterServerStrategy
                             ._connect_to_cluster)  # pylint: disable=protected-access
  assert "self._num_workers = " in source
  assert _compat.parameter_server_workers(tf.distribute.get_strategy()) == 1


def test_trackables_round_trip_through_a_checkpoint(tmp_path):
  root = _compat.AutoTrackable()
  root.v = tf.Variable(3.0)
  path = tf.train.Checkpoint(root=root).write(str(tmp_path / "ckpt"))
  root.v.assign(0.0)
  tf.train.Checkpoint(root=root).read(path).assert_consumed()
  assert float(root.v.numpy()) == 3.0
  assert issubclass(_compat.AutoTrackable, _compat.Trackable)


# The Keras layer graph.


def _functional():
  inputs = keras.Input((3,), name="x")
  hidden = keras.layers.Dense(4, name="hidden")(inputs)
  outputs = keras.layers.Dense(2, name="head")(keras.ops.add(hidden, 1.0))
  return keras.Model(inputs, outputs), inputs, hidden, outputs


def test_keras_history_and_producer_node():
  model, inputs, hidden, outputs = _functional()
  op, node_index, tensor_index = _compat.keras_history(hidden)
  assert (op.name, node_index, tensor_index) == ("hidden", 0, 0)
  node = _compat.producer_node(outputs)
  assert node.operation is model.get_layer("head")
  assert _compat.keras_history(inputs)[0].name == "x"


def test_model_operations_include_bare_ops():
  model, *_ = _functional()
  names = [type(op).__name__ for op in _compat.model_operations(model)]
  assert "Add" in names and names.count("Dense") == 2
  plain = keras.layers.Dense(1)
  fake = type("NoOps", (), {"layers": [plain]})()
  assert _compat.model_operations(fake) == [plain]


def test_flatten_layers_finds_nested_layers():
  inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2,
                                                                  name="in")])
  outer = keras.Sequential([keras.Input((2,)), inner,
                            keras.layers.Dense(1, name="out")])
  names = [l.name for l in _compat.flatten_layers(outer)]
  assert {"in", "out", inner.name} <= set(names)


def test_own_seed_generators_are_a_layers_own():
  drop = keras.layers.Dropout(0.5, seed=3, name="drop")
  model = keras.Sequential([keras.Input((2,)), drop])
  assert [g.state.path for g in _compat.own_seed_generators(drop)] == [
      drop.seed_generator.state.path]
  assert not _compat.own_seed_generators(model)


def test_no_deferred_initialization_forgets_deferred_variables():
  from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  pending = lambda: list(global_state.get_global_attribute(  # pylint: disable=unnecessary-lambda-assignment
      "uninitialized_variables", [], set_to_default=True))
  before = pending()
  with _compat.no_deferred_initialization():
    with keras.StatelessScope(initialize_variables=False):
      keras.layers.Dense(2).build((None, 3))
    assert len(pending()) > len(before)
  assert pending() == before


# Keras masks.


def test_keras_masks_get_and_set():
  embedded = keras.layers.Embedding(5, 2, mask_zero=True)(
      tf.constant([[1, 0]]))
  np.testing.assert_array_equal(_compat.get_keras_mask(embedded),
                                [[True, False]])
  other = tf.zeros((1, 2, 2))
  assert _compat.get_keras_mask(other) is None
  _compat.set_keras_mask(other, tf.constant([[False, True]]))
  np.testing.assert_array_equal(_compat.get_keras_mask(other),
                                [[False, True]])


# A compiled model's loss.


def test_compiled_loss_and_loss_tracker():
  model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
  assert _compat.compiled_loss(model) is None
  model.compile(optimizer="sgd", loss="mse")
  y_true, y_pred = tf.constant([[1.0], [3.0]]), tf.constant([[0.0], [1.0]])
  loss = _compat.compiled_loss(model)(y_true, y_pred, None)
  assert float(loss) == pytest.approx(2.5)
  tracker = _compat.loss_tracker(model)
  tracker.reset_state()
  tracker.update_state(4.0, sample_weight=2)
  assert float(tracker.result()) == pytest.approx(4.0)


def test_unscale_loss_for_distribution(cpu_devices):
  assert float(_compat.unscale_loss_for_distribution(tf.constant(1.5))) == 1.5
  strategy = tf.distribute.MirroredStrategy(cpu_devices[:2])
  with strategy.scope():
    out = strategy.run(
        lambda: _compat.unscale_loss_for_distribution(tf.constant(1.5)))
  assert [float(v) for v in strategy.experimental_local_results(out)] == [
      3.0, 3.0]


# Optimizers.


def test_optimizer_strategy(cpu_devices):
  strategy = tf.distribute.MirroredStrategy(cpu_devices[:2])
  with strategy.scope():
    optimizer = keras.optimizers.SGD()
  assert _compat.optimizer_strategy(optimizer) is strategy
  assert _compat.optimizer_strategy(object()) is None


def test_learning_rate_variable():
  variable = _compat.learning_rate_variable(keras.optimizers.SGD(0.25))
  assert float(variable.numpy()) == 0.25
  schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
  assert _compat.learning_rate_variable(keras.optimizers.SGD(schedule)) is None


def test_replace_gradient_all_reduce_is_called_by_apply_gradients():
  optimizer = keras.optimizers.SGD(1.0)
  variable = keras.Variable([1.0])
  calls = []

  def all_reduce(grads_and_vars):
    calls.append(1)
    return [(g * 2, v) for g, v in grads_and_vars]

  assert _compat.replace_gradient_all_reduce(optimizer, all_reduce) is True
  optimizer.apply_gradients([(tf.constant([0.25]), variable)])
  assert calls == [1]
  np.testing.assert_allclose(variable.numpy(), [0.5])
  assert _compat.replace_gradient_all_reduce(object(), all_reduce) is False


def test_variable_index_and_adam_slots():
  a, b = keras.Variable([1.0, 2.0]), keras.Variable([3.0])
  optimizer = keras.optimizers.Adam(0.1, beta_1=0.9, beta_2=0.99)
  optimizer.apply_gradients([(tf.constant([1.0, 2.0]), a),
                             (tf.constant([4.0]), b)])
  assert _compat.variable_index(optimizer, b) == 1
  momentum, velocity = _compat.adam_slots(optimizer, b)
  np.testing.assert_allclose(momentum.numpy(), [0.1 * 4.0], rtol=1e-6)
  np.testing.assert_allclose(velocity.numpy(), [0.01 * 16.0], rtol=1e-6)
