import pytest

from inventory import Inventory, report


def test_add_explicit_quantity():
    inv = Inventory()
    inv.add("apple", 3)
    inv.add("apple", 2)
    assert inv.count("apple") == 5


def test_remove():
    inv = Inventory()
    inv.add("pear", 4)
    inv.remove("pear", 3)
    assert inv.count("pear") == 1


def test_remove_too_many_raises():
    inv = Inventory()
    inv.add("pear", 1)
    with pytest.raises(ValueError):
        inv.remove("pear", 2)


def test_report():
    inv = Inventory()
    inv.add("b", 2)
    inv.add("a", 1)
    assert report(inv) == "a: 1\nb: 2\ntotal: 3"
