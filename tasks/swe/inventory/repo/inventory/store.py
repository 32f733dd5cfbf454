"""Stock counts per item."""


class Inventory:
    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, item: str, quantity: int = 0) -> None:
        """Add `quantity` units of `item` (one unit when no quantity is given)."""
        if quantity < 0:
            raise ValueError("quantity must not be negative")
        self._counts[item] = self._counts.get(item, 0) + quantity

    def remove(self, item: str, quantity: int = 1) -> None:
        have = self._counts.get(item, 0)
        if quantity > have:
            raise ValueError(f"cannot remove {quantity} {item}: only {have} in stock")
        self._counts[item] = have - quantity

    def count(self, item: str) -> int:
        return self._counts.get(item, 0)

    def items(self) -> list[tuple[str, int]]:
        return sorted((item, n) for item, n in self._counts.items() if n > 0)

    def total(self) -> int:
        return sum(self._counts.values())
