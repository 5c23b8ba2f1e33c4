"""The job spec: world size, parallel layout, roles, group rules, elastic size.

Pure values, built only by validating constructors (`JobSpec.build`,
`Layout.build`) whose cost is linear in the size of what they are given. A
malformed spec raises BadRequest; a spec no world of its size can satisfy
(sizes whose product is not the world size, role counts that do not add up)
raises Conflict, with the numbers in the message.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from commctx.common.modes import BUILTIN_MODES, LAYOUT_MODES

from ..errors import BadRequest, Conflict
from .layout import DIMS, Layout
from .names import NODE_KEY, check_mode, check_role, elide, whole_number

MAX_WORLD_SIZE = 1 << 20
DEFAULT_LAST_CALL_S = 1.0
@dataclasses.dataclass(frozen=True)
class RoleGroup:
    """All workers of `roles`, job-wide or one group per node."""

    mode: str
    roles: tuple[str, ...]
    per_node: bool = False


@dataclasses.dataclass(frozen=True)
class WeightTransfer:
    """The lowest-ranked `sender` and every worker of `receivers`, job-wide or per node."""

    mode: str
    sender: str
    receivers: tuple[str, ...]
    per_node: bool = False


@dataclasses.dataclass(frozen=True)
class NamedGroups:
    """Groups from explicit global ranks, each ascending; no rank in two of them."""

    mode: str
    groups: tuple[tuple[int, ...], ...]


Rule = RoleGroup | WeightTransfer | NamedGroups


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything every worker of a job must agree on. Build with `JobSpec.build`."""

    world_size: int
    layout: Layout | None = None
    roles: tuple[tuple[str, int], ...] = ()
    rules: tuple[Rule, ...] = ()
    cpu_twins: tuple[str, ...] = ()
    expected_nodes: tuple[str, ...] = ()  # informational, for describing who is missing
    min_size: int | None = None  # elastic: the world forms with min_size..world_size workers
    last_call_s: float = DEFAULT_LAST_CALL_S  # elastic: how long to wait for more once min_size are there
    # A job of launcher nodes (torchrun's --nnodes=MIN:MAX): world_size and
    # min_size then count node memberships, each a node of its own size, and
    # the world's size in workers is the sum of the nodes seated.
    nodes: bool = False

    @classmethod
    def build(
        cls,
        world_size: int,
        *,
        layout: Mapping[str, Any] | None = None,
        roles: Iterable[tuple[str, int]] = (),
        rules: Iterable[Rule] = (),
        cpu_twins: Iterable[str] = (),
        expected_nodes: Iterable[str] = (),
        min_size: int | None = None,
        last_call_s: float | None = None,
        nodes: bool = False,
    ) -> JobSpec:
        """Validates a spec (linear in its size).

        Args:
            world_size: the world's size; with `min_size`, its maximum (with
                `nodes`: counted in nodes).
            layout: see `Layout.build`.
            roles: (role, count) pairs; the counts add up to world_size.
            rules: group rules, in the order their groups are created.
            cpu_twins: modes whose groups also get a gloo twin.
            expected_nodes: node keys the job expects (for describing who is missing).
            min_size: elastic: the smallest world that may form.
            last_call_s: elastic: how long to wait for more once min_size are there.
            nodes: sizes count node memberships (torchrun's agents), not workers:
                the world's workers are those of its nodes; role counts cannot be
                declared, and a layout is checked against the world that forms.

        Raises:
            BadRequest: a malformed field, named.
            Conflict: sizes or counts no world of this size can satisfy.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise BadRequest(f"spec.world_size {elide(world_size)} is out of range 1..{MAX_WORLD_SIZE}")
        roles, rules = tuple(roles), tuple(rules)
        cpu_twins, expected_nodes = tuple(cpu_twins), tuple(expected_nodes)
        if layout is None and not (roles or rules or cpu_twins or expected_nodes) and min_size is None and not nodes:
            return cls(world_size)  # the common case, kept cheap
        if nodes and roles:
            raise BadRequest("role counts need a world size in workers, and a job of nodes has none until it "
                                  "forms: give each node's role instead (torchrun: --rdzv-conf role=...)")
        if nodes and min_size == world_size:
            min_size = None  # a fixed number of nodes
        if min_size is not None:
            if not 1 <= min_size <= world_size:
                raise BadRequest(f"elastic.min_size {min_size} is out of range 1..{world_size} (world_size is the maximum)")
            if roles:
                raise BadRequest("role counts need a fixed world size: give either roles or elastic")
            if last_call_s is not None and not 0 <= last_call_s <= 3600:
                raise BadRequest(f"elastic.last_call_ms {last_call_s * 1000:g} is out of range 0..3600000")
        for key in expected_nodes:
            if not isinstance(key, str) or not NODE_KEY.fullmatch(key):
                raise BadRequest(f"expected_nodes entry {elide(key)} is not a valid node key")
        if layout is not None and nodes:  # its sizes are checked against the world that forms: dp is derived
            built_layout = Layout.build(MAX_WORLD_SIZE, layout, 1)
        else:
            built_layout = Layout.build(world_size, layout, min_size) if layout is not None else None
        built_roles = _roles(world_size, roles)
        declared = {r for r, _ in built_roles}
        smallest = min_size or world_size
        built_rules = tuple(_rule(smallest, r, declared) for r in rules)
        modes = [*BUILTIN_MODES, *(LAYOUT_MODES.values() if built_layout else ()), *(r.mode for r in built_rules)]
        counts = collections.Counter(modes)
        duplicated = next((m for m in modes if counts[m] > 1), None)
        if duplicated is not None:
            raise BadRequest(f"group mode {elide(duplicated)} is defined twice (or is a built-in or layout mode)")
        for m in cpu_twins:
            if m not in counts:
                raise BadRequest(f"cpu_twins names mode {elide(m)}, which this spec does not define")
        return cls(
            world_size, built_layout, built_roles, built_rules, tuple(dict.fromkeys(cpu_twins)),
            tuple(dict.fromkeys(expected_nodes)), min_size,
            DEFAULT_LAST_CALL_S if last_call_s is None else float(last_call_s), nodes,
        )

    @classmethod
    def from_json(cls, form: Mapping[str, Any]) -> JobSpec:
        """Validates a spec in its JSON form: the protocol's JobSpec as JSON with
        its field names (`{"world_size": 8, "layout": {"tp": 2}, ...}`), as
        workers pass it to `CommContext.join(spec=...)`.

        Raises:
            BadRequest: an unknown key or a malformed value, named.
            Conflict: sizes or counts no world of this size can satisfy.
        """
        _keys("spec", form, _SPEC_KEYS)
        layout = form.get("layout")
        if layout is not None:
            _keys("layout", layout, _LAYOUT_KEYS)
        elastic = form.get("elastic")
        if elastic is not None:
            _keys("elastic", elastic, ("min_size", "last_call_ms"))
        last_call_ms = elastic.get("last_call_ms") if elastic is not None else None
        nodes = form.get("nodes")
        if nodes is not None:  # a job of nodes: its sizes are the nodes'
            _keys("nodes", nodes, ("min", "max", "last_call_ms"))
            if form.get("world_size") or elastic is not None:
                raise BadRequest("a spec with nodes (a job of launcher nodes) gives neither world_size nor elastic: "
                                      "its sizes are nodes.min and nodes.max")
            top = whole_number("nodes.max", nodes.get("max", 0))
            if not 1 <= top <= MAX_WORLD_SIZE:
                raise BadRequest(f"nodes.max {top} is out of range 1..{MAX_WORLD_SIZE}")
            elastic = {"min_size": whole_number("nodes.min", nodes.get("min", 0)) or top}
            last_call_ms = nodes.get("last_call_ms")
            form = {**form, "world_size": top}
        return cls.build(
            whole_number("world_size", form.get("world_size", 0)),
            layout=layout,
            roles=[(_keys("roles", r, ("role", "count")).get("role", ""), whole_number("count", r.get("count", 0)))
                   for r in _list("roles", form.get("roles", ()))],
            rules=[_rule_of_json(g) for g in _list("groups", form.get("groups", ()))],
            cpu_twins=_list("cpu_twins", form.get("cpu_twins", ())),
            expected_nodes=_list("expected_nodes", form.get("expected_nodes", ())),
            min_size=whole_number("elastic.min_size", elastic.get("min_size", 0)) if elastic is not None else None,
            last_call_s=None if last_call_ms is None else whole_number("elastic.last_call_ms", last_call_ms) / 1000,
            nodes=nodes is not None,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form (`from_json` reads it back to an equal spec)."""
        out: dict[str, Any] = {"world_size": self.world_size} if not self.nodes else {
            "nodes": {"min": self.min_world, "max": self.world_size, "last_call_ms": round(self.last_call_s * 1000)}}
        if self.layout is not None:
            out["layout"] = {**self.layout.given(), "order": self.layout.order}
            if self.layout.within_node:
                out["layout"]["within_node"] = list(self.layout.within_node)
        if self.roles:
            out["roles"] = [{"role": r, "count": c} for r, c in self.roles]
        if self.rules:
            out["groups"] = [_rule_json(r) for r in self.rules]
        if self.cpu_twins:
            out["cpu_twins"] = list(self.cpu_twins)
        if self.expected_nodes:
            out["expected_nodes"] = list(self.expected_nodes)
        if self.min_size is not None and not self.nodes:
            out["elastic"] = {"min_size": self.min_size, "last_call_ms": round(self.last_call_s * 1000)}
        return out

    @property
    def min_world(self) -> int:
        """The smallest world that may form (world_size for a fixed-size job)."""
        return self.world_size if self.min_size is None else self.min_size

    @property
    def step(self) -> int:
        """World sizes must be multiples of this (the layout's tp×cp×ep×pp)."""
        return self.layout.step if self.layout is not None else 1

    def admissible(self, n: int) -> bool:
        """Whether a world of n workers (of a job of nodes: n nodes) satisfies this spec."""
        return self.min_world <= n <= self.world_size and (self.nodes or n % self.step == 0)

    def largest_world(self, n: int) -> int | None:
        """The largest admissible world of at most n workers (nodes), or None."""
        k = min(n, self.world_size)
        if not self.nodes:  # a job of nodes meets the step in workers, when it forms
            k -= k % self.step
        return k if k >= self.min_world and k > 0 else None

    def at_size(self, n: int) -> JobSpec:
        """The fixed spec a world of n workers is planned with (a multiple of `step`)."""
        if n == self.world_size and self.min_size is None and not self.nodes:
            return self
        layout = self.layout.at_size(n) if self.layout is not None else None
        return dataclasses.replace(self, world_size=n, layout=layout, min_size=None, nodes=False)

    def role_count(self, role: str) -> int | None:
        """The declared count of `role`, or None when roles are not declared."""
        if not self.roles:
            return None
        return dict(self.roles).get(role, 0)

    def check_declared(self, job_id: str, role: str) -> None:
        """Raises Conflict when the spec declares roles and `role` is not one of them."""
        if self.role_count(role) == 0:
            roles = ", ".join(f"{r}:{c}" for r, c in self.roles)
            raise Conflict(f"job {elide(job_id)} declares roles {roles} but this worker joined as role {elide(role)}")

    def modes(self) -> list[str]:
        """Every mode this spec plans groups of, in canonical creation order."""
        layout = list(LAYOUT_MODES.values()) if self.layout else []
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
        text = ",".join(f"{v[0]}:{v[1]}" if isinstance(v, tuple) and len(v) == 2 else str(v) for v in value)
    else:
        text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _roles(world_size: int, counts: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    roles = []
    seen: set[str] = set()
    for role, count in counts:
        check_role(role)
        if count < 1:
            raise BadRequest(f"role {elide(role)} has count {count}; give 1 or more")
        if role in seen:
            raise BadRequest(f"roles name role {elide(role)} twice")
        seen.add(role)
        roles.append((role, count))
    total = sum(c for _, c in roles)
    if roles and total != world_size:
        parts = " + ".join(f"{r} {c}" for r, c in roles[:8]) + (" + ..." if len(roles) > 8 else "")
        raise Conflict(f"role counts add up to {total} ({parts}) but world_size is {world_size}")
    return tuple(roles)


def _rule(world_size: int, rule: Rule, declared: set[str]) -> Rule:
    """Validates one rule against the spec's smallest world and declared roles."""
    mode = check_mode(rule.mode)

    def known(role: str) -> str:
        check_role(role)
        if declared and role not in declared:
            raise BadRequest(f"group {mode!r} names role {elide(role)}, which spec.roles does not declare")
        return role

    if isinstance(rule, RoleGroup):
        if not rule.roles:
            raise BadRequest(f"group {mode!r} lists no roles")
        return RoleGroup(mode, tuple(known(r) for r in rule.roles), rule.per_node)
    if isinstance(rule, WeightTransfer):
        if not rule.receivers:
            raise BadRequest(f"group {mode!r} lists no receiver roles")
        if rule.sender in rule.receivers:
            raise BadRequest(f"group {mode!r} lists its sender role {elide(rule.sender)} among its receiver roles")
        return WeightTransfer(mode, known(rule.sender), tuple(known(r) for r in rule.receivers), rule.per_node)
    groups, seen = [], set()
    for given in rule.groups:
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in given):
            raise BadRequest(f"group {mode!r} lists {elide(list(given))}; ranks are whole numbers from 0")
        ranks = tuple(sorted(given))
        if not ranks:
            raise BadRequest(f"group {mode!r} has an empty rank list")
        if ranks[-1] >= world_size:
            raise BadRequest(f"group {mode!r} names rank {ranks[-1]}, not below world_size {world_size}")
        before = len(seen)
        seen.update(ranks)
        if len(seen) - before != len(ranks):
            if len(set(ranks)) != len(ranks):
                raise BadRequest(f"group {mode!r} lists a rank twice in {elide(list(ranks))}")
            twice = next(r for r in ranks if r in _ranks_before(groups))
            raise BadRequest(f"group {mode!r} puts rank {twice} in two groups; a worker is in one group per mode")
        groups.append(ranks)
    if not groups:
        raise BadRequest(f"group {mode!r} has no rank lists")
    return NamedGroups(mode, tuple(groups))


def _ranks_before(groups: list[tuple[int, ...]]) -> set[int]:
    """The ranks of earlier groups (built only to name the rank of an error)."""
    return {r for g in groups for r in g}


_SPEC_KEYS = ("world_size", "layout", "roles", "groups", "cpu_twins", "expected_nodes", "elastic", "nodes")
_LAYOUT_KEYS = (*DIMS, "order", "within_node")
_SCOPES = {"SCOPE_JOB": False, "SCOPE_NODE": True}


def _keys(where: str, form: object, known: Sequence[str]) -> Mapping[str, Any]:
    """Returns `form` if it is a mapping with only `known` keys; else BadRequest naming the first other."""
    if not isinstance(form, Mapping):
        raise BadRequest(f"{where} must be an object, not {elide(form)}")
    for key in form:
        if key not in known:
            raise BadRequest(f"{where} has no field {elide(key)}; known: {', '.join(known)}")
    return form


def _list(what: str, value: object) -> Sequence[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise BadRequest(f"{what} must be a list, not {elide(value)}")
    return value


def _scope(where: str, value: str) -> bool:
    if value not in _SCOPES:
        raise BadRequest(f"{where}.scope {elide(value)} is not one of {', '.join(_SCOPES)}")
    return _SCOPES[value]


def _rule_of_json(form: Mapping[str, Any]) -> Rule:
    _keys("groups entry", form, ("mode", "role_group", "weight_transfer", "named"))
    mode = form.get("mode", "")
    if "role_group" in form:
        g = _keys("role_group", form["role_group"], ("roles", "scope"))
        return RoleGroup(mode, tuple(g.get("roles", ())), _scope("role_group", g.get("scope", "SCOPE_JOB")))
    if "weight_transfer" in form:
        g = _keys("weight_transfer", form["weight_transfer"], ("sender_role", "receiver_roles", "scope"))
        return WeightTransfer(mode, g.get("sender_role", ""), tuple(g.get("receiver_roles", ())),
                              _scope("weight_transfer", g.get("scope", "SCOPE_JOB")))
    if "named" in form:
        g = _keys("named", form["named"], ("groups",))
        return NamedGroups(mode, tuple(tuple(_keys("named.groups entry", r, ("ranks",)).get("ranks", ())) for r in g.get("groups", ())))
    check_mode(mode)
    raise BadRequest(f"group {mode!r} has no kind: give role_group, weight_transfer or named")


def _rule_json(rule: Rule) -> dict[str, Any]:
    if isinstance(rule, NamedGroups):
        return {"mode": rule.mode, "named": {"groups": [{"ranks": list(g)} for g in rule.groups]}}
    scope = "SCOPE_NODE" if rule.per_node else "SCOPE_JOB"
    if isinstance(rule, RoleGroup):
        return {"mode": rule.mode, "role_group": {"roles": list(rule.roles), "scope": scope}}
    return {"mode": rule.mode, "weight_transfer": {"sender_role": rule.sender, "receiver_roles": list(rule.receivers), "scope": scope}}
