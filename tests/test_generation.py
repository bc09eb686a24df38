"""`tfmgpu.generate`: KV-cached decoding equals a loop without a cache and
keras_hub's own `generate`; seeded sampling repeats; data parallelism gives
the unplaced tokens; the decode step traces once. Placed models:
`test_generation_placed.py`."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import devices as devices_lib
from tfmgpu import generation
from tfmgpu import models
from tfmgpu.generation import samplers
from tfmgpu.parallel import cloning

VOCAB = 50
CONTEXT = 24
# New tokens of the tests that decode `gpt` on `_prompts()`: one request
# shape, so they share its compiled decode loops (one per sampler; each
# new shape or sampler compiles again, ~2 s).
NEW = 6
TOP_K = {"sampler": "top_k", "k": 5}


@pytest.fixture(scope="module")
def gpt():
  return models.build_model("gpt", input_shape=(CONTEXT,), num_classes=VOCAB,
                            seed=3)


def _prompts(vocab=VOCAB, width=8, lengths=(5, 2, 8)):
  """Right-padded prompts of different lengths (keras_hub's form)."""
  ids = np.random.RandomState(0).randint(1, vocab, (len(lengths), width))
  mask = np.arange(width)[None, :] < np.array(lengths)[:, None]
  return {"token_ids": (ids * mask).astype(np.int32), "padding_mask": mask}


def _no_cache_loop(model, prompts, new_tokens, with_mask=False):
  """Greedy tokens by re-reading the whole prefix at every position (and
  the mask of its real tokens, for a model that takes one)."""
  rows = []
  for ids, mask in zip(prompts["token_ids"], prompts["padding_mask"]):
    sequence = list(ids[mask])
    for _ in range(new_tokens):
      x = np.zeros((1, CONTEXT), np.int32)
      x[0, :len(sequence)] = sequence
      if with_mask:
        real = (np.arange(CONTEXT) < len(sequence)).astype(np.int32)
        x = {"tokens": x, "padding_mask": real[None]}
      logits = np.asarray(model(x, training=False))
      sequence.append(int(np.argmax(logits[0, len(sequence) - 1])))
    rows.append(sequence)
  return rows


def _rows(out):
  return [list(ids[mask]) for ids, mask in zip(out["token_ids"],
                                              out["padding_mask"])]


def test_gpt_greedy_equals_a_loop_without_cache(gpt):
  prompts = _prompts()
  out = tfmgpu.generate(gpt, prompts, max_new_tokens=NEW)
  assert out["token_ids"].shape == (3, 8 + NEW)
  assert _rows(out) == _no_cache_loop(gpt, prompts, NEW)
  assert out["padding_mask"].sum(axis=1).tolist() == [
      5 + NEW, 2 + NEW, 8 + NEW]


def test_token_array_is_all_prompt(gpt):
  ids = _prompts(lengths=(8, 8, 8))["token_ids"]
  out = tfmgpu.generate(gpt, ids, max_new_tokens=NEW)
  np.testing.assert_array_equal(out["token_ids"][:, :8], ids)
  assert out["padding_mask"].all()


def test_decode_step_traces_once_for_a_whole_generation(gpt):
  generator = generation.Generator(gpt)
  generator.generate(_prompts(), max_new_tokens=10)
  generator.generate(_prompts(), max_new_tokens=10)  # Same shapes again.
  streamed = [tokens for tokens, _ in generator.stream(
      _prompts(), max_new_tokens=10)]  # One position per call.
  assert generator.traces == 1
  assert len(streamed) == 1 + (8 + 10 - 2)  # Prefill, then each position.


def test_stop_token_ends_a_row_and_is_kept(gpt):
  prompts = _prompts()
  free = tfmgpu.generate(gpt, prompts, max_new_tokens=NEW)
  stop = int(free["token_ids"][0, 5 + 2])  # Row 0's third new token.
  out = tfmgpu.generate(gpt, prompts, max_new_tokens=NEW,
                        stop_token_ids=[stop])
  row = _rows(out)[0]
  assert row == _rows(free)[0][:row.index(stop, 5) + 1]
  assert not out["token_ids"][0, len(row):].any()


@pytest.mark.parametrize("sampler,options", [
    ("top_k", {"k": TOP_K["k"]}), ("top_p", {"p": 0.8}),
    ("random", {"temperature": 0.7})])
def test_a_seed_gives_the_same_tokens_twice(gpt, sampler, options):
  prompts = _prompts()
  first = tfmgpu.generate(gpt, prompts, max_new_tokens=NEW,
                          sampler=sampler, seed=11, **options)
  again = tfmgpu.generate(gpt, prompts, max_new_tokens=NEW,
                          sampler=sampler, seed=11, **options)
  other = tfmgpu.generate(gpt, prompts, max_new_tokens=NEW,
                          sampler=sampler, seed=12, **options)
  np.testing.assert_array_equal(first["token_ids"], again["token_ids"])
  assert (first["token_ids"] != other["token_ids"]).any()
  greedy = tfmgpu.generate(gpt, prompts, max_new_tokens=NEW)
  assert (first["token_ids"] != greedy["token_ids"]).any()


def test_top_k_draws_only_among_the_k_most_likely(gpt):
  """Every new token of every row (18 draws) is among the k most likely
  after the tokens before it (the gpt is causal: one call on the output
  gives each position's logits)."""
  out = tfmgpu.generate(gpt, _prompts(), max_new_tokens=NEW, seed=0, **TOP_K)
  ids = out["token_ids"]
  logits = np.asarray(gpt(np.pad(ids, [(0, 0), (0, CONTEXT - ids.shape[1])])))
  prompt = np.pad(_prompts()["padding_mask"], [(0, 0), (0, NEW)])
  draws = list(zip(*np.nonzero(out["padding_mask"] & ~prompt)))
  assert len(draws) == 3 * NEW
  for r, j in draws:
    assert ids[r, j] in np.argsort(logits[r, j - 1])[-TOP_K["k"]:], (r, j)


def test_a_model_built_in_the_mirrored_scope_generates_under_xla(gpt):
  """Mirrored variables, as training under the strategy leaves them: each
  replica's compiled loop reads its own copies (TF compiles a `tf.function`
  given to `strategy.run` as one XLA call on the first device, which fails
  on the second replica's copies)."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  with strategy.scope():
    mirrored = models.build_model("gpt", input_shape=(CONTEXT,),
                                  num_classes=VOCAB, seed=3)
  generator = generation.Generator(mirrored, strategy=strategy)
  assert generator._runner.jit_compile  # pylint: disable=protected-access
  spread = generator.generate(_prompts(), max_new_tokens=NEW)
  alone = tfmgpu.generate(gpt, _prompts(), max_new_tokens=NEW)
  np.testing.assert_array_equal(spread["token_ids"], alone["token_ids"])
  assert generator.traces == 2  # One compiled loop per replica.
  assert generator.model is mirrored  # No copy.
  assert [_weight_devices(g) for g in generator.graphs] == [
      {devices_lib.canonical_device(d)} for d in
      strategy.extended.worker_devices]


def test_a_model_from_outside_the_scope_decodes_on_each_replica_from_a_copy(
    gpt, caplog):
  """Weights made outside the strategy's scope are copied into it once:
  each replica's compiled loop reads its own replica's weights (before,
  under XLA, every replica's rows decoded as one call on the first
  device), and the user's model is left as it was. Its greedy and seeded
  top-k tokens are the unplaced ones (3 rows over 2 replicas: one padded
  row)."""
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  before = [w.copy() for w in gpt.get_weights()]
  generator = generation.Generator(gpt, strategy=strategy)
  assert generator.model is not gpt
  assert cloning.built_in_scope(generator.model, strategy)
  assert not cloning.built_in_scope(gpt, strategy)
  assert "a copy made in it" in caplog.text
  for options in ({}, dict(TOP_K, seed=4)):
    spread = generator.generate(_prompts(), max_new_tokens=NEW,
                                sampling=generation.Sampling(**options))
    alone = tfmgpu.generate(gpt, _prompts(), max_new_tokens=NEW, **options)
    for key in ("token_ids", "padding_mask"):
      np.testing.assert_array_equal(spread[key], alone[key], err_msg=options)
    if not options:
      assert generator.traces == 2  # One compiled loop per replica.
  read = [_weight_devices(g) for g in generator.graphs[:2]]
  replicas = [devices_lib.canonical_device(d)
              for d in strategy.extended.worker_devices]
  assert read == [{replicas[0]}, {replicas[1]}]
  for old, new in zip(before, gpt.get_weights()):
    np.testing.assert_array_equal(old, new)


def test_generate_with_a_copy_follows_the_models_later_weights():
  """`tfmgpu.generate` keeps its generator (and the copy it made in the
  strategy's scope) per model: a model trained on since the last request
  generates with its new weights (the copy's were kept): the tokens of a
  loop without a cache on them."""
  model = models.build_model("gpt", input_shape=(CONTEXT,),
                             num_classes=VOCAB, seed=5)
  strategy = tfmgpu.get_strategy("mirrored", num_replicas=2)
  first = tfmgpu.generate(model, _prompts(), max_new_tokens=4,
                          strategy=strategy)
  model.set_weights(models.build_model(  # As training on would.
      "gpt", input_shape=(CONTEXT,), num_classes=VOCAB, seed=6).get_weights())
  again = tfmgpu.generate(model, _prompts(), max_new_tokens=4,
                          strategy=strategy)
  assert _rows(again) == _no_cache_loop(model, _prompts(), 4)
  assert (first["token_ids"] != again["token_ids"]).any()


def _weight_devices(graph) -> set[str]:
  """The devices of the variables a traced function reads."""
  return {devices_lib.canonical_device(outer.device)
          for outer, _ in graph.captures if outer.dtype == tf.resource}


def test_a_gpt_with_a_padding_mask_input_and_one_device():
  model = models.build_model(
      "gpt", input_shape={"tokens": (CONTEXT,), "padding_mask": (CONTEXT,)},
      num_classes=VOCAB, seed=4)
  prompts = _prompts()
  expected = _no_cache_loop(model, prompts, 4, with_mask=True)
  assert _rows(tfmgpu.generate(model, prompts, max_new_tokens=4)) == expected
  placed = tfmgpu.generate(model, prompts, max_new_tokens=4,
                           strategy="one_device")
  assert _rows(placed) == expected


def test_rows_split_differently_get_the_same_seeded_tokens(gpt):
  prompts = _prompts()
  whole = tfmgpu.generate(gpt, prompts, max_new_tokens=NEW, seed=5, **TOP_K)
  # Row 1 alone has index 0: seeds are keyed by the request's row index,
  # so compare a request whose row order is kept (rows 0-1 of the three).
  first_two = {k: v[:2] for k, v in prompts.items()}
  part = tfmgpu.generate(gpt, first_two, max_new_tokens=NEW, seed=5,
                         **TOP_K)
  assert _rows(part) == _rows(whole)[:2]


@pytest.mark.parametrize("inputs,match", [
    ({"token_ids": np.ones((1, 4), np.int32),
      "padding_mask": np.array([[1, 0, 1, 0]], bool)}, "right-padded"),
    ({"tokens": np.ones((1, 4), np.int32)}, "keys"),
    (np.ones((1, 4), np.float32), "integer"),
    (np.array([[-3, 6]]), "holds -3; token ids are >= 0"),
    # Past the vocabulary: a raw GatherV2 error (zeros on a GPU).
    (np.array([[300, 6]]), r"holds 300, but the model's vocabulary has 50 "
     r"tokens \(ids 0\.\.49\)"),
    # Said "Use max_new_tokens <= -6".
    (np.ones((1, 30), np.int32), r"prompt \(30 tokens\) leaves no room in "
     r"the model's 24 positions: shorten it to at most 23 tokens"),
])
def test_bad_inputs_are_named(gpt, inputs, match):
  with pytest.raises(ValueError, match=match):
    tfmgpu.generate(gpt, inputs, max_new_tokens=2)


def test_bad_options_are_named(gpt):
  ids = np.ones((1, 4), np.int32)
  with pytest.raises(ValueError, match="more than the model's 24"):
    tfmgpu.generate(gpt, ids, max_new_tokens=21)
  with pytest.raises(ValueError, match="k=None must be a positive int"):
    tfmgpu.generate(gpt, ids, max_new_tokens=2, sampler="top_k")
  with pytest.raises(ValueError, match="sampler='beam' is unknown"):
    tfmgpu.generate(gpt, ids, max_new_tokens=2, sampler="beam")
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    tfmgpu.generate(gpt, ids, max_new_tokens=0)
  with pytest.raises(ValueError, match="k=5 is read only by sampler='top_k'"):
    tfmgpu.generate(gpt, ids, max_new_tokens=2, k=5)
  with pytest.raises(ValueError, match=r"stop_token_ids=5 must be a list"):
    tfmgpu.generate(gpt, ids, max_new_tokens=2, stop_token_ids=5)


def test_seeds_are_the_samplers_32_bit_ones_numpy_ints_too():
  """A new user's trial: seeds 2**32 apart wrote the same tokens, silently
  (an int32 counter), and `np.int64(5)` was refused."""
  for seed in (2**32, 2**31, -2**31 - 1):
    with pytest.raises(ValueError, match=rf"seed={seed} is outside the "
                       r"samplers' 32-bit seeds \(-2147483648\.\.2147483647\)"):
      generation.Sampling("random", seed=seed)
  assert generation.Sampling("top_k", k=np.int64(3), seed=np.int64(5)).seed == 5
  assert generation.Sampling("random", seed=2**31 - 1).seed == 2**31 - 1
  assert samplers.offset_seed(2**31 - 1, 1) == -2**31  # A later window's.


def test_a_placed_model_refuses_a_strategy_and_a_placed_non_gpt(
    gpt, cpu_devices):
  import keras  # pylint: disable=g-import-not-at-top
  from tfmgpu.parallel import hybrid  # pylint: disable=g-import-not-at-top
  placed = hybrid.build_layout(gpt, hybrid.Layout(stages=2),
                               devices=cpu_devices[:2])
  with pytest.raises(ValueError, match="placed over devices already"):
    generation.Generator(placed, strategy="mirrored")
  inputs = keras.Input((4,))
  mlp = keras.Model(inputs, keras.layers.Dense(3, name="b")(
      keras.layers.Dense(3, name="a")(inputs)))
  staged = hybrid.build_layout(mlp, hybrid.Layout(stages=2),
                               devices=cpu_devices[:2])
  with pytest.raises(ValueError, match="neither tfmgpu's gpt nor a "
                     "keras_hub CausalLM.*to_unsplit"):
    tfmgpu.generate(staged, np.ones((1, 4), np.int32), max_new_tokens=2)


# ------------------------------------------------------- keras_hub models

def _hub_lm(name):
  keras_hub = pytest.importorskip("keras_hub")
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  if name == "gpt2":
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=32)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
  if name == "gemma":
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
        head_dim=8)
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
  if name == "falcon":  # Its heads are num_attention_heads.
    backbone = keras_hub.models.FalconBackbone(
        vocabulary_size=64, num_layers=2, num_attention_heads=2,
        hidden_dim=16, intermediate_dim=32)
    return keras_hub.models.FalconCausalLM(backbone, preprocessor=None)
  if name == "smollm3":  # Its blocks refuse a Python index next to tensors.
    backbone = keras_hub.models.SmolLM3Backbone(
        vocabulary_size=64, hidden_dim=16, intermediate_dim=32, num_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
        attention_dropout=0.0, rope_layer_enabled_list=[True, True],
        layer_types=["full_attention"] * 2, mlp_bias=False,
        layer_norm_epsilon=1e-6, max_position_embeddings=64,
        rope_theta=10000.0, partial_rotary_factor=1.0)
    return keras_hub.models.SmolLM3CausalLM(backbone, preprocessor=None)
  backbone = keras_hub.models.LlamaBackbone(  # Grouped-query, rotary.
      vocabulary_size=64, num_layers=2, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
  return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


@pytest.fixture(scope="module")
def hub_greedy():
  """`name -> (lm, each row's prompt and first 8 new tokens by keras_hub's
  own greedy generate)`, made once per name (llama decodes twice)."""
  made = {}

  def get(name):
    if name not in made:
      lm = _hub_lm(name)
      prompts = _prompts(vocab=64)
      # keras_hub fills every position after each prompt up to the input's
      # width: give it room, keep each row's first 8 new tokens.
      wide = {k: np.pad(v, [(0, 0), (0, 16)]) for k, v in prompts.items()}
      lm.compile(sampler="greedy")
      theirs = lm.generate(wide, stop_token_ids=None)["token_ids"]
      lengths = prompts["padding_mask"].sum(axis=1)
      made[name] = lm, [list(row[:n + 8]) for row, n in zip(theirs, lengths)]
    return made[name]

  return get


@pytest.mark.parametrize("name,replicas", [
    ("gpt2", None), ("llama", None), ("gemma", None), ("llama", 2),
    ("falcon", None), ("smollm3", None)])
def test_keras_hub_greedy_equals_its_own_generate(name, replicas,
                                                  hub_greedy):
  """One device, and the rows spread over mirrored x2 (3 rows: one
  padded; the model is copied into the strategy's scope)."""
  lm, expected = hub_greedy(name)
  strategy = replicas and tfmgpu.get_strategy("mirrored",
                                              num_replicas=replicas)
  out = tfmgpu.generate(lm, _prompts(vocab=64), max_new_tokens=8,
                        strategy=strategy or None)
  assert _rows(out) == expected


def test_phi3_su_scaling_prefills_as_keras_hub_does():
  """Its rotary takes long factors past pretraining_sequence_length by the
  length it is called with: keras_hub prefills the whole buffer, tfmgpu
  prefilled the prompt alone (short factors): 5 rows of 8 differed."""
  keras_hub = pytest.importorskip("keras_hub")
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.Phi3Backbone(
      vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32,
      num_query_heads=2, num_key_value_heads=1, max_sequence_length=32,
      pretraining_sequence_length=8, rope_scaling_type="su",
      rope_scaling_short_factor=[1.0] * 4,
      rope_scaling_long_factor=[5.0, 9.0, 17.0, 33.0])
  lm = keras_hub.models.Phi3CausalLM(backbone, preprocessor=None)
  lm.set_weights([w * 4 if w.ndim > 1 else w for w in lm.get_weights()])
  ids = np.random.RandomState(0).randint(1, 64, (8, 6)).astype("int32")
  prompts = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
  lm.compile(sampler="greedy")
  theirs = lm.generate({k: np.pad(v, [(0, 0), (0, 6)])
                        for k, v in prompts.items()}, stop_token_ids=None)
  ours = tfmgpu.generate(lm, prompts, max_new_tokens=6)
  np.testing.assert_array_equal(ours["token_ids"], theirs["token_ids"])


def test_a_keras_hub_model_whose_cache_cannot_trace_is_named():
  """keras_hub 0.32's Qwen with sliding-window attention reads a tensor as
  a Python bool (its own generate fails too): TF's AutoGraph page came
  out."""
  keras_hub = pytest.importorskip("keras_hub")
  backbone = keras_hub.models.QwenBackbone(
      vocabulary_size=64, num_layers=1, num_query_heads=2,
      num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
      use_sliding_window_attention=True, sliding_window_size=4)
  lm = keras_hub.models.QwenCausalLM(backbone, preprocessor=None)
  with pytest.raises(ValueError, match=r"cached call cannot run in a TF "
                     r"graph.*Qwen with sliding-window attention"):
    tfmgpu.generate(lm, np.ones((1, 3), np.int32), max_new_tokens=2)


# ------------------------------------------------------- the CLI

@pytest.fixture(scope="module")
def byte_gpt_path(tmp_path_factory):
  """A tiny byte-level gpt (vocabulary 256) saved as .keras."""
  model = models.build_model("gpt", input_shape=(16,), num_classes=256,
                             seed=2)
  path = str(tmp_path_factory.mktemp("gen") / "model.keras")
  model.save(path)
  return path, model


def test_generate_takes_a_saved_models_path_as_predict_does(byte_gpt_path):
  """Found by a new user: `tfmgpu.predict(path, x)` loads the model, and
  `tfmgpu.generate(path, ...)` failed with "cannot create weak reference
  to 'str' object"; a missing file is now named."""
  path, model = byte_gpt_path
  ids = np.array([[72, 101, 108, 108]], np.int32)
  np.testing.assert_array_equal(
      tfmgpu.generate(path, ids, max_new_tokens=3)["token_ids"],
      tfmgpu.generate(model, ids, max_new_tokens=3)["token_ids"])
  with pytest.raises(FileNotFoundError, match=r"nope.keras"):
    tfmgpu.generate(path + "/../nope.keras", ids, max_new_tokens=3)
  with pytest.raises(ValueError, match=r"is a path: tfmgpu.generate\(path, "
                     r"...\) loads it for one call; here, load it first"):
    generation.generate(path, ids, max_new_tokens=3)


@pytest.mark.parametrize("placement", [
    {"strategy": "default"},
    # The model is copied into its scope; 2 replicas (not all 4: each
    # replica compiles its own loops, the same path).
    {"strategy": "mirrored", "num_replicas": 2},
    {"strategy": "model_parallel", "num_stages": 2, "tensor_parallel": 2}])
def test_cli_prints_the_prompt_and_the_greedy_text_past_the_context(
    byte_gpt_path, parsed_flags, capsys, caplog, placement):
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  path, model = byte_gpt_path
  with flagsaver.flagsaver(model_path=[path], prompt="def ",
                           max_new_tokens=20, **placement):
    assert generate.main(["generate"]) == 0
  out = capsys.readouterr()
  # 4 + 20 tokens > the 16 positions: the last 8 start the second window.
  expected = list(b"def ")
  for context, new in ((expected, 12), (None, 8)):
    context = expected[-8:] if context is None else context
    tokens = tfmgpu.generate(model, np.array([context]), max_new_tokens=new)
    expected += list(tokens["token_ids"][0, len(context):])
  assert out.out.rstrip("\n") == bytes(expected).decode("utf-8", "replace")
  assert "20 tokens in" in out.err
  copied = "a copy made in it" in caplog.text
  assert copied == (placement["strategy"] == "mirrored")
  assert copied == ("each of its 2 replicas" in caplog.text)


def test_cli_reads_as_much_of_a_long_prompt_as_fits_and_says_so(
    byte_gpt_path, parsed_flags, capsys):
  """A prompt past the 16 positions was cut to its last 8 silently (a new
  user's 100-byte prompt: read as its last 32 of 64); now the first token
  reads the last 15, and the CLI says how many it left out."""
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  path, model = byte_gpt_path
  prompt = b"import numpy as np, os\n"  # 23 bytes.
  with flagsaver.flagsaver(model_path=[path], prompt=prompt.decode(),
                           max_new_tokens=3):
    assert generate.main(["generate"]) == 0
  out = capsys.readouterr()
  expected = list(prompt)
  for context, new in ((expected[-15:], 1), (None, 2)):
    context = expected[-8:] if context is None else context
    tokens = tfmgpu.generate(model, np.array([context]), max_new_tokens=new)
    expected += list(tokens["token_ids"][0, len(context):])
  assert out.out.rstrip("\n") == bytes(expected).decode("utf-8", "replace")
  assert ("note: the prompt's 23 tokens are more than the model's 16 "
          "positions hold with a new token: it continues from the last 15 "
          "(the first 8 are not read).") in out.err


def test_cli_needs_a_prompt(byte_gpt_path, parsed_flags):
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver(model_path=[byte_gpt_path[0]], prompt=None,
                           prompt_ids=None):
    with pytest.raises(app.UsageError, match="--prompt"):
      generate.main(["generate"])


@pytest.mark.parametrize("ids,match", [
    # Said "bytes must be in range(0, 256)", naming no flag.
    (["1", "300"], r"--prompt_ids=1,300 holds 300, but the model's "
     r"vocabulary has 256 tokens \(ids 0\.\.255\)"),
    (["1", "-5"], r"--prompt_ids=1,-5 holds -5; token ids are >= 0 "
     r"\(indices into the vocabulary: 0\.\.255\)")])
def test_cli_names_prompt_ids_outside_the_vocabulary(
    byte_gpt_path, parsed_flags, capsys, ids, match):
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver(model_path=[byte_gpt_path[0]], prompt=None,
                           prompt_ids=ids, max_new_tokens=2):
    assert generate.main(["generate"]) == 1
  assert re.search("error: " + match, capsys.readouterr().err)


@pytest.mark.parametrize("given,match", [
    ({"top_k": 5}, r"--top_k=5 is read only by --sampler=top_k, and "
     r"--sampler=greedy is in use: add --sampler=top_k"),
    ({"sampler": "top_p", "top_k": 5}, r"--top_k=5 is read only by "),
    ({"temperature": 5.0}, r"--temperature=5\.0 is read only by --sampler="
     r"top_k or --sampler=top_p or --sampler=random"),
    ({"sample_seed": 1}, r"--sample_seed=1 is read only by ")])
def test_cli_refuses_a_sampling_flag_its_sampler_does_not_read(
    byte_gpt_path, parsed_flags, given, match):
  """A new user's trial: `--top_k=5 --temperature=5 --sample_seed=1`
  without `--sampler` wrote greedy text, silently."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver(model_path=[byte_gpt_path[0]], prompt="x",
                           **given):
    with pytest.raises(app.UsageError, match=match):
      generate.main(["generate"])


def test_cli_takes_only_one_of_prompt_and_prompt_ids(byte_gpt_path,
                                                     parsed_flags):
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver(model_path=[byte_gpt_path[0]], prompt="x",
                           prompt_ids=["1", "2"]):
    with pytest.raises(app.UsageError, match="Give only one of --prompt"):
      generate.main(["generate"])


def test_generate_is_the_cli_module_and_the_function(gpt):
  import types  # pylint: disable=g-import-not-at-top
  assert isinstance(tfmgpu.generate, types.ModuleType)
  assert callable(tfmgpu.generate.main)
  out = tfmgpu.generate(gpt, np.ones((3, 8), np.int32), max_new_tokens=NEW)
  assert out["token_ids"].shape == (3, 8 + NEW)


def test_cli_memory_plan_prints_weights_and_kv_cache_per_device(
    byte_gpt_path, parsed_flags, capsys):
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver(model_path=[byte_gpt_path[0]], prompt="def ",
                           max_new_tokens=12, memory_plan=True,
                           serve_batch=8, strategy="model_parallel",
                           num_stages=2, tensor_parallel=2):
    assert generate.main(["generate"]) == 0
  out = capsys.readouterr().out
  assert "8 row(s) of 16 positions" in out and "KV cache" in out
  # Each device: one block's one head (gpt tiny: 2 blocks of 2 heads of
  # 16), keys and values: 2 x 8 rows x 16 positions x 16 x 4 bytes.
  assert out.count(" 16.0 KiB ") == 4, out
  # This host has the 4 devices: the plan names them, not planned GPUs.
  assert "/device:CPU:3" in out and "GPU" not in out, out


def test_cli_memory_plan_needs_no_prompt_and_caps_at_the_context(
    byte_gpt_path, parsed_flags, capsys):
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  # 500 new tokens slide a window over the model's 16 positions: the cache
  # never holds more than 16.
  with flagsaver.flagsaver(model_path=[byte_gpt_path[0]], prompt=None,
                           prompt_ids=None, max_new_tokens=500,
                           memory_plan=True):
    assert generate.main(["generate"]) == 0
  assert "1 row(s) of 16 positions" in capsys.readouterr().out


def test_cli_serve_plan_weighs_layouts_and_chooses_one(
    byte_gpt_path, parsed_flags, capsys):
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from tfmgpu import generate  # pylint: disable=g-import-not-at-top
  with flagsaver.flagsaver(model_path=[byte_gpt_path[0]], prompt="def ",
                           max_new_tokens=12, serve="latency",
                           serve_batch=4):
    assert generate.main(["generate"]) == 0
  out = capsys.readouterr().out
  assert "Serving plan (latency)" in out and "16 positions per row" in out
  assert "tensor 2" in out and "\nchosen: " in out
