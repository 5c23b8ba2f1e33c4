"""A job's parallel layout: Megatron's tp, cp, ep, dp, pp sizes in an order,
validated for a world size."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from commctx.common.modes import LAYOUT_MODES

from ..errors import BadRequest, Conflict
from .names import elide, whole_number

DIMS = tuple(LAYOUT_MODES)  # tp, cp, ep, dp, pp
DEFAULT_ORDER = "-".join(DIMS)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Parallel dimension sizes in `order` (fastest-varying first)."""

    sizes: tuple[tuple[str, int], ...]
    within_node: tuple[str, ...] = ()
    dp_given: bool = False  # dp was given, rather than derived from the world size

    @classmethod
    def build(cls, world_size: int, layout: Mapping[str, Any], elastic_min: int | None = None) -> Layout:
        """Validates a layout for `world_size` workers.

        Args:
            layout: sizes `tp`, `cp`, `ep`, `dp`, `pp` (missing or 0: 1, but dp
                is derived), `order` ("tp-cp-ep-dp-pp" by default) and
                `within_node` (dimensions whose groups must stay inside a node).
            elastic_min: for an elastic job, its minimum size: dp is then derived
                for the largest multiple of the other sizes that fits.

        Raises:
            BadRequest: a malformed order or dimension name, or dp given for an elastic job.
            Conflict: the sizes do not multiply to a world size in range.
        """
        order = layout.get("order") or ""
        if not isinstance(order, str):
            raise BadRequest(f"layout.order {elide(order)} is not text")
        tokens = (order or DEFAULT_ORDER).split("-")
        for t in tokens:
            if t not in DIMS:
                raise BadRequest(f"layout.order {elide(order)}: {elide(t)} is not one of {', '.join(DIMS)}")
        if len(set(tokens)) != len(tokens):
            raise BadRequest(f"layout.order {elide(order)} names a dimension twice")
        given = {d: whole_number(f"layout.{d}", layout.get(d) or 0) for d in DIMS}
        for d, v in given.items():
            if v < 0:
                raise BadRequest(f"layout.{d} {v} is negative")
        sizes = {d: given[d] or 1 for d in DIMS}
        others = math.prod(sizes[d] for d in DIMS if d != "dp")
        product_text = f"{sizes['tp']}×{sizes['cp']}×{sizes['ep']}×{sizes['pp']} = {others}"
        if elastic_min is not None:
            if given["dp"]:
                raise BadRequest(f"layout.dp {given['dp']}: an elastic job derives dp from the world size; leave dp out")
            largest = world_size - world_size % others
            if largest < max(elastic_min, 1):
                raise Conflict(f"no world size from {elastic_min} to {world_size} is a multiple of tp×cp×ep×pp = {product_text}")
            world_size = largest
        if not given["dp"]:
            if world_size % others:
                raise Conflict(f"world_size {world_size} is not divisible by tp×cp×ep×pp = {product_text}")
            sizes["dp"] = world_size // others
        product = math.prod(sizes.values())
        if product != world_size:
            raise Conflict(
                f"tp×cp×ep×dp×pp = {'×'.join(str(sizes[d]) for d in DIMS)} = {product} but world_size is {world_size}"
            )
        for d in DIMS:
            if d not in tokens:
                if sizes[d] != 1:
                    raise BadRequest(f"layout.order {elide(order)} leaves out {d}, whose size is {sizes[d]}")
                tokens.append(d)
        within = tuple(sorted(set(layout.get("within_node") or ())))
        for d in within:
            if d not in DIMS:
                raise BadRequest(f"layout.within_node {elide(d)} is not one of {', '.join(DIMS)}")
        return cls(tuple((d, sizes[d]) for d in tokens), within, bool(given["dp"]))

    @property
    def step(self) -> int:
        """The product of every size but dp: world sizes must be multiples of it."""
        return math.prod(s for d, s in self.sizes if d != "dp")

    def at_size(self, world_size: int) -> Layout:
        """This layout with dp derived for `world_size` (a multiple of `step`)."""
        dp = world_size // self.step
        return dataclasses.replace(self, sizes=tuple((d, dp if d == "dp" else s) for d, s in self.sizes))

    @property
    def order(self) -> str:
        return "-".join(d for d, _ in self.sizes)

    def size(self, dim: str) -> int:
        return dict(self.sizes)[dim]

    def given(self) -> dict[str, int]:
        """The sizes as a caller gave them (dp only when it was not derived)."""
        return {d: s for d, s in self.sizes if d != "dp" or self.dp_given}

    def __str__(self) -> str:
        text = " ".join(f"{d}={s}" for d, s in self.sizes) + f" order={self.order}"
        return text + (f" within_node={','.join(self.within_node)}" if self.within_node else "")
