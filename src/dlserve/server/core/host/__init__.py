"""The host and the server process on it: GPUs, MPS, processes behind connections, memory
given back when idle."""
