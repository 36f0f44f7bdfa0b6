"""What ``execute`` returned, checked; and rescheduled requests (iterative sequences).

A model whose config has ``sequence_batching { iterative_sequence: true }`` may call
``request.set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``: when ``execute``
returns, that request is not done, and the server sends it to this instance again with
the next batch (Triton's continuous batching for iterative models). A non-decoupled model
puts None in its place in the responses; its response comes with a later ``execute``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError

RESCHEDULE = pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE


def iterative(config: dict[str, Any]) -> bool:
    """Whether the model's requests may be rescheduled."""
    return bool(config.get("sequence_batching", {}).get("iterative_sequence", False))


def checked_responses(
    responses: Any, requests: Sequence[pb_utils.InferenceRequest]
) -> list[pb_utils.InferenceResponse | None]:
    """execute()'s result checked, with Triton's messages: one InferenceResponse per
    request, or None where the request's response sender answers it (or it was
    rescheduled); None for the whole list when the senders answer every request."""
    count = len(requests)
    if responses is None:
        return [None] * count
    if not isinstance(responses, (list, tuple)):  # a tuple: no union object per call
        raise TritonError(f"Expected a list in the execute return, found type '{type(responses)}'.")
    if len(responses) != count:
        raise TritonError(
            "Number of InferenceResponse objects do not match the number of "
            f"InferenceRequest objects. InferenceRequest(s) size is:{count}, and "
            f"InferenceResponse(s) size is:{len(responses)}"
        )
    for response in responses:
        if response is not None and not isinstance(response, pb_utils.InferenceResponse):
            raise TritonError(
                "Expected an 'InferenceResponse' object in the execute function return "
                f"list, found type '{type(response)}'."
            )
    return responses if type(responses) is list else list(responses)


def rescheduled_reply(rid: int, response: pb_utils.InferenceResponse | None) -> m.InferDone:
    """The reply for a request the model rescheduled: it runs again, its response later."""
    if response is not None:
        raise TritonError(
            "a rescheduled request must have None in place of its response (its response "
            "comes from a later execute)"
        )
    return m.InferDone(rid=rid, rescheduled=True)
