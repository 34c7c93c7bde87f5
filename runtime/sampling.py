"""Sampling parameters, validated, and the per-row logit transforms (bias, penalties, min_tokens)
with the output history they read, stored per slot on the device.

The random numbers are runtime/randomness.py's; the distributions a row draws from (temperature,
top-k, top-p, min-p) and how it draws are runtime/distributions.py's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import distributions
from .distributions import Filtered, SamplingMode, filter_rows
from .structured import StructuredOutputError, StructuredOutputsParams


class SamplingError(ValueError):
    """Invalid sampling parameters; the message names the field and the valid range."""


@dataclass
class SamplingParams:
    """How to generate for one request.

    ``temperature == 0`` is greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those
    filters (applied in HF's order: temperature, top-k, top-p, min-p). Before them, the logits take
    ``logit_bias`` (token id -> added value), ``repetition_penalty`` (transformers / vLLM: over the
    prompt and output tokens, a positive logit divided by it, a negative one multiplied),
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI: minus the penalty once for a token in the
    output, minus the penalty per occurrence), and ``min_tokens`` (the stop tokens cannot be drawn
    before that many tokens are out). Every transform applies to the target and the draft alike, at
    each block position with the block's own earlier drafts in the history, so speculation keeps
    the transformed target distribution; a greedy request takes the argmax of its transformed logits.
    ``stop_token_ids=None`` takes the target's EOS ids (generation_config.json / config.json); the
    stop token is included in the output. ``seed=None`` draws a fresh seed per request.
    ``stop``: strings that end the output where they appear in its text (found across rounds;
    the text is cut before the string, or after it with ``include_stop_str_in_output``; the token
    ids end with the token that completed it); needs a tokenizer.
    ``timeout_s``: wall-clock seconds from submission after which the request ends with
    ``finish_reason="timeout"``, keeping the tokens committed so far (``None``: no deadline).
    ``n``: independent samples of the prompt, sharing one prefill (sample ``j`` is seeded
    ``seed + j`` when ``seed`` is given).
    ``logprobs``: with each output token, its log-probability, its rank and the ``logprobs`` most
    likely tokens' (0: the token's alone; at most :data:`MAX_LOGPROBS`); ``prompt_logprobs`` the same
    for each prompt token after the first. Which distribution they are of is the engine's
    ``logprobs_mode`` (runtime/logprobs.py): by default the target's raw logits, as vLLM returns them;
    an accepted draft token's log-probability is the target's, never the draft's.
    ``max_speculative_tokens``: the most draft tokens a round may accept for this request (``0``:
    speculation off for it; ``None``: as the engine's width policy decides, runtime/speculation.py).
    Such a request shares its rounds with the others; its output does not depend on the setting.
    ``structured_outputs``: a constraint on the output (a JSON schema, any JSON object, a regular
    expression, a choice of strings or a Lark grammar: runtime/structured.py), applied as a logit
    transform at every position, speculation kept on; needs a tokenizer.
    ``skip_special_tokens``: the output text leaves special tokens out (vLLM's default); ``False``
    spells them (a server parsing tool calls between LFM2's ``<|tool_call_start|>`` and
    ``<|tool_call_end|>`` needs them), all but the stop token that ended the output, as vLLM does.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    timeout_s: float | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    max_speculative_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def transforms_logits(self) -> bool:
        """Whether the logits are changed before sampling (bias, penalties, min_tokens): then even a
        greedy request needs the distribution path (its argmax moves)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0 or self.min_tokens > 0 or self.structured_outputs is not None

    @property
    def needs_distribution(self) -> bool:
        """Runs in the sampling step (probabilities on the device), not the greedy one."""
        return not self.greedy or self.transforms_logits

    def snapshot(self) -> SamplingParams:
        """A copy for one submitted request, with ``stop_token_ids`` materialised as a tuple (an
        iterator is read once): the engine keeps this copy, so changing the caller's object after
        submission changes nothing."""
        stops = self.stop_token_ids
        if stops is not None:
            if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
                raise SamplingError(f"stop_token_ids must be a list of token ids or None, got {stops!r}")
            stops = tuple(stops)
        strings = self.stop
        if strings is not None and not isinstance(strings, str):
            if isinstance(strings, bytes) or not hasattr(strings, "__iter__"):
                raise SamplingError(f"stop must be a string, a list of strings or None, got {strings!r}")
            strings = tuple(strings)
        elif isinstance(strings, str):
            strings = (strings,)
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise SamplingError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
            bias = dict(bias)
        structured = self.structured_outputs
        if isinstance(structured, dict):
            try:
                structured = StructuredOutputsParams(**structured)
            except TypeError as e:
                raise SamplingError(f"structured_outputs: {e}") from None
        return dataclasses.replace(self, stop_token_ids=stops, stop=strings, logit_bias=bias,
                                   structured_outputs=structured)

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`SamplingError` naming the first field with a value the engine cannot run:
        types are exact (a bool is not a number, a string not a bool), numbers finite and within
        what the device-side sampling takes (fp32 temperature and top_p)."""
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0 or t > _FP32_MAX:
            raise SamplingError(f"temperature must be a finite number >= 0 (0 = greedy) that fits fp32, got {t!r}")
        if 0 < t < 1e-5:
            raise SamplingError(f"temperature {t} is too small to sample with; use 0 for greedy decoding")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:
            raise SamplingError(f"top_p must be a number in (0, 1] (1 disables it), got {p!r}")
        n = self.max_new_tokens
        if not _is_int(n) or n < 1:
            raise SamplingError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be a number in [0, 1] (0 disables it), got {self.min_p!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0 or r > 1e6:
            raise SamplingError(f"repetition_penalty must be a number > 0 (1 disables it), got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise SamplingError(f"{name} must be a number in [-2, 2] (0 disables it), got {v!r}")
        m = self.min_tokens
        if not _is_int(m) or not 0 <= m <= n:
            raise SamplingError(f"min_tokens must be an integer in [0, max_new_tokens], got {m!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bad = [k for k, v in self.logit_bias.items() if not _is_int(k) or not 0 <= k < vocab_size
                   or not _is_number(v) or not -100 <= v <= 100]
            if bad:
                raise SamplingError(f"logit_bias entries {bad[:5]} are not token ids in [0, {vocab_size}) with a "
                                    "bias in [-100, 100]")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__len__"):
                raise SamplingError(f"stop_token_ids must be a list of token ids or None, got {self.stop_token_ids!r}")
            bad = [i for i in self.stop_token_ids if not _is_int(i) or not 0 <= i < vocab_size]
            if bad:
                raise SamplingError(f"stop_token_ids {bad} are not token ids in the vocabulary [0, {vocab_size})")
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.stop is not None:
            strings = (self.stop,) if isinstance(self.stop, str) else self.stop
            bad = [x for x in strings if not isinstance(x, str) or not x]
            if bad or isinstance(self.stop, bytes):
                raise SamplingError(f"stop must hold non-empty strings, got {bad or self.stop!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise SamplingError(f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise SamplingError(f"include_stop_str_in_output must be True or False, got "
                                f"{self.include_stop_str_in_output!r}")
        if not _is_int(self.n) or self.n < 1:
            raise SamplingError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise SamplingError(f"{name} must be None (off) or an integer in [0, {MAX_LOGPROBS}]: how many of the "
                                    f"most likely tokens to return beside the chosen one, got {v!r}")
        m = self.max_speculative_tokens
        if m is not None and (not _is_int(m) or m < 0):
            raise SamplingError(f"max_speculative_tokens must be None (the engine decides) or an integer >= 0 "
                                f"(0: no speculation for this request), got {m!r}")
        t = self.timeout_s
        if t is not None and (not _is_number(t) or not math.isfinite(t) or t <= 0):
            raise SamplingError(f"timeout_s must be a finite number of seconds > 0 or None, got {t!r}")
        structured = self.structured_outputs
        if structured is not None:
            if not isinstance(structured, StructuredOutputsParams):
                raise SamplingError(f"structured_outputs must be a StructuredOutputsParams, got {structured!r}")
            try:
                structured.validate()
            except StructuredOutputError as e:
                raise SamplingError(str(e)) from None


_FP32_MAX = 3.4028234663852886e38
# the most alternatives a request may ask per token (vLLM's default max_logprobs, the OpenAI API's top_logprobs)
MAX_LOGPROBS = 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def block_history(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per block position, the counts of the block's own earlier tokens: ``[B, T + 1, V]`` from
    ``tokens [B, T]``, row ``i`` counting ``tokens[:, :i]`` (what position ``i`` has in its history
    beyond the committed output)."""
    one_hot = torch.nn.functional.one_hot(tokens, vocab).to(torch.float32).cumsum(dim=1)
    return torch.cat([one_hot.new_zeros(tokens.shape[0], 1, vocab), one_hot], dim=1)


@dataclass
class RowSampling:
    """Per-row sampling parameters and output history gathered for one batch (device tensors)."""

    temperature: torch.Tensor     # [B]
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    repetition: torch.Tensor      # [B] 1 = off
    presence: torch.Tensor        # [B] 0 = off
    frequency: torch.Tensor       # [B] 0 = off
    min_len: torch.Tensor         # [B] stop tokens suppressed while the predicted position is below it
    bias: torch.Tensor            # [B, V] fp32
    stops: torch.Tensor           # [B, V] bool: the request's stop tokens
    in_prompt: torch.Tensor       # [B, V] bool
    counts: torch.Tensor          # [B, V] fp32: output token counts (the anchor included)
    grammar: torch.Tensor | None = None   # [B, W_max, ceil(V / 32)] int32: allowed tokens per position, or None

    def transform(self, logits: torch.Tensor, position: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """Bias, penalties, min_tokens and the structured-output masks on fp32 ``logits [B, W, V]``
        predicting ``position [B, W]``, with ``extra [B, W, V]`` counts of tokens each column has in its
        history beyond ``counts``."""
        x = logits + self.bias[:, None]
        counts = self.counts[:, None] if extra is None else self.counts[:, None] + extra
        seen = self.in_prompt[:, None] | (counts > 0)
        rep = self.repetition[:, None, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - self.presence[:, None, None] * (counts > 0) - self.frequency[:, None, None] * counts
        early = (position < self.min_len[:, None])[..., None] & self.stops[:, None]
        x = x.masked_fill(early, float("-inf"))
        if self.grammar is not None:
            x = x.masked_fill(~unpack_allowed(self.grammar[:, :x.shape[1]], x.shape[-1]), float("-inf"))
        return x

    def filtered(self, logits: torch.Tensor, position: torch.Tensor, extra: torch.Tensor | None,
                 mode: SamplingMode) -> Filtered:
        """The distributions each row draws from (:meth:`transform`, then temperature, top-k, top-p
        and min-p: runtime/distributions.py) for fp32 ``logits [B, W, V]`` (or ``[B, V]``, with
        ``position [B]``) predicting ``position``, as ``B * W`` rows (row ``b * W + j``), their
        thresholds found as ``mode`` says."""
        if logits.dim() == 2:
            logits, position = logits[:, None], position[:, None]
            extra = None if extra is None else extra[:, None]
        B, W, V = logits.shape
        x = self.transform(logits, position, extra).reshape(-1, V)
        rep = lambda t: t.repeat_interleave(W) if W > 1 else t  # noqa: E731
        return filter_rows(x, rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.min_p), mode)


def unpack_allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., ceil(V / 32)]`` int32 bit masks (bit ``v % 32`` of word ``v // 32``) as ``[..., V]`` bools."""
    v = torch.arange(vocab, device=bits.device)
    words = bits.index_select(-1, v >> 5)
    return ((words >> (v & 31)) & 1).bool()


@dataclass
class SlotSampling:
    """Sampling parameters and output history stored per slot on the device, written at admission;
    the counts grow as tokens are committed (:meth:`record`, inside the steps)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    min_len: torch.Tensor
    bias: torch.Tensor
    stops: torch.Tensor
    in_prompt: torch.Tensor
    counts: torch.Tensor
    grammar: torch.Tensor        # [n, window, ceil(V / 32)] int32 structured-output masks (-1: all allowed)
    # whether the target's transforms read ``grammar``: set by the model runner around the calls of a
    # batch with a constrained request (a trace-time constant: those calls are a variant of their own)
    constrain: bool = False

    @classmethod
    def allocate(cls, n: int, vocab: int, device: torch.device | str, window: int = 1) -> "SlotSampling":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(temperature=torch.zeros(n, **f32), top_k=torch.zeros(n, dtype=torch.int64, device=device),
                   top_p=torch.ones(n, **f32), min_p=torch.zeros(n, **f32),
                   seed=torch.zeros(n, dtype=torch.int64, device=device),
                   repetition=torch.ones(n, **f32), presence=torch.zeros(n, **f32), frequency=torch.zeros(n, **f32),
                   min_len=torch.zeros(n, dtype=torch.int64, device=device),
                   bias=torch.zeros(n, vocab, **f32), stops=torch.zeros(n, vocab, dtype=torch.bool, device=device),
                   in_prompt=torch.zeros(n, vocab, dtype=torch.bool, device=device), counts=torch.zeros(n, vocab, **f32),
                   grammar=torch.full((n, window, (vocab + 31) // 32), -1, dtype=torch.int32, device=device))

    def rows(self, idx: torch.Tensor, grammar: bool = True) -> RowSampling:
        """The rows' parameters; their structured-output masks only while :attr:`constrain` is set and
        ``grammar`` asks for them (the draft's proposals are not masked: runtime/structured.py)."""
        # spelled out: torch.compile (2.11) cannot trace dataclasses.fields() of the class
        return RowSampling(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                           self.seed[idx], self.repetition[idx], self.presence[idx], self.frequency[idx], self.min_len[idx],
                           self.bias[idx], self.stops[idx], self.in_prompt[idx], self.counts[idx],
                           self.grammar[idx] if grammar and self.constrain else None)

    def set(self, slot: int, params: SamplingParams, seed: int, prompt_ids: list[int],
            stop_ids: frozenset[int]) -> None:
        self.temperature[slot] = float(params.temperature)
        # top-k over more columns than the vocabulary has keeps them all, as top_k=0 does (and fits int64)
        self.top_k[slot] = min(int(params.top_k), 2 ** 31 - 1)
        self.top_p[slot] = float(params.top_p)
        self.min_p[slot] = float(params.min_p)
        self.seed[slot] = seed % 2**32         # the counter-based randomness keys on 32 bits
        self.repetition[slot] = float(params.repetition_penalty)
        self.presence[slot] = float(params.presence_penalty)
        self.frequency[slot] = float(params.frequency_penalty)
        self.min_len[slot] = len(prompt_ids) + params.min_tokens
        device = self.bias.device
        self.bias[slot] = 0.0
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
            self.bias[slot, ids] = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        self.stops[slot] = False
        if stop_ids and params.min_tokens:
            self.stops[slot, torch.tensor(sorted(stop_ids), dtype=torch.int64, device=device)] = True
        self.in_prompt[slot] = False
        if params.repetition_penalty != 1.0:
            self.in_prompt[slot, torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True
        self.counts[slot] = 0.0
        self.grammar[slot] = -1

    def record(self, index: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Count committed ``tokens [B, T]`` in the output history of slots ``index [B]`` (a scatter
        index: padding rows write the trash entry); ``keep [B, T]`` masks the real ones."""
        ones = torch.ones_like(tokens, dtype=torch.float32) if keep is None else keep.to(torch.float32)
        self.counts.index_put_((index[:, None].expand_as(tokens), tokens), ones, accumulate=True)


def sampling_mode(params: Iterable[SamplingParams], vocab: int) -> SamplingMode:
    """The mode a batch of requests runs in: ``GREEDY`` when none needs a distribution, ``THRESHOLD``
    when every sampled one has top-k off or ``top_k <= MAX_THRESHOLD_TOP_K`` (or the vocabulary has
    no more tokens than that), else ``FULL``."""
    sampled = [p for p in params if p.needs_distribution]
    if not sampled:
        return SamplingMode.GREEDY
    limit = distributions.MAX_THRESHOLD_TOP_K
    if vocab <= limit or all(p.greedy or p.top_k <= limit for p in sampled):
        return SamplingMode.THRESHOLD
    return SamplingMode.FULL
