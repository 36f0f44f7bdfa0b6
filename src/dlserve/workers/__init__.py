"""dlserve internals."""
