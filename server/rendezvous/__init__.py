"""Rendezvous: the state machine over the in-memory model (machine.py, model.py),
deadlines (deadlines.py), the store and its records (store.py, sqlite.py), and
the executor that persists, announces and wakes (executor.py). Only the
executor uses asyncio; nothing here uses grpc or protobuf."""
