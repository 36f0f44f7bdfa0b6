"""The HTTP frontend against its own OpenAPI document (``docs/openapi.json``), with
schemathesis: every operation gets the document's examples, schemathesis's coverage cases
(missing and malformed parts, methods the route does not serve) and a bounded number of
generated requests, sent to a real server; each answer is checked against the document
(status codes, content types, bodies, headers), and schemathesis's own rules: no server
error, a 405 carries Allow, a request the document calls invalid is refused, one it calls
valid is not.

Generation is deterministic (``derandomize``), so a run is the same every time.

A request the document calls valid may still be refused where its validity depends on the
server's state, which a schema cannot say: an inference request's inputs must be the
model's, a region's key must name an existing object of the right size, a load's config
must be a model configuration, an unknown model is not ready (400, as in Triton). Those
operations may answer 400 to valid data (``STATEFUL_400``); everything else is checked in
full. UNAVAILABLE (503) and UNSUPPORTED (501) are answers of the protocol, not server
errors; 500 is.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from conftest import EXAMPLES, ROOT, RunningServer, run_server

DOCUMENT = ROOT / "docs" / "openapi.json"
MAX_EXAMPLES = 20  # generated requests per operation (fuzzing); examples and coverage: all
MODELS = ("add_sub", "double")
LOADED_AND_UNLOADED = "double"  # the only model the load and unload operations name

# Operations whose valid requests may be refused with 400 by the server's state.
STATEFUL_400 = (
    r"/infer$", r"/generate(_stream)?$",  # the model's inputs
    r"/ready$", r"/trace/setting$",  # an unknown model: not ready, "Request for unknown model"
    r"\{model\}(/versions/\{version\})?/stats$",  # an unknown model: INVALID_ARG in Triton
    r"/v2/repository/models/",  # a config or model files that do not load
    r"sharedmemory(/region/\{region\})?/register$",  # the object or handle must exist; a name
)  # fmt: skip

CONFIG: dict[str, Any] = {
    "generation": {"max-examples": MAX_EXAMPLES, "database": "none", "deterministic": True},
    "cache": {"enabled": False},  # no replay of earlier runs' failures: each run is the same
    "phases": {"stateful": {"enabled": False}},
    "checks": {"not_a_server_error": {"expected-statuses": ["2XX", "3XX", "4XX", "501", "503"]}},
    "operations": [
        *(
            {"include-path-regex": path,
             "checks": {"positive_data_acceptance": {"expected-statuses": [
                 "2XX", "3XX", "400", "401", "403", "404", "409", "429", "5XX"]}}}
            for path in STATEFUL_400
        ),
        # Triton answers a shared-memory key it cannot open with INTERNAL (500), and so does
        # dlserve (the object's name is the client's; the server only tries to open it).
        {"include-path-regex": r"^/v2/systemsharedmemory/region/\{region\}/register$",
         "checks": {"not_a_server_error": {"expected-statuses": ["2XX", "3XX", "4XX", "500",
                                                                  "501", "503"]}}},
        # Unloading a model every other operation uses would leave them nothing to serve.
        {"include-path-regex": r"^/v2/repository/models/",
         "parameters": {"model": LOADED_AND_UNLOADED}},
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def openapi_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Models the document's examples name, in explicit mode (load and unload answer)."""
    repository = tmp_path_factory.mktemp("openapi_repo")
    for name in MODELS:
        shutil.copytree(EXAMPLES / name, repository / name)
    with run_server(repository, "--model-control-mode", "explicit", "--load-model", "*") as server:
        yield server


REQUEST_TIMEOUT_S = 60

# Loaded at collection: one test per operation (the server's address is given per call).
schema = schemathesis.openapi.from_path(DOCUMENT, config=SchemathesisConfig.from_dict(CONFIG))


@schema.parametrize()
@settings(
    derandomize=True, database=None, deadline=None, max_examples=MAX_EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)  # fmt: skip
def test_the_server_does_what_its_document_says(case: Any, openapi_server: RunningServer) -> None:
    # a model's load starts a worker process: seconds on a loaded 2-core machine
    case.call_and_validate(base_url=f"http://{openapi_server.http_url}", timeout=REQUEST_TIMEOUT_S)
