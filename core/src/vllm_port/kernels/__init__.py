"""Kernels shared by vendor plugins. Each subpackage needs its own compiler (``triton``) installed."""
