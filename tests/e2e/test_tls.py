"""gRPC over TLS with Triton's options (--grpc-use-ssl, --grpc-use-ssl-mutual,
--grpc-server-cert, --grpc-server-key, --grpc-root-cert), driven by unmodified tritonclient.

The certificates are made for the test with the openssl command line: a CA, a server
certificate for localhost signed by it, and a client certificate for mutual TLS.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import EXAMPLES, run_server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def _signed(folder: Path, name: str, subject: str, extensions: str) -> None:
    _openssl(folder, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", subject)  # fmt: skip
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
             "-extfile", f"{name}.ext")  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "2", "-subj", "/CN=dlserve test CA")  # fmt: skip
    _signed(folder, "server", "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _signed(folder, "client", "/CN=a client", "extendedKeyUsage=clientAuth\n")
    return folder


def _tls_flags(certs: Path, mutual: bool) -> list[str]:
    flags = ["--grpc-use-ssl", "--grpc-server-cert", str(certs / "server.pem"),
             "--grpc-server-key", str(certs / "server.key")]  # fmt: skip
    if mutual:
        flags += ["--grpc-use-ssl-mutual", "true", "--grpc-root-cert", str(certs / "ca.pem")]
    return flags


def _add_sub(client: grpcclient.InferenceServerClient) -> None:
    a, b = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    inputs = [grpcclient.InferInput("INPUT0", [4], "FP32"),
              grpcclient.InferInput("INPUT1", [4], "FP32")]  # fmt: skip
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("add_sub", inputs, client_timeout=60)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


@pytest.fixture(scope="module")
def tls_server(certs: Path) -> Iterator[int]:
    with run_server(EXAMPLES, *_tls_flags(certs, mutual=False)) as server:
        yield server.grpc_port


def test_a_tls_client_is_served(certs: Path, tls_server: int) -> None:
    client = grpcclient.InferenceServerClient(
        f"localhost:{tls_server}", ssl=True, root_certificates=str(certs / "ca.pem")
    )
    assert client.is_server_live()
    _add_sub(client)
    client.close()


def test_a_plain_text_client_is_not(tls_server: int) -> None:
    client = grpcclient.InferenceServerClient(f"localhost:{tls_server}")
    with pytest.raises(InferenceServerException):
        client.is_server_live(client_timeout=10)
    client.close()


def test_mutual_tls_wants_the_clients_certificate(certs: Path) -> None:
    with run_server(EXAMPLES, *_tls_flags(certs, mutual=True)) as server:
        url = f"localhost:{server.grpc_port}"
        trusted = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(certs / "ca.pem"),
            private_key=str(certs / "client.key"), certificate_chain=str(certs / "client.pem"),
        )  # fmt: skip
        _add_sub(trusted)
        trusted.close()
        anonymous = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(certs / "ca.pem")
        )
        with pytest.raises(InferenceServerException):
            anonymous.is_server_live(client_timeout=10)
        anonymous.close()


def test_a_missing_certificate_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(EXAMPLES),
         "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", "--grpc-use-ssl",
         "--grpc-server-cert", str(tmp_path / "none.pem"),
         "--grpc-server-key", str(tmp_path / "none.key")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "cannot set up TLS for gRPC" in done.stderr
