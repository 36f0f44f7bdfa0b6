"""``pb_utils.InferenceRequest`` and ``pb_utils.InferenceResponse``."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from dlserve.pb_utils import arguments
from dlserve.pb_utils.exceptions import TritonError, TritonModelException
from dlserve.pb_utils.runtime import current as _runtime
from dlserve.pb_utils.tensor import Tensor

ParamValue = bool | int | float | str


def _parameters_json(parameters: Mapping[str, Any] | str | None) -> str:
    """Triton's JSON form of request/response parameters, checked as Triton checks them
    (with its messages), and so that every value can travel in a frame.

    dlserve also takes float values (both wire protocols carry them), and the JSON text
    of an object (what ``request.parameters()`` returns).
    """
    if not parameters:
        return "{}"
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except ValueError as exc:
            raise TritonModelException(f"parameters are not a JSON object: {exc}") from None
    if not isinstance(parameters, Mapping):
        raise TritonModelException(
            f"Expect parameters to be a dict, got {type(parameters).__name__}"
        )
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key)}"
            )
        if not isinstance(value, bool | int | float | str):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/float/str, found type "
                f"{type(value)}"
            )
        _check_parameter(key, value)
    return json.dumps(dict(parameters))


def _check_parameter(key: str, value: ParamValue) -> None:
    """What a frame cannot carry: text that is not UTF-8, integers beyond 64 bits."""
    for piece in (key, value) if isinstance(value, str) else (key,):
        try:
            arguments.text(piece, "a parameter")
        except arguments.NotText:
            raise TritonModelException(
                f"parameter '{key.encode(errors='replace').decode()}' is not valid UTF-8 text"
            ) from None
    if type(value) is int and not arguments.INT64[0] <= value <= arguments.UINT64[1]:
        raise TritonModelException(f"parameter '{key}': {value} does not fit in a 64-bit integer")


class InferenceTrace:
    """A request's trace, as ``request.trace()`` returns it (python_backend's class):
    ``InferenceRequest(..., trace=request.trace())`` traces a BLS call as a child of the
    request's trace, when the request is traced."""

    __slots__ = ("_id",)

    def __init__(self, trace_id: int = 0) -> None:
        self._id = trace_id  # the server's trace id; 0: the request is not traced

    def get_context(self, mode: str = "opentelemetry") -> str | None:
        """The OpenTelemetry context: None, dlserve has only Triton's trace mode."""
        del mode
        return None


NOT_TRACED = InferenceTrace()


def _tensors(tensors: object) -> list[Tensor | None]:
    """A ``std::vector<Tensor>`` argument: a sequence of Tensors (raises NotText: it does
    not convert). A None in it is left for the caller's check (Triton's
    TritonModelException)."""
    kind = type(tensors)
    if (  # a list or tuple (the usual cases) needs no look at the Sequence ABC
        kind is not list
        and kind is not tuple
        and (isinstance(tensors, str | bytes) or not isinstance(tensors, Sequence))
    ):
        raise arguments.NotText
    result: list[Tensor | None] = list(tensors)  # type: ignore[call-overload]
    for tensor in result:
        if tensor is not None and not isinstance(tensor, Tensor):
            raise arguments.NotText
    return result


_REQUEST_SIGNATURE: Final = (
    f"{arguments.MODULE}.InferenceRequest(request_id: str = '', correlation_id: object = 0, "
    f"inputs: List[{arguments.MODULE}.Tensor], requested_output_names: List[str], "
    "model_name: str, model_version: int = -1, flags: int = 0, timeout: int = 0, "
    f"preferred_memory: {arguments.MODULE}.PreferredMemory = PreferredMemory(), "
    f"trace: {arguments.MODULE}.InferenceTrace = InferenceTrace(), parameters: object = None)"
)
_RESPONSE_SIGNATURE: Final = (
    f"{arguments.MODULE}.InferenceResponse(output_tensors: List[{arguments.MODULE}.Tensor] "
    f"= [], error: {arguments.MODULE}.TritonError = None, parameters: object = None)"
)


class _Required:
    """The default of an argument Triton requires (there is none: leaving it out is
    pybind11's TypeError)."""

    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()


# the constructor's arguments, in order, and their defaults (_REQUIRED: none)
_REQUEST_ARGUMENTS: Final[dict[str, object]] = {
    "request_id": "", "correlation_id": 0, "inputs": _REQUIRED,
    "requested_output_names": _REQUIRED, "model_name": _REQUIRED, "model_version": -1,
    "flags": 0, "timeout": 0, "preferred_memory": None, "trace": None, "parameters": None,
}  # fmt: skip


def _given(local: dict[str, Any]) -> dict[str, object]:
    """The arguments a constructor call was given, for pybind11's message (those left out,
    or at their defaults, are not shown)."""
    given = {}
    for key, default in _REQUEST_ARGUMENTS.items():
        value = local[key]
        if value is not _REQUIRED and not (type(value) is type(default) and value == default):
            given[key] = value
    return given


def _correlation_id(value: object) -> int | str:
    """Triton's correlation id: an unsigned 64-bit int or a string."""
    if isinstance(value, int) and arguments.UINT64[0] <= value <= arguments.UINT64[1]:
        return int(value)  # a bool is an int to pybind11: its number goes on
    if isinstance(value, str):
        try:
            return arguments.text(value, "correlation_id")
        except arguments.NotText:
            pass
    elif value is None:
        raise arguments.incompatible("__init__", _REQUEST_SIGNATURE, {"correlation_id": value})
    raise TritonModelException("Correlation ID must be integer or string")


_RELEASE_ALL = 1  # TRITONSERVER_REQUEST_RELEASE_ALL
_RELEASE_RESCHEDULE = 2  # TRITONSERVER_REQUEST_RELEASE_RESCHEDULE


class InferenceRequest:
    """A request given to ``execute``; also the constructor of a BLS request."""

    # set_release_flags(): RESCHEDULE runs the request again in a later execute
    # (models with sequence_batching { iterative_sequence: true }: the worker says so)
    _release_flags: int = _RELEASE_ALL
    _reschedulable: bool = False
    # a request given to a model that is not decoupled: its response sender, made by the
    # worker at the first get_response_sender() and the same one after
    _open_sender: Callable[[InferenceRequest], InferenceResponseSender] | None = None
    _rid = 0  # the worker's number for such a request

    def __init__(
        self,
        request_id: str | bytes = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] = _REQUIRED,
        requested_output_names: Sequence[str | bytes] = _REQUIRED,
        model_name: str | bytes = _REQUIRED,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: object = None,
        trace: object = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        """Triton's constructor, its arguments in its order: ``inputs``,
        ``requested_output_names`` and ``model_name`` are required; names may be bytes."""
        try:
            self._model_name = arguments.text(model_name, "model_name")
            self._request_id = arguments.text(request_id, "request_id")
            self._requested_output_names = arguments.texts(
                requested_output_names, "requested_output_names"
            )
            self._model_version = arguments.integer(model_version, arguments.INT64)
            self._flags = arguments.integer(flags, arguments.UINT32)
            self._timeout = arguments.integer(timeout, arguments.UINT64)
            self._inputs: list[Tensor] = _tensors(inputs)  # type: ignore[assignment]
        except arguments.NotText:
            raise arguments.incompatible("__init__", _REQUEST_SIGNATURE, _given(locals())) from None
        self._correlation_id = _correlation_id(correlation_id)
        self._check_names()
        self._trace = trace
        self._parameters = _parameters_json(parameters)
        self._preferred_memory = preferred_memory
        self._cancelled = False
        self._sender: InferenceResponseSender | None = None
        self._poll: Callable[[], None] | None = None  # reads a Cancel that has arrived

    def _check_names(self) -> None:
        """Triton's checks of the inputs and the requested outputs."""
        if None in self._inputs:
            raise TritonModelException(f"Input tensor for {self._which()} should not be empty.")
        if "" in self._requested_output_names:
            raise TritonModelException(
                f"Requested output name for {self._which()} should not be empty."
            )

    def _which(self) -> str:
        return f"request with id '{self._request_id}' and model name '{self._model_name}'"

    @classmethod
    def _received(
        cls,
        model_name: str,
        inputs: list[Tensor],
        requested_output_names: list[str],
        request_id: str,
        parameters: Mapping[str, ParamValue],
    ) -> InferenceRequest:
        """Internal: a request as ``execute`` receives it, from what the worker decoded
        (already checked by then)."""
        request = cls.__new__(cls)
        request._model_name, request._inputs = model_name, inputs
        request._requested_output_names = list(requested_output_names)
        request._request_id, request._correlation_id, request._flags = request_id, 0, 0
        request._model_version, request._timeout, request._trace = -1, 0, NOT_TRACED
        request._parameters = json.dumps(parameters) if parameters else "{}"
        request._preferred_memory, request._cancelled = None, False
        request._sender, request._poll = None, None
        return request

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        try:
            self._flags = arguments.integer(flags, arguments.UINT32)
        except arguments.NotText:
            signature = f"(self: {arguments.MODULE}.InferenceRequest, arg0: int) -> None"
            raise arguments.incompatible("set_flags", signature, (self, flags)) from None

    def timeout(self) -> int:
        return self._timeout

    def trace(self) -> object:
        """An :class:`InferenceTrace` for a request given to ``execute``."""
        return self._trace

    def parameters(self) -> str:
        """The request's parameters as a JSON object string, as in Triton."""
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def is_cancelled(self) -> bool:
        """Whether the client gave up on this request (a closed or cancelled stream)."""
        if not self._cancelled and self._poll is not None:
            self._poll()
        return self._cancelled

    def get_response_sender(self) -> InferenceResponseSender:
        """The request's sender: any number of responses for a decoupled model, exactly
        one for a model that is not (Triton 24.06 and later), sent before or after
        ``execute`` returns. A request the model built (BLS) has one that cannot send."""
        sender = self._sender
        if sender is None:
            opener = self._open_sender
            if opener is not None:  # the worker keeps it (not this request: see answers.py)
                return opener(self)
            sender = self._sender = InferenceResponseSender(self, None)
        return sender

    def set_release_flags(self, flags: int) -> None:
        """``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: when ``execute`` returns, this
        request is not done: it runs again in a later ``execute`` of this instance (a
        non-decoupled model puts None in its place in the responses). Needs
        ``sequence_batching { iterative_sequence: true }``, as in Triton."""
        if flags not in (_RELEASE_ALL, _RELEASE_RESCHEDULE):
            raise TritonModelException(
                f"set_release_flags: unknown flags {flags!r} (use "
                "TRITONSERVER_REQUEST_RELEASE_ALL or TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)"
            )
        if flags == _RELEASE_RESCHEDULE and not self._reschedulable:
            raise TritonModelException(
                "request rescheduling needs a model whose config has sequence_batching "
                "{ iterative_sequence: true }"
            )
        self._release_flags = flags

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on ``model_name`` (BLS): its response, or with ``decoupled``
        an iterator over the responses of a decoupled model (the empty final one last)."""
        return _runtime().execute(self, decoupled)

    async def async_exec(self, decoupled: bool = False) -> Any:
        """As :meth:`exec`, awaitable (``asyncio.gather`` runs several at once)."""
        return await _runtime().async_execute(self, decoupled)


class InferenceResponseSender:
    """``request.get_response_sender()``: responses, then the final flag, with Triton's
    rules and messages (python_backend's ``response_sender.cc``).

    ``emit`` (the worker's) sends one response (or none) with the flags; it may be called
    from any thread of the model. None: the request was built by the model (BLS), whose
    sender cannot send. A model that is not decoupled (``decoupled=False``) sends exactly
    one response, the final flag with it or after it; ``on_refused`` hears of a send
    these rules refuse (the exception is raised to the model as well).
    """

    def __init__(
        self,
        request: InferenceRequest,
        emit: Callable[[InferenceResponse | None, int], None] | None,
        *,
        decoupled: bool = True,
        on_refused: Callable[[TritonModelException], None] | None = None,
    ) -> None:
        self._request = request
        self._emit = emit
        self._decoupled = decoupled
        self._on_refused = on_refused
        self._closed = False
        self._sent = 0  # sends counted (a bare final flag too), as Triton counts them
        self._lock = threading.Lock()  # sends may come from several threads

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, _FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if response is None and flags == 0:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send() takes a pb_utils.InferenceResponse, not {type(response).__name__}"
            )
        self._count(response is not None, flags)
        assert self._emit is not None  # _count refuses a sender without one
        self._emit(response, flags)

    def _count(self, has_response: bool, flags: int) -> None:
        """Count one send, or raise Triton's message for a send its rules refuse."""
        with self._lock:
            refusal = self._refusal(has_response, flags)
            if refusal is None:
                if flags == _FINAL:
                    self._closed = True
                self._sent += 1
                return
        error = TritonModelException(refusal)
        if self._on_refused is not None:
            self._on_refused(error)
        raise error

    def _refusal(self, has_response: bool, flags: int) -> str | None:
        if self._emit is None:
            return (
                "Unable to send response. Response sender has no reference to the decoupled "
                "state of the model."
            )
        if not self._decoupled:
            if has_response and self._sent > 0:
                return SENT_TWICE
            if not has_response and flags == _FINAL and self._sent == 0:
                return (
                    "Unable to send response. Non-decoupled model cannot send complete final "
                    "before sending a response."
                )
        if self._closed:
            return "Unable to send response. Response sender has been closed."
        return None

    def _count_returned(self) -> None:
        """``execute`` returned a response for this (not decoupled) request: it counts as
        the one response, sent with the final flag."""
        self._count(True, _FINAL)

    def _close(self) -> bool:
        """Close it (the request ended otherwise); whether it was open."""
        with self._lock:
            was_open = not self._closed
            self._closed = True
            return was_open

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()

    @property
    def closed(self) -> bool:
        return self._closed


_FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL
SENT_TWICE = "Unable to send response. Non-decoupled model cannot send more than one response."


class InferenceResponse:
    """What ``execute`` returns for each request: output tensors or an error."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] = (),
        error: TritonError | str | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        """``error``: a TritonError (dlserve also takes its message as text)."""
        if isinstance(error, str | bytes):
            error = TritonError(error)
        try:
            if error is not None and not isinstance(error, TritonError):
                raise arguments.NotText
            tensors = _tensors(output_tensors)
        except arguments.NotText:
            given = {"output_tensors": output_tensors, "error": error}
            raise arguments.incompatible("__init__", _RESPONSE_SIGNATURE, given) from None
        if None in tensors:
            raise TritonModelException("Output tensor for inference response should not be empty.")
        self._output_tensors: list[Tensor] = tensors  # type: ignore[assignment]
        self._error = error
        self._parameters = _parameters_json(parameters)

    @classmethod
    def _received(
        cls, output_tensors: list[Tensor], parameters: Mapping[str, ParamValue] | None
    ) -> InferenceResponse:
        """Internal: a BLS call's response, from what the worker decoded (checked by the
        callee's worker already)."""
        response = cls.__new__(cls)
        response._output_tensors, response._error = output_tensors, None
        response._parameters = json.dumps(parameters) if parameters else "{}"
        return response

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters
