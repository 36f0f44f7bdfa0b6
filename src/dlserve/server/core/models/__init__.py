"""Model repository, configs, versions: loading, reloading, unloading."""
