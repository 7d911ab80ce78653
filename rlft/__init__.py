"""rlft: reinforcement-learning fine-tuning of LLMs (GRPO family) on verifiable maths."""

__version__ = "0.1.0"
