"""SGLang's router ``cache_aware`` policy, rebuilt from its documented behaviour as a baseline.

Pure and I/O-free like :class:`~kvwire.routing.policy.RoutingPolicy`, so the fleet simulator
can put it beside kvwire's policy on the same engines. What SGLang's router (``sglang-router``
0.3.x, ``--policy cache_aware``) does, and what this class does the same way:

* **Approximate tree.** The router never sees the engines' caches: it keeps one radix tree of
  the prompts it has *sent*, each node tagged with the workers (tenants) it sent them to and
  when. A worker's tree size is the number of characters tagged with it.
* **Imbalance first.** Load is the number of requests the router has in flight on a worker
  (+1 on routing, -1 when the answer ends). If ``max - min > balance_abs_threshold`` *and*
  ``max > balance_rel_threshold * min``, the request goes to the least-loaded worker
  (shortest queue), whatever the cache.
* **Otherwise the cache.** Match the prompt against the tree; ``match_rate`` = matched /
  prompt length. Above ``cache_threshold`` the request goes to a worker holding the deepest
  matched node; else to the least-loaded worker (ties: the first in the worker list), as
  sglang-router 0.3.2 (built from the SGLang Model Gateway source, ``smg::`` in its logs)
  does; older releases took the worker with the smallest tree (``miss="smallest_tree"``).
* The prompt is then inserted into the tree for the chosen worker (in every case).
* **Eviction.** Every ``eviction_interval`` seconds, each worker's tree is cut back to
  ``max_tree_size`` by dropping its least recently used entries.

Differences, said plainly: the tree here is a trie of *items* (characters for text, or whole
block hashes in the simulator, where a 512-token block is one item of 512 units of length),
not a radix tree with compressed edges: the same matches at item granularity. When several
workers hold the deepest node, SGLang takes one from an unordered map; this takes the one
that touched it last (deterministic). A node whose tenants are all evicted is removed with
its edge; eviction takes least recently touched nodes first, deepest first among equals.
Defaults are 0.3.2's CLI ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["CacheAwareParams", "CacheAwarePolicy"]


@dataclass(frozen=True)
class CacheAwareParams:
    """``sglang_router.launch_router`` defaults (0.3.2)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval: float = 60.0
    max_tree_size: int = 67_108_864
    #: on a low match: "min_load" (0.3.2, the gateway's source) or "smallest_tree" (older)
    miss: str = "min_load"


class CacheAwarePolicy:
    """Choose a worker as SGLang's ``cache_aware`` does; see the module docstring."""

    def __init__(self, workers: Sequence[str], params: CacheAwareParams | None = None,
                 unit: int = 1) -> None:
        if not workers:
            raise ValueError("no workers")
        self.p = params or CacheAwareParams()
        if self.p.miss not in ("smallest_tree", "min_load"):
            raise ValueError(f"miss must be smallest_tree or min_load, got {self.p.miss!r}")
        self.workers = list(workers)
        self.unit = int(unit)  # length of one item (1 for characters, block size for blocks)
        self.load = {w: 0 for w in self.workers}
        self.size = {w: 0 for w in self.workers}
        # a trie: (parent node, item) -> node (0 is the root); per node its tenants and when
        # each last touched it, its depth (eviction takes leaves first) and its edge
        self._child: dict[tuple[int, Hashable], int] = {}
        self._owners: dict[int, dict[str, float]] = {}
        self._depth: dict[int, int] = {}
        self._edge: dict[int, tuple[int, Hashable]] = {}
        self._next_node = 1
        self._next_evict: float | None = None
        self.imbalanced_routes = 0
        self.cache_routes = 0
        self.miss_routes = 0

    def choose(self, keys: Sequence[Hashable], length: float, now: float,
               alive: dict[str, bool] | None = None) -> str:
        """Route a prompt of item ``keys`` (each ``unit`` long) and total ``length``; returns
        the worker, with its load raised and the prompt inserted for it. Dead workers (in
        ``alive``) are skipped unless all are."""
        self._maybe_evict(now)
        pool = [w for w in self.workers if alive is None or alive.get(w, True)] or self.workers
        loads = [self.load[w] for w in self.workers]  # SGLang reads every worker's load
        lo, hi = min(loads), max(loads)
        if hi - lo > self.p.balance_abs_threshold and hi > lo * self.p.balance_rel_threshold:
            name = min(pool, key=lambda w: self.load[w])
            self.imbalanced_routes += 1
        else:
            matched, holders = self._match(keys)
            rate = matched * self.unit / length if length > 0 else 0.0
            live = {w: t for w, t in holders.items() if w in pool}
            if rate > self.p.cache_threshold and live:
                name = max(live, key=lambda w: live[w])
                self.cache_routes += 1
            else:
                table = self.size if self.p.miss == "smallest_tree" else self.load
                name = min(pool, key=lambda w: table[w])
                self.miss_routes += 1
        self._insert(keys, name, now)
        self.load[name] += 1
        return name

    def complete(self, name: str) -> None:
        """The answer from ``name`` ended (or failed): its in-flight count drops."""
        if self.load.get(name, 0) > 0:
            self.load[name] -= 1

    def _match(self, keys: Sequence[Hashable]) -> tuple[int, dict[str, float]]:
        holders: dict[str, float] = {}
        node, n = 0, 0
        for k in keys:
            node = self._child.get((node, k), -1)
            owners = self._owners.get(node)
            if not owners:
                break
            holders = owners
            n += 1
        return n, holders

    def _insert(self, keys: Sequence[Hashable], name: str, now: float) -> None:
        node = 0
        for depth, k in enumerate(keys):
            child = self._child.get((node, k))
            if child is None:
                child = self._child[(node, k)] = self._next_node
                self._next_node += 1
                self._depth[child] = depth
                self._edge[child] = (node, k)
            node = child
            owners = self._owners.setdefault(node, {})
            if name not in owners:
                self.size[name] += self.unit
            owners[name] = now

    def _maybe_evict(self, now: float) -> None:
        if self._next_evict is None:
            self._next_evict = now + self.p.eviction_interval
        if now < self._next_evict:
            return
        self._next_evict = now + self.p.eviction_interval
        over = {w for w, s in self.size.items() if s > self.p.max_tree_size}
        if not over:
            return
        # least recently used first, deeper entries before their parents (leaves first)
        entries = sorted(((t, -self._depth[k], k, w) for k, owners in self._owners.items()
                          for w, t in owners.items() if w in over))
        for _, _, k, w in entries:
            if self.size[w] <= self.p.max_tree_size:
                continue
            owners = self._owners[k]
            del owners[w]
            self.size[w] -= self.unit
            if not owners:  # no tenant left: the node goes (its children went first)
                del self._owners[k]
                del self._depth[k]
                del self._child[self._edge.pop(k)]
