"""Log-probabilities of the tokens a request emits (``SamplingParams.logprobs``) and of its prompt
(``SamplingParams.prompt_logprobs``).

Which distribution: the engine's ``logprobs_mode`` (vLLM's ``--logprobs-mode`` names the same two):

- ``"raw"`` (default): the log-softmax of the target's logits as the model produced them, before
  any logit transform, temperature or filter: what vLLM returns by default, and what evaluation
  and RL users compare against a plain forward of the model.
- ``"processed"``: the log of the distribution each token was drawn from: the logits after the
  request's transforms (``logit_bias``, penalties, ``min_tokens``) and, for a sampled request, its
  temperature and top-k / top-p / min-p filters (filtered tokens are left out of ``top``). Greedy
  requests are neither scaled nor filtered: the log-softmax of their transformed logits.

Under speculation an accepted draft token's log-probability is the target's at that position (the
verify computed it), never the draft's: the same numbers a target-only run of the same tokens gives.

Where it runs: the steps hand out the scores they already hold (the verify's or decode's logits, or
the processed logits of a sampling step), so the captured graphs are the same for every request;
the log-softmax, the chosen token's entry and the top-N run after the step, for the rows that asked,
on the same stream, and reach the host with the step's tokens (runtime/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOGPROBS_MODES = ("raw", "processed")


@dataclass
class TokenLogprobs:
    """One token's log-probability, its rank (1 = the most likely token) and the most likely tokens'
    ``(token id, log-probability)``, most likely first (``SamplingParams.logprobs`` of them)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class LogprobTensors:
    """What :func:`token_logprobs` computes for ``N`` tokens (device or host tensors)."""

    logprob: torch.Tensor         # [N] fp32
    rank: torch.Tensor            # [N] int64
    top_logprob: torch.Tensor     # [N, k] fp32
    top_ids: torch.Tensor         # [N, k] int64

    def to_host(self) -> "LogprobTensors":
        """Start copying to the host without waiting (pinned memory); read after the stream's event."""
        return LogprobTensors(*(t.to("cpu", non_blocking=True) for t in
                                (self.logprob, self.rank, self.top_logprob, self.top_ids)))

    def records(self, tokens: list[int], start: int, count: int, n_top: int) -> list[TokenLogprobs]:
        """:class:`TokenLogprobs` of entries ``start .. start + count`` (host tensors), each with its
        ``n_top`` best alternatives that have a finite log-probability."""
        lp = self.logprob[start:start + count].tolist()
        rank = self.rank[start:start + count].tolist()
        top_lp = self.top_logprob[start:start + count, :n_top].tolist()
        top_ids = self.top_ids[start:start + count, :n_top].tolist()
        return [TokenLogprobs(t, lp[i], rank[i], [(j, v) for j, v in zip(top_ids[i], top_lp[i]) if v != float("-inf")])
                for i, t in enumerate(tokens[:count])]


def token_logprobs(scores: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobTensors:
    """Log-probabilities of ``tokens [N]`` under the log-softmax of ``scores [N, V]`` (any float
    dtype, computed in fp32), their ranks, and the ``k`` most likely entries of each row."""
    logp = torch.log_softmax(scores.float(), dim=-1)
    chosen = logp.gather(-1, tokens[:, None])[:, 0]
    rank = (logp > chosen[:, None]).sum(dim=-1) + 1
    top_logprob, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], tokens[:, None][:, :0])
    return LogprobTensors(chosen, rank, top_logprob, top_ids)
