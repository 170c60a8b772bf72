"""Old import paths keep working for one release: the same object as at the new path, and a
DeprecationWarning naming the new path, attributed to the line that used the old one."""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import EntryPoint

import pytest

#: (old module, name, new module): every path a user may have (README, docs, entry points).
MOVED = [
    ("kvwire.consume.cache", "BlockCache", "kvwire.index.cache"),
    ("kvwire.consume.cache", "chain_events", "kvwire.index.cache"),
    ("kvwire.consume.cache", "CachedBlock", "kvwire.index.cache"),
    ("kvwire.consume.cache", "medium_key", "kvwire.index.cache"),
    ("kvwire.router.cache_aware", "CacheAwarePolicy", "kvwire.sim.baselines"),
    ("kvwire.router.cache_aware", "CacheAwareParams", "kvwire.sim.baselines"),
    ("kvwire.engines", "PublisherOptions", "kvwire.plugins"),
    ("kvwire.engines", "switch", "kvwire.plugins"),
    ("kvwire.engines.vllm", "register", "kvwire.plugins.vllm"),
    ("kvwire.engines.vllm", "publisher_class", "kvwire.plugins.vllm"),
    ("kvwire.engines.sglang", "register", "kvwire.plugins.sglang"),
    ("kvwire.engines.vllm_shm", "install", "kvwire.plugins.vllm_shm"),
    ("kvwire.nats.consumer", "NatsStreams", "kvwire.nats.streams"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_an_old_path_is_the_same_object_and_warns(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)
    assert [w.category for w in caught] == [DeprecationWarning], caught
    assert new in str(caught[0].message) and old in str(caught[0].message)
    assert caught[0].filename == __file__  # the user's line, not kvwire's


def test_from_import_of_an_old_path_warns_at_the_importing_line() -> None:
    with pytest.warns(DeprecationWarning, match="kvwire.index.cache") as rec:
        from kvwire.consume.cache import BlockCache
    from kvwire.index.cache import BlockCache as new

    assert BlockCache is new
    assert rec[0].filename == __file__


def test_an_unknown_name_at_an_old_path_is_an_attribute_error() -> None:
    import kvwire.consume.cache as old
    import kvwire.engines.vllm as old_plugin

    with pytest.raises(AttributeError, match="no attribute 'PrefixIndex'"):
        old.PrefixIndex  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute '_registry'"):
        old_plugin._registry  # noqa: B018


def test_an_installed_old_entry_point_still_loads_the_plugin() -> None:
    """An environment installed before the move names ``kvwire.engines.vllm:register`` in
    its entry points; loading it gives the plugin's own function."""
    from kvwire.plugins import sglang, vllm

    for value, plugin in (("kvwire.engines.vllm:register", vllm),
                          ("kvwire.engines.sglang:register", sglang)):
        ep = EntryPoint("kvwire", value, "vllm.general_plugins")
        with pytest.warns(DeprecationWarning):
            assert ep.load() is plugin.register
