"""The model's files, checked before anything loads them: ``policy.model_name`` (and ``policy.tokenizer_name``,
and PPO's ``algorithm.critic.model_name``) must be Hugging Face model directories, or hub ids the cache or the hub
knows. Without it, a wrong path fails deep inside transformers, after retries, naming neither the key nor the
directory."""

from __future__ import annotations

from pathlib import Path

from rlcore.algorithms.config import PPOConfig
from rlcore.config import ConfigError, RunConfig


def check_model_name(config: RunConfig) -> None:
    """``policy.model_name`` (``policy.tokenizer_name``, ``algorithm.critic.model_name``) must be Hugging Face
    model directories."""
    policy = config.policy
    _check_hf_dir("policy.model_name", policy.model_name, need="config.json")
    if policy.tokenizer_name:
        _check_hf_dir("policy.tokenizer_name", policy.tokenizer_name, need=None)
    else:
        _check_tokenizer_files("policy.model_name", policy.model_name)
    algorithm = config.section("algorithm")
    if isinstance(algorithm, PPOConfig) and algorithm.critic.model_name:  # a value model of its own
        _check_hf_dir("algorithm.critic.model_name", algorithm.critic.model_name, need="config.json")


# Files one of which a saved tokenizer has (fast, sentencepiece, BPE vocab, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def _check_tokenizer_files(key: str, name: str) -> None:
    """A local model directory read for its tokenizer must hold one: without, transformers guesses
    a slow tokenizer class and asks to install sentencepiece or tiktoken, naming neither the key
    nor the directory."""
    path = Path(name).expanduser()
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(key, f"{name!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer "
                          "beside the model (tokenizer.save_pretrained) or set policy.tokenizer_name")


def _check_hf_dir(key: str, name: str, need: str | None) -> None:
    if not name or not name.strip():
        raise ConfigError(key, "is empty; give a local Hugging Face model directory")
    path = Path(name).expanduser()
    if path.is_dir():
        if need and not (path / need).is_file():
            raise ConfigError(key, f"{name!r} is a directory but not a Hugging Face model: it has no {need}")
        pickled = sorted(p.name for p in path.glob("*.bin") if p.name.startswith("pytorch_model"))
        if need and pickled and not any(path.glob("*.safetensors")):
            raise ConfigError(key, f"{name!r} holds its weights only as pickled {pickled[0]}, which rlcore does not load "
                              "(unpickling can run code); save the model with safetensors (save_pretrained's default) "
                              "and point to that directory")
        return
    if path.exists():
        raise ConfigError(key, f"{name!r} is a file; give the Hugging Face model directory that holds it")
    if not looks_like_hub_id(name):
        raise ConfigError(key, f"{name!r}: no such directory (a local Hugging Face model directory is expected)")
    _check_hub_model(key, name)


def looks_like_hub_id(name: str) -> bool:
    """``org/model``, and no path a local file system could mean: not ``./x``, ``/abs``, ``~/x``,
    ``a/b/c``, nor ``runs/nothere`` where ``runs`` is a local directory (a missing local run
    directory is reported as such, never looked up on the hub)."""
    if name.count("/") != 1 or name.startswith((".", "/", "~")) or "\\" in name:
        return False
    return not Path(name.split("/")[0]).is_dir()


def _check_hub_model(key: str, name: str) -> None:
    """A hub model is taken from the local cache when it is there; otherwise one request asks the
    hub whether it exists, failing in one line (transformers' own lookup retries five times, about
    a minute, with a line per retry, before it says the same)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, local_files_only=True)
        return
    except Exception:  # noqa: BLE001 - not in the cache (or a broken entry there): ask the hub below
        pass
    import huggingface_hub
    from huggingface_hub.utils import OfflineModeIsEnabled, RepositoryNotFoundError

    where = f"{name!r} is not a local directory and not in the Hugging Face cache"
    try:
        huggingface_hub.model_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise ConfigError(key, f"{where}, and the hub has no such model (or it is private: log in with "
                          "`hf auth login`); give a local model directory or an existing model id") from None
    except OfflineModeIsEnabled:
        raise ConfigError(key, f"{where}, and HF_HUB_OFFLINE is set; download it first or give a local model "
                          "directory") from None
    except Exception as exc:  # noqa: BLE001 - the hub's and its HTTP client's (httpx) errors: out of reach
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(key, f"{where}, and the hub cannot be reached ({type(exc).__name__}: {first}); give a "
                          "local model directory") from None
