"""The server process: command line, wiring, transports, frontends and core."""
