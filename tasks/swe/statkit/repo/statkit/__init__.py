from statkit.summary import mean, median, spread

__all__ = ["mean", "median", "spread"]
