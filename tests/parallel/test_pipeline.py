"""PipelinedModel: parity with unsplit training, placement, schedule order and
stored activations read from the traced graph."""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmgpu.parallel
from tfmgpu import checks
from tfmgpu import strategies
from tfmgpu.benchmarks import pipeline as bench_pipeline
from tfmgpu.models import demo
from tfmgpu.parallel import branches
from tfmgpu.parallel import inspection
from tfmgpu.parallel import partition
from tfmgpu.parallel import pipeline
from tfmgpu.parallel import schedule
from tfmgpu.parallel import staged
from tfmgpu.parallel import timeline as timeline_lib
from tfmgpu.training import loop

PipelinedModel = pipeline.PipelinedModel

LR = 0.01
STEPS = 3
BATCH = 16
RESOURCE_OPS = {"Placeholder", "ReadVariableOp", "VarHandleOp"}


def _mlp(seed=0):
  keras.utils.set_random_seed(seed)
  return demo.deep_mlp((12,), 3, depth=6, width=16)


def _regularized(seed=0):
  """Weight and activity regularisers: counted once, and per micro-batch."""
  keras.utils.set_random_seed(seed)
  L, l2 = keras.layers, keras.regularizers.L2
  return keras.Sequential([
      keras.Input((12,)),
      L.Dense(16, activation="relu", kernel_regularizer=l2(1e-2), name="d0"),
      L.Dense(16, activation="relu", activity_regularizer=l2(1e-2),
              name="d1"),
      L.Dense(16, activation="tanh", name="d2"),
      L.Dense(3, kernel_regularizer=l2(1e-2), name="logits"),
  ], name="regularized")


def _data(n=STEPS * BATCH):
  rng = np.random.RandomState(1)
  return (rng.randn(n, 12).astype("float32"),
          rng.randint(0, 3, size=(n,)).astype("int64"))


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _assert_same_weights(a, b):
  wa, wb = a.get_weights(), b.get_weights()
  assert len(wa) == len(wb)
  for i, (u, v) in enumerate(zip(wa, wb)):
    np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5,
                               err_msg=f"weight {i}")


def _train_unsplit(model, x, y):
  """One GradientTape over the whole model: the reference."""
  loss_obj, optimizer = _loss(), keras.optimizers.Adam(LR)
  optimizer.build(model.trainable_variables)

  @tf.function
  def step(xb, yb):
    with tf.GradientTape() as tape:
      loss = loss_obj(yb, model(xb, training=True))
      if model.losses:
        loss += tf.add_n(model.losses)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return [float(step(x[i:i + BATCH], y[i:i + BATCH]))
          for i in range(0, len(x), BATCH)]


def _train_pipelined(pipe, x, y):
  """The hook in a custom loop; the loss averages over the rows it gets."""
  loss_obj = _loss()
  optimizer = pipe.build_optimizer(keras.optimizers.Adam(LR))

  @tf.function
  def step(xb, yb):
    loss, _, grads = pipe.compute_loss_and_gradients(xb, yb, loss_obj,
                                                     loss_reduction="mean")
    optimizer.apply_gradients(zip(grads, pipe.trainable_variables))
    return loss

  return [float(step(x[i:i + BATCH], y[i:i + BATCH]))
          for i in range(0, len(x), BATCH)]


@pytest.fixture(scope="module")
def reference():
  """Losses and final weights of unsplit single-device training."""
  model = _mlp()
  x, y = _data()
  losses = _train_unsplit(model, x, y)
  return losses, model


# ------------------------------------------------------------------ parity

# Each schedule at M=1 (no split) and M > K on K=2; on K=4 (middle stages)
# M < K, M = K and M > K, and recomputation with each schedule. M = 2, 4
# and 8 take one path (so K=2's M=2 and 8 went: K=2 M=4 and K=4 M=2 / 8
# cover them), and recomputation's on K=4 covers K=2's.
PARITY = ([(2, m, s, False) for s in ("gpipe", "1f1b") for m in (1, 4)] +
          [(4, 2, "gpipe", False), (4, 8, "gpipe", True),
           (4, 4, "1f1b", False), (4, 8, "1f1b", True)])


@pytest.mark.parametrize("num_stages,micro_batches,name,recompute", PARITY)
def test_custom_loop_matches_unsplit_training(reference, num_stages,
                                              micro_batches, name, recompute):
  want_losses, want = reference
  x, y = _data()
  pipe = PipelinedModel.from_model(_mlp(), num_stages=num_stages,
                                   micro_batches=micro_batches, schedule=name,
                                   recompute=recompute)
  assert len(set(pipe.stage_devices)) == num_stages
  got = _train_pipelined(pipe, x, y)
  np.testing.assert_allclose(got, want_losses, rtol=1e-5)
  _assert_same_weights(pipe.to_unsplit(), want)


@pytest.fixture(scope="module")
def regularized_reference():
  """Losses and final weights of unsplit training of `_regularized`."""
  model = _regularized()
  return _train_unsplit(model, *_data()), model


@pytest.mark.parametrize("name,recompute", [("gpipe", False), ("1f1b", True)])
def test_regularisation_counts_once_per_step(name, recompute,
                                             regularized_reference):
  want, model = regularized_reference
  x, y = _data()
  pipe = PipelinedModel.from_model(_regularized(), num_stages=2,
                                   micro_batches=4, schedule=name,
                                   recompute=recompute)
  got = _train_pipelined(pipe, x, y)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  _assert_same_weights(pipe.to_unsplit(), model)


def _global_batch_loss(y_true, y_pred):
  """What tfmgpu's Trainer passes: per-example losses / the global batch."""
  return tf.nn.compute_average_loss(
      keras.losses.sparse_categorical_crossentropy(y_true, y_pred,
                                                   from_logits=True),
      global_batch_size=BATCH)


@pytest.mark.parametrize("name,recompute", [("gpipe", False), ("1f1b", True)])
@pytest.mark.parametrize("loss_fn,reduction", [(_loss(), "mean"),
                                               (_global_batch_loss, "sum")])
def test_gradients_equal_the_unsplit_gradients(name, recompute, loss_fn,
                                               reduction):
  """Directly, not through Adam (which would hide a wrong overall scale)."""
  model = _regularized()
  x, y = _data(BATCH)
  pipe = PipelinedModel.from_model(model, num_stages=3, micro_batches=4,
                                   schedule=name, recompute=recompute)
  loss, y_pred, grads = pipe.compute_loss_and_gradients(
      x, y, loss_fn, loss_reduction=reduction)
  with tf.GradientTape() as tape:
    want_pred = model(x, training=True)
    want_loss = loss_fn(y, want_pred) + tf.add_n(model.losses)
  np.testing.assert_allclose(y_pred, want_pred, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  key = lambda v: "/".join(v.path.split("/")[-2:])  # layer/weight
  want = dict(zip([key(v) for v in model.trainable_variables],
                  tape.gradient(want_loss, model.trainable_variables)))
  assert [key(v) for v in pipe.trainable_variables] == list(want)
  for v, g in zip(pipe.trainable_variables, grads):
    np.testing.assert_allclose(g, want[key(v)], rtol=1e-5, atol=1e-7,
                               err_msg=v.path)


@pytest.mark.parametrize("name,recompute,weighted", [
    ("gpipe", False, False), ("1f1b", True, True)])
def test_fit_matches_unsplit_fit(name, recompute, weighted):
  model = _mlp()
  x, y = _data()
  weights = (np.random.RandomState(2).uniform(0.2, 2.0, len(x))
             .astype("float32") if weighted else None)
  pipe = PipelinedModel.from_model(model, num_stages=2, micro_batches=4,
                                   schedule=name, recompute=recompute)
  pipe.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  model.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  got = pipe.fit(x, y, sample_weight=weights, batch_size=BATCH,
                 shuffle=False, verbose=0)
  want = model.fit(x, y, sample_weight=weights, batch_size=BATCH,
                   shuffle=False, verbose=0)
  assert pipe.optimizer.iterations.numpy() == STEPS
  np.testing.assert_allclose(got.history["loss"], want.history["loss"],
                             rtol=1e-5)
  _assert_same_weights(pipe.to_unsplit(), model)


def _masked_sequence_model(seed=0):
  """Its output carries the Embedding's mask: Keras' loss skips padding."""
  keras.utils.set_random_seed(seed)
  L = keras.layers
  ids = keras.Input((5,), dtype="int32", name="ids")
  h = L.Embedding(9, 4, mask_zero=True, name="emb")(ids)
  h = L.GRU(4, return_sequences=True, name="rnn")(h)
  return keras.Model(ids, L.Dense(3, name="logits")(h), name="masked")


def _masked_sequence_data(n=STEPS * BATCH):
  rng = np.random.RandomState(3)
  ids = rng.randint(1, 9, size=(n, 5)).astype("int32")
  for row, length in enumerate(rng.randint(1, 6, size=n)):
    ids[row, length:] = 0
  return ids, rng.randint(0, 3, size=(n, 5)).astype("int64")


def test_gpipe_fit_and_evaluate_keep_the_output_mask():
  model = _masked_sequence_model()
  x, y = _masked_sequence_data()
  pipe = PipelinedModel.from_model(model, num_stages=2, micro_batches=2,
                                   split_points=["rnn"])
  for m in (pipe, model):
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
  got = pipe.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  want = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  np.testing.assert_allclose(got.history["loss"], want.history["loss"],
                             rtol=1e-5)
  _assert_same_weights(pipe.to_unsplit(), model)
  # 13 rows: the padded, ragged path of `call` keeps the mask too.
  np.testing.assert_allclose(pipe.evaluate(x[:13], y[:13], verbose=0),
                             model.evaluate(x[:13], y[:13], verbose=0),
                             rtol=1e-5)


def test_1f1b_mean_loss_of_a_masked_output_is_refused():
  pipe = PipelinedModel.from_model(_masked_sequence_model(), num_stages=2,
                                   micro_batches=4, schedule="1f1b")
  pipe.compile(optimizer="sgd", loss=_loss())
  x, y = _masked_sequence_data(BATCH)
  with pytest.raises(ValueError, match=r"schedule='1f1b' averages the "
                     r"per-micro-batch losses.*carries a Keras mask.*Use "
                     r"schedule='gpipe'"):
    pipe.fit(x, y, batch_size=BATCH, verbose=0)


def _trainer_fit(model, x, y):
  """One epoch of tfmgpu's Trainer (Adam), unshuffled: its `TrainResult`."""
  trainer = loop.Trainer(model, strategy=strategies.get_strategy("default"),
                         optimizer="adam", learning_rate=LR, verbose=0)
  return trainer.fit(x, y, epochs=1, global_batch_size=BATCH, shuffle=False)


@pytest.fixture(scope="module")
def unsplit_trainer():
  """`(TrainResult, model)` of the Trainer on the unsplit `_mlp`, once."""
  model = _mlp()
  return _trainer_fit(model, *_data()), model


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_trainer_matches_unsplit_trainer(name, unsplit_trainer):
  """The Trainer's loss divides by the global batch: micro-batch losses add."""
  want, model = unsplit_trainer
  pipe = PipelinedModel.from_model(_mlp(), num_stages=2, micro_batches=4,
                                   schedule=name)
  got = _trainer_fit(pipe, *_data())
  assert got.steps == want.steps == STEPS
  np.testing.assert_allclose(got.history["loss"], want.history["loss"],
                             rtol=1e-5)
  _assert_same_weights(pipe.to_unsplit(), model)


def test_predict_streams_micro_batches_and_pads_a_ragged_batch():
  model = _mlp()
  x, y = _data()
  pipe = PipelinedModel.from_model(model, num_stages=3, micro_batches=4)
  x13 = x[:13]  # Batches of 8 and 5: the 5 is padded to 8, then trimmed.
  np.testing.assert_allclose(pipe.predict(x13, batch_size=8, verbose=0),
                             model.predict(x13, batch_size=8, verbose=0),
                             rtol=1e-5, atol=1e-6)
  got = pipe(tf.constant(x[:3]))  # Fewer rows than micro-batches.
  assert got.shape == (3, 3)
  np.testing.assert_allclose(got, model(x[:3]), rtol=1e-5, atol=1e-6)
  pipe.compile(loss=_loss())
  model.compile(loss=_loss())
  np.testing.assert_allclose(pipe.evaluate(x, y, batch_size=12, verbose=0),
                             model.evaluate(x, y, batch_size=12, verbose=0),
                             rtol=1e-5)


# -------------------------------------------------------- traced graph

_TASK_OP = re.compile(
    r"^(gradient_tape/)?stage_(\d+)_(mb|backward_mb|recompute_mb)_(\d+)/")
_STAGE_OP = re.compile(r"^(?:gradient_tape/)?stage_(\d+)_")


def _task_of(name):
  m = _TASK_OP.match(name)
  if not m:
    return None
  forward = m.group(1) is None and m.group(3) == "mb"
  return schedule.Task(int(m.group(2)), int(m.group(4)),
                       schedule.FORWARD if forward else schedule.BACKWARD)


def _custom_step(pipe, rows=BATCH):
  optimizer = pipe.optimizer

  def step(xb, yb):
    loss, _, grads = pipe.compute_loss_and_gradients(xb, yb, _loss(),
                                                     loss_reduction="mean")
    optimizer.apply_gradients(zip(grads, pipe.trainable_variables))
    return loss

  return tf.function(step).get_concrete_function(
      tf.TensorSpec((rows, 12)), tf.TensorSpec((rows,), tf.int64))


def _fit_step(pipe, rows=BATCH):
  fn = tf.function(lambda xb, yb: pipe.train_step((xb, yb)))
  return fn.get_concrete_function(tf.TensorSpec((rows, 12)),
                                  tf.TensorSpec((rows,), tf.int64))


def _pipe(cpu_devices, name="gpipe", recompute=False, micro_batches=4,
          model=None):
  pipe = PipelinedModel.from_model(model or _mlp(), num_stages=3,
                                   devices=cpu_devices[1:],
                                   micro_batches=micro_batches, schedule=name,
                                   recompute=recompute)
  pipe.compile(optimizer=keras.optimizers.Adam(LR), loss=_loss())
  return pipe


@pytest.mark.parametrize("name,recompute,make_step", [
    ("gpipe", False, _custom_step), ("gpipe", True, _fit_step),
    ("1f1b", False, _fit_step), ("1f1b", True, _custom_step)])
def test_every_stage_op_and_update_runs_on_its_device(cpu_devices, name,
                                                      recompute, make_step):
  pipe = _pipe(cpu_devices, name, recompute, model=_regularized())
  placements = inspection.op_placements(make_step(pipe))
  compute = collections.defaultdict(set)
  bad = []
  for p in placements:
    m = _STAGE_OP.match(p.name)
    if not m:
      continue
    k = int(m.group(1))
    if p.device != pipe.stage_devices[k] and not (
        p.device == "" and p.type in RESOURCE_OPS):
      bad.append((p.name, p.type, p.device))
    task = _task_of(p.name)
    if task is not None and p.type == "MatMul":
      compute[task].add(p.name)
  assert bad == []
  # Every (stage, micro-batch, direction) has its own compute ops.
  assert set(compute) == {schedule.Task(k, m, kind) for k in range(3)
                          for m in range(4)
                          for kind in (schedule.FORWARD, schedule.BACKWARD)}
  squares = collections.Counter(p.device for p in placements
                                if p.name.startswith(pipe.optimizer.name + "/")
                                and p.type == "Square")
  assert squares == collections.Counter({
      d: len(s.trainable_variables)
      for s, d in zip(pipe.stages, pipe.stage_devices)})


def _upstream_tasks(ops, task_of_op, task):
  """Tasks (other than `task`) with an op that `ops` depend on."""
  seen, stack, found = set(), list(ops), set()
  while stack:
    op = stack.pop()
    for parent in list(op.inputs) + list(op.control_inputs):
      parent = getattr(parent, "op", parent)
      if parent.name in seen:
        continue
      seen.add(parent.name)
      other = task_of_op.get(parent.name)
      if other is not None and other != task:
        found.add(other)
      stack.append(parent)
  return found


def _graph_order(concrete_function):
  """{task: tasks that must finish before it starts}, from the graph's edges;
  and the recomputed forward ops of each task."""
  ops_of = collections.defaultdict(list)
  for op in concrete_function.graph.get_operations():
    task = _task_of(op.name)
    if task is not None:
      ops_of[task].append(op)
  task_of_op = {op.name: t for t, ops in ops_of.items() for op in ops}
  before = {t: _upstream_tasks(ops, task_of_op, t) for t, ops in ops_of.items()}
  recomputed = {t: [op for op in ops if "_recompute_mb_" in op.name]
                for t, ops in ops_of.items()}
  return before, {t: (ops, task_of_op) for t, ops in recomputed.items() if ops}


def _schedule_order(num_stages, micro_batches, name):
  """The same relation from the schedule: stage order plus data dependencies."""
  orders = schedule.stage_orders(num_stages, micro_batches, name)
  direct = collections.defaultdict(set)
  for order in orders:
    for a, b in zip(order, order[1:]):
      direct[b].add(a)
  for order in orders:
    for t in order:
      direct[t].update(schedule.dependencies(t, num_stages, micro_batches,
                                             name))
  before = {}
  for order in orders:
    for t in order:
      seen, stack = set(), list(direct[t])
      while stack:
        d = stack.pop()
        if d not in seen:
          seen.add(d)
          stack.extend(direct[d])
      before[t] = seen
  return before


@pytest.mark.parametrize("name,recompute", [("gpipe", False),
                                            ("1f1b", False), ("1f1b", True)])
def test_graph_orders_tasks_exactly_as_the_schedule(cpu_devices, name,
                                                    recompute):
  """No hidden serialisation: F(k, m) and F(k+1, m-1) are independent in the
  dataflow (so the executor can overlap them), and 1F1B's per-stage order
  is enforced."""
  pipe = _pipe(cpu_devices, name, recompute)
  got, recomputed = _graph_order(_custom_step(pipe))
  assert got == _schedule_order(3, 4, name)
  F = lambda k, m: schedule.Task(k, m, schedule.FORWARD)
  B = lambda k, m: schedule.Task(k, m, schedule.BACKWARD)
  # A recomputed forward waits for its upstream gradient: the executor cannot
  # run it early, in the forward phase, and keep its activations after all.
  assert len(recomputed) == (12 if recompute else 0)
  for task, (ops, task_of_op) in recomputed.items():
    if task.stage < 2:
      assert all(B(task.stage + 1, task.micro_batch) in
                 _upstream_tasks([op], task_of_op, task) for op in ops)
  for k, m in ((0, 1), (0, 2), (1, 1)):
    assert F(k, m) not in got[F(k + 1, m - 1)]
    assert F(k + 1, m - 1) not in got[F(k, m)]
  if name == "1f1b":
    # Stage k forwards micro-batch m + K - k only after micro-batch m's
    # backward there: at most K - k micro-batches of activations held.
    for k in range(3):
      for m in range(4 - (3 - k)):
        assert B(k, m) in got[F(k, m + 3 - k)]
  else:
    assert not any(t.kind == schedule.BACKWARD for t in got[F(0, 3)])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_recompute_keeps_only_each_stage_input(cpu_devices, name):
  kept = {}
  for recompute in (False, True):
    pipe = _pipe(cpu_devices, name, recompute)
    kept[recompute] = bench_pipeline.saved_activation_bytes(_custom_step(pipe))
  plan = pipe.plan
  for k, stage in enumerate(plan.stages):
    inputs = BATCH * stage.input_bytes
    if name == "gpipe" or k < 2:
      # Recomputation: the stage input of each micro-batch, nothing else.
      assert kept[True][k] == inputs
    else:
      # 1F1B's last stage also keeps each micro-batch's labels for its loss.
      assert kept[True][k] == inputs + BATCH * 8
    # Without it, every ReLU output too: the plan's activation estimate.
    if k < 2:
      assert kept[False][k] == BATCH * (stage.input_bytes +
                                        stage.activation_bytes)
    assert kept[False][k] > 2 * kept[True][k]


# ------------------------------------------------------------- the API


def test_registered_exported_and_places_itself():
  entry = strategies.lookup("pipeline")
  assert entry.kind is strategies.Kind.PLACEMENT
  assert "micro-batch" in entry.description
  assert strategies.get_strategy("pipeline") is tf.distribute.get_strategy()
  assert tfmgpu.parallel.PipelinedModel is PipelinedModel
  assert tfmgpu.parallel.simulate is timeline_lib.simulate
  for cls in (PipelinedModel, staged.StagedModel, branches.BranchParallel):
    assert cls.places_itself is True


def test_stage_times_feed_the_simulator():
  pipe = PipelinedModel.from_model(_mlp(), num_stages=2, micro_batches=4)
  x, y = _data(BATCH)
  fwd, bwd = bench_pipeline.measure_stage_times(pipe, x, y, _loss(),
                                                repeats=2, warmup=1)
  assert len(fwd) == len(bwd) == 2
  assert all(t > 0 for t in fwd) and all(t >= 0 for t in bwd)
  timeline = timeline_lib.simulate(fwd, bwd, pipe.micro_batches)
  assert timeline.step_time >= max(4 * (f + b) for f, b in zip(fwd, bwd))


# ------------------------------------------------------------------ errors


def test_a_batch_of_fewer_rows_than_micro_batches_is_refused():
  pipe = PipelinedModel.from_model(_mlp(), num_stages=2, micro_batches=4)
  x, y = _data()
  with pytest.raises(ValueError, match=r"batch of 3 examples has fewer rows "
                     r"than micro_batches=4, so some micro-batches would be "
                     r"empty"):
    pipe.compute_loss_and_gradients(x[:3], y[:3], _loss())


def _assert_unsplit_step(model, x, y, got, variables):
  """`got` (loss, predictions, summed gradients of `variables`) equals the
  unsplit `model`'s on the whole batch, its regularisers included."""
  loss, y_pred, grads = got
  with tf.GradientTape() as tape:
    want_pred = model(x, training=True)
    want_loss = _loss()(y, want_pred) + tf.add_n(model.losses)
  np.testing.assert_allclose(y_pred, want_pred, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  want = tape.gradient(want_loss, model.trainable_variables)
  for v, g, w in zip(variables, grads, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=v.path)


@pytest.mark.parametrize("name,signature", [("gpipe", False),
                                            ("1f1b", False), ("1f1b", True)])
def test_a_batch_the_micro_batches_do_not_divide_gives_unsplit_gradients(
    name, signature):
  """10 rows in micro-batches of 3, 3, 2, 2; activity regularisers and
  1F1B's mean loss weighted by their rows; the size static, or known only
  when the step runs (a dataset's short last batch)."""
  model = _regularized()
  x, y = _data(10)
  pipe = PipelinedModel.from_model(model, num_stages=2, micro_batches=4,
                                   schedule=name)
  grads_fn = lambda xb, yb: pipe.compute_loss_and_gradients(
      xb, yb, _loss(), loss_reduction="mean")
  if signature:
    grads_fn = tf.function(grads_fn, input_signature=[
        tf.TensorSpec([None, 12], tf.float32), tf.TensorSpec([None], tf.int64)])
  loss, y_pred, grads = grads_fn(x, y)
  _assert_unsplit_step(model, x, y, (loss, y_pred, grads),
                       pipe.trainable_variables)


@pytest.mark.parametrize("signature", [False, True])
def test_data_copies_split_a_short_batch_into_unsplit_gradients(
    cpu_devices, signature):
  """11 rows over 2 data copies (6 and 5, each in 2 micro-batches): each
  copy's mean and activity regularisers weighted by its rows; the size
  static, or known only when the step runs. They used to refuse it."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  model = _regularized()
  x, y = _data(11)
  placed = hybrid.build_layout(
      model, hybrid.Layout(data=2, stages=2, micro_batches=2,
                           schedule="1f1b"), devices=cpu_devices[:4])

  def grads_fn(xb, yb):
    loss, y_pred, grads = placed.compute_loss_and_gradients(
        xb, yb, _loss(), loss_reduction="mean")
    return loss, y_pred, placed.reduce_gradients(grads)
  if signature:
    grads_fn = tf.function(grads_fn, input_signature=[
        tf.TensorSpec([None, 12], tf.float32), tf.TensorSpec([None], tf.int64)])
  loss, y_pred, grads = grads_fn(x, y)
  _assert_unsplit_step(model, x, y, (loss, y_pred, grads),
                       placed.trainable_variables)
  with pytest.raises(ValueError, match=r"batch of 1 examples has fewer rows "
                     r"than data_parallel=2 copies"):
    placed.compute_loss_and_gradients(x[:1], y[:1], _loss())


def test_fit_with_a_ragged_last_batch_matches_unsplit_fit():
  """Keras' fit trains a short last batch; so does the pipeline's (it used
  to stop there)."""
  model = _mlp()
  pipe = PipelinedModel.from_model(model, num_stages=2, micro_batches=2,
                                   schedule="1f1b")
  x, y = _data(19)  # Batches of 8, 8 and 3 (in micro-batches of 2 and 1).
  for m in (pipe, model):
    m.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
  got = pipe.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  want = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  assert pipe.optimizer.iterations.numpy() == 3
  np.testing.assert_allclose(got.history["loss"], want.history["loss"],
                             rtol=1e-5)
  _assert_same_weights(pipe.to_unsplit(), model)


@pytest.mark.parametrize("kwargs,message", [
    (dict(micro_batches=0), r"micro_batches=0 must be an int >= 1"),
    (dict(micro_batches="4"), r"micro_batches='4' must be an int >= 1"),
    (dict(micro_batches=True), r"micro_batches=True must be an int >= 1"),
    (dict(schedule="interleaved"),
     r"schedule='interleaved' is unknown. Choose one of 'gpipe', '1f1b'"),
    (dict(recompute="yes"), r"recompute='yes' must be True or False"),
])
def test_bad_options_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    PipelinedModel.from_model(_mlp(), num_stages=2, **kwargs)


def test_unknown_loss_reduction_and_irreducible_1f1b_loss_are_rejected():
  pipe = PipelinedModel.from_model(_mlp(), num_stages=2, micro_batches=2,
                                   schedule="1f1b")
  x, y = _data(BATCH)
  with pytest.raises(ValueError, match=r"loss_reduction='avg' is unknown"):
    pipe.compute_loss_and_gradients(x, y, _loss(), loss_reduction="avg")
  irreducible = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="mean_with_sample_weight")
  pipe.compile(optimizer="adam", loss=irreducible)
  with pytest.raises(ValueError, match=r"reduction='mean_with_sample_weight'"
                     r".*schedule='gpipe'"):
    pipe.fit(x, y, batch_size=BATCH, verbose=0)


# ------------------------------------------------------ interleaved 1F1B

def _train_sgd(model, step_fn, x, y):
  optimizer = keras.optimizers.SGD(0.1)
  variables = model.trainable_variables
  optimizer.build(variables)

  @tf.function
  def step(xb, yb):
    loss, grads = step_fn(xb, yb)
    optimizer.apply_gradients(zip(grads, variables))
    return loss

  return [float(step(x[i:i + BATCH], y[i:i + BATCH]))
          for i in range(0, len(x), BATCH)]


def test_interleaved_1f1b_equals_unsplit_training_on_its_devices(
    cpu_devices):
  """2 devices x 2 virtual stages: 4 stages, stage k on device k % 2, each
  device running its two stages' tasks in Megatron's order; SGD to 1e-5 of
  the unsplit model, every stage op on its device (read from the graph)."""
  x, y = _data()
  unsplit, loss_obj = _mlp(), _loss()

  def unsplit_step(xb, yb):
    with tf.GradientTape() as tape:
      loss = loss_obj(yb, unsplit(xb, training=True))
    return loss, tape.gradient(loss, unsplit.trainable_variables)

  want = _train_sgd(unsplit, unsplit_step, x, y)
  pipe = PipelinedModel.from_model(_mlp(), num_stages=2, virtual_stages=2,
                                   devices=cpu_devices[:2], micro_batches=4,
                                   schedule="1f1b")
  assert list(pipe.stage_devices) == [cpu_devices[k % 2] for k in range(4)]

  def pipe_step(xb, yb):
    loss, _, grads = pipe.compute_loss_and_gradients(
        xb, yb, loss_obj, loss_reduction="mean")
    return loss, grads

  got = _train_sgd(pipe, pipe_step, x, y)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  _assert_same_weights(pipe.to_unsplit(), unsplit)
  graph = tf.function(pipe_step).get_concrete_function(
      tf.TensorSpec((BATCH, 12)), tf.TensorSpec((BATCH,), tf.int64))
  bad = [(p.name, p.device) for p in inspection.op_placements(graph)
         if (m := _STAGE_OP.match(p.name))
         and p.device != cpu_devices[int(m.group(1)) % 2]
         and not (p.device == "" and p.type in RESOURCE_OPS)]
  assert bad == []


def test_interleaving_needs_1f1b_and_a_repeating_plan(cpu_devices):
  with pytest.raises(ValueError, match=r"schedule='gpipe' cannot"):
    PipelinedModel.from_model(_mlp(), num_stages=2, virtual_stages=2,
                              devices=cpu_devices[:2], micro_batches=4)
  plan = partition.plan_stages(_mlp(), 4, devices=cpu_devices[:4])
  with pytest.raises(ValueError, match=r"virtual_stages=2 needs a plan whose "
                     r"stages repeat its first devices"):
    PipelinedModel(_mlp(), plan, virtual_stages=2, schedule="1f1b")


def test_only_batch_norms_that_train_are_said_to_differ(caplog, cpu_devices):
  """A frozen BatchNormalization normalises by its moving statistics, the
  same for any micro-batch: transfer learning's frozen base was warned
  about although it trained as unsplit (1e-9)."""
  x = keras.Input((6,))
  h = keras.layers.BatchNormalization(name="base_norm")(
      keras.layers.Dense(6, name="base")(x))
  model = keras.Model(x, keras.layers.Dense(2, name="head")(
      keras.layers.Dense(6, name="mid")(h)))
  said = []
  for frozen in (True, False):
    model.get_layer("base_norm").trainable = not frozen
    caplog.clear()
    pipeline.PipelinedModel.from_model(model, num_stages=2, micro_batches=2)
    said.append("normalise each of the 2 micro-batches with its own "
                "statistics (of its rows alone)" in caplog.text)
  assert said == [False, True]


def test_random_draws_per_micro_batch_are_said(caplog, cpu_devices):
  """A trial's augmentation (RandomFlip, RandomRotation) trained 0.011 off
  one device on a pipeline of 2 micro-batches, unsaid; a Dropout of rate
  0 draws nothing and is not named, and neither is anything at M=1."""
  L = keras.layers
  x = keras.Input((4, 4, 1))
  h = L.RandomRotation(0.1, name="rotate")(L.RandomFlip(name="flip")(x))
  h = L.Dropout(0.0, name="no_drop")(L.Flatten(name="flat")(h))
  model = keras.Model(x, L.Dense(2, name="head")(L.Dense(4, name="mid")(h)),
                      name="augmented")
  said = []
  for m in (1, 2):
    caplog.clear()
    pipeline.PipelinedModel.from_model(model, num_stages=2, micro_batches=m)
    said.append([r.getMessage() for r in caplog.records
                 if "drawing random numbers" in r.getMessage()])
  assert said[0] == []
  assert len(said[1]) == 1 and ("(flip, rotate) draw them for each of the "
                                "2 micro-batches") in said[1][0], said


def test_batch_norms_recorded_with_training_false_are_said_too(caplog,
                                                              cpu_devices):
  """keras.io's fine-tuning pattern, `base(x, training=False)`, and a
  BatchNormalization called so: Keras 3.15's `model(x, training=True)`
  (what `fit` passes) overrides the recorded `False`, so they normalise by
  the batch's statistics and the warning is right for them (the review
  thought not); a frozen one is left out."""
  L = keras.layers
  inner = keras.Input((6,))
  base = keras.Model(inner, L.BatchNormalization(name="inner_norm")(
      L.Dense(6, name="base_dense")(inner)), name="base")
  x = keras.Input((6,))
  h = L.BatchNormalization(name="called_norm")(base(x, training=False),
                                               training=False)
  h = L.BatchNormalization(name="frozen")(L.Dense(6, name="mid")(h))
  h = L.BatchNormalization(name="synced", synchronized=True)(h)
  model = keras.Model(x, L.Dense(2, name="head")(h), name="finetuned")
  model.get_layer("frozen").trainable = False
  rows = np.random.default_rng(0).normal(5.0, 2.0, (8, 6)).astype("float32")
  alone = keras.Model(x, model.get_layer("called_norm").output)  # Keras':
  assert np.abs(np.asarray(alone(rows, training=True))
                - np.asarray(alone(rows, training=False))).max() > 0.1
  assert checks.training_norms(model) == ["inner_norm", "called_norm",
                                          "synced"]
  assert checks.training_norms(model, synchronized=False) == [
      "inner_norm", "called_norm"]
  assert checks.training_norms([model], synchronized=True) == ["synced"]
  pipeline.PipelinedModel.from_model(model, num_stages=2, micro_batches=2)
  assert ("BatchNormalization layers (inner_norm, called_norm, synced) "
          "normalise each of the 2 micro-batches") in caplog.text


def test_an_unregistered_layer_of_the_users_rebuilds_unsplit():
  """A trial: `to_unsplit()` of a model holding a layer class the user had
  not registered (one that calls `add_loss`) failed in Keras' "Could not
  locate class"; the split itself took it. A class of the user's named as
  Keras' `Dense` stays the user's, and Keras' stays Keras' (the review:
  classes kept by name rebuilt one as the other, 0.25 off)."""

  class Penalty(keras.layers.Layer):
    def call(self, x):
      self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
      return x

  class Dense(keras.layers.Dense):  # pylint: disable=redefined-outer-name
    def call(self, x):
      return 2.0 * super().call(x)

  keras.utils.set_random_seed(0)
  x = keras.Input((12,))
  h = Penalty(name="penalty")(keras.layers.Dense(8, name="a")(x))
  h = Dense(8, name="doubled")(h)
  model = keras.Model(x, keras.layers.Dense(3, name="b")(h), name="users")
  pipe = PipelinedModel.from_model(model, num_stages=2, micro_batches=2)
  rows = _data(4)[0]
  unsplit = pipe.to_unsplit()
  assert type(unsplit.get_layer("penalty")) is Penalty
  assert type(unsplit.get_layer("doubled")) is Dense
  assert type(unsplit.get_layer("b")) is keras.layers.Dense
  np.testing.assert_allclose(unsplit.predict(rows, verbose=0),
                             model.predict(rows, verbose=0), atol=1e-6)


class _RunningCount(keras.layers.Layer):
  """A user's BatchNorm-like layer: state it assigns in call."""

  def build(self, input_shape):
    self.count = self.add_weight(shape=(), initializer="zeros",
                                 trainable=False)

  def call(self, x, training=False):
    if training:
      self.count.assign_add(1.0)
    return x


def test_a_users_layer_with_state_and_recomputed_dropout_are_named(caplog):
  """Its update ran once per micro-batch (count 4 for 2 steps, 8 with
  recompute) and recomputed dropout drew other masks, without a word."""
  x = keras.Input((6,))
  h = _RunningCount(name="counter")(keras.layers.Dense(6, name="a")(x))
  h = keras.layers.Dropout(0.3, name="drop")(keras.layers.Dense(6, name="b")(h))
  model = keras.Model(x, keras.layers.Dense(2, name="out")(h))
  pipeline.PipelinedModel.from_model(model, num_stages=2, micro_batches=2,
                                     recompute=True)
  assert re.search(r"layers counter hold non-trainable state.*once per "
                   r"micro-batch and again when recomputed", caplog.text)
  assert "re-runs drop and draws other random masks" in caplog.text


@keras.saving.register_keras_serializable("tests")
class _TokenAndPosition(keras.layers.Layer):
  """keras.io's text-classification embedding: positions shared by rows."""

  def __init__(self, length, vocab, width, **kwargs):
    super().__init__(**kwargs)
    self.length, self.vocab, self.width = length, vocab, width
    self.tokens = keras.layers.Embedding(vocab, width)
    self.positions = keras.layers.Embedding(length, width)

  def call(self, x):
    shared = self.positions(keras.ops.arange(0, keras.ops.shape(x)[-1]))
    return self.tokens(x) + shared

  def get_config(self):
    return {**super().get_config(), "length": self.length,
            "vocab": self.vocab, "width": self.width}


@pytest.mark.parametrize("layout", ["pipeline", "data_x_stages", "mirrored"])
def test_a_lookup_every_row_shares_trains_with_adam_as_one_device(
    cpu_devices, layout):
  """Each micro-batch's (copy's, replica's) rows of `positions(arange(T))`
  were concatenated: Keras' Adam squared each before adding them, so the
  table moved 7.5e-4 off one device in 2 steps at 4 micro-batches (the
  Trainer on mirrored x2: 1.4e-3; Keras' own mirrored `fit` still does)."""
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  from tfmgpu.training import loop  # pylint: disable=g-import-not-at-top

  def build():
    keras.utils.set_random_seed(0)
    ids = keras.Input((8,), dtype="int32")
    h = _TokenAndPosition(8, 50, 4, name="embed")(ids)
    h = keras.layers.Dense(4, activation="tanh", name="mid")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(ids, keras.layers.Dense(2, name="out")(h))

  rng = np.random.default_rng(0)
  x = rng.integers(0, 50, (32, 8)).astype("int32")
  y = (x[:, 0] > 25).astype("int32")
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  reference = build()
  reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
  reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  if layout == "mirrored":
    strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
    with strategy.scope():
      model = build()
    loop.Trainer(model, strategy=strategy, verbose=0, loss=loss,
                 optimizer=keras.optimizers.Adam(1e-2)).fit(
                     x, y, epochs=1, global_batch_size=16, shuffle=False)
    for got, want in zip(model.get_weights(), reference.get_weights()):
      np.testing.assert_allclose(got, want, atol=2e-6)
    return
  model = build()
  plan = partition.plan_stages(model, 2, split_points=["mid"])
  if layout == "pipeline":
    placed = pipeline.PipelinedModel(model, plan, micro_batches=4)
  else:
    placed = hybrid.build_layout(model, hybrid.Layout(data=2, stages=2),
                                 devices=cpu_devices[:4])
  placed.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
  placed.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  unsplit = placed.to_unsplit() if layout == "pipeline" else build()
  if layout != "pipeline":
    placed.copy_weights_to(unsplit)
  for got, want in zip(unsplit.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, atol=2e-6)


@keras.saving.register_keras_serializable("tests")
class _OneTable(keras.layers.Layer):
  """One table for tokens and for positions."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.table = keras.layers.Embedding(32, 4)

  def call(self, x):
    return self.table(x) + self.table(
        keras.ops.arange(0, keras.ops.shape(x)[-1]))


def test_one_table_for_tokens_and_positions_is_said_to_differ(caplog):
  """A trial: such a table trained 3.3e-3 off one device on 2 replicas
  with Adam (its position rows joined per replica among the token rows),
  unsaid. Said once; separate tables (keras.io's) train exactly and are
  not named."""
  from tfmgpu.training import loop  # pylint: disable=g-import-not-at-top
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  x = np.random.default_rng(0).integers(0, 32, (32, 8)).astype("int32")
  for layer in (_OneTable, lambda name: _TokenAndPosition(8, 32, 4,
                                                          name=name)):
    with strategy.scope():
      ids = keras.Input((8,), dtype="int32")
      h = keras.layers.GlobalAveragePooling1D()(layer(name="embed")(ids))
      model = keras.Model(ids, keras.layers.Dense(2)(h))
    caplog.clear()
    with caplog.at_level("WARNING"):
      loop.Trainer(model, strategy=strategy, verbose=0).fit(
          x, x[:, 0] % 2, global_batch_size=16)
    said = [r.getMessage() for r in caplog.records
            if "looked up both by the data" in r.getMessage()]
    assert said == ([] if layer is not _OneTable else [
        "A table of shape (32, 4) is looked up both by the data and by "
        "indices every row shares (positions: arange(length)); over "
        "replicas its shared rows are joined, not summed, so an optimizer "
        "that squares gradient rows (Adam) trains it otherwise than one "
        "device. Use separate tables for tokens and positions (as "
        "keras.io's TokenAndPositionEmbedding), or SGD."]), said


class RouterLoss(keras.layers.Layer):
  """Adds a loss (a router's load balancing) in call()."""

  def call(self, x):
    self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
    return x


@keras.saving.register_keras_serializable("tests")
class _MoeLike(keras.layers.Layer):
  """As keras_hub's MoE decoder: its sublayer, named by Keras, adds the
  load-balancing loss."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.router = RouterLoss()  # Named by Keras: router_loss, _1, ...

  def call(self, x):
    return self.router(x)


def test_losses_added_in_call_are_said_by_the_users_layer_names(caplog,
                                                                cpu_devices):
  """The warning named the stage model (which bore the name of its last
  layer: 'moe', 'out') and the copies' sublayers, named by Keras anew
  (Mixtral: 'mixtral_sparse_moe_block_2' for the user's
  'mixtral_sparse_moe_block'); and it said nothing of a second model whose
  stages bore the same names."""
  def build():
    x = keras.Input((6,))
    h = keras.layers.Dense(6, name="reg", activity_regularizer="l2")(x)
    h = keras.layers.Dense(6, name="mid")(_MoeLike(name="moe")(h))
    return keras.Model(x, keras.layers.Dense(2, name="out")(h), name="user")

  x = np.ones((8, 6), np.float32)
  for _ in range(2):
    caplog.clear()
    model = PipelinedModel.from_model(
        build(), num_stages=2, micro_batches=2, devices=cpu_devices[:2],
        split_points=["mid"])
    assert [s.name for s in model.stages] == ["user_stage_0", "user_stage_1"]
    model.compute_loss_and_gradients(  # Eager: one step's forward.
        x, np.zeros((8, 2), np.float32),
        lambda y, y_pred: tf.reduce_mean(tf.square(y_pred - y)))
    assert "Pipeline stage 0: losses added in call() by layers moe are " \
           "computed per micro-batch and averaged over the 2" in caplog.text
    assert "Pipeline stage 1" not in caplog.text  # It adds none.
  # Activity regularisers alone are per example, weighted by rows: exact,
  # and not warned of (a trial took the warning for a false alarm).
  caplog.clear()
  x_in = keras.Input((6,))
  h = keras.layers.Dense(6, name="reg", activity_regularizer="l2")(x_in)
  h = keras.layers.Dense(6, name="mid")(h)
  PipelinedModel.from_model(
      keras.Model(x_in, keras.layers.Dense(2, name="out")(h), name="act"),
      num_stages=2, micro_batches=2, devices=cpu_devices[:2],
      split_points=["mid"]).compute_loss_and_gradients(
          x, np.zeros((8, 2), np.float32),
          lambda y, y_pred: tf.reduce_mean(tf.square(y_pred - y)))
  assert "losses added in call()" not in caplog.text
