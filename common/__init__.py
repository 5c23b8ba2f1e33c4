"""What both halves need, importing neither: communication modes (modes.py),
address rules (addresses.py), the pure planner and its job spec (planning/)
with the refusals it raises (errors.py). The wire package is commctx.v1
(proto/). The server (commctx.server) and the client (commctx) import this;
it imports neither of them."""
