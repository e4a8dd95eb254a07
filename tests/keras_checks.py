"""attnx.keras.MultiHeadAttention against keras.layers.MultiHeadAttention, on
the Keras backend that ``$KERAS_BACKEND`` names (Keras picks its backend
once, at import): run by tests/test_keras_layer.py in a process of its own
for each backend.  Each check raises on a difference; the script prints
what it checked."""

from __future__ import annotations

import os
import sys
import tempfile

import keras
import numpy as np
from keras import ops

import attnx.keras

BACKEND = keras.backend.backend()
GEN = np.random.default_rng(0)
X = GEN.standard_normal((2, 5, 8)).astype("float32")
Y = GEN.standard_normal((2, 7, 8)).astype("float32")


def numpy(array):
    return ops.convert_to_numpy(array)


def pair(**options):
    """Keras' layer and ours, ours holding Keras' weights."""
    keras.utils.set_random_seed(0)
    theirs = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, **options)
    ours = attnx.keras.MultiHeadAttention(num_heads=2, key_dim=4, **options)
    theirs(X, Y)
    ours(X, Y)
    ours.set_weights(theirs.get_weights())
    return ours, theirs


def gradients(layer, *arguments, **call):
    """Each trainable weight's gradient of ``sum(sin(layer(...)))``, by the backend's own autograd."""
    if BACKEND == "jax":
        import jax

        def loss(trainable):
            out, _ = layer.stateless_call(
                trainable, [v.value for v in layer.non_trainable_variables], *arguments, **call
            )
            return ops.sum(ops.sin(out))

        # jitted, as Keras trains: one program to compile, not each operation of the tape
        return [np.asarray(g) for g in jax.jit(jax.grad(loss))([v.value for v in layer.trainable_variables])]
    for variable in layer.trainable_variables:
        variable.value.grad = None
    ops.sum(ops.sin(layer(*arguments, **call))).backward()
    return [variable.value.grad.numpy() for variable in layer.trainable_variables]


def check_outputs_scores_and_gradients():
    padding = np.broadcast_to(np.arange(7)[None, None, :] < np.array([7, 3])[:, None, None], (2, 5, 7))
    cases = [
        ({}, (X, Y), {}),
        ({}, (X, Y), {"attention_mask": padding}),
        ({"use_bias": False}, (X, X), {"use_causal_mask": True}),
        ({"output_shape": 6}, (X, Y), {"use_causal_mask": True}),  # Keras' causal rule: j <= i, T != S
        ({}, (X, Y, Y[..., ::-1]), {}),  # a key of its own
    ]
    for options, arguments, call in cases:
        ours, theirs = pair(**options)
        np.testing.assert_allclose(numpy(ours(*arguments, **call)), numpy(theirs(*arguments, **call)), atol=2e-6)
        _, our_scores = ours(*arguments, return_attention_scores=True, **call)
        _, their_scores = theirs(*arguments, return_attention_scores=True, **call)
        np.testing.assert_allclose(numpy(our_scores), numpy(their_scores), atol=2e-6)
        for mine, keras_s in zip(gradients(ours, *arguments, **call), gradients(theirs, *arguments, **call)):
            np.testing.assert_allclose(mine, keras_s, rtol=1e-4, atol=2e-5)
    print("outputs, scores and every weight's gradient equal Keras'", len(cases), "cases")


def check_attnx_computes_it():
    ours, _ = pair()
    calls = []
    original = attnx.keras.scaled_dot_product_attention
    attnx.keras.scaled_dot_product_attention = lambda *a, **kw: calls.append(kw) or original(*a, **kw)
    try:
        ours(X, Y)
    finally:
        attnx.keras.scaled_dot_product_attention = original
    assert len(calls) == 1, calls
    print("attnx computes the attention")


def check_a_fully_padded_sequence_gets_the_output_bias():
    ours, _ = pair()
    mask = np.zeros((2, 5, 7), dtype=bool)
    mask[0] = True
    out = numpy(ours(X, Y, attention_mask=mask))
    np.testing.assert_allclose(out[1], np.broadcast_to(numpy(ours._output_dense.bias), out[1].shape), atol=1e-7)
    print("a fully padded sequence gets the output bias")


def check_config_and_a_saved_model():
    ours, _ = pair(dropout=0.1, output_shape=6)
    again = attnx.keras.MultiHeadAttention.from_config(ours.get_config())
    assert type(again) is attnx.keras.MultiHeadAttention and again.get_config() == ours.get_config()
    inputs = keras.Input((5, 8))
    model = keras.Model(inputs, attnx.keras.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    assert type(loaded.layers[-1]) is attnx.keras.MultiHeadAttention
    np.testing.assert_allclose(numpy(loaded(X)), numpy(model(X)), atol=1e-6)
    print("get_config, from_config and a saved model")


def check_dropout_repeats_under_a_seed():
    ours, _ = pair(dropout=0.5, seed=3)
    first = numpy(ours(X, Y, training=True))
    second = numpy(ours(X, Y, training=True))  # the seed generator moved on
    keras.utils.set_random_seed(0)
    ours_again, _ = pair(dropout=0.5, seed=3)
    np.testing.assert_array_equal(numpy(ours_again(X, Y, training=True)), first)
    assert not np.allclose(first, second)
    np.testing.assert_allclose(numpy(ours(X, Y)), numpy(ours(X, Y, training=False)))
    print("dropout: attnx's mask, repeated under the same seed")


def check_what_attnx_cannot_do_is_refused():
    for options, words in (
        ({"attention_axes": (1, 2)}, "attention_axes"),
        ({"flash_attention": True}, "flash_attention"),
    ):
        try:
            attnx.keras.MultiHeadAttention(num_heads=2, key_dim=4, **options)
        except ValueError as error:
            assert words in str(error), error
        else:
            raise AssertionError(f"{options} was not refused")
    print("attention_axes and flash_attention=True refused by name")


def check_a_model_trains_as_with_keras_s():
    """A one-layer copy model fitted with model.fit: the loss falls, and its
    curve follows the same model's with Keras' layer, from the same weights."""
    tokens = GEN.integers(0, 10, (32, 6))

    def model(layer):
        inputs = keras.Input((6,), dtype="int32")
        x = keras.layers.Embedding(10, 16)(inputs)
        x = x + layer(num_heads=4, key_dim=4)(x, x)
        return keras.Model(inputs, keras.layers.Dense(10)(x))

    keras.utils.set_random_seed(0)
    theirs, ours = model(keras.layers.MultiHeadAttention), model(attnx.keras.MultiHeadAttention)
    ours.set_weights(theirs.get_weights())
    curves = []
    for one in (theirs, ours):
        one.compile(
            optimizer=keras.optimizers.Adam(0.02), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        history = one.fit(tokens, tokens, epochs=30, batch_size=32, shuffle=False, verbose=0)
        curves.append(history.history["loss"])
    assert curves[1][-1] < 0.5 * curves[1][0], curves[1]
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-3, atol=1e-3)
    print(f"model.fit: loss {curves[1][0]:.2f} -> {curves[1][-1]:.2f}, as with Keras' layer")


if __name__ == "__main__":
    for name, check in sorted(globals().items()):
        if name.startswith("check_"):
            check()
    print(f"all checks passed on Keras' {BACKEND} backend", file=sys.stderr)
