"""The daemon's gRPC layer: the servicer (thin, proto -> engine -> proto) and the server."""
