"""Turning user prompts into token ids, and the target's default stop tokens.

A prompt is a list of token ids, a string (tokenised; wrapped in the chat template as one user
turn when the tokenizer has one and ``chat`` is on) or a list of chat messages
(``[{"role": ..., "content": ...}]``, which needs a chat template).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Union

from ..models.config import BOOL, NUMBER, TOKEN_IDS, WHOLE_NUMBER, Fields, Kind, parse_token_ids, read_json_object
from ..models.loading import CheckpointError

log = logging.getLogger("lfmspark")

Prompt = Union[str, list[int], list[dict[str, Any]]]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# the tokenizer's JSON files, which a damaged download leaves unreadable
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


class PromptError(ValueError):
    """A prompt that cannot be served; the message says which and why."""


def load_tokenizer(path: str | Path | None):
    """The HF tokenizer of a model directory, or None when the directory has none. Tokenizer files
    that transformers cannot read (not JSON, truncated, not a tokenizer) raise
    :class:`CheckpointError` naming the file and the problem, with transformers' error as its cause."""
    if path is None or not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except ImportError:
        raise                   # a package the tokenizer needs (sentencepiece, ...), not a damaged file
    except Exception as e:      # json, tokenizers and transformers each raise their own
        raise CheckpointError(_tokenizer_problem(Path(path), e)) from e


def _tokenizer_problem(path: Path, error: Exception) -> str:
    """What is wrong with the tokenizer in ``path``: the first of its JSON files that is not valid
    JSON, else transformers' ``error``."""
    for name in _TOKENIZER_JSON:
        file = path / name
        if not file.is_file():
            continue
        try:
            with open(file, encoding="utf-8") as f:
                json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return f"{file}: not valid JSON ({e}); the file is damaged or incomplete: download it again"
        except OSError as e:
            return f"{file}: cannot be read ({e.strerror or e})"
    return (f"{path}: the tokenizer cannot be loaded ({type(error).__name__}: {error}); its files are damaged or "
            "not a Hugging Face tokenizer: download them again")


# every field of generation_config.json that lfmspark reads
GENERATION_FIELDS: dict[str, Kind] = {
    "eos_token_id": TOKEN_IDS, "do_sample": BOOL.or_null(),
    "temperature": NUMBER.or_null(), "top_k": WHOLE_NUMBER.or_null(), "top_p": NUMBER.or_null(),
    "min_p": NUMBER.or_null(), "repetition_penalty": NUMBER.or_null(), "presence_penalty": NUMBER.or_null(),
    "frequency_penalty": NUMBER.or_null(), "max_new_tokens": WHOLE_NUMBER.or_null(),
    # read only to warn that they are not applied
    "typical_p": NUMBER.or_null(), "epsilon_cutoff": NUMBER.or_null(), "eta_cutoff": NUMBER.or_null(),
    "no_repeat_ngram_size": WHOLE_NUMBER.or_null(), "diversity_penalty": NUMBER.or_null(),
}


def _generation_config(path: str | Path | None) -> tuple[Path, Fields] | None:
    """``generation_config.json`` of a model directory, read through :data:`GENERATION_FIELDS`
    (errors name the file); None when there is none."""
    if path is None or not (Path(path) / "generation_config.json").is_file():
        return None
    gen = Path(path) / "generation_config.json"
    return gen, Fields(read_json_object(gen), GENERATION_FIELDS, where=f"{gen}: ")


def default_stop_ids(path: str | Path | None, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` when present, else from config.json."""
    found = _generation_config(path)
    if found is not None:
        eos = found[1].get("eos_token_id")
        if eos is not None:
            return parse_token_ids(eos)
    return config_eos


# generation_config.json fields that become SamplingParams defaults, and their names there
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                        "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_new_tokens"}
# sampling fields lfmspark cannot apply yet, with their neutral values: a checkpoint that sets one
# to something else is served without it, and a warning says so
_UNSUPPORTED_DEFAULTS = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0,
                         "diversity_penalty": 0.0}


def generation_defaults(path: str | Path | None) -> dict[str, Any]:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, as ``SamplingParams``
    fields (as transformers and vLLM take them): temperature, top_k, top_p, min_p, the repetition,
    presence and frequency penalties, max_new_tokens;
    ``do_sample: false`` means greedy. Fields lfmspark cannot apply are named in a warning."""
    found = _generation_config(path)
    if found is None:
        return {}
    gen_path, gen = found
    out: dict[str, Any] = {}
    for field, key in _GENERATION_DEFAULTS.items():
        value = gen.get(key)
        if value is None:
            continue
        out[field] = int(value) if field in ("top_k", "max_new_tokens") else float(value)
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    ignored = [k for k, neutral in _UNSUPPORTED_DEFAULTS.items() if gen.get(k) not in (None, neutral)]
    if ignored:
        log.warning("%s sets %s, which lfmspark does not apply yet: sampling runs without them",
                    gen_path, ", ".join(f"{k}={gen.get(k)}" for k in ignored))
    return out


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Refuse chat messages the OpenAI API would refuse: each a dict with a ``role`` among
    :data:`CHAT_ROLES` and a string ``content`` (or a list of ``{"type": "text", "text": str}``
    parts), so that nothing is rendered as an empty turn."""
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise PromptError(f"message {i}: role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if isinstance(content, list):
            bad = [part for part in content
                   if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))]
            if bad:
                raise PromptError(f"message {i}: content parts must be {{'type': 'text', 'text': str}}, got {bad[0]!r}")
        elif not isinstance(content, str):
            raise PromptError(f"message {i} ({role}): content must be a string or a list of text parts, got "
                              f"{type(content).__name__}")


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{where} is not valid Unicode text (a lone surrogate at character {e.start})") from None


def encode_prompt(prompt: Prompt, tokenizer, vocab_size: int, chat: bool = True, *,
                  tools: list[dict[str, Any]] | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A prompt's token ids (module doc). ``tools`` (OpenAI function definitions) and
    ``template_kwargs`` go to the chat template of a message list (LFM2's renders the tools into
    the system turn; ``template_kwargs`` holds what a template reads beyond the messages, such as
    ``enable_thinking``)."""
    if isinstance(prompt, str):
        _check_text(prompt, "the prompt")
        if tokenizer is None:
            raise PromptError("a text prompt needs a tokenizer, and this engine has none (no tokenizer files in the "
                              "target directory): pass token ids instead")
        if chat and getattr(tokenizer, "chat_template", None):
            ids = _chat_ids(tokenizer, [{"role": "user", "content": prompt}])
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        check_messages(list(prompt))
        for i, m in enumerate(prompt):
            for part in ([m["content"]] if isinstance(m["content"], str) else [p["text"] for p in m["content"]]):
                _check_text(part, f"message {i}")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise PromptError("chat messages need a tokenizer with a chat template, and this engine has none")
        ids = _chat_ids(tokenizer, list(prompt), tools, template_kwargs)
    elif isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):
        raise PromptError("a list of chat messages must hold only message dicts ({'role': ..., 'content': ...})")
    elif isinstance(prompt, (list, tuple)):
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)]
        if bad:
            raise PromptError(f"a token-id prompt must hold integers, got {bad[:5]!r}")
        ids = list(prompt)
    else:
        raise PromptError(f"a prompt must be a string, a list of token ids or a list of chat messages, "
                          f"got {type(prompt).__name__}")
    if not ids:
        raise PromptError("the prompt is empty: it needs at least one token")
    out_of_range = [t for t in ids if not 0 <= t < vocab_size]
    if out_of_range:
        raise PromptError(f"token ids {out_of_range[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids


def _chat_ids(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
              template_kwargs: dict[str, Any] | None = None) -> list[int]:
    options = dict(template_kwargs or {})
    if tools:
        options["tools"] = tools
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **options)
    except TemplateError as e:       # the template's raise_exception: messages it does not take
        raise PromptError(f"the chat template refused the messages: {e}") from e
    if isinstance(ids, dict) or hasattr(ids, "keys"):      # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
