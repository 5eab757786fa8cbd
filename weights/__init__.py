"""Checkpoint loading (Hugging Face folders and GGUF files) and the default model."""

from weights.checkpoint import CheckpointError, load_checkpoint, load_config

__all__ = ["CheckpointError", "load_checkpoint", "load_config"]
