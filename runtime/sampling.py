"""Sampling parameters and graph-safe, device-side sampling.

Randomness is counter-based: a uniform is a hash of ``(request seed, sequence position, stream,
vocabulary index)`` computed with integer tensor ops (no generator state, no ``multinomial``, no
host sync), so a sampling round can live inside a CUDA graph and a seeded request draws the same
numbers whatever batch it shares. Each draw has its own stream so the draft proposal, the
acceptance test and the correction/bonus draw at one position are independent. Reusing a
position's numbers in a later round is harmless: draws that did not decide a committed token are
never looked at again (rejection sampling stays exact).

Sampling picks ``argmax(p / E)`` with ``E = -log(u)`` exponential noise, which draws from ``p``
(the exponential-race form of the Gumbel-max trick, as in gpt-fast).
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF

# random streams: one per kind of draw at a position
STREAM_DRAFT = 1      # the draft's Markov walk samples x_k
STREAM_ACCEPT = 2     # acceptance test of x_k
STREAM_TOKEN = 3      # the token the target commits itself (correction, bonus, plain decode, first token)
STREAM_IMPOSED = 4    # benchmark mode: imposed acceptance draws


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def transforms_logits(self) -> bool:
        """Whether the logits are changed before sampling (bias, penalties, min_tokens): then even a
        greedy request needs the distribution path (its argmax moves)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0 or self.min_tokens > 0

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
        return dataclasses.replace(self, stop_token_ids=stops, stop=strings, logit_bias=bias)

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
        t = self.timeout_s
        if t is not None and (not _is_number(t) or not math.isfinite(t) or t <= 0):
            raise SamplingError(f"timeout_s must be a finite number of seconds > 0 or None, got {t!r}")


_FP32_MAX = 3.4028234663852886e38
# the most alternatives a request may ask per token (vLLM's default max_logprobs, the OpenAI API's top_logprobs)
MAX_LOGPROBS = 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------------
# counter-based uniforms

def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for ``0 <= x < 2^32`` without int64 overflow (two 16-bit halves of c)."""
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (hi + x * (c & 0xFFFF)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' integer hash search): a well-mixed bijection on 32-bit values."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def draw_key(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """A 32-bit key per draw (int64 tensor) from the request seed, the sequence position and the stream."""
    k = _hash32(seed & _MASK32)
    k = _hash32((k + (position & _MASK32)) & _MASK32)
    return _hash32((k + stream * 0x3C6EF372) & _MASK32)


def uniforms(key: torch.Tensor, n: int) -> torch.Tensor:
    """``[*key.shape, n]`` fp32 uniforms in (0, 1), element ``i`` hashed from ``(key, i)``."""
    idx = torch.arange(n, device=key.device, dtype=torch.int64)
    x = _hash32((key[..., None] + _mulmod32(idx, 0x9E3779B9)) & _MASK32)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def uniform(key: torch.Tensor) -> torch.Tensor:
    """One uniform per key."""
    return uniforms(key, 1)[..., 0]


def sample(probs: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Draw an index from each row of ``probs [..., V]`` (unnormalised is fine) with its key."""
    noise = -torch.log(uniforms(key, probs.shape[-1]))
    return torch.argmax(probs / noise, dim=-1)


# ---------------------------------------------------------------------------------------------
# distributions

def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [N, V]`` (fp32) at per-row temperature with what top-k, top-p and min-p filter out
    (HF order) at ``-inf``: the log-space form of the distribution a sampled row draws from. Rows
    with temperature 0 (greedy) come back unscaled and unfiltered (their argmax is what counts)."""
    V = logits.shape[-1]
    greedy = temperature <= 0
    x = logits / torch.where(greedy, 1.0, temperature)[:, None]
    sorted_x, _ = torch.sort(x, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sorted_p = torch.softmax(sorted_x, dim=-1)
    mass_before = row_prefix_sums(sorted_p) - sorted_p
    keep = (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)        # the first token is always kept
    # top_p == 1 keeps everything: the fp32 cumsum reaches 1.0 before the end of a large vocabulary
    keep = torch.where(top_p >= 1.0, V, keep)
    threshold = torch.maximum(sorted_x.gather(1, (keep - 1)[:, None]), kth)
    if min_p is not None:       # p_i >= min_p * p_max, i.e. x_i >= x_max + log(min_p) (min_p 0: -inf)
        threshold = torch.maximum(threshold, sorted_x[:, :1] + torch.log(min_p)[:, None])
    threshold = torch.where(greedy[:, None], float("-inf"), threshold)
    return x.masked_fill(x < threshold, float("-inf"))


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax`` of :func:`filtered_logits`; rows with temperature 0 get the one-hot of their
    argmax, so greedy and sampled rows share one acceptance rule."""
    return probs_of(filtered_logits(logits, temperature, top_k, top_p, min_p), temperature)


def probs_of(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The sampling distribution of :func:`filtered_logits` ``scores [N, V]``: their softmax, or the
    one-hot of the argmax for greedy rows."""
    one_hot = torch.nn.functional.one_hot(scores.argmax(dim=-1), scores.shape[-1]).to(torch.float32)
    return torch.where((temperature <= 0)[:, None], one_hot, torch.softmax(scores, dim=-1))


_SCAN_BLOCK = 256


def row_prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums along the last dim of ``x [N, V]``, as ``x.cumsum(-1)``, computed in two
    levels: within blocks of 256 columns, then over the block totals.

    Why not ``cumsum``: over a whole 65536-entry vocabulary with few rows, Inductor (torch 2.11) emits
    a split scan (one scan spread over several programs) and fails to generate it once the sampling
    tail's pointwise ops are fused in (``TypeError`` in ``TritonSymbols.get_block_shape``: the split
    scan's row range has no tensor dimension); every scan here is 256 long, which Inductor keeps in
    one program. The two-level sum also rounds less than one sequential fp32 sum."""
    n, v = x.shape
    pad = -v % _SCAN_BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).view(n, -1, _SCAN_BLOCK).cumsum(dim=-1)
    totals = blocks[..., -1]
    before_block = totals.cumsum(dim=-1) - totals
    return (blocks + before_block[..., None]).view(n, -1)[:, :v]


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

    def transform(self, logits: torch.Tensor, position: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """Bias, penalties and min_tokens on fp32 ``logits [B, W, V]`` predicting ``position [B, W]``,
        with ``extra [B, W, V]`` counts of tokens each column has in its history beyond ``counts``."""
        x = logits + self.bias[:, None]
        counts = self.counts[:, None] if extra is None else self.counts[:, None] + extra
        seen = self.in_prompt[:, None] | (counts > 0)
        rep = self.repetition[:, None, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - self.presence[:, None, None] * (counts > 0) - self.frequency[:, None, None] * counts
        early = (position < self.min_len[:, None])[..., None] & self.stops[:, None]
        return x.masked_fill(early, float("-inf"))

    def scores(self, logits: torch.Tensor, position: torch.Tensor, extra: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The transformed, filtered logits (:meth:`transform`, then :func:`filtered_logits`) of fp32
        ``logits [B, W, V]`` (or ``[B, V]``, with ``position [B]``) predicting ``position``: the
        log-space distribution each row draws from (the "processed" logprobs)."""
        flat = logits.dim() == 2
        if flat:
            logits, position = logits[:, None], position[:, None]
            extra = None if extra is None else extra[:, None]
        B, W, V = logits.shape
        x = self.transform(logits, position, extra)
        rep = lambda t: t.repeat_interleave(W)  # noqa: E731
        out = filtered_logits(x.reshape(-1, V), rep(self.temperature), rep(self.top_k), rep(self.top_p),
                              rep(self.min_p)).view(B, W, V)
        return out[:, 0] if flat else out

    def probs_of(self, scores: torch.Tensor) -> torch.Tensor:
        """The distributions of :meth:`scores` ``[B, W, V]`` or ``[B, V]`` (greedy rows: one-hot)."""
        shape = scores.shape
        temperature = self.temperature.repeat_interleave(shape[1]) if scores.dim() == 3 else self.temperature
        return probs_of(scores.reshape(-1, shape[-1]), temperature).view(shape)

    def probs(self, logits: torch.Tensor, position: torch.Tensor, extra: torch.Tensor | None = None
              ) -> torch.Tensor:
        """Transformed, filtered distributions for fp32 ``logits [B, W, V]`` (or ``[B, V]``, with
        ``position [B]``) predicting ``position``."""
        return self.probs_of(self.scores(logits, position, extra))

    def pick(self, logits: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
        """Sample (or argmax, for greedy rows) one token per row from ``logits [B, V]`` predicting
        ``position [B]``."""
        key = draw_key(self.seed, position, stream)
        return sample(self.probs(logits, position), key)


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

    @classmethod
    def allocate(cls, n: int, vocab: int, device: torch.device | str) -> "SlotSampling":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(temperature=torch.zeros(n, **f32), top_k=torch.zeros(n, dtype=torch.int64, device=device),
                   top_p=torch.ones(n, **f32), min_p=torch.zeros(n, **f32),
                   seed=torch.zeros(n, dtype=torch.int64, device=device),
                   repetition=torch.ones(n, **f32), presence=torch.zeros(n, **f32), frequency=torch.zeros(n, **f32),
                   min_len=torch.zeros(n, dtype=torch.int64, device=device),
                   bias=torch.zeros(n, vocab, **f32), stops=torch.zeros(n, vocab, dtype=torch.bool, device=device),
                   in_prompt=torch.zeros(n, vocab, dtype=torch.bool, device=device), counts=torch.zeros(n, vocab, **f32))

    def rows(self, idx: torch.Tensor) -> RowSampling:
        # spelled out: torch.compile (2.11) cannot trace dataclasses.fields() of the class
        return RowSampling(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                           self.seed[idx], self.repetition[idx], self.presence[idx], self.frequency[idx], self.min_len[idx],
                           self.bias[idx], self.stops[idx], self.in_prompt[idx], self.counts[idx])

    def set(self, slot: int, params: SamplingParams, seed: int, prompt_ids: list[int],
            stop_ids: frozenset[int]) -> None:
        self.temperature[slot] = float(params.temperature)
        # top-k over more columns than the vocabulary has keeps them all, as top_k=0 does (and fits int64)
        self.top_k[slot] = min(int(params.top_k), 2 ** 31 - 1)
        self.top_p[slot] = float(params.top_p)
        self.min_p[slot] = float(params.min_p)
        self.seed[slot] = seed & _MASK32
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

    def record(self, index: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Count committed ``tokens [B, T]`` in the output history of slots ``index [B]`` (a scatter
        index: padding rows write the trash entry); ``keep [B, T]`` masks the real ones."""
        ones = torch.ones_like(tokens, dtype=torch.float32) if keep is None else keep.to(torch.float32)
        self.counts.index_put_((index[:, None].expand_as(tokens), tokens), ones, accumulate=True)
