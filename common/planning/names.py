"""Names and numbers as a spec or request gives them: checked against their
patterns, and shown in messages cut short (a message names a bad value, never
copies it whole)."""

from __future__ import annotations

import re

from commctx.common.modes import MODE_NAME

from ..errors import BadRequest

ROLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NODE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")


def elide(value: object, limit: int = 64) -> str:
    """repr() of a value, cut to about `limit` characters: messages name bad values, never copy them whole."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_name(kind: str, value: str, pattern: re.Pattern[str], rule: str) -> str:
    """Returns `value`; raises BadRequest naming it unless it matches `pattern`."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise BadRequest(f"{kind} {elide(value)} is malformed: {rule}")
    return value


def check_role(value: str) -> str:
    """Raises BadRequest unless `value` is a well-formed role name."""
    return check_name("role", value, ROLE_NAME, "1-64 characters of [A-Za-z0-9._-], starting with a letter or digit")


def check_mode(value: str) -> str:
    """Raises BadRequest unless `value` is a well-formed group mode."""
    return check_name("groups.mode", value, MODE_NAME, "1-64 characters of [A-Za-z0-9_.-], starting with a letter")


def whole_number(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{what} {elide(value)} is not a whole number")
    return value
