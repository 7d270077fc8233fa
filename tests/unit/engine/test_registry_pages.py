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
