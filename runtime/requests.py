"""A request inside the engine, from submission to its finish, and the errors a caller can meet.

The engine keeps one :class:`Request` per submitted prompt: its own copy of the parameters, its
slot while it runs, the tokens committed so far, and where its events go (``sink``). A request
carries its own life: :func:`make_requests` validates a prompt and its parameters against the
engine's :class:`RequestLimits` and makes its requests (one per ``SamplingParams.n`` sample);
:meth:`Request.commit` appends the tokens a round committed under the stop rules (stop tokens, stop
strings, ``max_new_tokens``) and says what text they add; :meth:`Request.to_output` is its
:class:`GenerationOutput`. A request finishes exactly once, with one of :data:`FINISH_REASONS`; its
slot is free from that moment.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .detokenize import TextStream
from .logprobs import TokenLogprobs
from .outputs import GenerationOutput, RequestStats, StreamEvent
from .prompts import Prompt, PromptError, encode_prompt
from .sampling import SamplingError, SamplingParams
from .structured import GrammarCache, Matcher, StructuredOutputError

# "stop": a stop token (included in the tokens); "length": max_new_tokens; "cancelled": the caller
# left (closed the stream, aborted the id, shut the engine down); "timeout": SamplingParams.timeout_s
# passed; "error": a failure that concerned this request (GenerationOutput.error says which)
FINISH_REASONS = ("stop", "length", "cancelled", "timeout", "error")


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, bad sampling parameters, too long); nothing ran."""


class RequestFailedError(RuntimeError):
    """Submitted requests that ended with ``finish_reason="error"``; the first failure is the cause."""

    def __init__(self, message: str, request_ids: Sequence[str]):
        super().__init__(message)
        self.request_ids = list(request_ids)


class EngineDeadError(RuntimeError):
    """The engine hit a device-level failure (a CUDA error): every request in it was failed with that
    error and it takes no more. The GPU context is unusable after such an error: restart the process."""


def is_device_error(error: BaseException) -> bool:
    """A failure of the device itself (after which nothing on it can be trusted), as opposed to one of
    the requests being run: CUDA errors surface as ``torch.AcceleratorError`` (older builds: a
    ``RuntimeError`` whose message says so)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@dataclass(eq=False)          # identity comparison: requests are tracked in queues and lists
class Request:
    request_id: str
    index: int                    # position in the generate/stream call that submitted it (0 otherwise)
    prompt_ids: list[int]
    params: SamplingParams        # the request's own snapshot, validated
    stop_ids: frozenset[int]
    seed: int
    submitted: float              # time.perf_counter()
    sink: Callable[[StreamEvent], None] | None = None     # where its events go
    slot: int | None = None
    prefilled: int = 0                  # context tokens in the cache (prefill runs in chunks across steps)
    cached_tokens: int = 0              # of them, copied from the prefix cache at admission
    output: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)   # tokens each round committed
    drafts_verified: list[int] = field(default_factory=list)  # draft tokens each round offered the target
    finish_reason: str | None = None
    error: BaseException | None = None
    admitted_at: float = 0.0            # when it got a slot
    first_token_at: float = 0.0
    finished_at: float = 0.0
    text: TextStream | None = None      # its output text, with a tokenizer
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    group: str | None = None            # samples of one prompt (SamplingParams.n > 1): the id they share
    sample: int = 0                     # which of them
    logprobs: list[TokenLogprobs] = field(default_factory=list)   # with SamplingParams.logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None    # with SamplingParams.prompt_logprobs
    cache_only: bool = False            # a finished turn's tokens prefilled into the prefix cache only
                                        # (Engine(prefix_cache_outputs=True)): no output, no events
    matcher: Matcher | None = None      # its structured-output state (SamplingParams.structured_outputs)
    preemptions: int = 0                # times its KV pages were taken back (it resumed by recomputing them)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context_ids(self) -> list[int]:
        """The tokens its prefill runs: the prompt, and after a preemption the output so far too."""
        return self.prompt_ids + self.output if self.output else self.prompt_ids

    @property
    def deadline(self) -> float | None:
        t = self.params.timeout_s
        return None if t is None else self.submitted + t

    def expired(self, now: float | None = None) -> bool:
        deadline = self.deadline
        return deadline is not None and (time.perf_counter() if now is None else now) >= deadline

    def commit(self, tokens: list[int], logprobs: list[TokenLogprobs] | None = None
               ) -> tuple[list[int], str | None, list[TokenLogprobs] | None]:
        """Append committed tokens, stopping at a stop token, a stop string or ``max_new_tokens``
        (``finish_reason`` set); returns the tokens kept, the text they add (less what is held back
        while it may still become a stop string) and, with ``logprobs`` (one per token), those of the
        tokens kept. A tokenizer that cannot decode the output raises, the request unfinished."""
        kept: list[int] = []
        text = self.text
        try:
            for token in tokens:
                self.output.append(token)
                kept.append(token)
                if token in self.stop_ids:
                    self.finish_reason, self.stop_reason = "stop", token
                    break
                if text is not None and text.has_stop_strings and text.push(self.output):
                    self.finish_reason, self.stop_reason = "stop", text.stop_string
                    break
                if len(self.output) >= self.params.max_new_tokens:
                    self.finish_reason = "length"
                    break
            delta = None
            if text is not None:
                if not text.has_stop_strings:
                    text.push(self.spelled())
                if self.finished:
                    text.finish(self.spelled())
                delta = text.take(final=self.finished)
        except Exception:
            self.finish_reason = None
            raise
        kept_logprobs = None
        if logprobs is not None:
            kept_logprobs = logprobs[:len(kept)]
            self.logprobs += kept_logprobs
        return kept, delta, kept_logprobs

    def spelled(self) -> list[int]:
        """The output tokens its text spells: all of them, but, when special tokens are spelled
        (``skip_special_tokens=False``), not the stop token that ended it (vLLM leaves it out too,
        unless ``include_stop_str_in_output``): a parser reading the text never sees the EOS."""
        p = self.params
        if not p.skip_special_tokens and not p.include_stop_str_in_output and self.finish_reason == "stop" \
                and isinstance(self.stop_reason, int):
            return self.output[:-1]
        return self.output

    def final_text(self) -> str | None:
        """Ending outside the token flow (cancelled, timeout): the text held back is final now."""
        if self.text is None or self.error is not None:
            return None
        self.text.finish(self.spelled())
        return self.text.take(final=True)

    def to_output(self, block_size: int, imposed_acceptance: bool) -> GenerationOutput:
        """The finished request's output (``block_size``: the draft's, 0 without one)."""
        stats = RequestStats(accept_lengths=self.accept_lengths, drafts_verified=self.drafts_verified,
                             block_size=block_size, imposed_acceptance=imposed_acceptance,
                             prompt_tokens=len(self.prompt_ids), prompt_tokens_cached=self.cached_tokens,
                             ttft_s=(self.first_token_at - self.submitted) if self.first_token_at else 0.0,
                             decode_s=(self.finished_at - self.first_token_at) if self.first_token_at else 0.0,
                             queue_s=(self.admitted_at - self.submitted) if self.admitted_at else 0.0,
                             prefill_s=(self.first_token_at - self.admitted_at) if self.first_token_at else 0.0)
        text = self.text.text if self.text is not None and self.finish_reason != "error" else None
        return GenerationOutput(prompt_token_ids=self.prompt_ids, token_ids=list(self.output),
                                finish_reason=self.finish_reason, text=text, stats=stats, request_id=self.request_id,
                                error=describe(self.error) if self.error is not None else None,
                                stop_reason=self.stop_reason, sample=self.sample,
                                logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
                                prompt_logprobs=self.prompt_logprobs)

    def event(self, tokens: list[int], text: str | None, logprobs: list[TokenLogprobs] | None = None,
              output: GenerationOutput | None = None) -> StreamEvent:
        return StreamEvent(self.index, tokens, text, finished=output is not None, output=output,
                           request_id=self.request_id, sample=self.sample, logprobs=logprobs)


@dataclass
class PrefillPlan:
    """One prefill forward: ``chunks[i]`` of ``rows[i]``'s prompt, from ``starts[i]``."""

    rows: list[Request]
    chunks: list[list[int]]
    starts: list[int]
    budgeted: bool               # requests are decoding: this is the step's one prefill forward

    @property
    def ends(self) -> list[int]:
        """Where each row's prompt stands after the forward."""
        return [s + len(c) for s, c in zip(self.starts, self.chunks)]


@dataclass(frozen=True)
class RequestLimits:
    """What a request is validated against: the engine's vocabulary, length and slots, its
    tokenizer (None: token-id prompts only), whether text prompts take the chat template, and the
    default stop ids."""

    vocab_size: int
    max_seq_len: int
    verify_width: int                 # the round's window (scratch past a request's tokens, outside max_seq_len)
    max_batch: int
    tokenizer: object | None = None
    chat: bool = True
    stop_token_ids: tuple[int, ...] = ()
    grammars: GrammarCache | None = None    # compiles structured-output constraints (needs the tokenizer)


def make_requests(prompt: Prompt, params: SamplingParams, limits: RequestLimits, request_id: str, *,
                  index: int = 0, sink: Callable[[StreamEvent], None] | None = None, label: str = "",
                  rng: random.Random | None = None) -> list[Request]:
    """Validate one prompt and its parameters and make its requests (``params.n`` samples: ids
    ``{request_id}-{j}`` sharing the group ``request_id``). Raises :class:`RequestError` naming the
    problem (``label`` prefixes it) and the fix; nothing is queued."""
    try:
        p = params.snapshot()     # the request's own copy: later changes to the caller's object change nothing
        p.validate(limits.vocab_size)
        ids = encode_prompt(prompt, limits.tokenizer, limits.vocab_size, limits.chat)
    except (PromptError, SamplingError) as e:
        raise RequestError(f"{label}{e}") from e
    need = len(ids) + p.max_new_tokens
    if need > limits.max_seq_len:
        raise RequestError(f"{label}prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = {need} "
                           f"exceeds max_seq_len {limits.max_seq_len} (the context length): shorten the prompt, "
                           "lower max_new_tokens, or build the engine with a larger max_seq_len (--max-model-len)")
    # explicit stop ids always stop; ignore_eos drops only the default (EOS) ones
    if p.stop_token_ids is not None:
        stops = frozenset(p.stop_token_ids)
    else:
        stops = frozenset(() if p.ignore_eos else limits.stop_token_ids)
    if p.stop and limits.tokenizer is None:
        raise RequestError(f"{label}stop strings need a tokenizer, and this engine has none: use stop_token_ids")
    if p.structured_outputs is not None and limits.grammars is None:
        raise RequestError(f"{label}structured_outputs need a tokenizer, and this engine has none")
    if p.n > limits.max_batch:
        raise RequestError(f"{label}n={p.n} samples run at once, one slot each, and the engine has "
                           f"max_batch={limits.max_batch}: lower n or raise max_batch")
    rng = rng or random.Random()
    now, requests = time.perf_counter(), []
    for j in range(p.n):
        seed = p.seed + j if p.seed is not None else rng.getrandbits(32)
        text = (TextStream(limits.tokenizer, p.stop or (), p.include_stop_str_in_output, p.skip_special_tokens)
                if limits.tokenizer is not None else None)
        rid = request_id if p.n == 1 else f"{request_id}-{j}"
        try:
            matcher = limits.grammars.matcher(p.structured_outputs) if p.structured_outputs is not None else None
        except StructuredOutputError as e:
            raise RequestError(f"{label}{e}") from e
        requests.append(Request(rid, index, ids, p, stops, seed, now, sink=sink, text=text,
                                group=request_id if p.n > 1 else None, sample=j, matcher=matcher))
    return requests


def is_single_prompt(prompts) -> bool:
    """A string, a list of token ids or a list of chat messages is one prompt. A flat list of
    scalars is one (token-id) prompt even when some are not ints, so that ``encode_prompt``
    names the bad ids instead of reporting each one as a malformed prompt."""
    if isinstance(prompts, str):
        return True
    if not isinstance(prompts, (list, tuple)) or not prompts:
        return False
    if all(isinstance(p, dict) for p in prompts):
        return True
    return not any(isinstance(p, (str, list, tuple, dict)) or p is None for p in prompts)


def pair_prompts(prompts, params) -> list[tuple[object, SamplingParams]]:
    """``(prompt, params)`` for each prompt of a generate/stream call, the call's shape checked."""
    if isinstance(prompts, dict):
        raise RequestError("a chat message must be inside a list: pass [message] for one conversation, "
                           "[[message, ...], ...] for several")
    if not isinstance(prompts, (str, list, tuple)):
        raise RequestError(f"prompts must be a string, a list of token ids, a list of chat messages or a list "
                           f"of such prompts, got {type(prompts).__name__}")
    prompt_list = [prompts] if is_single_prompt(prompts) else list(prompts)
    nones = [i for i, p in enumerate(prompt_list) if p is None]
    if nones:
        raise RequestError(f"prompts {nones} are None: every prompt needs text, token ids or chat messages")
    if not prompt_list:
        raise RequestError("no prompts given")
    if params is None or isinstance(params, SamplingParams):
        return [(p, params or SamplingParams()) for p in prompt_list]
    params_list = list(params)
    if len(params_list) != len(prompt_list):
        raise RequestError(f"{len(params_list)} SamplingParams for {len(prompt_list)} prompts")
    bad = [i for i, p in enumerate(params_list) if not isinstance(p, SamplingParams)]
    if bad:
        raise RequestError(f"params {bad} are not SamplingParams (got {type(params_list[bad[0]]).__name__})")
    return list(zip(prompt_list, params_list))
