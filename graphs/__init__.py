"""Step runners: eager/compiled execution and per-batch-size CUDA graph capture (DESIGN §5)."""

from .runner import EagerRunner, StepKind, WarmupEntry, WarmupReport

__all__ = ["EagerRunner", "StepKind", "WarmupEntry", "WarmupReport"]
