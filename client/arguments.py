"""The checks of what a caller passes to CommContext (and of the variables
standing for it): each value that cannot be right fails at the call, with one
line naming the argument and what is wrong."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from commctx.v1 import rendezvous_pb2 as pb

from .errors import InvalidArgument, InvalidRequest
from .launcher import LauncherEnv
from .progress import DEFAULT_EVERY_S


def job_spec_of(spec: Mapping[str, Any] | pb.JobSpec | None, world_size: int) -> pb.JobSpec:
    """The wire JobSpec for `spec` (a message, its JSON form as a dict, or None).

    Raises:
        InvalidRequest (a ValueError): the dict is not a JobSpec (the message
            names an unknown key and where it is), or its world_size disagrees.
    """
    if spec is None:
        out = pb.JobSpec()
    elif isinstance(spec, pb.JobSpec):
        out = pb.JobSpec()
        out.CopyFrom(spec)
    else:
        if not isinstance(spec, Mapping):
            raise InvalidRequest("INVALID_ARGUMENT", f"spec is not a JobSpec: expected a dict or a JobSpec, got {type(spec).__name__}")
        problem = _spec_problem(spec, pb.JobSpec.DESCRIPTOR, "spec")
        if problem:
            raise InvalidRequest("INVALID_ARGUMENT", f"spec is not a JobSpec: {problem}")
        try:
            out = json_format.ParseDict(dict(spec), pb.JobSpec())
        except json_format.ParseError as exc:
            why = str(exc).splitlines()[0].rstrip(".")[:300]
            raise InvalidRequest("INVALID_ARGUMENT", f"spec is not a JobSpec: {why}") from None
    if out.world_size and out.world_size != world_size:
        raise InvalidRequest("INVALID_ARGUMENT", f"spec.world_size {out.world_size} disagrees with world_size {world_size}")
    out.world_size = world_size
    return out


def _spec_problem(value: Mapping[str, Any], descriptor: Any, path: str) -> str:
    """What is wrong with the shape of `value` as a `descriptor` message:
    the first key (here or in the messages nested in it) that names no field,
    or a message field that is not a dict (a repeated one not a list); ""
    when nothing is. Values themselves are left to json_format."""
    for key, item in value.items():
        field = None
        if isinstance(key, str):  # the proto name or its JSON (camelCase) name
            field = descriptor.fields_by_name.get(key) or descriptor.fields_by_camelcase_name.get(key)
        if field is None:
            known = ", ".join(f.name for f in descriptor.fields)
            return f"unknown key {key!r} in {path} (known keys: {known})"
        if item is None or field.message_type is None or field.message_type.full_name.startswith("google.protobuf."):
            continue  # None: JSON null, the field left out
        if field.is_repeated and not isinstance(item, list):
            return f"{path}.{key} must be a list, not {type(item).__name__}"
        for i, sub in enumerate(item) if field.is_repeated else [(None, item)]:
            where = f"{path}.{key}" + (f"[{i}]" if i is not None else "")
            if not isinstance(sub, Mapping):
                return f"{where} must be an object (a dict), not {type(sub).__name__}"
            found = _spec_problem(sub, field.message_type, where)
            if found:
                return found
    return ""


def check_seconds(name: str, value: float, what: str) -> float:
    """Returns `value` if it is a positive, finite number of seconds.

    Raises:
        InvalidArgument: it is not (the message names `name` and says `what` it is).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive number of seconds ({what}), not {_shown(value)}")
    return value


def progress_seconds(value: float | None, launcher: LauncherEnv) -> float:
    """How often a waiting join says who it waits for: `value`, else
    COMMCTX_PROGRESS_S, else every 10 s; 0 silences it.

    Raises:
        InvalidArgument: not a number of seconds of at least 0.
    """
    name = "progress_interval"
    if value is None and launcher.progress_s is not None:
        name, value = "COMMCTX_PROGRESS_S", launcher.progress_s
        try:
            value = float(value)
        except ValueError:
            raise InvalidArgument(f"COMMCTX_PROGRESS_S must be a number of seconds (0: no progress lines), "
                                  f"not {_shown(launcher.progress_s)}") from None
    if value is None:
        return DEFAULT_EVERY_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{name} must be a number of seconds (0: no progress lines), not {_shown(value)}")
    return float(value)


def share_host_of(value: bool | None, launcher: LauncherEnv) -> bool:
    """Whether workers of one host share a membership: `value`, else
    COMMCTX_SHARE_HOST ("0", "false", "no", "off": no), else yes.

    Raises:
        InvalidArgument: not True, False or None; a variable that is not a yes or no.
    """
    if value is not None:
        if not isinstance(value, bool):
            raise InvalidArgument(f"share_host must be True or False, not {_shown(value)}")
        return value
    raw = (launcher.share_host or "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise InvalidArgument(f"COMMCTX_SHARE_HOST must be 1 or 0 (true/false, yes/no, on/off), not {_shown(launcher.share_host)}")
    return raw in ("1", "true", "yes", "on")


def check_count(name: str, value: int | None, what: str, *, minimum: int = 1, optional: bool = False) -> int | None:
    """Returns `value` if it is an integer >= `minimum` (None too when `optional`).

    Raises:
        InvalidArgument: it is not (a bool, a string, a float or too small).
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        given = "not given" if value is None else f"not {_shown(value)}"
        raise InvalidArgument(f"{name} must be {kind} ({what}), {given}")
    return value


JOB_SECRET_MIN, JOB_SECRET_MAX = 16, 256


def check_job_secret(secret: str, source: str) -> str:
    """Returns `secret` if it can seal a job: 16-256 printable ASCII characters
    without spaces. `source` names where it came from ("job_secret=",
    "COMMCTX_JOB_SECRET").

    Raises:
        InvalidArgument: one line naming `source` and what is wrong, with the
            secret's length but never the secret itself.
    """
    if not isinstance(secret, str):
        raise InvalidArgument(f"{source}: a job secret is a string, not {type(secret).__name__}")
    rule = f"a job secret is {JOB_SECRET_MIN}-{JOB_SECRET_MAX} printable ASCII characters without spaces"
    if not secret:
        raise InvalidArgument(f"{source} is empty: {rule}, or leave it out for an open job")
    problem = ("has a space" if any(c.isspace() for c in secret) else
               "has a non-ASCII character" if not secret.isascii() else
               "has a control character" if not secret.isprintable() else
               "is too short" if len(secret) < JOB_SECRET_MIN else
               "is too long" if len(secret) > JOB_SECRET_MAX else "")
    if problem:
        length = f"{len(secret)} character{'s' * (len(secret) != 1)}"
        raise InvalidArgument(f"{source} is not a usable job secret ({length}; it {problem}): {rule}")
    return secret


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."
