"""Client shared memory (system and CUDA): registry, owners, checks."""
