"""Status pages: one page costs the page, and the pages of a read cover every block once."""

from asteria_server.engine.registry import CoherenceRegistry


def _pages(registry: CoherenceRegistry, tenant: str, limit: int) -> list[list[str]]:
    pages, after = [], ""
    while True:
        page, total = registry.status_page(tenant, after, limit)
        assert total == registry.blocks_of(tenant)
        if not page:
            return pages
        pages.append([s.block for s in page])
        after = page[-1].block


def test_pages_cover_every_block_in_name_order_and_follow_changes() -> None:
    registry = CoherenceRegistry()
    names = [f"b{i:03d}" for i in range(25)]
    for name in reversed(names):
        registry.on_submit("t", name, 1)
    registry.on_submit("other", "a", 1)  # another tenant's block is never on t's pages
    pages = _pages(registry, "t", 10)
    assert [len(p) for p in pages] == [10, 10, 5]
    assert [b for p in pages for b in p] == names
    assert [s.block for s in registry.status("t")] == names  # the same order as status()
    registry.forget("t", "b005")  # a block leaves: the next read no longer shows it
    registry.on_submit("t", "a-new", 1)  # one comes: it takes its place by name
    shown = [b for p in _pages(registry, "t", 10) for b in p]
    assert shown == ["a-new", *[n for n in names if n != "b005"]]
    page, total = registry.status_page("t", "b020", 10)  # from the middle
    assert [s.block for s in page] == names[21:] and total == 25


class _CountingRecords(dict):  # type: ignore[type-arg]
    """The registry's records, counting the walks over all of them."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().__iter__()


def test_a_new_block_is_merged_into_the_sorted_names_without_a_walk_over_every_record() -> None:
    """While many clients register, a status page came after every new block: each one sorted
    every record's name again (under the engine's lock). Now the new names are merged in."""
    registry = CoherenceRegistry()
    registry._records = _CountingRecords(registry._records)  # the one place this reaches inside
    for i in range(50):
        registry.on_submit("t", f"b{i:03d}", 1)
    assert [b for p in _pages(registry, "t", 20) for b in p] == [f"b{i:03d}" for i in range(50)]
    walks = _CountingRecords.walks
    for added, name in enumerate(("a", "b0255", "c"), 1):  # after the names were sorted
        registry.on_submit("t", name, 1)
        page, total = registry.status_page("t", "", 5)
        assert total == 50 + added and page[0].block == "a"
    assert _CountingRecords.walks == walks  # merged, not rebuilt from every record
    shown = [b for p in _pages(registry, "t", 20) for b in p]
    assert shown == sorted(["a", "b0255", "c", *(f"b{i:03d}" for i in range(50))])
