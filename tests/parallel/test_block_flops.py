"""FLOPs inside keras_hub's transformer blocks (`parallel.block_flops`),
against the analytic count: 2 FLOPs per matmul weight per token, plus
attention's scores and weighted sum (`4 * T^2 * heads * head size` a layer)
and its softmax.
Published shapes, built shapes-only (no weight values)."""

import math

import pytest

from tfmgpu import _compat
from tfmgpu import models
from tfmgpu.parallel import accounting
from tfmgpu.parallel import block_flops
from tfmgpu.parallel import cost
from tfmgpu.parallel import graph as graph_lib
from tfmgpu.parallel import hybrid

pytest.importorskip("keras_hub")

T = 1024


def _published(family, size):
  return graph_lib.shapes_only(lambda: models.build_model(
      family, input_shape=(T,), num_classes=None, size=size))


def _params(model):
  return sum(math.prod(v.shape) for v in model.weights)


@pytest.fixture(scope="module")
def llama3_8b():
  return _published("llama", "llama3_8b")


def test_llama3_8b_costs_2_flops_per_weight_per_token(llama3_8b):
  params = _params(llama3_8b)
  assert 8.02e9 < params < 8.04e9  # Llama 3 8B's published count.
  lookup = 128256 * 4096  # The input embedding is read, not multiplied.
  attention = 32 * 4 * T * T * 4096
  want = 2 * (params - lookup) * T + attention
  got = sum(b.flops for b in cost.model_blocks(llama3_8b))
  assert got == pytest.approx(want, rel=2e-3)
  # Before: one FLOP per output element of each block, 1e5 times too few.
  assert got / T > 1.5e10


def test_gpt2_costs_its_tied_head_once_and_attention_by_t_squared():
  model = _published("gpt2", "gpt2_base")
  params = _params(model)
  assert params == 124_439_808  # GPT-2 small's published count.
  # The position table is a lookup; the token table is the tied LM head.
  softmax = 12 * 5 * 12 * T * T  # 5 a score, 12 heads, 12 layers.
  want = 2 * (params - 1024 * 768) * T + 12 * 4 * T * T * 768 + softmax
  got = sum(b.flops for b in cost.model_blocks(model))
  assert got == pytest.approx(want, rel=1e-3)


def test_kernel_widths_follow_the_einsum(llama3_8b):
  block = llama3_8b.layers[-1].backbone.transformer_layers[0]
  named = {l.name: l for l in _compat.flatten_layers(block)}
  # "bquh,uhm->bqm": 32 heads x 128 in, 4096 out (not 128 x 4096).
  assert block_flops.kernel_widths(named["attention_output"]) == (4096, 4096)
  assert block_flops.kernel_widths(named["key"]) == (4096, 8 * 128)


def test_llama3_8b_plan_predicts_a_step_of_seconds(llama3_8b):
  """32 devices (4 stages x tensor 8): its compute is the seconds its
  FLOPs take, and its tensor all-reduces the bytes each kernel joins."""
  acc = accounting.account(llama3_8b, hybrid.Layout(
      stages=4, tensor=8, micro_batches=4), global_batch_size=64)
  step = acc.step(accounting.host_hardware("dgx_a100", hosts=4))
  ideal = 3 * 64 * sum(b.flops for b in cost.model_blocks(llama3_8b)) / (
      32 * 100e12)
  assert ideal < step.compute_s < 6 * ideal
  assert 0.1 < step.tensor_s < step.compute_s


def test_a_blocks_kept_activations_count_its_matmuls_and_scores(llama3_8b):
  """What one Llama 3 block keeps for its backward, per example: its output,
  each projection's output (q, k, v, o; gate, up, down) and the attention
  scores and their softmax (32 heads x T x T each), in float32."""
  block = next(b for b in cost.model_blocks(llama3_8b)
               if b.layers == ("transformer_layer_0",))
  matmuls = 4096 + 1024 + 1024 + 4096 + 2 * 14336 + 4096
  want = 4 * (T * 4096 + T * matmuls + 2 * 32 * T * T)
  assert block.activation_bytes == want
