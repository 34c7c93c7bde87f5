"""The tiny presets' tokenizer: byte-level, with LFM2's special tokens and chat template.

Random-weight presets have no tokenizer of their own; the tiny ones (tests, CPU smoke runs, the
embedded default) get this one so that text prompts, chat messages, stop strings and the README's
examples work on them. It is built here with ``tokenizers`` (no files, no download): ids 0-7 are
LFM2's special tokens at LFM2's ids (``<|startoftext|>`` 1 is the BOS, ``<|im_end|>`` 7 the EOS the
presets stop on, ``<|im_start|>`` 6 opens a chat turn), ids 8-263 the 256 bytes, so any text
encodes and every id sequence decodes. The chat template is LFM2's ChatML layout.
"""

from __future__ import annotations

import functools

SPECIAL_TOKENS = ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
                  "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
CHAT_TEMPLATE = ("{{- bos_token -}}"
                 "{%- for message in messages -%}"
                 "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
                 "{%- endfor -%}"
                 "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def _byte_symbols() -> list[str]:
    """The printable character byte-level BPE writes for each byte value (GPT-2's map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbol: len(SPECIAL_TOKENS) + b for b, symbol in enumerate(_byte_symbols())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(single="<|startoftext|> $A",
                                                       special_tokens=[("<|startoftext|>", 1)])
    return tok.to_str()


def byte_tokenizer():
    """A fresh ``PreTrainedTokenizerFast`` (callers may change its template)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token="<|startoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)
