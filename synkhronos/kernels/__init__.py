"""Compiled loops shared by backends and extensions (``half``: float16 reductions and
conversions with float32 accumulation)."""
