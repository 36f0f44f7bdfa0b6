"""pb_utils' arguments as Triton's pybind11 bindings take them (python_backend r24.10,
``src/pb_stub.cc``): where Triton takes a C++ string, ``str`` and ``bytes`` (read as
UTF-8) both work and give the same ``str`` back; any other type is pybind11's
``TypeError`` ("incompatible function arguments"), or the TritonModelException Triton
raises itself where its own code checks the argument. These run on pb_utils alone; the
arguments whose effect needs a worker and a server (BLS, model control, metrics, output
names) are run inside a real worker by tests/e2e/test_worker_arguments.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from dlserve import pb_utils as pb_utils

X = np.arange(3, dtype=np.float32)


def request(**kwargs: Any) -> pb_utils.InferenceRequest:
    arguments = {"model_name": "m", "inputs": [], "requested_output_names": [], **kwargs}
    return pb_utils.InferenceRequest(**arguments)


# (argument, make(value) -> what it reads back, the text it reads back)
TEXT_ARGUMENTS: list[tuple[str, Callable[[Any], object], str]] = [
    ("TritonError(message)", lambda v: pb_utils.TritonError(v).message(), "went wrong"),
    ("Tensor(name)", lambda v: pb_utils.Tensor(v, X).name(), "OUTPUT0"),
    ("Tensor.from_dlpack(name)", lambda v: pb_utils.Tensor.from_dlpack(v, X).name(), "OUTPUT0"),
    ("InferenceRequest(model_name)", lambda v: request(model_name=v).model_name(), "add_sub"),
    ("InferenceRequest(request_id)", lambda v: request(request_id=v).request_id(), "r-1"),
    (
        "InferenceRequest(requested_output_names)",
        lambda v: request(requested_output_names=[v, "B"]).requested_output_names()[0],
        "OUTPUT1",
    ),
]


@pytest.mark.parametrize(("argument", "make", "text"), TEXT_ARGUMENTS, ids=lambda a: a)
@pytest.mark.parametrize("kind", ["str", "bytes", "bytearray", "numpy"])
def test_a_c_string_argument_takes_str_and_bytes(
    argument: str, make: Callable[[Any], object], text: str, kind: str
) -> None:
    value = {"str": text, "bytes": text.encode(), "bytearray": bytearray(text.encode()),
             "numpy": np.array([text.encode()], dtype=np.object_)[0]}[kind]  # fmt: skip
    read = make(value)
    assert read == text and type(read) is str


@pytest.mark.parametrize(("argument", "make", "text"), TEXT_ARGUMENTS, ids=lambda a: a)
@pytest.mark.parametrize("wrong", [5, None, 1.5, ["x"], "\udc80"], ids=repr)
def test_a_c_string_argument_refuses_other_types_as_pybind11_does(
    argument: str, make: Callable[[Any], object], text: str, wrong: object
) -> None:
    """A lone surrogate is a str that has no UTF-8 form: pybind11 refuses it too."""
    with pytest.raises(TypeError, match=r"\(\): incompatible (function|constructor) arguments"):
        make(wrong)


def test_bytes_that_are_not_utf8_are_refused_where_they_name_something() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="model_name is not valid UTF-8"):
        request(model_name=b"\xff\xfe")
    with pytest.raises(pb_utils.TritonModelException, match="Tensor name is not valid UTF-8"):
        pb_utils.Tensor(b"\xff", X)
    # a message is only text: what cannot be read is replaced, the error stays an error
    assert pb_utils.TritonError(b"bad \xff").message() == "bad \ufffd"
    # TritonModelException is a plain exception in Triton: any object, as str() writes it
    assert pb_utils.TritonModelException(b"x").message() == "b'x'"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        # Triton checks these itself, with its messages
        (lambda: request(correlation_id=b"7"), "Correlation ID must be integer or string"),
        # (beyond an unsigned 64-bit number Triton's cast fails; dlserve says why)
        (lambda: request(correlation_id=-1), "Correlation ID must be integer or string"),
        (
            lambda: request(parameters={b"key": "v"}),
            "Expect parameters keys to have type str, found type <class 'bytes'>",
        ),
        (
            lambda: request(parameters={"key": b"v"}),
            "Expect parameters values to have type bool/int/float/str, found type <class 'bytes'>",
        ),
        (
            lambda: pb_utils.InferenceResponse(parameters={b"key": "v"}),
            "Expect parameters keys to have type str, found type <class 'bytes'>",
        ),
        (lambda: request(inputs=[None]), "Input tensor for request with id '' and model name"),
        (
            lambda: request(requested_output_names=[""]),
            "Requested output name for request with id '' and model name 'm' should not be empty.",
        ),
        (
            lambda: pb_utils.InferenceResponse([None]),  # type: ignore[list-item]
            "Output tensor for inference response should not be empty.",
        ),
        (lambda: pb_utils.Tensor("", X), "Tensor name cannot be an empty string."),
        (lambda: pb_utils.Tensor.from_dlpack("", X), "Tensor name cannot be an empty string."),
        # what a frame cannot carry: refused before it is sent
        (lambda: request(parameters={"key": "\udc80"}), "is not valid UTF-8 text"),
        (lambda: request(parameters={"key": 2**64}), "does not fit in a 64-bit integer"),
        (lambda: request(parameters='{"key": [1]}'), "found type <class 'list'>"),
    ],
)
def test_triton_s_own_checks_raise_triton_model_exception(
    make: Callable[[], object], message: str
) -> None:
    with pytest.raises(pb_utils.TritonModelException) as raised:
        make()
    assert message in raised.value.message()


@pytest.mark.parametrize(
    "make",
    [
        # Triton requires inputs, requested_output_names and model_name
        lambda: pb_utils.InferenceRequest(inputs=[], requested_output_names=["OUTPUT0"]),
        lambda: pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=["O"]),
        lambda: pb_utils.InferenceRequest(model_name="add_sub", inputs=[]),
        # a string is not a list of names, None is not a list
        lambda: request(requested_output_names="OUTPUT0"),
        lambda: request(requested_output_names=None),
        lambda: request(requested_output_names=[None]),
        lambda: request(inputs=None),
        lambda: request(inputs=[5]),
        # numbers of C++ integer types: no None, no float, nothing out of range
        lambda: request(model_version=None),
        lambda: request(model_version=1.0),
        lambda: request(flags=None),
        lambda: request(flags=-1),
        lambda: request(timeout=2**64),
        lambda: request(correlation_id=None),
        lambda: request().set_flags("1"),
        lambda: pb_utils.InferenceResponse(output_tensors=None),  # type: ignore[arg-type]
        lambda: pb_utils.InferenceResponse(error=5),  # type: ignore[arg-type]
        lambda: pb_utils.Tensor("OUTPUT0", None),
        lambda: pb_utils.Tensor("", None),  # the types are checked first, as pybind11 does
        lambda: pb_utils.Logger.log("level", None),  # type: ignore[arg-type]
        lambda: pb_utils.Logger.log("level", 1),  # type: ignore[arg-type]
    ],
)
def test_arguments_pybind11_would_not_convert_are_type_errors(make: Callable[[], object]) -> None:
    with pytest.raises(TypeError, match="incompatible"):
        make()


def test_the_constructor_s_message_is_pybind11_s() -> None:
    with pytest.raises(TypeError) as raised:
        pb_utils.InferenceRequest(model_name=7, inputs=[], requested_output_names=[])
    lines = str(raised.value).splitlines()
    assert lines[0] == (
        "__init__(): incompatible constructor arguments. The following argument types are "
        "supported:"
    )
    assert lines[1].startswith("    1. triton_python_backend_utils.InferenceRequest(request_id: ")
    assert lines[-1] == "Invoked with: kwargs: inputs=[], requested_output_names=[], model_name=7"


def test_triton_s_argument_order_and_numbers_of_other_integer_types() -> None:
    tensor = pb_utils.Tensor("INPUT0", X)
    made = pb_utils.InferenceRequest("r", 7, [tensor], [b"OUT"], b"m", np.int64(2), True)
    assert (made.request_id(), made.correlation_id(), made.inputs()) == ("r", 7, [tensor])
    assert (made.requested_output_names(), made.model_name()) == (["OUT"], "m")
    assert (made.model_version(), made.flags()) == (2, 1)
    assert all(type(v) is int for v in (made.model_version(), made.flags(), made.timeout()))
    named = pb_utils.InferenceRequest(model_name="m", inputs=(), requested_output_names=())
    assert (named.inputs(), named.requested_output_names()) == ([], [])


def test_parameters_and_errors_as_dlserve_also_takes_them() -> None:
    """The JSON text of parameters, float values, and an error given as its message."""
    made = request(parameters='{"a": 1, "b": 0.5}')
    assert json.loads(made.parameters()) == {"a": 1, "b": 0.5}
    for error in ("boom", b"boom"):
        response = pb_utils.InferenceResponse(error=error)
        assert response.error() is not None and response.error().message() == "boom"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "log",
    [
        lambda v: pb_utils.Logger.log(v),
        lambda v: pb_utils.Logger.log(v, pb_utils.Logger.WARNING),
        pb_utils.Logger.log_info,
        pb_utils.Logger.log_warn,
        pb_utils.Logger.log_error,
    ],
)
def test_log_messages_take_str_and_bytes(
    capsys: pytest.CaptureFixture[str], log: Callable[[Any], None]
) -> None:
    log("one line")
    log(b"another line")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["one line", "another line"]
    for wrong in (None, 5):
        with pytest.raises(TypeError, match=r"\(\): incompatible function arguments"):
            log(wrong)


def test_control_and_metric_arguments_are_checked_before_anything_is_sent() -> None:
    """Outside a worker these would fail for want of a server; the type comes first."""
    for make in (
        lambda: pb_utils.is_model_ready(5),
        lambda: pb_utils.is_model_ready("m", 1),
        lambda: pb_utils.load_model(None),
        lambda: pb_utils.load_model("m", config=5),
        lambda: pb_utils.unload_model(5),
        lambda: pb_utils.unload_model("m", unload_dependents="yes"),
        lambda: pb_utils.load_model("m", "{}", files={"file:1/model.py": "text"}),
        lambda: pb_utils.MetricFamily(5, "d", pb_utils.MetricFamily.COUNTER),
        lambda: pb_utils.MetricFamily("n", None, pb_utils.MetricFamily.COUNTER),
    ):
        with pytest.raises(TypeError, match=r"incompatible|is not an instance of 'bytes'"):
            make()


def test_lookups_by_name_compare_as_triton_s_python_does() -> None:
    """get_input_tensor_by_name is Python in Triton too: it compares the name with each
    tensor's ``name()`` (a str), so a bytes name finds nothing, as there."""
    tensor = pb_utils.Tensor("INPUT0", X)
    made = request(inputs=[tensor])
    assert pb_utils.get_input_tensor_by_name(made, "INPUT0") is tensor
    assert pb_utils.get_input_tensor_by_name(made, b"INPUT0") is None
    response = pb_utils.InferenceResponse([tensor])
    assert pb_utils.get_output_tensor_by_name(response, b"INPUT0") is None


def test_metric_labels_are_what_json_writes_as_in_triton() -> None:
    """Triton writes the labels with json.dumps: its TypeError for bytes. (Outside a worker
    the family itself cannot be made; the labels are checked on their own here.)"""
    from dlserve.pb_utils.custom_metrics import _labels

    assert _labels({"k": "v"}) == {"k": "v"}
    with pytest.raises(TypeError, match="bytes is not JSON serializable"):
        _labels({"k": b"v"})
    with pytest.raises(pb_utils.TritonModelException, match="must be a string"):
        _labels({"k": 5})
