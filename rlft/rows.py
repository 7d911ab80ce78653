"""The names of :mod:`rlft.data.rows`, where this module moved; kept until rlft/bench/cli.py imports
them from there."""
from rlft.data.rows import *  # noqa: F401,F403
