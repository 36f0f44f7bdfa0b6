"""The worker's channel to the server, shared by the serve loop and the model."""
