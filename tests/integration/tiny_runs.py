"""The tiny-run builder under the name the integration tests first imported it by; it lives in tests/support.py."""

from support import TINY_RUN, tiny_run, tiny_run_args

__all__ = ["TINY_RUN", "tiny_run", "tiny_run_args"]
