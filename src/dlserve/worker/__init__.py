"""The worker process: runs one model instance (``python -m dlserve.worker.main``)."""
