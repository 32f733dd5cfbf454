from pathkit.names import change_ext, split_ext

__all__ = ["change_ext", "split_ext"]
