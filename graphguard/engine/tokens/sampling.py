"""Sampling parameters and the batched sampler (grammar masks, greedy, temperature, top-k,
min-p, top-p, seeds); a request's bias, bans and penalties are graphguard.engine.tokens.logits'."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from graphguard.engine.tokens.limits import GREEDY_BELOW_TEMPERATURE
from graphguard.engine.tokens.params_check import validate_params
from graphguard.engine.tokens.structured import ResponseFormat

SEED_MASK = (1 << 64) - 1
FORK_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: distinct choices of one seed get distinct seeds


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops; vLLM's names and meanings.

    ``temperature == 0`` is greedy; ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` switch
    those filters off (``min_p`` drops the tokens less likely than that share of the likeliest,
    after temperature); ``seed`` makes a request's draws reproducible whatever else shares its
    batch. Penalties apply before everything but the bias: each token's logit is lowered by
    ``frequency_penalty`` times the number of times the request has generated it and by
    ``presence_penalty`` once if it has (the OpenAI API's), and every token of the prompt or the
    output is divided by ``repetition_penalty`` where its logit is positive, multiplied where
    negative (transformers' and vLLM's). ``logprobs`` asks for each generated token's log
    probability and its ``logprobs`` most likely alternatives, from the model's distribution
    (before penalties and temperature); ``prompt_logprobs`` the same for each prompt token
    after the first. ``logit_bias`` adds its bias to its token's logit before anything else
    (-100 bans a token, 100 all but forces it); ``allowed_token_ids`` bans every other token;
    ``bad_words`` bans each word's token sequence (with and without a leading space) from the
    output; ``min_tokens`` bans the end-of-sequence and ``stop_token_ids`` tokens, and stop
    strings end nothing, until that many tokens are out. ``response_format`` confines the
    output to a grammar (graphguard.engine.tokens.structured). ``stop_token_ids`` end the
    request like an end-of-sequence token (``ignore_eos`` aside): the token is kept among its
    output ids and its text is left out; a stop string is cut from the text unless
    ``include_stop_str_in_output``. ``skip_special_tokens`` and
    ``spaces_between_special_tokens`` are the detokenizer's; ``truncate_prompt_tokens`` keeps
    only the prompt's last tokens; a ``cache_salt`` keeps its cached prompt blocks apart from
    those of requests of other salts (graphguard.engine.scheduling.prefix_cache). ``n`` choices
    of one prompt (the offline API and the server
    run one engine request each, forked from the first).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: off; k >= 0: the chosen token and the k most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids distinct
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    response_format: ResponseFormat | None = None
    cache_salt: str | None = None  # its cached prefixes are shared within this salt only

    def __post_init__(self) -> None:
        # NOTE: vLLM's callers pass lists, a string stop and a dict bias: kept as tuples, so
        # that the params stay hashable and immutable
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        for name in ("stop_token_ids", "allowed_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.logit_bias, dict):
            pairs = tuple((int(k), float(v)) for k, v in self.logit_bias.items())
            object.__setattr__(self, "logit_bias", pairs)

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value cannot be honoured."""
        validate_params(self)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the host changes this request's logits before it picks (a sampler that
        only takes the argmax on the device would pick another token)."""
        return bool(
            self.has_penalties or self.logit_bias or self.allowed_token_ids is not None
            or self.bad_words or self.min_tokens
        )  # fmt: skip

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflows float32 into inf and softmax into NaN;
        # the distribution is a point mass on the argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and the most likely alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: Tensor, token_ids: Sequence[int], num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Log probabilities of the chosen tokens under log_softmax(logits), one per row, with
    num_top[i] alternatives; None for rows whose num_top is None. One device-to-host copy."""
    rows = [i for i, k in enumerate(num_top) if k is not None]
    result: list[TokenLogprob | None] = [None] * len(num_top)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=logits.device)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    k = max(num_top[i] or 0 for i in rows)
    top_values, top_ids = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0],) * 2
    chosen_cpu, values_cpu, ids_cpu = (t.tolist() for t in (chosen, top_values, top_ids))
    for j, i in enumerate(rows):
        n = num_top[i] or 0
        top = tuple(zip(ids_cpu[j][:n], values_cpu[j][:n], strict=True))
        result[i] = TokenLogprob(token_ids[i], chosen_cpu[j], top)
    return result


def fork_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed` (n > 1): choice 0 keeps it,
    so its answer is the n=1 answer; the others get distinct seeds derived from it, so a
    seeded request repeats its choices exactly. Stays in the signed 64-bit range."""
    derived = (seed + index * FORK_SEED_STRIDE) & SEED_MASK
    return derived - (1 << 64) if derived >= 1 << 63 else derived


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A private generator for one request, so its draws do not depend on its neighbours."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    allowed: Sequence[Tensor | None] | None = None,
) -> list[int]:
    """Pick one token per row. logits: [num_rows, vocab], real rows only, each request's own
    changes applied already (graphguard.engine.tokens.logits); `allowed`: per row, None or a
    bool [vocab] mask of the only tokens it may pick (its grammar)."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError("sample() needs exactly one params and one generator per logits row")
    logits = logits.float()
    if allowed is not None and any(mask is not None for mask in allowed):
        logits = _apply_masks(logits, allowed)
    token_ids = torch.argmax(logits, dim=-1)  # [num_rows]; the answer for greedy rows
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        drawn = _sample_random_rows(
            logits.index_select(0, rows),
            [params[i] for i in random_rows],
            [generators[i] for i in random_rows],
        )
        token_ids = token_ids.index_copy(0, rows, drawn)
    return token_ids.tolist()


def _sample_random_rows(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    """Temperature, then top-k, min-p and top-p in sorted space, then one draw per row."""
    device = logits.device
    temperatures = torch.tensor([p.temperature for p in params], device=device)
    # Shift by the row max first: the largest scaled logit is 0, so no temperature overflows.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperatures.unsqueeze(1)
    # NOTE: stable sort keeps the lowest token id first among ties, as argmax does.
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    vocab_size = logits.shape[1]
    top_ks = torch.tensor([p.top_k or vocab_size for p in params], device=device)
    ranks = torch.arange(vocab_size, device=device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_ks.unsqueeze(1), -math.inf)
    probs = torch.softmax(sorted_logits, dim=-1)
    # min_p: drop what is less likely than that share of the likeliest (sorted first)
    min_ps = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
    probs = probs.masked_fill(probs < min_ps.unsqueeze(1) * probs[:, :1], 0.0)
    top_ps = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    # A token is kept when the mass strictly before it is below top_p (the first always is).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_ps.unsqueeze(1), 0.0)
    picks = [torch.multinomial(probs[i], 1, generator=generators[i]) for i in range(len(params))]
    return sorted_ids.gather(1, torch.stack(picks)).squeeze(1)


def _apply_masks(logits: Tensor, allowed: Sequence[Tensor | None]) -> Tensor:
    """-inf for every token a row's mask forbids (a copy; rows without a mask are untouched).
    A mask that allows nothing raises ValueError: that row has no token to give."""
    rows = [i for i, mask in enumerate(allowed) if mask is not None]
    masks = torch.stack([allowed[i] for i in rows]).to(logits.device)  # type: ignore[misc]
    if not bool(masks.any(dim=-1).all()):
        raise ValueError("the request's grammar allows no next token")
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~masks, -math.inf)
    return logits.index_copy(0, index, masked)
