"""The names of :mod:`rlft.data.prompts`, where this module moved; kept until rlft/bench/cli.py and
rlft/evaluate/scoring.py import them from there."""
from rlft.data.prompts import *  # noqa: F401,F403
