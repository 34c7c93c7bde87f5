"""A request inside the engine, from submission to its finish, and the errors a caller can meet.

The engine keeps one :class:`Request` per submitted prompt: its own copy of the parameters, its
slot while it runs, the tokens committed so far, and where its events go (``sink``). A request
finishes exactly once, with one of :data:`FINISH_REASONS`; its slot is free from that moment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .detokenize import TextStream
from .logprobs import TokenLogprobs
from .outputs import StreamEvent
from .sampling import SamplingParams

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
    prefilled: int = 0                  # prompt tokens in the cache (prefill runs in chunks across steps)
    cached_tokens: int = 0              # of them, copied from the prefix cache at admission
    output: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)   # tokens each round committed
    drafts_verified: list[int] = field(default_factory=list)  # draft tokens each round offered the target
    finish_reason: str | None = None
    error: BaseException | None = None
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def deadline(self) -> float | None:
        t = self.params.timeout_s
        return None if t is None else self.submitted + t

    def expired(self, now: float | None = None) -> bool:
        deadline = self.deadline
        return deadline is not None and (time.perf_counter() if now is None else now) >= deadline


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
