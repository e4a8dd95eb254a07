from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import pytest

import attnx

QKV = [np.ones((2, 3, 4), dtype=np.float32)] * 3


def test_backend_is_inferred_from_inputs_and_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="attnx"):
        attnx.scaled_dot_product_attention(*QKV)
    assert caplog.messages == ["scaled_dot_product_attention: backend 'numpy' (owns query), native"]


def test_explicit_backend_native_and_declined(loopback, caplog):
    with caplog.at_level(logging.DEBUG, logger="attnx"):
        attnx.scaled_dot_product_attention(*QKV, backend="loopback")
        attnx.scaled_dot_product_attention(*QKV, backend="loopback", return_weights=True)
    assert len(loopback.calls) == 2
    assert caplog.messages == [
        "scaled_dot_product_attention: backend 'loopback' (backend= argument), native",
        "scaled_dot_product_attention: backend 'loopback' (backend= argument), generic, native declined",
    ]
    assert isinstance(loopback.calls[0]["scale"], float)


def test_torch_calls_go_to_pytorchs_kernel_unless_there_is_nothing_to_attend(caplog):
    """The torch backend's native (PyTorch's SDPA) takes its calls, planned
    or not, with keys or values broadcast over the batch; a call with no
    query goes to the generic algorithm, which gives its empty output."""
    torch = pytest.importorskip("torch")
    query, broadcast = torch.ones(2, 3, 4, 8), torch.ones(1, 3, 4, 8)
    with caplog.at_level(logging.DEBUG, logger="attnx"):
        for _ in range(2):  # the second from the plan made for the signature
            attnx.scaled_dot_product_attention(query, query, query)
        attnx.scaled_dot_product_attention(query, broadcast, broadcast, is_causal=True)
        assert attnx.scaled_dot_product_attention(query[..., :0, :], query, query).shape == (2, 3, 0, 8)
    native = "scaled_dot_product_attention: backend 'torch' (owns query), native"
    assert caplog.messages == [native] * 3 + [
        "scaled_dot_product_attention: backend 'torch' (owns query), generic, native declined"
    ]


def test_use_backend_is_context_local():
    pytest.importorskip("torch")
    seen = {}

    def worker():
        seen["thread"] = attnx.get_backend()

    with attnx.use_backend("torch"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        seen["inside"] = attnx.get_backend()

        async def task():
            return attnx.get_backend()

        seen["task"] = asyncio.run(task())
    assert seen == {"inside": "torch", "thread": "numpy", "task": "torch"}
    assert attnx.get_backend() == "numpy"


def test_current_backend_order(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("ATTNX_BACKEND", "torch")
    assert attnx.get_backend() == "torch"
    attnx.set_backend("numpy")
    try:
        assert attnx.get_backend() == "numpy"
        with attnx.use_backend("torch"):
            assert type(attnx.masks.causal(2)).__module__ == "torch"
    finally:
        attnx.set_backend(None)
    monkeypatch.setenv("ATTNX_BACKEND", "nope")
    with pytest.raises(ValueError, match="ATTNX_BACKEND"):
        attnx.masks.causal(2)


def test_unavailable_backend_raises_on_use_with_reason():
    if next(i for i in attnx.list_backends() if i.name == "cupy").available:
        pytest.skip("cupy is available here")
    with pytest.raises(attnx.BackendUnavailableError, match="cupy.*unavailable"):
        attnx.scaled_dot_product_attention(*QKV, backend="cupy")


def test_non_arrays_are_rejected_with_a_conversion_hint():
    with pytest.raises(TypeError, match=r"query must be an array.*got builtins.list.*attnx.asarray"):
        attnx.scaled_dot_product_attention([[1.0]], QKV[1], QKV[2])


def test_asarray_and_to_numpy_round_trip():
    torch = pytest.importorskip("torch")
    x = attnx.asarray(np.arange(3.0), backend="torch", dtype="float32")
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32
    np.testing.assert_array_equal(attnx.to_numpy(x), [0.0, 1.0, 2.0])
    y = attnx.asarray(x, backend="numpy")
    assert isinstance(y, np.ndarray)
    # Another backend's array goes through its owner's to_numpy: NumPy alone
    # refuses a tensor that records gradients.  Its own backend's is kept.
    recorded = torch.ones(2, requires_grad=True)
    np.testing.assert_array_equal(attnx.asarray(recorded, backend="numpy"), [1.0, 1.0])
    assert attnx.asarray(recorded, backend="torch") is recorded
    with pytest.raises(TypeError):  # backend, dtype and device are keywords, as in NumPy's and PyTorch's
        attnx.asarray([1.0], "numpy")


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_to_numpy_gives_float32_for_bfloat16(backend):
    """NumPy has no bfloat16: the values come back in float32, which holds them exactly."""
    pytest.importorskip(backend)
    values = [0.5, -3.0, 1.0 + 2.0**-7]  # each exact in bfloat16's 8 significant bits
    made = attnx.asarray(np.asarray(values, np.float32), backend=backend, dtype="bfloat16")
    back = attnx.to_numpy(made)
    assert type(back) is np.ndarray and back.dtype == np.float32
    np.testing.assert_array_equal(back, values)


def test_device_names_become_the_library_s_devices():
    class Device:
        def __init__(self, name):
            self.name = name

        def __repr__(self):
            return f"mylib.Device({self.name!r})"

    devices = [Device("CPU_DEVICE"), Device("device1")]

    class Backend(attnx.Backend):
        def devices(self):
            return devices

    backend = Backend()
    assert backend.device("device1") is devices[1]
    assert backend.device(devices[0]) is devices[0]  # the library's own objects pass unchanged
    assert backend.device("cuda") == "cuda"  # a name the library may read itself
    assert backend.device(None) is None
    assert attnx.backend.device_label(devices[1]) == "device1"


@pytest.mark.parametrize(
    "create",
    [
        lambda device: attnx.masks.causal(3, device=device),
        lambda device: attnx.sinusoidal_positions(3, 4, device=device),
        lambda device: attnx.create_block_mask(attnx.mods.causal, None, None, 4, 4, device=device),
        lambda device: attnx.mods.alibi_slopes(4, device=device),
    ],
    ids=["masks.causal", "sinusoidal_positions", "create_block_mask", "alibi_slopes"],
)
def test_creation_refuses_a_device_its_backend_does_not_list(create):
    with pytest.raises(ValueError, match=r"device='cuda' is not a device of backend 'numpy' .*its devices: cpu"):
        create("cuda")
    assert create("cpu") is not None


def test_creation_functions_take_device_names(array_api_strict_backend):
    import array_api_strict as strict

    made = [
        attnx.asarray(np.ones(3), backend="array_api_strict", device="device1"),
        attnx.masks.causal(3, backend="array_api_strict", device="device1"),
        attnx.masks.sliding_window(3, window=1, backend="array_api_strict", device="device1"),
        attnx.sinusoidal_positions(3, 4, backend="array_api_strict", device="device1"),
        attnx.init_multi_head_params(8, 2, backend="array_api_strict", device="device1")["w_q"],
    ]
    assert all(array.device == strict.Device("device1") for array in made)


def test_a_kind_of_device_names_the_first_device_of_that_kind():
    class Device:  # a library's device object, as JAX's are
        def __init__(self, label):
            self.label = label

        def __str__(self):
            return self.label

    class TwoKinds(attnx.Backend):
        def devices(self):
            return [Device("cpu:0"), Device("gpu:0"), Device("gpu:1")]

    backend = TwoKinds()
    assert [str(backend.device(name)) for name in ("gpu", "gpu:1", "cpu", "cpu:0")] == [
        "gpu:0",
        "gpu:1",
        "cpu:0",
        "cpu:0",
    ]
    assert backend.device("tpu") == "tpu"  # not this backend's: the creation functions refuse it first


def test_jax_arrays_made_on_a_kind_of_device():
    # JAX reads no device name itself: "cpu" must become jax.devices("cpu")[0].
    jax = pytest.importorskip("jax")
    made = [
        attnx.asarray(np.ones(3, dtype=np.float32), backend="jax", device="cpu"),
        attnx.masks.causal(3, backend="jax", device="cpu"),
        attnx.sinusoidal_positions(3, 4, backend="jax", device="cpu"),
    ]
    assert all(array.devices() == {jax.devices("cpu")[0]} for array in made)


@pytest.fixture(params=["loopback", "vectorised"])  # named before "numpy" and after
def sharing(request, loopback_class, register_backend):
    """A backend that owns NumPy arrays too, registered after numpy."""
    return register_backend(type("Sharing", (loopback_class,), {"name": request.param})(), "sharing-plugin")


@pytest.mark.parametrize("choice", ["use_backend() block", "set_backend()", "$ATTNX_BACKEND"])
def test_the_chosen_backend_wins_a_type_it_shares_when_it_owns_every_input(sharing, caplog, monkeypatch, choice):
    """numpy's calls stay numpy's, unless the user chose the backend that
    shares its arrays, however they chose it; the plan made for the
    signature before does not hold."""
    call = lambda: attnx.scaled_dot_product_attention(*QKV)  # noqa: E731
    with caplog.at_level(logging.DEBUG, logger="attnx"):
        call()
        assert sharing.calls == []
        if choice == "use_backend() block":
            with attnx.use_backend(sharing.name):
                call()
        elif choice == "set_backend()":
            attnx.set_backend(sharing.name)
            try:
                call()
            finally:
                attnx.set_backend(None)
        else:
            monkeypatch.setenv("ATTNX_BACKEND", sharing.name)
            call()
            monkeypatch.delenv("ATTNX_BACKEND")
        call()
    assert len(sharing.calls) == 1
    assert caplog.messages == [
        "scaled_dot_product_attention: backend 'numpy' (owns query), native",
        f"scaled_dot_product_attention: backend '{sharing.name}' ({choice}, owns the inputs too), native",
        "scaled_dot_product_attention: backend 'numpy' (owns query), native",
    ]


def _unknown_devices():
    raise RuntimeError("the driver did not answer")


@pytest.mark.parametrize("listed", [2, 3, "a failing devices()"])
def test_inputs_on_two_devices_of_one_backend_are_refused(array_api_strict_backend, monkeypatch, listed):
    """A backend with several devices (array-api-strict's example lists
    three; two, as PyTorch on a machine with one GPU; or it can't tell) has
    its inputs compared device by device; one device alone is a call."""
    import array_api_strict as strict

    devices = array_api_strict_backend.devices()
    monkeypatch.setattr(
        array_api_strict_backend, "devices", _unknown_devices if isinstance(listed, str) else lambda: devices[:listed]
    )
    attnx._registry._forget_types()  # what it learnt of the type, with the devices listed before
    default = strict.ones((2, 3, 4))
    other, another = (strict.ones((2, 3, 4), device=strict.Device("device1")) for _ in range(2))
    with pytest.raises(ValueError, match=r"inputs lie on two devices: query on .* but key on .*device1"):
        attnx.scaled_dot_product_attention(default, other, default)
    assert attnx.scaled_dot_product_attention(other, another, other).device == other.device
