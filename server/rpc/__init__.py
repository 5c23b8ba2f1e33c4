"""The RPC edge: the wire codec, the gRPC servicer and the server's wiring."""
