"""On-disk checkpoints and tokenizers for the Engine API tests.

* :func:`word_tokenizer`: a 64-token word-level tokenizer (``tokenizers`` + ``PreTrainedTokenizerFast``)
  with LFM2-style special tokens, a BOS post-processor and a small Jinja chat template.
* :func:`byte_tokenizer`: a byte-level BPE tokenizer (no merges) in which ``é`` is two tokens, so
  decoding a prefix that ends between them yields ``U+FFFD``.
* :func:`save_tiny_target`: a random-init tiny HF ``Lfm2ForCausalLM`` saved with transformers
  (plus, optionally, the word tokenizer and a ``generation_config.json``).
* :func:`save_tiny_draft`: a tiny DSpark draft directory in the DeepSpec layout, written by hand
  (config.json with the DeepSpec fields, model.safetensors with random tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lfmspark.runtime.byte_tokenizer import _byte_symbols

VOCAB = 64
HIDDEN = 32
N_LAYERS = 4
LAYER_TYPES = ["conv", "full_attention", "conv", "full_attention"]

SPECIALS = ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "system"] + [f"w{i}" for i in range(VOCAB - len(SPECIALS) - 3)]
TOKENS = SPECIALS + WORDS                      # id == position
TOKEN_ID = {t: i for i, t in enumerate(TOKENS)}
PAD, BOS, EOS, UNK, IM_START, IM_END = range(len(SPECIALS))
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
assert len(TOKENS) == VOCAB


def word_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(TOKEN_ID, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<|startoftext|> $A",
                                                       special_tokens=[("<|startoftext|>", BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|pad|>", unk_token="<|unk|>", chat_template=chat_template)


def words_to_ids(text: str) -> list[int]:
    """Plain tokenisation of space-separated vocabulary words, computed without the tokenizer."""
    return [TOKEN_ID[w] for w in text.split()]


def ids_to_text(ids: list[int]) -> str:
    """What decoding with ``skip_special_tokens=True`` must give, computed without the tokenizer."""
    return " ".join(TOKENS[i] for i in ids if i >= len(SPECIALS))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet), as the runtime's tokenizer uses."""
    return dict(enumerate(_byte_symbols()))


def byte_tokenizer():
    """A byte-level BPE tokenizer with ``VOCAB`` tokens and no merges: ``a``-``z``, ``A``-``Z``, the
    space, the two bytes of ``é`` (returned ids ``(first, second)``) and filler bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()
    e_bytes = list("é".encode())
    chars = [b2u[b] for b in e_bytes] + [b2u[ord(c)] for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ "]
    for b in range(ord("0"), 256):
        if len(chars) == VOCAB:
            break
        if b2u[b] not in chars and b < 0x80:
            chars.append(b2u[b])
    assert len(chars) == VOCAB
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok), (0, 1)


def byte_level_text(tokenizer, ids: list[int]) -> str:
    """Decode byte-level tokens by hand: token characters -> bytes -> UTF-8 (invalid -> U+FFFD)."""
    u2b = {c: b for b, c in _bytes_to_unicode().items()}
    data = bytes(u2b[c] for tok in tokenizer.convert_ids_to_tokens(ids) for c in tok)
    return data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# checkpoints

@torch.no_grad()
def save_tiny_target(path: Path, seed: int = 0, tokenizer=True, generation_eos=None, *, vocab: int = VOCAB,
                     max_positions: int = 512, special_ids: tuple[int, int, int] = (BOS, IM_END, PAD)) -> Path:
    """A random tiny LFM2 target saved by transformers. Weights are re-drawn larger than HF's
    0.02 init so that the greedy output depends on the context and has no near-ties.
    ``generation_eos`` (an int or a list) is written to generation_config.json; ``None`` leaves
    transformers' own file (eos = config.json's ``eos_token_id`` = ``<|im_end|>``). ``tokenizer``:
    True saves the word tokenizer, a tokenizer object is saved instead (with ``vocab`` covering it
    and ``special_ids`` its BOS, EOS and pad ids)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    path = Path(path)
    bos, eos, pad = special_ids
    cfg = Lfm2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=N_LAYERS,
                     num_attention_heads=4, num_key_value_heads=2, layer_types=list(LAYER_TYPES),
                     block_auto_adjust_ff_dim=False, max_position_embeddings=max_positions, bos_token_id=bos,
                     eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True,
                     rope_parameters={"rope_theta": 10_000.0, "rope_type": "default"})
    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif "conv.conv" in name:
            p.copy_(0.7 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(1.2 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(str(path))
    if tokenizer is True:
        word_tokenizer().save_pretrained(str(path))
    elif tokenizer:
        tokenizer.save_pretrained(str(path))
    if generation_eos is not None:
        write_generation_eos(path, generation_eos)
    return path


def write_generation_eos(path: Path, eos) -> None:
    with open(Path(path) / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": eos, "pad_token_id": PAD}, f)


def draft_config_dict(**changes) -> dict:
    """A DeepSpec DSpark draft config.json for the tiny target (fields as in LiquidAI's exports)."""
    cfg = {
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3",
        "hidden_size": HIDDEN, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "block_size": 4, "target_layer_ids": [0, 2],
        "mask_token_id": VOCAB - 1, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
        "rope_is_neox_style": False, "markov_rank": 8, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True, "num_target_layers": N_LAYERS,
        "max_position_embeddings": 512,
    }
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def draft_tensors(cfg: dict, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random DeepSpec-named tensors for ``cfg`` (listed here, independently of the loader)."""
    gen = torch.Generator().manual_seed(seed)
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, r, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["markov_rank"], cfg["vocab_size"]
    shapes = {"fc.weight": (H, len(cfg["target_layer_ids"]) * HIDDEN), "hidden_norm.weight": (H,),
              "norm.weight": (H,), "markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r),
              "confidence_head.proj.weight": (1, H + r), "confidence_head.proj.bias": (1,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nq * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
            p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nq * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        })
    out = {}
    for name, shape in shapes.items():
        if "norm" in name:
            out[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = 0.3 * torch.randn(shape, generator=gen)
    return out


def save_tiny_draft(path: Path, seed: int = 1, **changes) -> Path:
    """A DSpark draft directory: config.json (``changes`` override fields; ``None`` removes one)
    and model.safetensors with random tensors."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = draft_config_dict(**changes)
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.contiguous() for k, v in draft_tensors(cfg, seed).items()}, str(path / "model.safetensors"))
    return path


def map_slots(engine, slots) -> None:
    """Give ``slots`` KV pages for the engine's whole ``max_seq_len``, for tests that run rounds or
    steps on slots themselves, outside the scheduler (which covers each round's rows as it goes)."""
    runner = engine.model_runner
    for slot in slots:
        if slot >= 0:
            runner.pages.ensure(slot, runner.max_seq_len)
    runner.pages.flush(runner.tcache.page_table)


def cached_pages(engine) -> list[int]:
    """The KV pages the prefix cache's blocks hold, one entry per block that holds it."""
    cache, pages = engine.model_runner.prefix_cache, []
    stack = list(cache.root.children.values()) if cache is not None else []
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        pages += node.pages
    return pages


def assert_no_page_leaked(engine) -> None:
    """With no request live, the only KV pages in use are the prefix cache's, each referenced once."""
    held = set(cached_pages(engine))
    pool = engine.kv_pages
    assert pool.in_use == len(held), (pool.in_use, len(held))
    assert (pool.refs[sorted(held)] == 1).all() and (pool.refs >= 0).all()
