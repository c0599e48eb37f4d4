"""The original Synkhronos' path of ``Function``: ``synkhronos.function_module.Function``."""
from .function import Function  # noqa: F401
