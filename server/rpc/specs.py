"""Specs by their wire bytes: parsed and validated once for all the workers of
a job that send them, big ones off the event loop."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures

from commctx.common.planning import JobSpec
from commctx.v1 import rendezvous_pb2 as pb

from ..errors import BadRequest
from ..rendezvous.model import Limits
from .codec import spec_from_message


class SpecCache:
    """Specs by their wire bytes: every worker of a job sends the same one, so
    each is parsed and validated once (the 256 most recent; a spec that fails
    validation is never kept). Big ones are parsed off the event loop."""

    SIZE = 256
    INLINE_BYTES = 4096  # larger: parsed in a worker thread (a spec of many rules takes the loop too long)

    def __init__(self) -> None:
        # One parsing thread, made at the first big spec and shut down by close():
        # several would each take the GIL from the event loop in turn, and a burst
        # of big specs would lag the loop more than parsing them inline.
        self._parser: concurrent.futures.ThreadPoolExecutor | None = None
        self._specs: collections.OrderedDict[bytes, JobSpec] = collections.OrderedDict()
        self._parsing: dict[bytes, asyncio.Future[JobSpec]] = {}  # big specs being parsed: one parse for a burst

    async def spec_of(self, r: pb.JoinRequest, limits: Limits) -> JobSpec:
        """The request's spec, within `limits` (checked before it is parsed).

        Raises:
            BadRequest: over a limit, or malformed (naming the field).
            Conflict: a spec no world of its size can satisfy.
        """
        size = r.spec.ByteSize()
        if size > limits.max_spec_bytes:
            raise BadRequest(f"spec is {size} bytes; at most {limits.max_spec_bytes} allowed (--max-spec-bytes)")
        rules = len(r.spec.roles) + len(r.spec.groups) + len(r.spec.cpu_twins) + len(r.spec.expected_nodes)
        if rules > limits.max_spec_rules:
            raise BadRequest(f"spec has {rules} roles, group rules, cpu twins and expected nodes; "
                                  f"at most {limits.max_spec_rules} allowed (--max-spec-rules)")
        wire = r.spec.SerializeToString(deterministic=True)
        spec = self._specs.get(wire)
        if spec is not None:
            self._specs.move_to_end(wire)
            return spec
        if size > self.INLINE_BYTES:
            parsing = self._parsing.get(wire)
            if parsing is None:
                if self._parser is None:
                    self._parser = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="commctx-spec")
                parsing = self._parsing[wire] = asyncio.get_running_loop().run_in_executor(self._parser, _parse_spec, wire)
                parsing.add_done_callback(lambda _: self._parsing.pop(wire, None))
            spec = await asyncio.shield(parsing)  # a Join that goes away does not cancel the others' parse
        else:
            spec = _parse_spec(wire)
        self._specs[wire] = spec
        if len(self._specs) > self.SIZE:
            self._specs.popitem(last=False)
        return spec

    def close(self) -> None:
        """Shuts the parsing thread down (parses under way finish; none start)."""
        if self._parser is not None:
            self._parser.shutdown(wait=False, cancel_futures=True)
            self._parser = None


def _parse_spec(wire: bytes) -> JobSpec:
    return spec_from_message(pb.JobSpec.FromString(wire))
