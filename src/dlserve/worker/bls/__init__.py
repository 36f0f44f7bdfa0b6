"""BLS from inside a worker: calls to other models, their tensors, direct calls."""
