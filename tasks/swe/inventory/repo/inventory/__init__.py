from inventory.report import report
from inventory.store import Inventory

__all__ = ["Inventory", "report"]
