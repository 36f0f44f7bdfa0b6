"""The server's handles on its worker processes (model instances)."""
