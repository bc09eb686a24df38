"""Hybrid accounting (`tfmgpu.parallel.accounting`): memory and bytes per
device of a data x pipeline x tensor layout, each part derived by hand for
`gpt` tiny, and the predicted step. No training: layer shapes only."""

import re

import pytest

from tfmgpu import models
from tfmgpu.parallel import accounting
from tfmgpu.parallel import choices
from tfmgpu.parallel import hybrid
from tfmgpu.parallel import links
from tfmgpu.parallel import partition
from tfmgpu.parallel import timeline

# gpt tiny: sequence S, width D, H heads of KD, MLP width F, vocabulary V.
S, D, H, KD, F, V = 16, 32, 2, 16, 128, 256
FLOAT = 4  # float32 bytes.
ATTENTION = 3 * (D * H * KD + H * KD) + H * KD * D + D  # q, k, v, output.
UP, DOWN = D * F + F, F * D + D
# Split over T: all but the biases added after the sum (row, attention out).
SPLIT_PARAMS = (ATTENTION - D) + UP + (DOWN - D)
# Kept per example: attention keeps q, k, v, scores, softmax, weighted sum.
INTERNALS = H * S * KD * 3 + 2 * H * S * S + H * S * KD
BLOCK_KEPT = 6 * S * D + INTERNALS + S * F  # ln1 attn add1 ln2 up down add2
SPLIT_KEPT = INTERNALS + S * F  # Summed outputs (attention, down) stay.
BATCH, R, K, T, M = 8, 2, 2, 2, 2


@pytest.fixture(scope="module")
def gpt():
  return models.build_model("gpt", input_shape=(S,), num_classes=V, seed=0,
                            size="tiny")


@pytest.fixture(scope="module")
def cut(gpt):
  """Stage 0: embeddings and block 0; stage 1: block 1, final_ln, logits."""
  return partition.plan_stages(gpt, K, split_points=["block1_ln1"],
                               devices=["/device:CPU:0", "/device:CPU:1"])


@pytest.fixture(scope="module")
def layout(gpt, cut):
  return accounting.account(
      gpt, hybrid.Layout(R, K, T, micro_batches=M), global_batch_size=BATCH,
      optimizer="adam", plan=cut)


def test_the_rules_are_the_tensor_engines():
  from tfmgpu.parallel import tensor  # pylint: disable=g-import-not-at-top
  assert tensor.GPT_RULES == choices.TENSOR_RULES_GPT
  assert tuple(tensor.KINDS) == choices.TENSOR_KINDS


def test_what_the_rules_split(gpt):
  split = accounting.tensor_split(gpt)
  assert [(l.name, l.kind, l.feeds) for l in split.layers] == [
      (f"block{i}_{n}", k, f"block{i}_mlp_down" if k == "column" else "")
      for i in range(2) for n, k in (("attention", "heads"),
                                     ("mlp_up", "column"),
                                     ("mlp_down", "row"))]
  assert sum(l.param_bytes for l in split.layers) == 2 * SPLIT_PARAMS * FLOAT
  share = split.share(("block0_attention", "block0_mlp_up",
                       "block0_mlp_down"))
  assert share.blocks == 2  # Attention, and the MLP pair.
  assert share.activation_bytes == SPLIT_KEPT * FLOAT
  # Forward: attention's and the pair's outputs; backward: their inputs.
  assert share.reduce_forward_bytes == 2 * S * D * FLOAT
  assert share.reduce_backward_bytes == 2 * S * D * FLOAT
  # Cut between the pair: two blocks of their own, each way.
  alone = split.share(("block0_mlp_up",))
  assert (alone.blocks, alone.reduce_forward_bytes) == (1, S * F * FLOAT)


def test_memory_per_device_by_hand(layout):
  stage_params = [V * D + S * D + 4 * D + ATTENTION + UP + DOWN,
                  4 * D + ATTENTION + UP + DOWN + 2 * D + D * V + V]
  kept = [2 * S * D + BLOCK_KEPT, BLOCK_KEPT + S * D + S * V]
  inputs = [S * 4, S * D * FLOAT]  # int32 tokens; block 0's output.
  micro = BATCH // R // M
  assert [(d.device, d.stage, d.shard) for d in layout.devices] == [
      (f"/device:GPU:{i}", i // T, i % T) for i in range(K * T)]
  for d in layout.devices:
    home = d.shard == 0
    params = FLOAT * ((stage_params[d.stage] - SPLIT_PARAMS if home else 0)
                      + SPLIT_PARAMS // T)
    keeps = FLOAT * ((kept[d.stage] - SPLIT_KEPT if home else 0) +
                     SPLIT_KEPT // T)
    received = inputs[d.stage] if home else 0
    m = d.memory
    assert (m.weights, m.gradients, m.optimizer_slots) == (
        params, params, 2 * params), d.device
    # GPipe: all M micro-batches in flight on each stage.
    assert m.activations == M * micro * (received + keeps), d.device
    assert m.in_flight == (M,)
  assert layout.peak.device == "/device:GPU:2"  # Stage 1 keeps the logits.


def test_bytes_sent_per_step_by_hand(layout):
  per_replica = BATCH // R
  for d in layout.devices:
    # Data: ring all-reduce over R = 2 sends 2 (R - 1) / R = 1 gradient.
    assert d.sent.data == d.memory.gradients
    # Pipeline: block 0's output forward (stage 0), its gradient back
    # (stage 1), per example; the shards send none.
    assert d.sent.pipeline == (S * D * FLOAT * per_replica
                               if d.shard == 0 else 0)
    # Tensor: 2 blocks x (output forward + input gradient backward), each
    # S x D floats per example, ring over T = 2: 2 (T - 1) / T = 1.
    assert d.sent.tensor == 2 * 2 * S * D * FLOAT * per_replica
    assert d.sent.total == d.sent.data + d.sent.pipeline + d.sent.tensor


def test_recompute_and_1f1b_reuse_the_stage_estimate(gpt, cut):
  acc = accounting.account(
      gpt, hybrid.Layout(1, K, T, micro_batches=4, schedule="1f1b",
                         recompute=True), global_batch_size=8, plan=cut)
  home0 = acc.devices[0]
  assert home0.memory.in_flight == (2,)  # 1F1B: min(K - k, M) on stage 0.
  keeps = FLOAT * (2 * S * D + BLOCK_KEPT - SPLIT_KEPT + SPLIT_KEPT // T)
  assert home0.memory.activations == 2 * (2 * S * 4) + 2 * keeps
  # The recomputed forward all-reduces again: 3 per block, not 2.
  assert home0.sent.tensor == 2 * 3 * S * D * FLOAT * 8
  assert home0.sent.data == 0


def hardware(**kw):
  values = dict(num_devices=8, device_kind="GPU", memory_bytes=10**9,
                flops_per_s=1e9, link_bytes_per_s=1e8, link="fast",
                task_overhead_s=1e-3)
  return accounting.Hardware(**{**values, **kw})


def test_a_tensor_only_step_by_hand(gpt):
  acc = accounting.account(gpt, hybrid.Layout(2, 1, T),
                           global_batch_size=BATCH)
  hw = hardware()
  step = acc.step(hw)
  b = BATCH // 2
  home_flops = acc.stage_flops[0]
  assert step.compute_s == pytest.approx(
      3 * home_flops * b / 1e9 + 2 * 1e-3)
  # Two blocks per transformer block, 2 layers: 4 forward, 4 backward.
  assert step.tensor_s == pytest.approx(8 * S * D * FLOAT * b / 1e8)
  assert step.pipeline_s == 0
  grads = acc.devices[0].memory.gradients
  assert step.data_s == pytest.approx(grads / 1e8)
  assert step.total_s == pytest.approx(step.compute_s + step.comm_s)
  assert step.links == {"tensor": "fast", "data": "fast"}


def test_the_pipeline_step_is_simulated(layout):
  hw = hardware()
  step = layout.step(hw)
  micro = BATCH // (R * M)
  fwd = [f * micro / 1e9 + 1e-3 for f in layout.stage_flops]
  bwd = [f * micro / 1e9 * 2 + 1e-3 for f in layout.stage_flops]
  assert step.compute_s == pytest.approx(
      timeline.simulate(fwd, bwd, M).step_time)
  assert step.tensor_s > 0 and step.pipeline_s > 0 and step.data_s > 0


def test_groups_spanning_hosts_use_the_network(layout):
  one_host = layout.step(hardware(devices_per_host=8))
  two_hosts = layout.step(hardware(devices_per_host=4,
                                   network_bytes_per_s=1e7, network="net"))
  assert two_hosts.links == {"tensor": "fast", "pipeline": "fast",
                             "data": "net"}
  assert two_hosts.data_s == pytest.approx(10 * one_host.data_s)
  assert two_hosts.tensor_s == pytest.approx(one_host.tensor_s)


def test_named_hosts():
  hw = accounting.host_hardware("dgx_a100", hosts=2)
  assert (hw.num_devices, hw.memory_bytes, hw.devices_per_host) == (
      16, 80 * 10**9, 8)
  assert hw.link_bytes_per_s == 300e9 and hw.network_bytes_per_s == 25e9
  assert links.host("dgx_h100").link == "nvlink_h100"
  assert links.host("pcie_a10x8").memory_gb == 24
  with pytest.raises(ValueError, match="host='dgx_z' is unknown"):
    links.host("dgx_z")


def test_the_table(layout):
  text = accounting.format_layout_table(layout, "dgx_a100")
  assert text.startswith("Layout data 2 x pipeline K=2 M=2 gpipe x tensor 2"
                         " of 'gpt' on 8 device(s)")
  assert re.search(r"^device\s+stage\s+shard\s+weights\s+grads\s+slots\s+"
                   r"activations\s+total\s+sends: data\s+pipeline\s+tensor$",
                   text, re.M)
  assert re.search(r"^/device:GPU:1\s+0\s+1\s.*\s+32\.0 KiB$", text, re.M)
  assert re.search(r"^max\s+[\d.]+ KiB", text, re.M)
  assert re.search(r"Projected step on 1 x dgx_a100 \(8 GPUs of 80 GB.*\): "
                   r"compute .* \+ tensor .* \(nvlink_a100\) .* = [\d.]+ "
                   r"\w+ \(predicted by the cost model, not measured\)\.$",
                   text)
  assert "Projected" not in accounting.format_layout_table(layout, None)


def test_a_split_the_heads_do_not_allow_is_named(gpt):
  with pytest.raises(ValueError, match=re.escape(
      "cannot be split over tensor=4 devices: layer 'block0_attention': "
      "num_heads=2 is not divisible by T=4")):
    accounting.account(gpt, hybrid.Layout(1, 1, 4), global_batch_size=8)
  with pytest.raises(ValueError, match="global_batch_size=6 must divide"):
    accounting.account(gpt, hybrid.Layout(2, 2, 1, micro_batches=2),
                       global_batch_size=6)


def test_an_interleaved_plan_is_counted_per_device(gpt):
  """`--plan_only --virtual_stages=2` hands a plan of K x V chunks: it is
  counted per device (it failed: "plan has 4 stages ... stages=2"), and
  each chunk's KV cache lands on its device (`k % K`)."""
  from tfmgpu.parallel import kv_cache  # pylint: disable=g-import-not-at-top
  layout = hybrid.Layout(stages=2, micro_batches=4, schedule="1f1b",
                         virtual_stages=2)
  names = ["/device:GPU:0", "/device:GPU:1"]
  chunks = partition.plan_stages(gpt, 4, devices=names * 2,
                                 check_devices=False)
  acc = accounting.account(gpt, layout, global_batch_size=64, plan=chunks,
                           devices=names)
  assert [d.device for d in acc.devices] == names
  cache = kv_cache.per_device(gpt, layout, batch=8, context=16, plan=chunks,
                              devices=names)
  whole = kv_cache.per_device(gpt, hybrid.Layout(), batch=8, context=16,
                              devices=names[:1])
  assert sum(cache.values()) == sum(whole.values()) > 0
  expected = dict.fromkeys(names, 0)
  for layer in kv_cache.cache_layers(gpt, None):
    expected[names[chunks.stage_of(layer.name) % 2]] += layer.bytes(8, 16, 1)
  assert cache == expected
