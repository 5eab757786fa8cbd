"""What `--model` names: a local Hugging Face folder, a .gguf file, a packaged model's short name, or a hub id."""

from __future__ import annotations

import hashlib
from pathlib import Path

from weights.default_model import DEFAULT_MODEL, PACKAGED_MODELS, ModelUnavailable, cached_folder, models_dir, pull
from weights.gguf_file import import_gguf


def resolve_model(spec: str | None, progress: bool = True) -> Path:
    """A local folder that `weights.loading.load_engine` can load."""
    spec = spec or DEFAULT_MODEL.name
    if spec in PACKAGED_MODELS:
        return pull(PACKAGED_MODELS[spec], progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return import_gguf_cached(path, progress)
    if path.exists():
        raise ModelUnavailable(f"{spec}: expected a model folder or a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return from_hub(spec)
    raise ModelUnavailable(
        f"{spec}: no such folder or file. --model takes a Hugging Face folder, a .gguf file, "
        f"or one of: {', '.join(PACKAGED_MODELS)}"
    )


def import_gguf_cached(path: Path, progress: bool) -> Path:
    """Import a GGUF once into the cache, keyed by its name, size and modification time."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cached_folder(models_dir() / f"{path.stem}-{key}", lambda out: import_gguf(path, out, progress=progress))


def from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelUnavailable(
            f"{repo_id} looks like a hub id, but huggingface_hub is not installed; "
            "download the folder yourself and pass its path to --model"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated: all end the same way for the user
        raise ModelUnavailable(f"could not fetch {repo_id} from the hub ({type(e).__name__}: {e}); "
                               "pass a local folder or .gguf file to --model") from None
