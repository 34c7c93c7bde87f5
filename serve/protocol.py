"""The OpenAI request bodies the server takes, and how each maps onto ``SamplingParams``.

Every field the OpenAI API defines for these endpoints is declared, so that one the engine cannot
honour is refused by name (:class:`UnsupportedParameter` -> HTTP 400) instead of being ignored; an
unknown field is refused too (``extra="forbid"``). Types are strict, as OpenAI's are: ``true`` is
not an integer and ``"yes"`` is not a boolean (an integer is a number, though), and JSON's
non-standard ``NaN`` / ``Infinity`` are refused. Extensions, as vLLM names them: ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``return_token_ids``, ``timeout_s``,
``prompt_logprobs``, ``structured_outputs`` and the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (serve/constraints.py), and on chat ``chat_template_kwargs``.
Tools, ``response_format`` and reasoning are read by serve/tools.py, serve/constraints.py and
serve/chat_output.py. vLLM's ``/tokenize`` and ``/detokenize`` bodies are here too.

Bodies are decoded by :func:`parse_body` (the server calls it off the event loop), and responses
encoded by :func:`dumps`.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..runtime.sampling import SamplingParams

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class UnsupportedParameter(ValueError):
    """A request the server refuses (HTTP 400), naming the parameter at fault (``None``: the body)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """``raw`` (a request body) decoded and validated as ``model``; an invalid body raises
    :class:`UnsupportedParameter` naming the field at fault (none for JSON that does not parse)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise invalid_body(e.errors()) from None


def invalid_body(errors: list) -> UnsupportedParameter:
    """The 400 for pydantic's first error: the parameter is the top-level field it concerns (list
    indices and the ``body`` prefix FastAPI adds are not parameters)."""
    err = errors[0] if errors else {}
    kind = err.get("type")
    if kind == "json_invalid":
        detail = str(err.get("ctx", {}).get("error") or err.get("msg", "invalid JSON"))
        return UnsupportedParameter(None, f"the request body is not valid JSON: {detail}")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    if kind == "extra_forbidden":
        return UnsupportedParameter(loc[0] if loc else None,
                                    f"unknown parameter {where!r}: this server does not support it")
    if kind == "model_type" and not loc:
        return UnsupportedParameter(None, "the request body must be a JSON object")
    return UnsupportedParameter(loc[0] if loc else None, f"{where or 'body'}: {err.get('msg', 'invalid value')}")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = _STRICT

    model: str | None = None
    temperature: float | None = None       # OpenAI's default: 1
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None                # metadata only: accepted, not used
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    timeout_s: float | None = None
    prompt_logprobs: int | None = None
    max_speculative_tokens: int | None = None     # 0: no speculation for this request (runtime/speculation.py)
    # structured output (serve/constraints.py): OpenAI's field, vLLM's, and vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def guided(self) -> dict[str, Any]:
        """vLLM's older constraint fields, by name."""
        return {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            bad = [k for k in self.logit_bias if not k.lstrip("-").isdigit()]
            if bad:
                raise UnsupportedParameter("logit_bias", f"logit_bias keys must be token ids, got {bad[:5]}")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options is only allowed with stream=true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise UnsupportedParameter("stream_options", "continuous_usage_stats is not supported")

    def sampling(self, max_tokens: int, defaults: dict[str, Any], logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters (validated by the engine: a bad value is a 400 naming it). A field
        the request leaves out takes the checkpoint's default (``Engine.sampling_defaults``, from
        generation_config.json), else OpenAI's (temperature 1)."""
        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            temperature=pick("temperature", 1.0),
            top_k=pick("top_k", 0),
            top_p=pick("top_p", 1.0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            max_new_tokens=max_tokens,
            stop_token_ids=self.stop_token_ids,
            stop=self.stop or None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            timeout_s=self.timeout_s,
            n=1 if self.n is None else self.n,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            max_speculative_tokens=self.max_speculative_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    # tried in this order, the first that fits taken: a long token-id list validates in one pass,
    # not after failing as a list of strings with an error per id
    prompt: str | list[int] | list[list[int]] | list[str] = Field(union_mode="left_to_right")
    max_tokens: int | None = None          # default: generation_config's max_new_tokens, else 16 (OpenAI's)
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._refuse_unsupported()
        _check_max_tokens("max_tokens", self.max_tokens)
        if self.best_of not in (None, 1):
            raise UnsupportedParameter("best_of", f"best_of={self.best_of} is not supported")
        if self.echo:
            raise UnsupportedParameter("echo", "echo is not supported")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix (insertion) is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise UnsupportedParameter("prompt", "prompt is an empty list")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p or isinstance(p[0], int):       # validated: a list's items are all of one kind
            return [p]
        return list(p)


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None          # serve/tools.py reads these five
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: what the template reads beyond the messages
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    web_search_options: dict[str, Any] | None = None

    def check(self) -> None:
        self._refuse_unsupported()
        _check_max_tokens("max_tokens", self.max_tokens)
        _check_max_tokens("max_completion_tokens", self.max_completion_tokens)
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs needs logprobs=true")
        for name in ("audio", "prediction", "web_search_options", "reasoning_effort"):
            if getattr(self, name) is not None:
                raise UnsupportedParameter(name, f"{name} is not supported by this server")
        reserved = set(self.chat_template_kwargs or ()) & _TEMPLATE_ARGUMENTS
        if reserved:
            raise UnsupportedParameter("chat_template_kwargs", f"chat_template_kwargs cannot set {sorted(reserved)}: "
                                       "the server sets them")
        if self.modalities not in (None, ["text"]):
            raise UnsupportedParameter("modalities", "only text output is supported")
        if self.store:
            raise UnsupportedParameter("store", "this server does not store completions")
        if self.service_tier not in (None, "auto", "default"):
            raise UnsupportedParameter("service_tier", "service tiers are not supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise UnsupportedParameter("max_completion_tokens", "max_tokens and max_completion_tokens disagree")

    @property
    def logprobs_count(self) -> int | None:
        """``SamplingParams.logprobs``: None unless ``logprobs`` is true, then ``top_logprobs`` (0 by default)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# apply_chat_template's own arguments, which chat_template_kwargs may not override
_TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _check_max_tokens(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UnsupportedParameter(name, f"{name} must be >= 1, got {value}")


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (special tokens added by default) or chat ``messages``
    (through the chat template, with the generation prompt by default; no special tokens beyond
    the template's). ``token_strs`` in the answer when ``return_token_strs``. ``tools`` and
    ``chat_template_kwargs`` render as a chat request's do."""

    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None        # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedParameter("prompt", "give either prompt or messages")
        if self.prompt is None and self.add_generation_prompt and self.continue_final_message:
            raise UnsupportedParameter("continue_final_message", "continue_final_message needs "
                                       "add_generation_prompt=false")
        if self.prompt is not None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise UnsupportedParameter("tools", "tools and chat_template_kwargs go with messages, not a prompt")
        reserved = set(self.chat_template_kwargs or ()) & _TEMPLATE_ARGUMENTS
        if reserved:
            raise UnsupportedParameter("chat_template_kwargs", f"chat_template_kwargs cannot set {sorted(reserved)}: "
                                       "the server sets them")

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.prompt is not None


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize``: token ids -> ``{"prompt": text}``."""

    model_config = _STRICT

    model: str | None = None
    tokens: list[int]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


def error_json(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": ErrorBody(message=message, type=type_, param=param, code=code).model_dump()}



def dumps(content: Any) -> str:
    """A response's JSON text. JSON has no NaN or infinity: a non-finite float (a rate over no
    rounds, say) is written as ``null``, never as the non-standard ``NaN`` clients fail to parse."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite_or_null(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value
