"""The gRPC edge: the wire codec (codec.py, with status.py, paging.py, wire.py,
specs.py and undecodable.py), the servicer, callers' tokens at the door
(auth.py), health, and the gRPC server with its terms (app.py). It imports the
rendezvous layer below it, never the HTTP edge beside it (server/__init__.py)."""
