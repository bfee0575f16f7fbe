"""kvcodec.device.plans: pinned launch plans survive eviction while their owner lives."""

import gc

import pytest

from kvcodec.device.plans import PlanCache, pinned_by, pinned_count


class Owner:
    pass


def test_unpinned_plans_are_dropped_together_when_full():
    cache = PlanCache("test", 3)
    built = []
    for key in range(5):
        cache.get(key, lambda k=key: built.append(k) or f"plan {k}")
    assert built == [0, 1, 2, 3, 4] and len(cache) == 2  # cleared when the fourth came
    assert cache.get(4, lambda: "rebuilt") == "plan 4"


def test_pinned_plans_survive_eviction_until_the_owner_goes():
    cache = PlanCache("test", 2)
    owner = Owner()
    with pinned_by(owner):
        cache.get("a", lambda: "plan a")
    assert pinned_count(owner) == 1
    for key in range(10):  # fills and clears the unpinned plans several times
        cache.get(key, lambda: "other")
    assert cache.get("a", lambda: pytest.fail("a pinned plan was rebuilt")) == "plan a"
    del owner
    gc.collect()
    cache.clear()
    assert cache.get("a", lambda: "rebuilt") == "rebuilt"


def test_a_new_pin_replaces_the_owners_old_set_and_shared_pins_count_owners():
    cache = PlanCache("test", 1)
    one, two = Owner(), Owner()
    with pinned_by(one):
        cache.get("a", lambda: "plan a")
    with pinned_by(two):
        cache.get("a", lambda: "plan a'")
    with pinned_by(one):  # one now pins b only; a stays pinned by two
        cache.get("b", lambda: "plan b")
    cache.clear()
    assert cache.get("a", lambda: "rebuilt") == "plan a"
    del two
    gc.collect()
    cache.clear()
    assert cache.get("a", lambda: "rebuilt") == "rebuilt"
    assert cache.get("b", lambda: "rebuilt") == "plan b"


def test_pinned_blocks_do_not_nest():
    with pinned_by(Owner()), pytest.raises(RuntimeError, match="nest"):
        with pinned_by(Owner()):
            pass
