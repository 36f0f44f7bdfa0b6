"""Facts about the host: GPUs, MPS, processes behind connections."""
