"""The cost model: FLOPs, parameter and activation bytes per block."""

import keras

from tfmgpu.models import demo
from tfmgpu.parallel import cost
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import partition

plan_stages = partition.plan_stages


def test_costs_count_dense_and_conv_flops_params_and_activations():
  L = keras.layers
  inputs = keras.Input((6, 6, 2))
  x = L.Conv2D(4, 3, padding="valid", activation="relu", name="conv")(inputs)
  x = L.Flatten(name="flat")(x)
  outputs = L.Dense(5, name="dense")(x)
  blocks = cost.model_blocks(keras.Model(inputs, outputs))
  conv, flat, dense = blocks
  # Conv: 4x4 outputs x 4 filters x (3*3*2 MACs x 2) + bias + ReLU.
  assert conv.flops == 16 * 4 * 3 * 3 * 2 * 2 + 64 + 64
  assert conv.param_bytes == (3 * 3 * 2 * 4 + 4) * 4
  assert conv.output_bytes == 4 * 4 * 4 * 4 and conv.output_shape == (
      None, 4, 4, 4)
  assert flat.flops == 0 and flat.param_bytes == 0
  assert dense.flops == 2 * 64 * 5 + 5
  assert dense.param_bytes == (64 * 5 + 5) * 4


def test_residual_blocks_are_cut_between_blocks_where_one_tensor_crosses():
  model = demo.small_resnet((8, 8, 3), 4, blocks=3, filters=4)
  graph = graph_lib.ModelGraph(model)
  blocks = cost.model_blocks(graph)
  assert [b.layers[0] for b in blocks] == graph.names  # One block per layer.
  # A cut inside a residual block sends the skip tensor too, and costs it.
  inside, between = graph.position("block1_conv2"), graph.position(
      "block1_conv1")
  assert [graph.name_of(t) for t in graph.crossing(inside)] == [
      "block0_out", "block1_relu1"]
  crossing = cost.cut_bytes(graph)
  assert crossing[between] == 8 * 8 * 4 * 4
  assert crossing[inside] == 2 * crossing[between]
  costs = cost.block_costs(blocks, cost.Criterion.FLOPS)
  cuts = cost.cut_costs(blocks, costs, crossing)
  assert cuts[inside - 1] == 2 * cuts[between - 1] > 0
  assert cost.cut_costs(blocks, costs, crossing, 0.0) == [0.0] * len(cuts)
  # Expensive transfers keep the cuts between residual blocks, where one
  # tensor crosses; free ones cut inside a block for a better balance.
  single = {graph.names[p] for p in range(1, len(graph.nodes))
            if len(graph.crossing(p)) == 1}
  assert "block1_conv1" in single and "block1_conv2" not in single
  assert "block1_bn1" not in single and "block2_proj" not in single
  costly = plan_stages(model, 3, criterion="flops", transfer_weight=2.0)
  free = plan_stages(model, 3, criterion="flops", transfer_weight=0.0)
  for stage in costly.stages[:-1]:
    assert len(stage.sent) == 1
  for stage in costly.stages[1:]:
    assert stage.layers[0] in single
  assert any(len(s.sent) == 2 for s in free.stages)
  assert (max(s.flops for s in free.stages) <
          max(s.flops for s in costly.stages))
  assert sum(s.sent_bytes for s in free.stages) > sum(
      s.sent_bytes for s in costly.stages)
  assert costly.layer_names == tuple(l.name for l in model.layers[1:])


def test_attention_counts_its_projections_scores_and_what_it_keeps():
  L = keras.layers
  query = keras.Input((4, 6), name="query")  # Tq = 4, dq = 6.
  value = keras.Input((5, 3), name="value")  # Tk = Tv = 5, dk = dv = 3.
  attention = L.MultiHeadAttention(2, 3, value_dim=2, name="attention")
  model = keras.Model([query, value], attention(query, value))
  (block,) = cost.model_blocks(model)
  # Projections, 2 * heads * (Tq dq kd + Tk dk kd + Tv dv vd + Tq vd dout):
  #   4 * (4*6*3 + 5*3*3 + 5*3*2 + 4*2*6) = 4 * 195 = 780.
  # Scores, softmax, weighted sum, heads * Tq * Tk * (2 kd + 5 + 2 vd):
  #   2 * 4 * 5 * 15 = 600.
  # Biases, heads * (Tq kd + Tk kd + Tv vd) + Tq dout: 2 * 37 + 24 = 98.
  assert block.flops == 780 + 600 + 98
  # Kept: the output (4 * 6 = 24), Q, K, V (2 * (12 + 15 + 10) = 74), the
  # scores and their softmax (2 * 2 * 4 * 5 = 80), the weighted sum
  # (2 * 4 * 2 = 16): 194 floats.
  assert block.activation_bytes == 194 * 4
  assert block.output_bytes == 24 * 4
  # Called by keyword, the same layer costs the same.
  by_name = L.MultiHeadAttention(2, 3, value_dim=2, name="attention")
  keyword = keras.Model([query, value], by_name(query=query, value=value))
  (same,) = cost.model_blocks(keyword)
  assert (same.flops, same.activation_bytes) == (block.flops,
                                                 block.activation_bytes)


def _token_model(length=None):
  L = keras.layers
  x = keras.Input((length,), dtype="int32", name="tokens")
  h = L.Embedding(50, 16, name="emb")(x)
  h = L.MultiHeadAttention(2, 8, name="mha")(h, h)
  h = L.Dense(32, name="up")(h)
  return keras.Model(x, L.Dense(50, name="logits")(h), name="tokens_lm")


def _costs(plan):
  return [(s.flops, s.activation_bytes, s.sent_bytes, s.input_bytes)
          for s in plan.stages]


def test_an_unknown_sequence_length_comes_from_the_data_or_the_config(
    caplog):
  """A `keras.Input((None,))` model was costed as if its length were 1."""
  want = _costs(plan_stages(_token_model(12), 2, check_devices=False,
                            devices=["/cpu:0", "/cpu:1"]))
  assert want[0][0] > 12 * 2 * 16 * 16  # Lengths count: a real workload.
  given = plan_stages(_token_model(), 2, input_shape=(12,),
                      check_devices=False, devices=["/cpu:0", "/cpu:1"])
  assert _costs(given) == want  # From the data's shape.
  configured = _token_model()
  configured.max_sequence_length = 12  # As keras_hub backbones have it.
  assert _costs(plan_stages(configured, 2, check_devices=False,
                            devices=["/cpu:0", "/cpu:1"])) == want
  graph = graph_lib.ModelGraph(configured)
  assert graph.shape(graph.outputs[0]) == (None, 12, 50)
  assert not graph.unknown()
  unknown = graph_lib.ModelGraph(_token_model())
  assert [unknown.name_of(t) for t in unknown.unknown()][:2] == ["tokens",
                                                                "emb"]
  with caplog.at_level("WARNING"):
    cost.model_blocks(unknown)
  assert "unknown length (e.g. input 'tokens' (None, None))" in caplog.text
  assert "UNKNOWN" in caplog.text and "input_shape=" in caplog.text
  # The plan's table says it too (a new user saw no log line).
  table = str(plan_stages(_token_model(), 2, check_devices=False,
                          devices=["/cpu:0", "/cpu:1"]))
  assert table.endswith(
      "UNKNOWN length (input 'tokens' (None, None)): FLOPs and bytes above "
      "count it as 1, far too few; plan again with input_shape=<one "
      "example's shape>."), table
  assert "UNKNOWN" not in str(given)


class PositionEmbedding(keras.layers.Layer):
  """A custom layer with weights the cost model counts as 1 per element."""

  def build(self, shape):
    self.table = self.add_weight(shape=tuple(shape[1:]), name="table")

  def call(self, x):
    return x + self.table


def test_recurrent_layers_count_their_gate_matmuls_at_every_step(caplog):
  """LSTM/GRU/Bidirectional were 1 FLOP per output element (~1000x low)."""
  L = keras.layers
  x = keras.Input((8, 6))  # 8 steps of 6 features.
  h = PositionEmbedding(name="positions")(x)  # Counted right: not logged.
  h = L.LSTM(5, return_sequences=True, name="lstm")(h)
  h = L.Bidirectional(L.GRU(3, return_sequences=True), name="bigru")(h)
  h = L.SimpleRNN(4, name="rnn")(h)
  h = L.RNN(L.LSTMCell(2), name="cell_rnn")(L.RepeatVector(8)(h))
  y = L.PReLU(name="prelu")(h)  # Weights, unknown: estimated, and logged.
  blocks = {b.layers[0]: b.flops for b in cost.model_blocks(
      keras.Model(x, y, name="rnns"))}
  # steps * gates * 2 * (in + units) * units; Bidirectional twice.
  assert blocks["lstm"] == 8 * 4 * 2 * (6 + 5) * 5
  assert blocks["bigru"] == 2 * 8 * 3 * 2 * (5 + 3) * 3
  assert blocks["rnn"] == 8 * 1 * 2 * (6 + 4) * 4
  assert blocks["cell_rnn"] == 8 * 4 * 2 * (4 + 2) * 2
  assert blocks["prelu"] == 2  # One per output element.
  assert "prelu (PReLU)" in caplog.text and "lstm" not in caplog.text
  assert blocks["positions"] == 8 * 6 and "positions" not in caplog.text
  assert "1 per output element" in caplog.text
  caplog.clear()
  cost.model_blocks(keras.Model(x, y, name="rnns"))
  assert "prelu" not in caplog.text  # Once.
