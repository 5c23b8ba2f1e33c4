"""Rendezvous: the domain, and below it the stores (the layers of
server/__init__.py). The state machine (machine.py) changes the in-memory
model (model.py) in synchronous transitions on validated requests
(params.py) and returns the actions they imply, which the executor
(executor.py) persists through a store (store.py, sqlite.py, etcd.py), then
announces, then wakes. Nothing here imports the edges (rpc/, web/) or the
process that wires them; only the stores do I/O (grpc in etcd.py, as etcd's
client), and no module builds protocol messages."""
