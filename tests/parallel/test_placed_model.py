"""`is_placed` and `unsplit_of`: the one way to ask about a placed model."""

import keras

from tfmgpu.parallel import placed_model


class _Placed:
  places_itself = True

  def compute_loss_and_gradients(self, x, y, loss_fn, *,
                                 scale_regularization=None):
    del x, y, loss_fn, scale_regularization

  def to_unsplit(self, **kwargs):
    del kwargs
    return "unsplit"

  def copy_weights_to(self, unsplit):
    del unsplit

  def load_from(self, unsplit):
    del unsplit


def test_placed_models_say_so_and_give_their_unsplit_form():
  plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  assert not placed_model.is_placed(plain)
  assert placed_model.unsplit_of(plain) is plain
  assert placed_model.is_placed(_Placed())
  assert placed_model.unsplit_of(_Placed()) == "unsplit"


def test_a_model_that_does_not_place_itself_is_not_placed():
  model = _Placed()
  model.places_itself = False
  assert not placed_model.is_placed(model)
