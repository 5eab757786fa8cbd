"""Checkpoint loading (Hugging Face folders and GGUF files) and the default model.

Submodules: `checkpoint` (HF folders), `gguf_file` (GGUF import), `default_model` (the packaged
default), `resolve` (what `--model` names). Import them directly; this package imports nothing
heavy so that `python -m weights pull` answers fast from the cache.
"""
