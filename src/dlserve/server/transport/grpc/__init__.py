"""gRPC over HTTP/2, server side: ``rpc.py`` (a connection whose streams are calls),
``calls.py`` (the method table's entries, a call's context and state, gRPC's header
codecs), ``status.py`` (how a call ends), ``outbox.py`` (a streaming call's bounded queue of
responses) and ``listener.py`` (listening, TLS, graceful stop)."""
