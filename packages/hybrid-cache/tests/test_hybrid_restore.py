"""restorable_pages: a hybrid prefix is a hit only as far as every pool can restore it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.hybrid_cache import InvalidOperation, RestoreKind, RestoreRule, restorable_pages

FULL = RestoreRule.prefix()
MAMBA = RestoreRule.boundary()


def flags(text: str) -> list[bool]:
    return [c == "x" for c in text]


def test_module_doc_example() -> None:
    rules = {
        "full": FULL,
        "swa": RestoreRule(kind=RestoreKind.WINDOW, window_pages=2),
        "mamba": MAMBA,
    }
    available = {
        "full": flags("xxxxxx.."),
        "swa": flags("...xxxx."),
        "mamba": flags(".....x.x"),
    }
    got = restorable_pages(rules, available, 8)
    assert got.num_pages == 6
    assert got.limited_by == "full"


@pytest.mark.parametrize(
    ("full", "expected"),
    [("", 0), ("xxxx", 4), ("xx.x", 2), (".xxx", 0), ("xxx.", 3)],
)
def test_full_only_is_the_leading_run(full: str, expected: int) -> None:
    got = restorable_pages({"full": FULL}, {"full": flags(full)}, len(full))
    assert got.num_pages == expected
    assert got.limited_by == (None if expected == len(full) else "full")


def test_swa_needs_only_its_window_before_the_boundary() -> None:
    rules = {"full": FULL, "swa": RestoreRule.window(sliding_window=20, page_size=8)}
    assert rules["swa"].window_pages == 3
    # SWA pages 0..2 were dropped (out of window): boundary 6 needs pages 3..5 only.
    got = restorable_pages(rules, {"full": flags("xxxxxx"), "swa": flags("...xxx")}, 6)
    assert got.num_pages == 6
    # A gap inside the last window moves the boundary back to where a whole window exists.
    got = restorable_pages(rules, {"full": flags("xxxxxx"), "swa": flags("xxx.xx")}, 6)
    assert got.num_pages == 3
    assert got.limited_by == "swa"


def test_swa_short_prefix_needs_every_page() -> None:
    rules = {"swa": RestoreRule(kind=RestoreKind.WINDOW, window_pages=4)}
    assert restorable_pages(rules, {"swa": flags("xx")}, 2).num_pages == 2
    assert restorable_pages(rules, {"swa": flags(".x")}, 2).num_pages == 0


def test_mamba_needs_the_state_at_the_boundary() -> None:
    rules = {"full": FULL, "mamba": MAMBA}
    got = restorable_pages(rules, {"full": flags("xxxxx"), "mamba": flags(".x..x")}, 5)
    assert got.num_pages == 5
    got = restorable_pages(rules, {"full": flags("xxx.."), "mamba": flags(".x..x")}, 5)
    assert got.num_pages == 2
    got = restorable_pages(rules, {"full": flags("xxxxx"), "mamba": flags(".....")}, 5)
    assert (got.num_pages, got.limited_by) == (0, "mamba")


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidOperation):
        restorable_pages({"full": FULL}, {}, 0)
    with pytest.raises(InvalidOperation):
        restorable_pages({"full": FULL}, {"full": [True]}, 2)
    with pytest.raises(ValueError, match="window_pages"):
        RestoreRule(kind=RestoreKind.WINDOW)
    with pytest.raises(ValueError, match="window_pages"):
        RestoreRule(kind=RestoreKind.PREFIX, window_pages=2)


def _brute(rules: dict[str, RestoreRule], available: dict[str, list[bool]], n: int) -> int:
    def accepts(rule: RestoreRule, avail: list[bool], b: int) -> bool:
        if b == 0:
            return True
        if rule.kind is RestoreKind.PREFIX:
            return all(avail[:b])
        if rule.kind is RestoreKind.WINDOW:
            return all(avail[max(0, b - rule.window_pages) : b])
        return avail[b - 1]

    return max(
        b for b in range(n + 1) if all(accepts(r, available[m], b) for m, r in rules.items())
    )


@given(
    n=st.integers(0, 24),
    window=st.integers(1, 6),
    data=st.data(),
)
def test_matches_a_brute_force_definition(n: int, window: int, data: st.DataObject) -> None:
    every = {
        "full": FULL,
        "swa": RestoreRule(kind=RestoreKind.WINDOW, window_pages=window),
        "mamba": MAMBA,
    }
    # Any non-empty subset of the members (one member alone takes its own path), any order.
    names = data.draw(st.lists(st.sampled_from(list(every)), min_size=1, max_size=3, unique=True))
    rules = {name: every[name] for name in names}
    available = {m: data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for m in rules}
    got = restorable_pages(rules, available, n)
    assert got.num_pages == _brute(rules, available, n)
    if got.num_pages < n:
        assert got.limited_by in rules


def test_a_rule_kind_that_is_not_a_restore_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="RestoreKind"):
        RestoreRule(kind="prefix")  # pyright: ignore[reportArgumentType]
