"""Protocol machinery of the server's endpoints (HTTP/2, gRPC, HTTP/1.1): imports
nothing of dlserve's domain; what is Triton's is passed in."""
