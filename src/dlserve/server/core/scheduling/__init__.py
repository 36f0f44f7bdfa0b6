"""Where requests wait for an instance: queues, batching, sequences."""
