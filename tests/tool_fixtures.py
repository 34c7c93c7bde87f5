"""A tiny checkpoint for the tool-calling, structured-output and reasoning tests: random weights
whose byte-level tokenizer holds LFM2's special tokens at LFM2's ids (0-7 as the presets', then
``<|tool_list_start|>`` 8 ... ``<|tool_response_end|>`` 13), ``<think>`` and ``</think>`` as special
tokens, then the 256 bytes, and a chat template that renders tools and tool results the way LFM2's
does: ``List of tools: <|tool_list_start|>[...]<|tool_list_end|>`` in the system turn, a tool turn
wrapped in ``<|tool_response_start|>...<|tool_response_end|>``, assistant ``tool_calls`` dropped
(as LFM2's template drops them). ``thinking=True`` also opens ``<think>`` in the generation prompt
(as DeepSeek-R1's template does)."""

from __future__ import annotations

from pathlib import Path

from engine_fixtures import save_tiny_draft, save_tiny_target
from lfmspark.runtime.byte_tokenizer import _byte_symbols

SPECIALS = ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
            "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
            "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>", "<think>", "</think>")
ID = {t: i for i, t in enumerate(SPECIALS)}
VOCAB = len(SPECIALS) + 256
MAX_POSITIONS = 2048

_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{%- set ns.system = ns.system + ('\\n' if ns.system else '') + 'List of tools: <|tool_list_start|>[' -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.system = ns.system + (tool if tool is string else tool | tojson) + (', ' if not loop.last else '') -%}"
    "{%- endfor -%}"
    "{%- set ns.system = ns.system + ']<|tool_list_end|>' -%}"
    "{%- endif -%}"
    "{%- if ns.system -%}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else m['content'] | tojson -%}"
    "{%- if m['role'] == 'tool' -%}{%- set content = '<|tool_response_start|>' + content + '<|tool_response_end|>' -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}OPEN{%- endif -%}"
)


def chat_template(thinking: bool = False) -> str:
    return _TEMPLATE.replace("OPEN", "{{- '<think>\\n' -}}" if thinking else "")


def tool_tokenizer(thinking: bool = False):
    """The tokenizer of the module doc (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = dict(ID)
    vocab.update({symbol: len(SPECIALS) + b for b, symbol in enumerate(_byte_symbols())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<|startoftext|> $A",
                                                       special_tokens=[("<|startoftext|>", ID["<|startoftext|>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|pad|>", chat_template=chat_template(thinking))


def save_tool_checkpoint(root: Path, thinking: bool = False) -> tuple[Path, Path]:
    """A target (random weights, the tokenizer above) and a DSpark draft over its vocabulary."""
    root = Path(root)
    target = save_tiny_target(root / "target", tokenizer=tool_tokenizer(thinking), vocab=VOCAB,
                              max_positions=MAX_POSITIONS,
                              special_ids=(ID["<|startoftext|>"], ID["<|im_end|>"], ID["<|pad|>"]))
    draft = save_tiny_draft(root / "draft", vocab_size=VOCAB, mask_token_id=VOCAB - 1,
                            max_position_embeddings=MAX_POSITIONS)
    return target, draft
