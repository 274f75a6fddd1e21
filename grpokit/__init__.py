"""grpokit: GRPO-family reinforcement learning for language models.

Importing the package is cheap; torch and transformers load only when a command needs them.
"""

__version__ = "0.1.0"
