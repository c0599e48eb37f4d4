"""The original Synkhronos' path of ``Data``: ``synkhronos.data_module.Data``."""
from .data import Data  # noqa: F401
