"""omnips: a parameter server for heterogeneous clusters."""

__version__ = "0.1.0"
