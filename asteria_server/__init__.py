"""Asteria's lower layer: the preconditioner engine and the daemon that serves it.

This package never imports torch: the daemon must start on a host without it.
"""

__version__ = "0.1.0"
