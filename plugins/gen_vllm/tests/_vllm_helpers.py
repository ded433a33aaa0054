"""Reference computations (plain transformers) and a backend that exports a state dict."""

from __future__ import annotations

import torch

from rlcore.training.weights import chunked


class StateDictBackend:
    """Exports HF-named tensors in byte-bounded chunks, as a training backend's ``export_weights``."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state_dict = state_dict

    def export_weights(self, dtype=None, chunk_bytes: int = 1 << 30):
        named = ((n, t.to(dtype) if dtype is not None else t) for n, t in self.state_dict.items())
        yield from chunked(named, chunk_bytes)


def state_dict_trainer(state_dict: dict[str, torch.Tensor]):
    """A trainer handle over :class:`StateDictBackend` in this process (what transports get)."""
    from rlcore.runtime import LocalTrainer

    return LocalTrainer(StateDictBackend(state_dict))


def perturbed_state_dict(model, scale: float = 0.03, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t.detach().clone() + scale * torch.randn(t.shape, generator=g) for n, t in model.state_dict().items()}


@torch.no_grad()
def hf_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Token-aligned logprobs [L] (index 0 is 0)."""
    x = torch.tensor([ids])
    lp = torch.log_softmax(model(x).logits[0].float(), -1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
    return torch.cat([lp.new_zeros(1), lp])


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def with_weights(model, state_dict):
    """A copy of ``model`` holding ``state_dict``."""
    import copy

    clone = copy.deepcopy(model)
    clone.load_state_dict(state_dict)
    return clone.eval()
