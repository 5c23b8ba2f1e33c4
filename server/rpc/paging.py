"""Pages at the RPC edge: a request's page size and token, checked, and the
replies that hold a page (DescribeJob's nodes, ListJobs, ListEvents), kept
within their byte budget. The domain chooses what a page holds
(rendezvous/views.py); this module fits it to the wire."""

from __future__ import annotations

from commctx.common.planning import elide
from commctx.v1 import rendezvous_pb2 as pb

from ..errors import BadRequest
from ..rendezvous.model import JobEvent
from ..rendezvous.reports import JobView
from ..rendezvous.views import MAX_PAGE_SIZE, PAGE_SIZE, page_key
from .codec import description_message, event_message, summary_message

MAX_REPLY_BYTES = 1 << 20  # DescribeJob's reply: fewer nodes than asked if theirs are long (keys, many roles)


def page_size(size: int, field: str = "page_size", default: int = PAGE_SIZE, most: int = MAX_PAGE_SIZE) -> int:
    """A request's page size (0: the default).

    Raises:
        BadRequest: above `most`, naming `field`.
    """
    size = size or default
    if size > most:
        raise BadRequest(f"{field} {size} is above the most a {'reply' if field.startswith('node') else 'page'} holds, {most}")
    return size


def position(token: str, field: str, method: str, digits: int) -> int:
    """Where a numeric page token (as DescribeJob and ListEvents give them) starts; "" is 0.

    Raises:
        BadRequest: not such a token, naming `field` and `method`.
    """
    if token and not (token.isdigit() and token.isascii() and len(token) <= digits):
        raise BadRequest(f"{field} {elide(token)} is not a token {method} gave")
    return int(token or 0)


def description_page(v: JobView, first: int, max_bytes: int = MAX_REPLY_BYTES) -> pb.JobDescription:
    """A job's description holding its nodes from `first` on, as many as fit
    in `max_bytes` (at least one), with the token of the next page."""
    message = description_message(v)
    if message.ByteSize() > max_bytes:
        nodes = list(message.nodes)
        del message.nodes[:]
        budget, keep = max_bytes - message.ByteSize(), 0
        for node in nodes:
            budget -= node.ByteSize() + 5  # + its tag and length, at most
            if budget < 0:
                break
            keep += 1
        message.nodes.extend(nodes[:max(keep, 1)])
    shown = first + len(message.nodes)
    message.next_node_page_token = str(shown) if shown < v.num_nodes else ""
    return message


def jobs_page(views: list[JobView], more: bool, admin: bool, runs: bool = False) -> pb.ListJobsResponse:
    """A page of ListJobs: sealed jobs as summaries unless an admin asks; `runs`:
    a page of runs (include_ended), whose token names the last one's run."""
    return pb.ListJobsResponse(
        jobs=[summary_message(v) if v.seal and not admin else description_message(v) for v in views],
        next_page_token=(page_key(views[-1]) if runs else views[-1].job_id) if more else "")


def events_page(events: list[JobEvent], size: int) -> pb.ListEventsResponse:
    """A page of ListEvents from up to `size` + 1 events (one more: there is a next page)."""
    shown = events[:size]
    return pb.ListEventsResponse(events=[event_message(e) for e in shown],
                                 next_page_token=str(shown[-1].seq) if len(events) > size else "")
