"""Rendezvous: the domain. The state machine (machine.py: one object whose
concerns are one module each: admission.py, forming.py, leases.py,
restore.py, views.py, and a job's history, history.py) over the in-memory
model (model.py) and the validated requests (params.py); deadlines in heaps
(deadlines.py); per-caller shares (shares.py); the store and its records
(store.py, sqlite.py, etcd.py); the executor that persists, announces and wakes
(executor.py, actions.py); the Join that waits for its world (waiting.py); and
the watches of a job's history (watching.py). Only the executor, waiting and
watching use asyncio; nothing here uses grpc or protobuf."""
