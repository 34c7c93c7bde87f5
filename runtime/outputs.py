"""What the engine hands back: finished generations, their statistics, and streaming events."""

from __future__ import annotations

from dataclasses import dataclass, field

from .logprobs import TokenLogprobs


@dataclass
class RequestStats:
    """Per-request speculation and timing statistics.

    ``accept_lengths`` holds one entry per speculative round: the tokens that round committed,
    the correction/bonus token included (the DSpark paper's convention), so ``tau`` is their mean.
    ``drafts_verified`` holds, per round, the draft tokens the target verified for this request
    (the round's width less one, capped by ``max_speculative_tokens``; 0: a round that drafted
    nothing, runtime/speculation.py). ``acceptance_per_position[k]`` is the conditional rate at
    which draft ``k+1`` was accepted in rounds that verified it after accepting drafts ``1..k``.
    Without a draft every list is empty and ``tau`` is 1.
    """

    accept_lengths: list[int] = field(default_factory=list)
    drafts_verified: list[int] = field(default_factory=list)
    block_size: int = 0
    imposed_acceptance: bool = False      # accept lengths were imposed (benchmark mode), not measured
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0         # of them, reused from the prefix cache (not prefilled)
    ttft_s: float = 0.0                   # submission -> first token available on the host
    decode_s: float = 0.0                 # first token -> last token
    queue_s: float = 0.0                  # submission -> a slot (admission; vLLM's queue time)
    prefill_s: float = 0.0                # admission -> first token (vLLM's prefill time)

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        rates = []
        rounds = list(zip(self.accept_lengths, self.drafts_verified or [self.block_size] * self.rounds))
        for k in range(1, self.block_size + 1):
            reached = sum(1 for n, v in rounds if n >= k and v >= k)   # draft k offered, drafts 1..k-1 accepted
            passed = sum(1 for n, v in rounds if n >= k + 1)           # draft k accepted too
            rates.append(passed / reached if reached else float("nan"))
        return rates

    @property
    def draft_tokens_verified(self) -> int:
        return sum(self.drafts_verified)

    @property
    def draft_tokens_accepted(self) -> int:
        return sum(n - 1 for n in self.accept_lengths)

    @property
    def rounds_without_draft(self) -> int:
        """Rounds that verified no draft token for this request (width 1, or speculation off for it)."""
        return sum(1 for v in self.drafts_verified if v == 0)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "tau": self.tau, "accept_lengths": self.accept_lengths,
                "drafts_verified": self.drafts_verified, "draft_tokens_verified": self.draft_tokens_verified,
                "draft_tokens_accepted": self.draft_tokens_accepted, "rounds_without_draft": self.rounds_without_draft,
                "acceptance_per_position": self.acceptance_per_position, "imposed_acceptance": self.imposed_acceptance,
                "prompt_tokens": self.prompt_tokens, "prompt_tokens_cached": self.prompt_tokens_cached,
                "ttft_s": self.ttft_s, "decode_s": self.decode_s, "queue_s": self.queue_s, "prefill_s": self.prefill_s}


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    # "stop" (a stop token, included in token_ids), "length", "cancelled", "timeout" or "error"
    finish_reason: str
    text: str | None = None               # when the target directory has a tokenizer
    stats: RequestStats = field(default_factory=RequestStats)
    request_id: str = ""
    error: str | None = None              # with finish_reason "error": what failed ("RuntimeError: ...")
    stop_reason: int | str | None = None  # with finish_reason "stop": the stop token id or stop string
    sample: int = 0                       # which of the prompt's SamplingParams.n samples
    # with SamplingParams.logprobs: one entry per token of token_ids (runtime/logprobs.py)
    logprobs: list[TokenLogprobs] | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the output tokens' log-probabilities (with ``logprobs``), as vLLM reports it."""
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)


@dataclass
class StreamEvent:
    """New tokens of one request, as a round commits them."""

    index: int                            # position of the request in the generate/stream call
    token_ids: list[int]
    text: str | None = None               # decoded text of these tokens (incremental)
    finished: bool = False
    output: GenerationOutput | None = None  # set on the request's last event
    request_id: str = ""
    sample: int = 0                       # which of the prompt's SamplingParams.n samples
    logprobs: list[TokenLogprobs] | None = None   # with SamplingParams.logprobs: one per token of token_ids
