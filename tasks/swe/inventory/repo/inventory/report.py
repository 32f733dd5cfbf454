"""Plain-text stock reports."""
from inventory.store import Inventory


def report(inventory: Inventory) -> str:
    lines = [f"{item}: {n}" for item, n in inventory.items()]
    lines.append(f"total: {inventory.total()}")
    return "\n".join(lines)
