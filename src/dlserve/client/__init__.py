"""dlserve's client SDK: one-call inference with numpy, torch, cupy or any DLPack tensor,
shared memory handled for you (pools of regions registered once, freed on exit), and
drop-in replacements for tritonclient's shared-memory utilities.

- :class:`Client` / :class:`AsyncClient` (``dlserve.client.aio``);
- :mod:`dlserve.client.shared_memory`, :mod:`dlserve.client.cuda_shared_memory`.
"""

from dlserve.client._tensors import DeviceArray
from dlserve.client.aio import AsyncClient
from dlserve.client.client import Client

__all__ = ["AsyncClient", "Client", "DeviceArray"]
