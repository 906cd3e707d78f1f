# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Tenants: each tenant (a tenant_salt) keeps its chunks in an arena of its own, within a quota.

- A tenant's arena (a sparse memfd, twice as large as the tenant's quota: pages being returned
  to the kernel never leave it short of room within its quota) is created when one of its
  namespaces is first registered and handed (OpenArena) only to sessions that registered one of
  its namespaces; no other session has a mapping of its bytes. It goes once no session holds it
  and none of its chunks is in RAM.
- Placement (asked by the RAM tier for each new chunk): the namespace's arena and the quota
  scopes its chunks count against: its tenant's (`tenant_quota`), and its own when it was
  registered with `quota_bytes`.
- Sessions that pin the public pool (Hello.pins_pool) keep the RAM tier from returning the pool's
  free pages to the kernel while they live.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvstored.errors import InvalidRequest, PoolExhausted, SessionRequired, UnknownRegion
from kvstored.events.bus import EventFilter, KvEvent
from kvstored.namespaces import Namespace, NamespaceRegistry
from kvstored.observability.snapshot import QuotaSnapshot, QuotaUsage
from kvstored.server.sessions import Session
from kvstored.shm.arenas import PUBLIC_ARENA, Arena, ArenaSet
from kvstored.sizes import format_size
from kvstored.tiers.ram import PUBLIC, Placement, QuotaScope, RamTier

log = logging.getLogger(__name__)


class UnknownArena(UnknownRegion):
    """An arena this session may not open, or none at all (NOT_FOUND either way: a session learns
    nothing about other tenants' arenas)."""


class TooManyTenants(PoolExhausted):
    """Every tenant arena the daemon allows is in use."""


class ArenasUnsupported(SessionRequired):
    """A session whose client maps only the public pool used a tenant namespace's pool slots."""


def visible(ns: Namespace, session: Session | None) -> bool:
    """Tenant namespaces exist only for the sessions that registered them (while they live)."""
    return not ns.private or (session is not None and not session.closed and ns.namespace_id in session.namespaces)


def events_for(namespaces: NamespaceRegistry, session: Session | None) -> EventFilter:
    """The events `session` (None: no session) may see: those of the namespaces visible to it.
    A namespace not registered since the daemon started (an fs tier evicting files of an earlier
    run, say) may be a tenant's: its events are seen by nobody."""

    def accepts(event: KvEvent) -> bool:
        ns = namespaces.find(event.namespace_id)
        return ns is not None and visible(ns, session)

    return accepts


@dataclass(frozen=True)
class TenantPolicy:
    quota_bytes: int  # each tenant's RAM quota (its arena is twice that, in address space)
    max_tenants: int = 1024


@dataclass(frozen=True)
class Registration:
    """What RegisterNamespace reports beyond the namespace itself."""

    arena_id: int
    arena_bytes: int
    quota_bytes: int  # the namespace's own quota in effect (0: none)


@dataclass(eq=False)
class Tenant:
    key: str
    arena: Arena
    scope: QuotaScope
    sessions: set[str] = field(default_factory=set)  # ids of the sessions granted its arena


class Tenancy:
    def __init__(self, ram: RamTier, arenas: ArenaSet, namespaces: NamespaceRegistry, policy: TenantPolicy) -> None:
        self._ram = ram
        self._arenas = arenas
        self._namespaces = namespaces
        self._page = ram.page_bytes
        # A tenant's quota: whole pages, at least one, at most the RAM tier.
        self._tenant_pages = max(1, min(policy.quota_bytes, ram.capacity_bytes) // self._page)
        self._max_tenants = policy.max_tenants
        self._tenants: dict[str, Tenant] = {}
        self._by_arena: dict[int, Tenant] = {}
        self._ns_scopes: dict[str, QuotaScope] = {}
        self._placements: dict[str, Placement] = {}
        self._pinning: set[str] = set()  # sessions that pin the public pool
        ram.set_placement(self.placement)
        ram.set_public_releasable(True)

    @property
    def tenant_quota_bytes(self) -> int:
        return self._tenant_pages * self._page

    def __len__(self) -> int:
        return len(self._tenants)

    # -- namespaces -----------------------------------------------------------------------

    def register(self, session: Session | None, ns: Namespace, quota_bytes: int) -> Registration:
        """After NamespaceRegistry.register: set the namespace's quota (if given) and, for a
        tenant namespace, grant `session` its tenant's arena (created on first use)."""
        if ns.private and session is None:
            raise SessionRequired("a tenant namespace (tenant_salt set) must be registered with a session_id")
        if quota_bytes:
            self._set_quota(ns, quota_bytes)
        own = self._ns_scopes.get(ns.namespace_id)
        quota = own.limit_pages * self._page if own is not None else 0
        if session is None or not ns.private:
            return Registration(PUBLIC_ARENA, self._arenas.get(PUBLIC_ARENA).size, quota)
        tenant = self._tenants.get(ns.tenant) or self._new_tenant(ns.tenant)
        tenant.sessions.add(session.session_id)
        session.tenants.add(ns.tenant)
        return Registration(tenant.arena.arena_id, tenant.arena.size, quota)

    def placement(self, namespace_id: str) -> Placement | None:
        """Where the namespace's new chunks go (None: nowhere, e.g. not registered)."""
        placement = self._placements.get(namespace_id)
        if placement is not None:
            return placement
        ns = self._namespaces.find(namespace_id)
        if ns is None:
            return None
        own = (self._ns_scopes[namespace_id],) if namespace_id in self._ns_scopes else ()
        if not ns.private:
            placement = Placement(PUBLIC_ARENA, own) if own else PUBLIC
        else:
            tenant = self._tenants.get(ns.tenant)
            if tenant is None:  # its arena went with its last session and chunk: nothing to place into
                return None
            placement = Placement(tenant.arena.arena_id, (tenant.scope, *own))
        self._placements[namespace_id] = placement
        return placement

    def namespace_usage(self, namespace_id: str) -> QuotaUsage | None:
        scope = self._ns_scopes.get(namespace_id)
        return None if scope is None else self._usage(namespace_id, scope)

    def tenant_usage(self, tenant_key: str) -> QuotaUsage | None:
        tenant = self._tenants.get(tenant_key)
        return None if tenant is None else self._usage(tenant_key, tenant.scope)

    def snapshot(self) -> QuotaSnapshot:
        """Every tenant's quota and use, and every public namespace's that has a quota (for
        metrics, which anyone who reaches them may read). A tenant is named by its arena id: its
        key is a digest of its salt, and a digest of a guessable salt would give the salt (the
        tenant's credential) away; its namespaces are not named at all."""
        public = [
            (ns_id, scope)
            for ns_id, scope in self._ns_scopes.items()
            if not (ns := self._namespaces.find(ns_id)) or not ns.private
        ]
        return QuotaSnapshot(
            [self._usage(str(t.arena.arena_id), t.scope) for t in self._tenants.values()],
            [self._usage(ns_id, scope) for ns_id, scope in public],
        )

    # -- sessions and arenas --------------------------------------------------------------

    def open_arena(self, session: Session, arena_id: int) -> Arena:
        """An arena `session` may map: the public one, or one of a tenant it registered."""
        tenant = self._by_arena.get(arena_id)
        if arena_id != PUBLIC_ARENA and (tenant is None or tenant.key not in session.tenants):
            raise UnknownArena(
                f"arena {arena_id} is not open to session {session.session_id}: register "
                f"a namespace of its tenant in this session first"
            )
        return self._arenas.get(arena_id)

    def session_opened(self, session: Session) -> None:
        if session.pins_pool:
            self._pinning.add(session.session_id)
            self._ram.set_public_releasable(False)

    def session_closed(self, session: Session) -> None:
        for key in session.tenants:
            tenant = self._tenants.get(key)
            if tenant is not None:
                tenant.sessions.discard(session.session_id)
        session.tenants.clear()
        if session.session_id in self._pinning:
            self._pinning.discard(session.session_id)
            self._ram.set_public_releasable(not self._pinning)
        self.sweep()

    def sweep(self) -> None:
        """Remove the arenas of tenants that no session holds and that have no chunk in RAM."""
        for tenant in [t for t in self._tenants.values() if not t.sessions and self._ram.arena_idle(t.arena.arena_id)]:
            arena_id = tenant.arena.arena_id
            self._ram.remove_arena(arena_id)
            self._arenas.remove(arena_id)
            del self._tenants[tenant.key], self._by_arena[arena_id]
            self._placements.clear()
            log.debug("tenant arena %d removed (no session, no chunk)", arena_id)

    # -- hand-over (kvstored/server/handover.py) -----------------------------------------------

    def arenas_by_tenant(self) -> dict[str, int]:
        """Each tenant's key and arena id, for the next daemon."""
        return {key: tenant.arena.arena_id for key, tenant in self._tenants.items()}

    def adopt_tenant(self, key: str, arena: Arena) -> None:
        """A tenant whose arena the previous daemon handed over (its sessions register again)."""
        self._ram.add_arena(arena.arena_id, arena.size)
        tenant = Tenant(key, arena, QuotaScope(f"arena:{arena.arena_id}", self._tenant_pages))
        self._tenants[key] = tenant
        self._by_arena[arena.arena_id] = tenant
        self._placements.clear()

    # -- internals ------------------------------------------------------------------------

    def _new_tenant(self, key: str) -> Tenant:
        if len(self._tenants) >= self._max_tenants:
            self.sweep()
        if len(self._tenants) >= self._max_tenants:
            raise TooManyTenants(
                f"{len(self._tenants)} tenants hold arenas (max_tenants={self._max_tenants}); "
                f"a new tenant can register once one has no session and no chunk in RAM"
            )
        size = 2 * self._tenant_pages * self._page  # address space only: memory follows use
        arena = self._arenas.create(key, size)
        self._ram.add_arena(arena.arena_id, size)
        tenant = Tenant(key, arena, QuotaScope(f"arena:{arena.arena_id}", self._tenant_pages))
        self._tenants[key] = tenant
        self._by_arena[arena.arena_id] = tenant
        self._placements.clear()
        log.debug("tenant arena %d of %s (address space)", arena.arena_id, format_size(size))
        return tenant

    def _set_quota(self, ns: Namespace, quota_bytes: int) -> None:
        if quota_bytes < ns.chunk_bytes:
            raise InvalidRequest(
                f"quota_bytes {quota_bytes} is less than one chunk ({ns.chunk_bytes} bytes) "
                f"of namespace {ns.namespace_id}"
            )
        cap = self.tenant_quota_bytes if ns.private else self._ram.capacity_bytes
        pages = max(min(quota_bytes, cap) // self._page, self._ram.pages_for(ns.chunk_bytes))  # whole chunks
        scope = self._ns_scopes.get(ns.namespace_id)
        if scope is not None:
            scope.limit_pages = pages
            return
        scope = self._ns_scopes[ns.namespace_id] = QuotaScope(f"namespace:{ns.namespace_id}", pages)
        self._ram.attach_scope(ns.namespace_id, scope)
        self._placements.pop(ns.namespace_id, None)

    def _usage(self, name: str, scope: QuotaScope) -> QuotaUsage:
        return QuotaUsage(name, scope.limit_pages * self._page, scope.used_pages * self._page, scope.evictions)
