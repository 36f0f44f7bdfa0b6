"""``--busy-poll-us``: workers and the server poll instead of sleeping; answers stay right."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient

from conftest import EXAMPLES, run_server


def test_a_busy_polling_server_answers_correctly() -> None:
    with run_server(EXAMPLES, "--busy-poll-us", "300") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        for n in range(20):
            a = np.full(16, n, np.float32)
            b = np.arange(16, dtype=np.float32)
            inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"),
                      grpcclient.InferInput("INPUT1", [16], "FP32")]  # fmt: skip
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer("add_sub", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        client.close()
