"""Sampling parameters and the batched sampler (logit bias, grammar masks, penalties, greedy,
temperature, top-k, top-p, seeds)."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from graphguard.engine.tokens.structured import InvalidParamError, ResponseFormat

MAX_TEMPERATURE = 100.0
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in the OpenAI API
MAX_LOGPROBS = 20  # alternatives per token, the OpenAI chat limit
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100], as in the OpenAI API
SEED_MASK = (1 << 64) - 1
FORK_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: distinct choices of one seed get distinct seeds


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` switch those filters off;
    ``seed`` makes a request's draws reproducible whatever else shares its batch. Penalties
    follow the OpenAI API: before any other step, each token's logit is lowered by
    ``frequency_penalty`` times the number of times the request has generated it, and by
    ``presence_penalty`` once if it has generated it at all (greedy rows included).
    ``logprobs`` asks for each generated token's log probability and its ``logprobs`` most
    likely alternatives, from the model's distribution (before penalties and temperature);
    ``prompt_logprobs`` the same for each prompt token after the first (the prefill computes
    them, and the request's first output carries them). ``logit_bias`` adds its bias to its
    token's logit before anything else (OpenAI semantics: -100 bans a token, 100 all but
    forces it); ``response_format`` confines the output to a JSON grammar
    (graphguard.engine.tokens.structured). ``stop_token_ids`` end the request like an
    end-of-sequence token (``ignore_eos`` aside): the token is kept among its output ids and
    its text is left out.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; k >= 0: the chosen token and the k most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids distinct
    response_format: ResponseFormat | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value cannot be honoured."""
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(
                f"max_tokens must be an integer >= 0 (0: prefill and score the prompt only), "
                f"got {self.max_tokens!r}"
            )
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if _as_float32(self.top_p) == 0.0:
            # the sampler compares in float32, where this top_p would keep no token at all
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r} (0 in float32)")
        self._validate_counts()
        self._validate_logit_bias()
        if self.response_format is not None and not isinstance(
            self.response_format, ResponseFormat
        ):
            raise InvalidParamError("response_format", "response_format must be a ResponseFormat")

    def _validate_counts(self) -> None:
        """Penalties, top_k, logprob counts, the seed and stop strings."""
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                    f"got {getattr(self, name)!r}"
                )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            is_count = isinstance(value, int) and not isinstance(value, bool)
            if value is not None and (not is_count or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit a signed 64-bit integer, got {self.seed!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")

    def _validate_logit_bias(self) -> None:
        token_ids = [token_id for token_id, _ in self.logit_bias]
        if any(type(t) is not int or t < 0 for t in token_ids) or len(set(token_ids)) != len(
            token_ids
        ):
            raise InvalidParamError("logit_bias", "logit_bias keys must be distinct token ids >= 0")
        for token_id, bias in self.logit_bias:
            if not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidParamError(
                    "logit_bias",
                    f"logit_bias of token {token_id} must be a number in "
                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}",
                )

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

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


def _as_float32(value: float) -> float:
    """`value` rounded to float32, as the sampler holds it (a tensor would cost the server's
    event loop about 20 us a request)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A private generator for one request, so its draws do not depend on its neighbours."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    output_token_ids: Sequence[Sequence[int]] | None = None,
    allowed: Sequence[Tensor | None] | None = None,
) -> list[int]:
    """Pick one token per row. logits: [num_rows, vocab] float32, real rows only;
    `output_token_ids`: each row's generated tokens so far (needed by penalties); `allowed`:
    per row, None or a bool [vocab] mask of the only tokens it may pick (its grammar)."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError("sample() needs exactly one params and one generator per logits row")
    logits = logits.float()
    if any(p.logit_bias for p in params):
        logits = _apply_logit_bias(logits, params)
    if allowed is not None and any(mask is not None for mask in allowed):
        logits = _apply_masks(logits, allowed)
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    if penalized:
        if output_token_ids is None or len(output_token_ids) != len(params):
            raise ValueError("penalties need each row's output_token_ids")
        logits = _apply_penalties(logits, penalized, params, output_token_ids)
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
    """Temperature, then top-k and top-p in sorted space, then one draw per row."""
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
    top_ps = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    # A token is kept when the mass strictly before it is below top_p (the first always is).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_ps.unsqueeze(1), 0.0)
    picks = [torch.multinomial(probs[i], 1, generator=generators[i]) for i in range(len(params))]
    return sorted_ids.gather(1, torch.stack(picks)).squeeze(1)


def _apply_penalties(
    logits: Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
) -> Tensor:
    """Lower the logits of tokens each penalized row has generated (a copy; only those rows)."""
    logits = logits.clone()
    vocab_size = logits.shape[1]
    for i in rows:
        if not output_token_ids[i]:
            continue
        ids = torch.tensor(output_token_ids[i], device=logits.device)
        counts = torch.bincount(ids, minlength=vocab_size)[:vocab_size].to(logits.dtype)
        penalty = params[i].frequency_penalty * counts + params[i].presence_penalty * (counts > 0)
        logits[i] -= penalty
    return logits


def _apply_logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Add each row's biases to its logits (a copy; rows without a bias are untouched)."""
    logits = logits.clone()
    for i, p in enumerate(params):
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            index = torch.tensor(ids, device=logits.device)
            values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, index, values)
    return logits


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
