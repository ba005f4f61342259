"""The prefix cache's structures: ref-counted pages, the radix tree over full pages, Mamba
snapshots, and the cache that ties them (lookup at snapshots, LRU eviction of unused leaves,
consistent accounting)."""
from __future__ import annotations

import pytest
import torch

from blockspec.cache import BlockAllocator, MambaStatePool
from blockspec.cache.mamba_snapshots import MambaSnapshots
from blockspec.cache.prefix_cache import PrefixCache
from blockspec.cache.radix_cache import RadixTree

PAGE = 4


def _pool(slots=3):
    return MambaStatePool(2, slots, conv_dim=16, conv_kernel=4, num_heads=2, head_dim=4,
                          state_size=4, dtype=torch.float32, device=torch.device("cpu"), groups=1)


def test_allocator_shared_page_frees_with_last_holder():
    a = BlockAllocator(4, PAGE, first=1)
    t = []
    assert a.grow(t, 2 * PAGE) and a.num_free == 2
    a.share([t[0]])
    held = list(t)
    a.release(t)
    assert a.num_free == 3 and a.refs(held[0]) == 1 and a.refs(held[1]) == 0
    a.release([held[0]])
    assert a.num_free == 4
    with pytest.raises(RuntimeError, match="released more often"):
        a.release([held[0]])
    with pytest.raises(RuntimeError, match="is free"):
        a.share([held[0]])


def test_tree_insert_keeps_existing_pages_and_matches_full_pages():
    tree = RadixTree(PAGE)
    toks = list(range(10))                      # 2 full pages + 2 tokens
    path, adopted = tree.insert(toks, [7, 8, 9])
    assert [n.page for n in path] == [7, 8] and adopted == [0, 1]
    other = toks[:4] + [99] * 4
    path2, adopted2 = tree.insert(other, [1, 2])
    assert path2[0] is path[0] and path2[0].page == 7 and adopted2 == [1]
    assert [n.depth for n in tree.match(toks, 100)] == [4, 8]
    assert len(tree.match(toks, 7)) == 1        # the limit counts tokens
    assert tree.match([5] + toks[1:], 100) == []


def test_snapshots_round_trip():
    pool = _pool()
    snaps = MambaSnapshots(pool, 2)
    pool.conv[:, 1].normal_()
    pool.ssm[:, 1].normal_()
    sid = snaps.save(1)
    pool.reset(1)
    snaps.restore(sid, 2)
    assert torch.equal(pool.conv[:, 2], snaps.conv[:, sid]) and pool.ssm[:, 2].abs().sum() > 0
    assert snaps.save(0) is not None and snaps.save(0) is None      # only 2 slots
    snaps.free(sid)
    with pytest.raises(RuntimeError):
        snaps.free(sid)


def _cache(pages=8, snaps=2, interval=8):
    a = BlockAllocator(pages, PAGE, first=1)
    return a, PrefixCache(a, _pool(), track_interval=interval, snapshot_slots=snaps)


def _insert(a, cache, tokens, slot=0):
    """A request that holds pages for ``tokens`` and checkpoints all of them, then finishes."""
    pages, nodes = [], []
    assert a.grow(pages, len(tokens))
    cache.insert(tokens, pages, nodes, slot)
    cache.release(nodes)
    a.release(pages)


def test_lookup_stops_at_the_deepest_snapshot_and_respects_the_limit():
    a, cache = _cache()
    toks = list(range(12))
    pages, nodes = [], []
    a.grow(pages, 12)
    cache.insert(toks[:4], pages, nodes, 0)         # snapshot at 4
    cache.insert(toks[:12], pages, nodes, 0)        # snapshot at 12, nothing at 8
    hit = cache.lookup(toks + [50], 13)
    assert hit.length == 12 and hit.snapshot is not None
    assert cache.lookup(toks, 11).length == 4       # 8 has no snapshot: rounds down to 4
    assert cache.lookup([1] + toks[1:], 12).length == 0
    cache.audit([pages])
    cache.release(nodes)
    a.release(pages)
    cache.audit([])


def test_eviction_is_lru_leaves_never_used_pages():
    a, cache = _cache(pages=6, snaps=4)
    _insert(a, cache, [1] * 8)
    _insert(a, cache, [2] * 8)
    assert a.num_free == 2 and cache.cached_pages == 4
    hit = cache.lookup([1] * 9, 8)
    pages = hit.pages
    a.share(pages)
    cache.tree.lock(hit.nodes)                      # a running request uses [1]*8
    cache.evict_pages(10)
    assert cache.lookup([1] * 9, 8).length == 8 and cache.lookup([2] * 9, 8).length == 0
    assert a.num_free == 4
    cache.audit([pages])
    cache.tree.unlock(hit.nodes)
    a.release(pages)
    cache.evict_pages(1)                            # the [1] path's leaf goes first
    assert cache.cached_pages == 1 and a.num_free == 5
    cache.audit([])


def test_snapshot_pressure_evicts_the_oldest_unused_snapshot_and_its_dead_pages():
    a, cache = _cache(pages=8, snaps=2)
    _insert(a, cache, [1] * 4)
    _insert(a, cache, [2] * 4)
    _insert(a, cache, [3] * 4)                      # needs a snapshot: [1]'s goes, and its page
    assert cache.lookup([1] * 5, 4).length == 0
    assert cache.lookup([3] * 5, 4).length == 4 and cache.cached_pages == 2
    cache.audit([])


def test_chunk_ends_at_the_last_checkpoint_inside_it():
    _, cache = _cache(interval=8)
    assert cache.chunk_end(0, 12, 30) == 8          # a multiple of the interval
    assert cache.chunk_end(0, 30, 30) == 28         # the context's last page boundary
    assert cache.chunk_end(0, 28, 28) == 24         # ... before its last token
    assert cache.chunk_end(0, 20, 30) == 16         # the last multiple inside the chunk
    assert cache.chunk_end(28, 30, 30) == 30
    assert cache.chunk_end(8, 12, 30) == 12         # none inside: unchanged
    assert cache.is_checkpoint(28, 30) and cache.is_checkpoint(16, 30)
    assert cache.is_checkpoint(24, 28) and not cache.is_checkpoint(28, 28)
    assert not cache.is_checkpoint(12, 30) and not cache.is_checkpoint(30, 30)
    with pytest.raises(ValueError, match="multiple of page_size"):
        PrefixCache(BlockAllocator(2, PAGE), _pool(), track_interval=6, snapshot_slots=1)


def test_a_running_requests_inner_snapshots_give_way_but_not_its_deepest():
    a, cache = _cache(pages=8, snaps=2)
    toks = [1] * 8
    pages, nodes = [], []
    a.grow(pages, 8)
    cache.insert(toks[:4], pages, nodes, 0)
    cache.insert(toks, pages, nodes, 0)             # both snapshots used by this request
    other = [2] * 4
    _insert(a, cache, other)                        # the inner one (depth 4) gives way
    assert [n.snapshot is not None for n in nodes] == [False, True]
    assert cache.lookup(other + [0], 4).length == 4
    cache.audit([pages])
    _insert(a, cache, [3] * 4)                      # now [2]'s, unused, goes: never depth 8's
    assert nodes[-1].snapshot is not None and cache.lookup(other + [0], 4).length == 0
    cache.release(nodes)
    a.release(pages)
    cache.audit([])


def test_track_interval_is_checked_only_with_the_cache_on():
    from blockspec.args import ArgsError, EngineArgs  # lazy: the rest of the file is cache/ only

    EngineArgs.from_kwargs(page_size=48)                    # 256 is no multiple: cache off
    with pytest.raises(ArgsError, match="mamba_track_interval"):
        EngineArgs.from_kwargs(page_size=48, enable_radix_cache=True)
    with pytest.raises(ArgsError, match="mamba_cache_slots"):
        EngineArgs.from_kwargs(mamba_cache_slots=-1)
