"""Prefill at bucket shapes (graphs/prefill.py), on CPU: the bucket list, the choice of a bucket,
and that padding a chunk to its bucket (padding rows with slot -1, padding columns past each
row's length) computes what the chunk at its own shape computes: the same caches, draft context,
slot state and tokens. The graphs themselves are tested on the GPU (tests/graphs/test_prefill_graphs_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import assert_no_page_leaked
from lfmspark.graphs.prefill import PrefillRunner, bucket_widths, prefill_buckets
from lfmspark.runtime import Engine, SamplingParams


@pytest.mark.parametrize("max_width", [1, 8, 16, 17, 100, 256, 1000, 1024, 2048])
def test_bucket_widths_end_at_the_limit_and_pad_by_at_most_half_past_256(max_width):
    widths = bucket_widths(max_width)
    assert widths == sorted(set(widths)) and widths[-1] == max_width
    assert widths[0] == min(16, max_width)
    for a, b in zip(widths, widths[1:]):
        assert b <= 2 * a                      # a chunk at most doubles
        if a >= 256:
            assert b * 2 <= a * 3              # past 256 (compute-bound widths) by at most half


@pytest.mark.parametrize("max_batch,max_width,budget", [(1, 2048, 1024), (8, 2048, 1024), (3, 64, 1024),
                                                        (16, 512, 4096), (5, 2048, 100)])
def test_buckets_stay_in_the_token_budget_and_cover_every_row_count(max_batch, max_width, budget):
    buckets = prefill_buckets(max_batch, max_width, budget)
    assert all(r * w <= budget and w <= max_width for r, w in buckets)
    row_counts = {r for r, _ in buckets}
    assert max_batch in row_counts and 1 in row_counts
    # any batch of up to max_batch rows has a bucket at the narrowest width
    assert all(any(r >= rows for r in row_counts) for rows in range(1, max_batch + 1))
    assert prefill_buckets(max_batch, max_width, 0) == []


def test_the_runner_picks_the_smallest_bucket_whose_padding_stays_in_the_cache():
    runner = PrefillRunner(lambda *a: None, torch.device("cpu"), prefill_buckets(4, 512, 1024), max_seq_len=300)
    assert runner.bucket(1, 1, 0) == (1, 16)
    assert runner.bucket(1, 17, 0) == (1, 32)
    assert runner.bucket(3, 100, 0) == (4, 128)
    assert runner.bucket(2, 129, 0) == (2, 256)
    assert runner.bucket(1, 257, 0) is None             # (1, 384) would write past position 300
    assert runner.bucket(1, 40, 250) is None           # (1, 64) would too
    assert runner.bucket(1, 40, 200) == (1, 64)
    assert runner.bucket(4, 257, 0) is None             # over the token budget: its own shape


def _engine(tokens: int, max_batch: int = 4, prefill_chunk: int = 2048) -> Engine:
    return Engine.from_preset("tiny", "default", dtype=torch.float32, device="cpu", max_batch=max_batch,
                              max_seq_len=160, prefill_graph_tokens=tokens, prefill_chunk=prefill_chunk)


def _state(engine: Engine) -> dict[str, torch.Tensor]:
    tc, dc, st = engine.model_runner.tcache, engine.model_runner.dcache, engine.model_runner.state
    # the KV pages without the trash page (the writes of rounds that finished requests ride along in)
    return {"k": tc.k[:, :-1], "v": tc.v[:, :-1], "conv": tc.conv_state, "dk": dc.k[:, :-1], "dv": dc.v[:, :-1],
            "seq_len": st.seq_len, "anchor": st.anchor}


@pytest.mark.parametrize("prefill_chunk", [2048, 24])
def test_bucketed_prefill_computes_what_the_exact_shape_computes(prefill_chunk):
    """Three ragged prompts: the bucketed engine pads them to 4 x 64 (a padding row, padding columns;
    in 24-token chunks 4 x 24 then 2 x 24), the other runs them at 3 x 45 (3 x 24, 2 x 21). Same
    caches, draft context and slot state, same untouched slot, same tokens."""
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((45, 3, 30))]
    params = SamplingParams(max_new_tokens=6)
    bucketed, exact = _engine(1024, prefill_chunk=prefill_chunk), _engine(0, prefill_chunk=prefill_chunk)
    shapes = []
    bucketed.model_runner.prefill_runner.forward = lambda *a, f=bucketed.model_runner.prefill_runner.forward: shapes.append(a[0].shape) or f(*a)
    out_b = bucketed.generate(prompts, params)
    out_e = exact.generate(prompts, params)
    assert [o.token_ids for o in out_b] == [o.token_ids for o in out_e]
    # padded: a row and columns (chunked: widths end at the chunk, 24; the second chunk has two rows left)
    assert shapes == ([(4, 64)] if prefill_chunk == 2048 else [(4, 24), (2, 24)])
    sb, se = _state(bucketed), _state(exact)
    for name in sb:
        torch.testing.assert_close(sb[name], se[name], rtol=1e-5, atol=1e-5, msg=name)
    assert sb["seq_len"][3] == 0 and not sb["conv"][:, 3].any()   # the free slot
    for engine in (bucketed, exact):                  # every page back in the pool but the prefix cache's
        assert_no_page_leaked(engine)


def test_a_prompt_no_bucket_holds_runs_at_its_own_shape():
    engine = _engine(64)                              # buckets up to 64 tokens
    shapes = []
    engine.model_runner.prefill_runner.forward = lambda *a, f=engine.model_runner.prefill_runner.forward: shapes.append(a[0].shape) or f(*a)
    engine.generate([[5] * 70, [6] * 20], SamplingParams(max_new_tokens=2))
    assert shapes == [(2, 70)]


def test_bad_prefill_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="prefill_graph_tokens must be >= 0"):
        _engine(-1)
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        _engine(1024, prefill_chunk=0)


@pytest.mark.parametrize("shape", [(1, 16), (1, 17), (3, 75), (4, 128), (5, 1000), (7, 33)])
def test_packed_chunk_inputs_are_16_byte_aligned_views_that_round_trip(shape):
    """Triton specializes kernels on 16-byte pointer alignment: a misaligned ``start`` would compile
    a variant the warm-up has not. Every input view starts on 16 bytes, is
    contiguous, and holds what was packed (padding rows: slot -1, length 0; padding tokens 0)."""
    R, W = shape
    chunks = [[r * 10 + t + 1 for t in range(W - r)] for r in range(R - 1)]
    flat = PrefillRunner._pack(chunks, list(range(R - 1)), [37] * (R - 1), shape)
    ids, slots, start, lens = PrefillRunner._unpack(flat, shape)
    for t in (ids, slots, start, lens):
        assert t.is_contiguous() and t.storage_offset() * t.element_size() % 16 == 0
    assert ids.shape == shape and slots.shape == start.shape == lens.shape == (R,)
    assert slots.tolist() == list(range(R - 1)) + [-1] and start.tolist() == [37] * (R - 1) + [0]
    assert lens.tolist() == [W - r for r in range(R - 1)] + [0]
    for r, chunk in enumerate(chunks):
        assert ids[r].tolist() == chunk + [0] * r
    assert not ids[R - 1].any()


@pytest.mark.parametrize("shape", [(1, 16), (3, 75), (4, 128)])
def test_warmup_inputs_are_all_padding_rows_over_every_column(shape):
    """What the bucket warm-up runs and captures (graphs/prefill.py): every row a padding row (slot
    -1, so no state changes) over all W columns, in the same aligned layout as a real chunk."""
    R, W = shape
    runner = PrefillRunner(lambda *a: None, torch.device("cpu"), [shape], max_seq_len=1024)
    flat, (ids, slots, start, lens) = runner.padding_inputs(shape)
    assert flat.shape == PrefillRunner._pack([[1]], [0], [0], shape).shape
    assert ids.shape == shape and not ids.any()
    assert slots.tolist() == [-1] * R and start.tolist() == [0] * R and lens.tolist() == [W] * R
    for t in (ids, slots, start, lens):
        assert t.storage_offset() * t.element_size() % 16 == 0
