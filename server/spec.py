"""The job spec: world size, parallel layout, roles and group rules.

`spec_from_proto` turns the wire form into an immutable, validated JobSpec.
Malformed specs raise InvalidArgument; specs no world can satisfy (sizes whose
product is not the world size, role counts that do not add up) raise Conflict
(FAILED_PRECONDITION), with the numbers in the message.
"""

from __future__ import annotations

import dataclasses
import math
import re

from commctx.v1 import rendezvous_pb2 as pb

from .errors import Conflict, InvalidArgument

MAX_WORLD_SIZE = 1 << 20
DIMS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DIM_MODES = {
    "tp": "TENSOR_PARALLEL",
    "cp": "SEQUENCE_PARALLEL",
    "ep": "EXPERT",
    "dp": "DATA_PARALLEL",
    "pp": "PIPELINE_PARALLEL",
}
BUILTIN_MODES = ("GLOBAL", "INTRA_NODE", "INTER_NODE")
_MODE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
ROLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NODE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")  # at most 253 characters


@dataclasses.dataclass(frozen=True)
class Layout:
    """Parallel dimension sizes in `order` (fastest-varying first)."""

    sizes: tuple[tuple[str, int], ...]
    within_node: tuple[str, ...] = ()
    dp_given: bool = False  # dp was given, rather than derived from the world size

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

    def __str__(self) -> str:
        text = " ".join(f"{d}={s}" for d, s in self.sizes) + f" order={self.order}"
        return text + (f" within_node={','.join(self.within_node)}" if self.within_node else "")


@dataclasses.dataclass(frozen=True)
class RoleGroup:
    mode: str
    roles: tuple[str, ...]
    per_node: bool = False


@dataclasses.dataclass(frozen=True)
class WeightTransfer:
    mode: str
    sender: str
    receivers: tuple[str, ...]
    per_node: bool = False


@dataclasses.dataclass(frozen=True)
class NamedGroups:
    mode: str
    groups: tuple[tuple[int, ...], ...]


Rule = RoleGroup | WeightTransfer | NamedGroups


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything every worker of a job must agree on."""

    world_size: int
    layout: Layout | None = None
    roles: tuple[tuple[str, int], ...] = ()
    rules: tuple[Rule, ...] = ()
    cpu_twins: tuple[str, ...] = ()
    expected_nodes: tuple[str, ...] = ()  # informational, for describing who is missing
    min_size: int | None = None  # elastic: the world forms with min_size..world_size workers
    last_call_s: float = 1.0  # elastic: how long to wait for more once min_size are there

    @property
    def max_size(self) -> int:
        return self.world_size

    @property
    def min_world(self) -> int:
        return self.world_size if self.min_size is None else self.min_size

    def admissible(self, n: int) -> bool:
        """Whether a world of n workers satisfies this spec."""
        step = self.layout.step if self.layout is not None else 1
        return self.min_world <= n <= self.world_size and n % step == 0

    def at_size(self, n: int) -> JobSpec:
        """The fixed spec a world of n workers is planned with."""
        if n == self.world_size and self.min_size is None:
            return self
        layout = self.layout.at_size(n) if self.layout is not None else None
        return dataclasses.replace(self, world_size=n, layout=layout, min_size=None)

    def role_count(self, role: str) -> int | None:
        """The declared count of `role`, or None when roles are not declared."""
        if not self.roles:
            return None
        return dict(self.roles).get(role, 0)

    def modes(self) -> list[str]:
        layout = [DIM_MODES[d] for d in DIMS] if self.layout else []
        return [*BUILTIN_MODES, *layout, *(r.mode for r in self.rules)]

    def difference(self, other: JobSpec) -> str:
        """Names the first field in which `other` differs from this spec."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                return f"{field.name}={_show(mine)} but this worker asked for {field.name}={_show(theirs)}"
        return "the same spec"


def _show(value: object) -> str:
    if value is None or value == ():
        return "none"
    if isinstance(value, tuple):
        return ",".join(f"{v[0]}:{v[1]}" if isinstance(v, tuple) and len(v) == 2 else str(v) for v in value)
    return str(value)


def _name(kind: str, value: str, pattern: re.Pattern[str]) -> str:
    if not pattern.fullmatch(value):
        raise InvalidArgument(f"{kind} {value[:70]!r} is malformed: 1-64 characters of [A-Za-z0-9._-], starting with a letter or digit")
    return value


def role_of(value: str) -> str:
    """Raises InvalidArgument unless `value` is a well-formed role name."""
    return _name("role", value, ROLE)


def _layout(world_size: int, p: pb.ParallelLayout, elastic_min: int | None = None) -> Layout:
    tokens = [t for t in (p.order or DEFAULT_ORDER).split("-")]
    for t in tokens:
        if t not in DIMS:
            raise InvalidArgument(f"layout.order {p.order!r}: {t!r} is not one of {', '.join(DIMS)}")
    if len(set(tokens)) != len(tokens):
        raise InvalidArgument(f"layout.order {p.order!r} names a dimension twice")
    given = {d: getattr(p, d) for d in DIMS}
    sizes = {d: given[d] or 1 for d in DIMS}
    others = math.prod(sizes[d] for d in DIMS if d != "dp")
    if elastic_min is not None:
        if given["dp"]:
            raise InvalidArgument(f"layout.dp {given['dp']}: an elastic job derives dp from the world size; leave dp out")
        fits = [n for n in range(world_size, elastic_min - 1, -1) if n % others == 0]
        if not fits:
            raise Conflict(
                f"no world size from {elastic_min} to {world_size} is a multiple of tp×cp×ep×pp = "
                f"{sizes['tp']}×{sizes['cp']}×{sizes['ep']}×{sizes['pp']} = {others}"
            )
        world_size = fits[0]
    if not given["dp"]:
        if world_size % others:
            raise Conflict(
                f"world_size {world_size} is not divisible by tp×cp×ep×pp = "
                f"{sizes['tp']}×{sizes['cp']}×{sizes['ep']}×{sizes['pp']} = {others}"
            )
        sizes["dp"] = world_size // others
    product = math.prod(sizes.values())
    if product != world_size:
        raise Conflict(
            f"tp×cp×ep×dp×pp = {'×'.join(str(sizes[d]) for d in DIMS)} = {product} but world_size is {world_size}"
        )
    for d in DIMS:
        if d not in tokens:
            if sizes[d] != 1:
                raise InvalidArgument(f"layout.order {p.order!r} leaves out {d}, whose size is {sizes[d]}")
            tokens.append(d)
    within = tuple(sorted(set(p.within_node)))
    for d in within:
        if d not in DIMS:
            raise InvalidArgument(f"layout.within_node {d!r} is not one of {', '.join(DIMS)}")
    return Layout(tuple((d, sizes[d]) for d in tokens), within, bool(given["dp"]))


def _roles(world_size: int, counts) -> tuple[tuple[str, int], ...]:
    roles = []
    for rc in counts:
        role_of(rc.role)
        if rc.count < 1:
            raise InvalidArgument(f"role {rc.role!r} has count {rc.count}; give 1 or more")
        roles.append((rc.role, rc.count))
    names = [r for r, _ in roles]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"roles name a role twice: {', '.join(names)}")
    total = sum(c for _, c in roles)
    if roles and total != world_size:
        parts = " + ".join(f"{r} {c}" for r, c in roles)
        raise Conflict(f"role counts add up to {total} ({parts}) but world_size is {world_size}")
    return tuple(roles)


def _rule(world_size: int, r: pb.GroupRule, declared: set[str]) -> Rule:
    mode = _name("groups.mode", r.mode, _MODE)
    kind = r.WhichOneof("kind")

    def known(role: str) -> str:
        role_of(role)
        if declared and role not in declared:
            raise InvalidArgument(f"group {mode!r} names role {role!r}, which spec.roles does not declare")
        return role

    if kind == "role_group":
        if not r.role_group.roles:
            raise InvalidArgument(f"group {mode!r} lists no roles")
        return RoleGroup(mode, tuple(known(x) for x in r.role_group.roles), r.role_group.scope == pb.SCOPE_NODE)
    if kind == "weight_transfer":
        wt = r.weight_transfer
        if not wt.receiver_roles:
            raise InvalidArgument(f"group {mode!r} lists no receiver roles")
        return WeightTransfer(mode, known(wt.sender_role), tuple(known(x) for x in wt.receiver_roles), wt.scope == pb.SCOPE_NODE)
    if kind == "named":
        groups, seen = [], set()
        for g in r.named.groups:
            ranks = tuple(sorted(g.ranks))
            if not ranks:
                raise InvalidArgument(f"group {mode!r} has an empty rank list")
            if ranks[-1] >= world_size:
                raise InvalidArgument(f"group {mode!r} names rank {ranks[-1]}, not below world_size {world_size}")
            if len(set(ranks)) != len(ranks):
                raise InvalidArgument(f"group {mode!r} lists a rank twice in {list(ranks)}")
            overlap = seen.intersection(ranks)
            if overlap:
                raise InvalidArgument(f"group {mode!r} puts rank {min(overlap)} in two groups; a worker is in one group per mode")
            seen.update(ranks)
            groups.append(ranks)
        if not groups:
            raise InvalidArgument(f"group {mode!r} has no rank lists")
        return NamedGroups(mode, tuple(groups))
    raise InvalidArgument(f"group {mode!r} has no kind: give role_group, weight_transfer or named")


def spec_from_proto(p: pb.JobSpec) -> JobSpec:
    """Validates a wire JobSpec.

    Raises:
        InvalidArgument: a malformed field, named.
        Conflict: sizes or counts no world of this size can satisfy.
    """
    world_size = p.world_size
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(f"spec.world_size {world_size} is out of range 1..{MAX_WORLD_SIZE}")
    if not (p.HasField("layout") or p.roles or p.groups or p.cpu_twins or p.expected_nodes or p.HasField("elastic")):
        return JobSpec(world_size)  # the common case, kept cheap
    min_size = last_call_s = None
    if p.HasField("elastic"):
        min_size = p.elastic.min_size
        if not 1 <= min_size <= world_size:
            raise InvalidArgument(f"elastic.min_size {min_size} is out of range 1..{world_size} (world_size is the maximum)")
        if p.roles:
            raise InvalidArgument("role counts need a fixed world size: give either roles or elastic")
        last_call_s = p.elastic.last_call_ms / 1000 if p.elastic.HasField("last_call_ms") else 1.0
    for key in p.expected_nodes:
        if len(key) > 253 or not NODE_KEY.fullmatch(key):
            raise InvalidArgument(f"expected_nodes entry {key[:70]!r} is not a valid node key")
    layout = _layout(world_size, p.layout, min_size) if p.HasField("layout") else None
    roles = _roles(world_size, p.roles)
    declared = {r for r, _ in roles}
    rules = tuple(_rule(min_size or world_size, r, declared) for r in p.groups)
    spec = JobSpec(world_size, layout, roles, rules, min_size=min_size, last_call_s=1.0 if last_call_s is None else last_call_s)
    modes = spec.modes()
    duplicated = sorted({m for m in modes if modes.count(m) > 1})
    if duplicated:
        raise InvalidArgument(f"group mode {duplicated[0]!r} is defined twice (or is a built-in or layout mode)")
    for m in p.cpu_twins:
        if m not in modes:
            raise InvalidArgument(f"cpu_twins names mode {m!r}, which this spec does not define")
    return dataclasses.replace(spec, cpu_twins=tuple(dict.fromkeys(p.cpu_twins)), expected_nodes=tuple(dict.fromkeys(p.expected_nodes)))


def spec_to_proto(spec: JobSpec) -> pb.JobSpec:
    """The wire form of a spec (for describing jobs)."""
    out = pb.JobSpec(world_size=spec.world_size, cpu_twins=spec.cpu_twins, expected_nodes=spec.expected_nodes)
    if spec.min_size is not None:
        out.elastic.CopyFrom(pb.Elastic(min_size=spec.min_size, last_call_ms=round(spec.last_call_s * 1000)))
    if spec.layout is not None:
        sizes = {d: s for d, s in spec.layout.sizes if d != "dp" or spec.layout.dp_given}
        out.layout.CopyFrom(pb.ParallelLayout(order=spec.layout.order, within_node=spec.layout.within_node, **sizes))
    out.roles.extend(pb.RoleCount(role=r, count=c) for r, c in spec.roles)
    for rule in spec.rules:
        g = out.groups.add(mode=rule.mode)
        scope = pb.SCOPE_NODE if getattr(rule, "per_node", False) else pb.SCOPE_JOB
        if isinstance(rule, RoleGroup):
            g.role_group.CopyFrom(pb.RoleGroup(roles=rule.roles, scope=scope))
        elif isinstance(rule, WeightTransfer):
            g.weight_transfer.CopyFrom(pb.WeightTransfer(sender_role=rule.sender, receiver_roles=rule.receivers, scope=scope))
        else:
            g.named.CopyFrom(pb.NamedGroups(groups=[pb.RankList(ranks=r) for r in rule.groups]))
    return out
