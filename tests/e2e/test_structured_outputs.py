"""Structured outputs (runtime/structured.py) through the engine, speculative and target-only.

* Every sampled output of a constraint is valid: 200 generations per JSON-schema family (objects,
  arrays, enums, nested objects, ``anyOf``, string formats and patterns, bounded numbers) on the
  tiny preset's random weights at temperature 1, 100 speculative and 100 target-only, each with
  its own seed (200 of each would take twice the CPU time, some 50 s on two cores), each ending
  with the EOS and validating with ``jsonschema``.
* Greedy constrained speculation equals greedy constrained target-only decoding token for token
  (dense and MoE; schemas, a regular expression, a choice, a Lark grammar; alone and in batches),
  also with a draft that agrees with the target, so that drafts are accepted under the masks of
  the verify window's later columns.
* Sampled constrained speculation follows the constrained target distribution: on an 8-token
  vocabulary the exact joint of the first three tokens under a regular expression (the target's
  distribution renormalised over the allowed tokens at each step, the allowed tokens found by
  enumerating the language with Python's ``re``) against thousands of samples, chi-square.
* A JSON schema costs no acceptance when the draft agrees with the target and the target's own
  choices are valid: tau with the schema is tau without it.
* Constrained and unconstrained requests in one batch (or joining each other mid-run) give their
  solo outputs.
* A constraint that cannot be used is refused as a ``RequestError`` naming the problem, and the
  engine goes on.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode
from lfmspark.runtime import Engine, RequestError, SamplingParams
from lfmspark.runtime.byte_tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, byte_tokenizer
from lfmspark.runtime.structured import StructuredOutputsParams as SO
from sampling_oracles import chi_square_pvalue, filtered
from spec_fixtures import (bigram_target, derangement_of, mix_permutations, oracle_draft, random_tiny_draft,
                           random_tiny_target)
from structured_fixtures import allowed_next, byte_vocabulary, finite_language, token_tokenizer

F32 = dict(dtype=torch.float32, device="cpu")
EOS = 7                     # the byte tokenizer's <|im_end|>, the tiny presets' stop token
FORMATS = jsonschema.FormatChecker()


def validate(output, schema: dict) -> object:
    """The output ended with the EOS and its text is a JSON value valid against ``schema``."""
    assert output.finish_reason == "stop" and output.token_ids[-1] == EOS, (output.finish_reason, output.text)
    value = json.loads(output.text)
    jsonschema.validate(value, schema, format_checker=FORMATS)
    return value


_ENGINES: dict = {}


def preset_engine(name: str, speculative: bool, max_batch: int = 8) -> Engine:
    """A tiny-preset engine (fp32, CPU), one per configuration for the whole module (engines are
    left idle between tests)."""
    key = (name, speculative, max_batch)
    if key not in _ENGINES:
        _ENGINES[key] = Engine.from_preset(name, "default" if speculative else None, **F32, max_batch=max_batch,
                                           max_seq_len=96)
    engine = _ENGINES[key]
    assert engine.idle
    return engine


# -- 1. every sampled output validates -------------------------------------------------------------

# small schemas whose valid outputs are short (one-letter keys, bounded strings and numbers), so that
# random weights end them; optional properties leave the model a choice
FAMILIES = {
    "object": {"type": "object", "properties": {"n": {"type": "string", "maxLength": 3},
                                                "a": {"type": "integer", "minimum": 0, "maximum": 120},
                                                "o": {"type": "boolean"}},
               "required": ["n", "a"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    "enum": {"enum": ["red", "green", "blue", 3, None, True, {"a": 1}]},
    "nested": {"type": "object", "properties": {
        "u": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "t": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
              "required": ["id", "t"], "additionalProperties": False},
        "m": {"type": "object", "properties": {"v": {"type": "boolean"}}, "additionalProperties": False}},
        "required": ["u"], "additionalProperties": False},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "pattern": "^[a-z]{1,3}$"},
                        {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"],
                         "additionalProperties": False},
                        {"type": "null"}]},
    "format": {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                                "c": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
               "required": ["d", "c"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "i": {"type": "integer", "minimum": -20, "maximum": 20},
        "x": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        "m": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 50}},
        "required": ["i", "x", "m"], "additionalProperties": False},
}
PER_FAMILY = 100           # per engine: 200 generations per family


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_sampled_output_is_valid(family, speculative):
    """The target's logits are masked at every position (prefill's first token, decode steps, every
    verify column after the window's earlier drafts), and the matcher follows the committed tokens."""
    schema = FAMILIES[family]
    jsonschema.Draft202012Validator.check_schema(schema)
    engine = preset_engine("tiny", speculative, max_batch=PER_FAMILY)
    prompts = [[1, 6, 9 + i % 50] for i in range(PER_FAMILY)]
    first_seed = 0 if speculative else PER_FAMILY
    params = [SamplingParams(temperature=1.0, seed=first_seed + i, max_new_tokens=48,
                             structured_outputs=SO(json=schema)) for i in range(PER_FAMILY)]
    outs = engine.generate(prompts, params)
    values = [json.dumps(validate(o, schema), sort_keys=True) for o in outs]
    assert len(set(values)) >= 3             # sampled: the model's choices among the valid values vary
    assert engine.scheduler.pool.in_use == 0 and engine.idle


# -- 2. greedy: speculative == target-only ---------------------------------------------------------

CONSTRAINTS = {
    "object": SO(json={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}),
    "array": SO(json={"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1,
                      "maxItems": 4}),
    "anyOf": SO(json={"anyOf": [{"type": "integer"}, {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 5}}, "required": ["k"], "additionalProperties": False}]}),
    "json_object": SO(json_object=True),
    "regex": SO(regex=r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)"),
    "choice": SO(choice=["alpha", "beta", "gamma", "delta", "epsilon"]),
    "grammar": SO(grammar='start: "(" item ("," item)* ")"\nitem: /[a-z]{1,5}/ | /[0-9]{1,3}/'),
}


def class_permutation(seed: int) -> torch.Tensor:
    """A permutation of the byte vocabulary that keeps lower-case letters, upper-case letters and
    digits among themselves (each class a random cycle): a bigram target over it writes runs of
    letters or digits, which strings and numbers accept, so an oracle draft is often accepted under
    a constraint (and rejected where the constraint turns the target elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    classes = [[len(SPECIAL_TOKENS) + ord(c) for c in chars]
               for chars in ("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789")]
    taken = {t for c in classes for t in c}
    classes.append([t for t in range(VOCAB_SIZE) if t not in taken])
    perm = torch.empty(VOCAB_SIZE, dtype=torch.int64)
    for c in map(torch.tensor, classes):
        perm[c] = c[torch.randperm(len(c), generator=gen)]
    return perm


def engine_pair(kind: str) -> tuple[Engine, Engine]:
    """(speculative, target-only) engines: the tiny presets (random draft), or a leaky bigram target
    over the byte vocabulary with an oracle draft (dense or MoE), with the byte tokenizer."""
    if kind.startswith("preset"):
        name = "tiny-moe" if kind.endswith("moe") else "tiny"
        return preset_engine(name, True), preset_engine(name, False)
    perm = class_permutation(1)
    target = bigram_target(perm, leak=0.05, moe=kind.endswith("moe"), seed=2)
    kw = dict(tokenizer=byte_tokenizer(), stop_token_ids=(EOS,), max_batch=8, max_seq_len=96)
    return Engine(target, oracle_draft(perm, block=4), **kw), Engine(target, None, **kw)


@pytest.mark.parametrize("kind", ["preset-dense", "preset-moe", "bigram-dense", "bigram-moe"])
def test_greedy_constrained_speculation_equals_target_only(kind):
    """Each verify column's mask is the one after the window's earlier drafts: a column masked as
    another (or left open) commits what target-only decoding, one masked position at a time, never
    would, once drafts are accepted (the bigram targets with an oracle draft)."""
    spec, plain = engine_pair(kind)
    names = list(CONSTRAINTS)
    prompts = [[1, 6, len(SPECIAL_TOKENS) + ord(c)] for c in "kqbxmzf"]
    params = [SamplingParams(max_new_tokens=32, structured_outputs=CONSTRAINTS[n]) for n in names]
    reference = [plain.generate([p], q)[0] for p, q in zip(prompts, params)]
    alone = [spec.generate([p], q)[0] for p, q in zip(prompts, params)]
    batched = spec.generate(prompts, params)
    batched_plain = plain.generate(prompts, params)
    for name, ref, *outs in zip(names, reference, alone, batched, batched_plain):
        for out in outs:
            assert out.token_ids == ref.token_ids, name
            assert out.finish_reason == ref.finish_reason
    taus = [o.stats.tau for o in batched]
    if kind.startswith("bigram"):
        # drafts were accepted under the constraints: the masks of the later columns decided tokens
        assert max(taus) >= 2.0 and sum(t > 1.5 for t in taus) >= 3, taus


# -- 3. sampling follows the constrained target distribution ---------------------------------------

LETTERS = "abcdefg"                       # ids 0-6; id 7 is the end token
LETTER_EOS = 7
FOLLOW = {"a": "bce", "b": "adf", "c": "abg", "d": "ceg", "e": "adf", "f": "beg", "g": "acd"}
FIRST = "abcdg"
# the first token one of FIRST, each next one of FOLLOW[previous] (three tokens), then any letters
REGEX = "(" + "|".join(x + "(" + "|".join(y + "[" + FOLLOW[y] + "]" for y in FOLLOW[x]) + ")" for x in FIRST) \
    + ")[a-g]*"
PROMPT = [1, 5, 2]


def letter_tokenizer():
    return token_tokenizer([*LETTERS, "<|end|>"], ("<|end|>",), "<|end|>")


@torch.no_grad()
def constrained_joint(target, language: set[str], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) when each token is drawn from the target's distribution with the tokens
    the language forbids after the earlier ones removed (-inf logits), then temperature / top-k /
    top-p (the reference implementation of tests/sampling_oracles.py), from full-sequence forwards."""

    def next_dist(tokens: list[int]) -> np.ndarray:
        cache = TargetCache.allocate(target.config, 1, 32, 2, torch.float32, "cpu")
        z = torch.zeros(1, dtype=torch.int64)
        logits = target(torch.tensor([PROMPT + tokens]), cache, z, z, torch.tensor([len(PROMPT) + len(tokens)]),
                        ForwardMode.PREFILL).logits[0, -1].double().numpy()
        ok = allowed_next(language, "".join(LETTERS[t] for t in tokens))
        allowed = np.array([c in ok for c in LETTERS] + ["" in ok])
        return filtered(np.where(allowed, logits, -np.inf), temperature, top_k, top_p)

    n = len(LETTERS) + 1
    joint = np.zeros((n, n, n))
    p1 = next_dist([])
    for t1 in np.flatnonzero(p1):
        p2 = next_dist([t1])
        for t2 in np.flatnonzero(p2):
            joint[t1, t2] = p1[t1] * p2[t2] * next_dist([t1, t2])
    return joint


# (sampling setting, how many sequences it leaves possible); top-k after the constraint: the two most
# likely allowed tokens, not the allowed ones among the two most likely; samples drawn
SETTINGS = {"plain": (dict(temperature=1.0, top_k=0, top_p=1.0), 45, 4000),
            "top-2": (dict(temperature=0.8, top_k=2), 8, 2000)}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_constrained_sampling_follows_the_constrained_target_distribution(setting):
    """Acceptance and the residual draw use the constrained target ``p`` at every column (the draft's
    unconstrained ``q`` as it is): the first token from prefill, the second and third from rounds."""
    target = random_tiny_target(seed=3, vocab=len(LETTERS) + 1)
    draft = random_tiny_draft(block=3, seed=4, vocab=len(LETTERS) + 1)
    language = finite_language(REGEX, LETTERS, 3)
    sampling, support, samples = SETTINGS[setting]
    probs = constrained_joint(target, language, **{"top_k": 0, "top_p": 1.0, **sampling})
    assert abs(probs.sum() - 1) < 1e-9 and (probs > 0).sum() == support
    engine = Engine(target, draft, tokenizer=letter_tokenizer(), stop_token_ids=(LETTER_EOS,), max_batch=256,
                    max_seq_len=32)
    params = [SamplingParams(max_new_tokens=3, seed=1000 + i, structured_outputs=SO(regex=REGEX), **sampling)
              for i in range(samples)]
    outs = engine.generate([PROMPT] * samples, params)
    counts = np.zeros_like(probs)
    for o in outs:
        assert "".join(LETTERS[t] for t in o.token_ids) in language      # every sample is allowed
        counts[tuple(o.token_ids)] += 1
    assert chi_square_pvalue(counts.ravel(), probs.ravel()) > 1e-3
    # the draft proposes unconstrained: many of its tokens are refused by the constraint or rejected by
    # the target, some accepted (the correction draws from the residual of the constrained target)
    taus = np.array([o.stats.tau for o in outs])
    assert 1.05 < taus.mean() < 2.5


def test_the_constrained_distribution_is_far_from_the_unconstrained_one():
    """Power of the test above: the constrained joint is not the target's own (renormalised over the
    allowed sequences), so an engine that sampled unconstrained and threw invalid samples away fails."""
    target = random_tiny_target(seed=3, vocab=len(LETTERS) + 1)
    language = finite_language(REGEX, LETTERS, 3)
    constrained = constrained_joint(target, language, 1.0, 0, 1.0)
    free = constrained_joint(target, finite_language("[a-g]{3}", LETTERS, 3), 1.0, 0, 1.0)   # letters only
    free = free * (constrained > 0)
    free /= free.sum()
    assert 0.5 * np.abs(free - constrained).sum() > 0.05


# -- 4. tau under a schema with a draft that agrees --------------------------------------------------

# a bigram target whose greedy chain spells a valid object: each piece one token (the multi-character
# ones added to the byte vocabulary), none twice, then the EOS
CHAIN = ['{"id":', "42", ',"name":"', "A", "d", "a", '","tags":[', '"t0"', *(f',"t{i}"' for i in range(1, 20)),
         '],"ok":', "true", "}"]
TAU_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 20},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 30},
    "ok": {"type": "boolean"}}, "required": ["id", "name", "tags", "ok"], "additionalProperties": False}


def chain_setup():
    """(tokens, tokenizer, perm, the token before the chain): ``perm`` sends that token through the
    chain to the EOS, and every other token around one cycle."""
    vocab = byte_vocabulary([t for t in CHAIN if len(t) > 1] + ["<|mask|>"])
    tok = token_tokenizer(vocab, SPECIAL_TOKENS + ("<|mask|>",), "<|im_end|>")
    ids = [vocab.index(t if len(t) > 1 else t.encode()) for t in CHAIN]
    start = vocab.index(b"b")
    seq = [start, *ids, EOS]
    ring = [EOS] + [t for t in range(len(vocab)) if t not in seq] + [start]
    perm = torch.empty(len(vocab), dtype=torch.int64)
    for a, b in [*zip(seq, seq[1:]), *zip(ring, ring[1:])]:
        perm[a] = b
    assert sorted(perm.tolist()) == list(range(len(vocab)))
    return vocab, tok, perm, start


@pytest.mark.parametrize("agreement", ["oracle", "partial"])
def test_tau_under_a_schema_is_tau_without_it(agreement):
    """Where the target's own choices are valid, the masks refuse nothing it would draw: a mask
    computed for the wrong column, or from a matcher behind the committed tokens, refuses agreed
    drafts (tau falls) and turns the output."""
    vocab, tok, perm, start = chain_setup()
    target = bigram_target(perm, leak=0.0, seed=2)
    proposals = perm if agreement == "oracle" else mix_permutations(perm, derangement_of(perm), 0.6, 3)
    draft = oracle_draft(proposals, block=4)
    engine = Engine(target, draft, tokenizer=tok, stop_token_ids=(EOS,), max_batch=4, max_seq_len=64)
    prompts = [[start], [5, start], [9, 40, start]]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=40))
    constrained = engine.generate(prompts, SamplingParams(max_new_tokens=40, structured_outputs=SO(json=TAU_SCHEMA)))
    assert json.loads(free[0].text) == json.loads("".join(CHAIN))     # the target's own choices are valid
    for f, c in zip(free, constrained):
        validate(c, TAU_SCHEMA)
        assert c.token_ids == f.token_ids
    tau_free = np.mean([o.stats.tau for o in free])
    tau_constrained = np.mean([o.stats.tau for o in constrained])
    assert tau_free > (4.5 if agreement == "oracle" else 1.5)
    assert abs(tau_constrained - tau_free) <= 0.1 * tau_free, (tau_constrained, tau_free)


@pytest.mark.parametrize("past_the_end", [dict(ignore_eos=True), dict(stop_token_ids=[])],
                         ids=["ignore_eos", "no-stops"])
def test_a_request_that_goes_on_after_its_constraint_ended_still_equals_target_only(past_the_end):
    """Once the grammar has ended (its EOS drawn) a request that does not stop there (``ignore_eos``,
    or stop ids without the EOS) may only draw the EOS again. A draft that proposes the EOS several
    times has those drafts verified at columns past the grammar's end: their masks must be the ended
    grammar's too, or the target draws freely there (what target-only decoding never does)."""
    vocab, tok, perm, start = chain_setup()
    target = bigram_target(perm, leak=0.0, seed=2)
    proposals = perm.clone()
    proposals[EOS] = EOS                          # the draft: the chain, then EOS after EOS
    spec = Engine(target, oracle_draft(proposals, block=4), tokenizer=tok, stop_token_ids=(EOS,), max_batch=4,
                  max_seq_len=64)
    plain = Engine(target, None, tokenizer=tok, stop_token_ids=(EOS,), max_batch=4, max_seq_len=64)
    # prompts entering the chain at different points, so that its end falls at different columns of a round
    chain = [start]
    for _ in range(4):
        chain.append(int(perm[chain[-1]]))
    prompts = [chain[:k] for k in range(1, 5)]
    params = SamplingParams(max_new_tokens=40, structured_outputs=SO(json=TAU_SCHEMA), **past_the_end)
    reference = [plain.generate([p], params)[0] for p in prompts]
    for ref in reference:                         # the object, then only the EOS
        end = ref.token_ids.index(EOS)
        assert json.loads(tok.decode(ref.token_ids[:end])) == json.loads("".join(CHAIN))
        assert set(ref.token_ids[end:]) == {EOS} and ref.finish_reason == "length"
    for out, ref in zip(spec.generate(prompts, params), reference):
        assert out.token_ids == ref.token_ids


# -- 5. mixed batches ------------------------------------------------------------------------------

MIXED = [
    ([1, 6, 80], SamplingParams(max_new_tokens=24, structured_outputs=CONSTRAINTS["object"])),
    ([1, 6, 81], SamplingParams(max_new_tokens=24)),
    ([1, 6, 82], SamplingParams(max_new_tokens=24, structured_outputs=CONSTRAINTS["regex"])),
    ([1, 6, 83, 90], SamplingParams(max_new_tokens=20, ignore_eos=True)),
    ([1, 6, 84], SamplingParams(max_new_tokens=24, structured_outputs=CONSTRAINTS["choice"])),
    ([1, 6, 85], SamplingParams(max_new_tokens=24, temperature=0.9, seed=11, ignore_eos=True)),
]


def run_staggered(engine: Engine, first: list, later: list, steps_between: int) -> list:
    """Outputs of ``first`` submitted at once, then ``later`` after ``steps_between`` engine steps."""
    outs = {}

    def sink(event):
        if event.finished:
            outs[event.request_id] = event.output

    for i, (prompt, params) in enumerate(first):
        engine.add_request(prompt, params, request_id=f"first-{i}", on_event=sink)
    for _ in range(steps_between):
        engine.step()
    for i, (prompt, params) in enumerate(later):
        engine.add_request(prompt, params, request_id=f"later-{i}", on_event=sink)
    while not engine.idle:
        engine.step()
    return [outs[f"first-{i}"] for i in range(len(first))] + [outs[f"later-{i}"] for i in range(len(later))]


@pytest.mark.parametrize("kind", ["preset-dense", "bigram-dense"])
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_mixed_batches_give_each_request_its_solo_output(kind, speculative):
    """Unconstrained rows of a constrained round draw from their own logits (no mask of another row
    or of the slot's previous request), greedy in the sampling mode the constrained rows bring; the
    round of a batch that gains or loses its constrained requests carries on exactly."""
    engine = engine_pair(kind)[0 if speculative else 1]
    solo = [engine.generate([p], q)[0].token_ids for p, q in MIXED]
    together = engine.generate([p for p, _ in MIXED], [q for _, q in MIXED])
    assert [o.token_ids for o in together] == solo
    constrained = [i for i, (_, q) in enumerate(MIXED) if q.structured_outputs is not None]
    free = [i for i in range(len(MIXED)) if i not in constrained]
    # the unconstrained run pipelined rounds when the constrained join (and the reverse)
    late = run_staggered(engine, [MIXED[i] for i in free], [MIXED[i] for i in constrained], 3)
    assert [o.token_ids for o in late] == [solo[i] for i in free + constrained]
    late = run_staggered(engine, [MIXED[i] for i in constrained], [MIXED[i] for i in free], 2)
    assert [o.token_ids for o in late] == [solo[i] for i in constrained + free]
    assert engine.scheduler.pool.in_use == 0 and engine.idle


# -- 6. errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("constraint, message", [
    (SO(regex="(unclosed"), "unclosed group"),
    (SO(regex="a{5,2}"), "invalid repetition count"),
    (SO(json={"type": "objekt"}), "Invalid type: objekt"),
    (SO(json={"type": "string", "minLength": 5, "maxLength": 2}), "minLength \\(5\\) is greater than maxLength"),
    (SO(json={"$ref": "#/definitions/missing"}), "/definitions/missing"),
    (SO(json='{"type": "object", '), "json is not a JSON schema: Expecting property name"),
    (SO(json={"enum": {1, 2}}), "json is not a JSON schema: Object of type set is not JSON serializable"),
    (SO(grammar="start: foo"), 'unknown name: "foo"'),
    (SO(grammar="this is not lark"), "Expected token ':'"),
    (SO(json={"type": "object"}, regex="a+"),
     "exactly one of json, json_object, regex, choice, grammar; got json, regex"),
    (SO(), "exactly one of .*; got none"),
    (SO(choice=[]), "choice must be a non-empty list"),
    ({"regex": "a+", "typo": 1}, "structured_outputs: .*typo"),
], ids=["bad-regex", "bad-repetition", "bad-type", "unsatisfiable", "missing-ref", "json-text", "json-set",
        "lark-unknown-rule", "lark-syntax", "two-fields", "no-field", "empty-choice", "unknown-field"])
def test_a_constraint_that_cannot_be_used_is_refused_by_name(constraint, message):
    engine = preset_engine("tiny", True)
    good = SamplingParams(max_new_tokens=12, structured_outputs=SO(choice=["yes", "no"]))
    reference = engine.generate([[1, 6, 70]], good)[0]
    with pytest.raises(RequestError, match=message):
        engine.generate([[1, 6, 70], [1, 6, 71]],
                        [good, SamplingParams(max_new_tokens=12, structured_outputs=constraint)])
    assert engine.idle and engine.scheduler.pool.in_use == 0
    again = engine.generate([[1, 6, 70]], good)[0]            # the engine goes on
    assert again.token_ids == reference.token_ids and again.text in ("yes", "no")


def test_a_constraint_without_a_tokenizer_is_refused_by_name():
    engine = Engine(random_tiny_target(seed=3), random_tiny_draft(seed=4), max_batch=2, max_seq_len=64)
    with pytest.raises(RequestError, match="structured_outputs need a tokenizer"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, structured_outputs=SO(regex="a+")))
    assert engine.idle
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].token_ids) == 4

