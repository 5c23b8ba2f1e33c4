"""Which torch.distributed backend: a name checked against what this torch
has, and 'auto' resolved to NCCL or gloo."""

from __future__ import annotations

import difflib

import torch
import torch.distributed as dist

from .errors import InvalidArgument, UsageError


def torch_backends() -> tuple[list[str], list[str]]:
    """The backends this torch knows (torch.distributed.Backend's list, with
    third-party ones registered; not 'undefined'), and those of them built
    into it, as far as torch can tell."""
    known = [b for b in dist.Backend.backend_list if b != dist.Backend.UNDEFINED]
    built = []
    for b in known:
        try:
            if hasattr(dist, "is_backend_available"):  # torch >= 2.3: plugins too
                ok = dist.is_backend_available(b)
            else:
                check = getattr(dist, f"is_{b}_available", None)
                ok = check() if check is not None else True
        except Exception:  # noqa: BLE001 - a plugin's own check failing: not available
            ok = False
        if ok:
            built.append(b)
    return known, built


# torch's "fake" backend stands in for a real one in torch's own test suites: accepted, never suggested.
_UNLISTED_BACKENDS = ("fake",)


def check_backend(backend: str | None) -> str:
    """The lower-cased name of `backend` ('auto' for None), when torch knows it.

    Accepts 'auto', a backend of torch.distributed.Backend (gloo, nccl, ucc,
    mpi, xccl and registered third-party ones), or torch's per-device form
    'cpu:gloo,cuda:nccl' of those.

    Raises:
        InvalidArgument: torch knows no such backend (the message lists those
            it has and suggests the closest name), or this torch was built
            without it.
    """
    if backend is None:
        return "auto"
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string such as 'auto', 'gloo' or 'nccl', not {type(backend).__name__}")
    name = backend.strip().lower()
    if name == "auto":
        return name
    known, built = torch_backends()
    shown = [b for b in known if b not in _UNLISTED_BACKENDS]
    parts = [p.partition(":")[2] if ":" in p else p for p in name.split(",")] if ":" in name else [name]
    for part in parts:
        if part not in known:
            close = difflib.get_close_matches(part, [*shown, "auto"], n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidArgument(
                f"backend {backend[:64]!r} is not a torch.distributed backend{hint}: give 'auto' or one of "
                f"{', '.join(shown)} (built into this torch {torch.__version__}: "
                f"{', '.join(b for b in built if b not in _UNLISTED_BACKENDS) or 'none'})")
        if part not in built and part != "nccl":  # nccl without CUDA: resolve_backend says why
            raise InvalidArgument(
                f"backend {part!r} is not built into this torch ({torch.__version__}): give 'auto' or one of "
                f"{', '.join(b for b in built if b not in _UNLISTED_BACKENDS) or 'none'}")
    return name


def resolve_backend(backend: str | None) -> str:
    """'auto' (or None) -> 'nccl' when CUDA is available, else 'gloo'; any
    other name as check_backend accepts it.

    Raises:
        InvalidArgument: torch has no such backend (see check_backend).
        UsageError: 'nccl' was asked for but no CUDA device is visible.
    """
    name = check_backend(backend)
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise UsageError("backend 'nccl' needs a CUDA device and none is visible; use 'gloo' or 'auto'")
    return name
