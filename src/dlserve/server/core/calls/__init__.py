"""Calls between models: BLS through the server, direct calls, ensembles."""
