"""The server's core: models, scheduling, calls, shared memory, telemetry."""
