"""The CPU kernels (models/csrc) against torch's own ops, and the packed linear's promise:
a row's output does not depend on the batch it was computed in."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import kernels
from models.layers import RMSNorm, RotaryEmbedding


@pytest.mark.parametrize("n,k", [(768, 256), (100, 70), (17, 5), (4096, 32)])
def test_packed_linear_equals_torch(ops, n, k):
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = ops.pack_linear_weight(w)
    # every tile height (4 rows, then 5-8 rows x 2 panels with AVX-512; 6 rows without) and remainders
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 33):
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(ops.packed_linear(x, packed, n), F.linear(x, w), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ops.packed_linear(x, packed, n, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_packed_linear_is_batch_invariant(ops):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 256, generator=g)
    packed, x = ops.pack_linear_weight(w), torch.randn(37, 256, generator=g)
    full = ops.packed_linear(x, packed, 300)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 11), slice(30, 37), slice(0, 5), slice(2, 10), slice(8, 21)):
        assert torch.equal(ops.packed_linear(x[rows].contiguous(), packed, 300), full[rows])


def test_linear_packs_once_and_repacks_new_weights(ops):
    layer = torch.nn.Linear(64, 48, bias=False).requires_grad_(False)
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(kernels.linear(layer, x, layer.weight), layer(x), rtol=1e-5, atol=1e-5)
        first = layer.__dict__["_packed"][1]
        kernels.linear(layer, x, layer.weight)
        assert layer.__dict__["_packed"][1] is first
        layer.weight = torch.nn.Parameter(torch.randn(48, 64), requires_grad=False)  # a new tensor: packed again
        torch.testing.assert_close(kernels.linear(layer, x, layer.weight), layer(x), rtol=1e-5, atol=1e-5)


def test_linear_with_autograd_takes_torch(ops):
    w = torch.randn(8, 4, requires_grad=True)
    y = kernels.linear(torch.nn.Module(), torch.randn(2, 4), w)
    y.sum().backward()
    assert w.grad is not None


def test_rms_norm(ops):
    x, w = torch.randn(9, 256), torch.randn(256)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (256,), w, 1e-5), rtol=1e-5, atol=1e-5)
    strided = torch.randn(9, 512)[:, :256]  # rows need not be packed together
    torch.testing.assert_close(ops.rms_norm(strided, w, 1e-5), F.rms_norm(strided, (256,), w, 1e-5))


@pytest.mark.parametrize("kernels_on", [True, False])
def test_rms_norm_into_given_rows(ops, monkeypatch, kernels_on):
    """RMSNorm with `out` (the MTP's hidden log): the same values, returned as a tensor of their
    own and also written into exactly the rows asked for (the kernels' streamed stores, or a
    copy); rows past the end are refused."""
    if not kernels_on:
        monkeypatch.setattr(kernels, "ops_for", lambda *t: None)
    norm = RMSNorm(256, 1e-5)
    norm.weight.data.copy_(torch.randn(256))
    x, rows = torch.randn(9, 256), torch.zeros(20, 256)
    y = norm(x, (rows, 5))
    torch.testing.assert_close(y, F.rms_norm(x, (256,), norm.weight, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(rows[5:14], y) and not rows[:5].any() and not rows[14:].any()
    odd = torch.zeros(20, 256)[:, :255].contiguous()  # rows of 255 floats: no streamed stores, a plain copy
    y = norm.__class__(255, 1e-5)(x[:, :255], (odd, 3))
    assert torch.equal(odd[3:12], y) and not odd[:3].any() and not odd[12:].any()
    with pytest.raises((RuntimeError, ValueError)):
        norm(x, (rows, 12))


def test_rotary_in_place_matches_torch(ops, monkeypatch):
    rope = RotaryEmbedding(32, 128, 10000.0)
    qkv = torch.randn(6, 24, 32)  # 16 query, 4 key and 4 value heads
    positions = torch.tensor([0, 1, 5, 9, 100, 127])
    with torch.no_grad():
        monkeypatch.setitem(kernels._state, "ops", None)
        expected = rope(positions, qkv[:, :20].clone())
        monkeypatch.setitem(kernels._state, "ops", ops)
        values = qkv[:, 20:].clone()
        out = rope(positions, qkv[:, :20])
    assert out.data_ptr() == qkv.data_ptr()  # rotated where it lies
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 20:], values)  # the value heads beside them untouched


def test_silu_mul(ops):
    gate_up = torch.randn(7, 2 * 96) * 20  # far into both tails of the sigmoid
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [4096, 1000, 17])
def test_draft_top2_matches_softmax_and_topk(ops, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g) * 4
    logits[1, -1] = 50.0  # the maximum in the tail past the last full vector
    logits[2, 3] = logits[2, vocab - 1] = 60.0  # equal maxima: the first wins, the margin is 0
    logits[3, :vocab // 2] = float("-inf")  # masked entries
    logits[4] = 0.0  # every entry equal
    tokens, top, margin = torch.full((9,), -1), torch.zeros(9, dtype=torch.float64), torch.zeros(9, dtype=torch.float64)
    ops.draft_top2(logits, tokens, top, margin)
    q = torch.softmax(logits.double(), dim=-1)
    two = q.topk(2, dim=-1).values
    assert tokens.tolist() == [int(torch.nonzero(row == row.max())[0]) for row in logits]
    torch.testing.assert_close(top, two[:, 0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(margin, two[:, 0] - two[:, 1], rtol=1e-6, atol=1e-9)
    assert margin[2] == 0.0 and tokens[2] == 3
    again = torch.empty(9, dtype=torch.float64)
    ops.draft_top2(logits[[0]], tokens[:1], again[:1], again[1:2])
    assert again[0] == top[0] and again[1] == margin[0]  # a row's answer does not depend on the batch


@pytest.mark.parametrize("kernel", [True, False])
def test_draft_top2_at_writes_a_draft_position_of_the_loops_buffers(ops, kernel, monkeypatch):
    """draft_top2_at(logits, tokens, inputs, j): draft_top2's tokens, top probabilities and margins
    into row j of (budget, n) tokens and (3, budget, n) inputs, the drafted token's probability set
    to the top one, nothing else touched; into contiguous buffers and into a strided slab's rows
    (SpecPolicy.draft_slab's); by the kernel and by the torch path alike."""
    from workers import sampler

    if not kernel:
        monkeypatch.setattr(sampler, "_row_kernels", lambda logits: None)
    n, budget, vocab = 3, 4, 1000
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(2)) * 4
    want_tokens, want_top, want_margin = torch.full((n,), -1), torch.zeros(n, dtype=torch.float64), \
        torch.zeros(n, dtype=torch.float64)
    sampler.draft_top2(logits, want_tokens, want_top, want_margin)  # the same path's draft_top2
    slab = torch.from_numpy(np.full((3, 20, n), -1.0))
    for inputs in (torch.full((3, budget, n), -1.0, dtype=torch.float64), slab[:, 5:5 + budget]):
        tokens = torch.full((budget, n), -1)
        sampler.draft_top2_at(logits, tokens, inputs, 2)
        assert tokens[2].tolist() == want_tokens.tolist() and (tokens[[0, 1, 3]] == -1).all()
        assert inputs[0, 2].tolist() == want_top.tolist() == inputs[2, 2].tolist()
        assert inputs[1, 2].tolist() == want_margin.tolist()
        assert (inputs[:, [0, 1, 3]] == -1).all()
    assert (slab[:, :7] == -1).all() and (slab[:, 8:] == -1).all()  # the slab's other rows untouched
    if kernel:
        with pytest.raises(RuntimeError, match="no draft position"):
            ops.draft_top2_at(logits, tokens, inputs, budget)
        with pytest.raises(RuntimeError, match="float64"):
            ops.draft_top2_at(logits, tokens, inputs.float(), 0)


def test_draft_top2_gives_no_confidence_to_a_row_that_is_no_distribution(ops, monkeypatch):
    """NaN or infinite logits (a draft that overflowed): top and margin 0, from the kernel and
    from the torch path alike, a valid token index, and the other rows untouched."""
    from workers import sampler

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5))
    logits[0, 3] = float("nan")
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    answers = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(sampler, "_row_kernels", lambda logits: None)  # the torch path
        tokens, top, margin = torch.full((4,), -1), torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
        sampler.draft_top2(logits, tokens, top, margin)
        assert top[:3].tolist() == [0.0] * 3 and margin[:3].tolist() == [0.0] * 3
        assert 0 < top[3] < 1 and all(0 <= t < 100 for t in tokens.tolist())
        answers.append(float(top[3]))
    assert answers[0] == pytest.approx(answers[1], rel=1e-6)


def test_argmax_rows_takes_the_first_of_equal_maxima(ops):
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = logits[1, 998] = 40.0  # equal maxima, the second in the tail
    logits[2, 999] = 40.0  # the last column
    logits[3] = 1.0  # all equal
    assert ops.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist() == [
        int(torch.nonzero(row == row.max())[0]) for row in logits]


def _attention_reference(q, k_cache, v_cache, tables, q_seq, q_pos, scale):
    """paged_attention in torch: token t attends to its sequence's positions 0..q_pos[t]."""
    nh, nkv, bs = q.shape[1], k_cache.shape[1], k_cache.shape[3]
    out = torch.empty_like(q)
    for t in range(len(q)):
        n = int(q_pos[t]) + 1
        blocks = tables[q_seq[t], :(n + bs - 1) // bs]
        keys = k_cache[blocks].permute(1, 0, 3, 2).reshape(nkv, -1, q.shape[2])[:, :n]  # (nkv, n, hd)
        values = v_cache[blocks].permute(1, 0, 2, 3).reshape(nkv, -1, q.shape[2])[:, :n]
        keys, values = keys.repeat_interleave(nh // nkv, 0), values.repeat_interleave(nh // nkv, 0)
        weights = torch.softmax(torch.einsum("hd,hnd->hn", q[t].double(), keys.double()) * scale, dim=-1)
        out[t] = torch.einsum("hn,hnd->hd", weights, values.double()).float()
    return out


# block size, head dim, query heads per KV head: the specialised kernels (attend_item16: the first four;
# attend_item<16, hd, 0>: the next two) and the generic one
@pytest.mark.parametrize("bs,hd,group", [(16, 32, 4), (16, 64, 4), (16, 128, 4), (16, 128, 8), (16, 64, 2),
                                         (16, 128, 2), (8, 32, 4), (16, 48, 3)])
def test_paged_attention_equals_torch(ops, bs, hd, group):
    g = torch.Generator().manual_seed(hd * group + bs)
    nkv, blocks, width = 2, 12, 6
    k_cache, v_cache = torch.randn(blocks, nkv, hd, bs, generator=g), torch.randn(blocks, nkv, bs, hd, generator=g)
    tables = torch.randperm(blocks, generator=g).view(2, width)  # blocks out of order
    q = torch.randn(9, nkv * group, hd, generator=g)
    q_seq = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1])
    # positions that end in partial and in full blocks
    q_pos = torch.tensor([0, 1, bs - 1, bs, 2 * bs + 3, width * bs - 1, 5 * bs + 1, 7, 3 * bs])
    got = ops.paged_attention(q, k_cache, v_cache, tables, q_seq, q_pos, hd ** -0.5)
    torch.testing.assert_close(got, _attention_reference(q, k_cache, v_cache, tables, q_seq, q_pos, hd ** -0.5),
                               rtol=1e-5, atol=1e-5)


def _attention_inputs(tokens: int, g: torch.Generator):
    nkv, hd, blocks, bs = 4, 32, 8, 16
    k_cache, v_cache = torch.randn(blocks, nkv, hd, bs, generator=g), torch.randn(blocks, nkv, bs, hd, generator=g)
    tables = torch.arange(blocks, dtype=torch.int64).view(2, 4)
    q = torch.randn(tokens, 16, hd, generator=g)
    q_seq = torch.arange(tokens, dtype=torch.int64) % 2
    q_pos = torch.randint(0, 4 * bs, (tokens,), generator=g)
    return q, k_cache, v_cache, tables, q_seq, q_pos


def test_thread_pool_results_do_not_depend_on_threads_or_caller(ops):
    """The kernels' pool (models/csrc/thread_pool.cpp) splits work that any thread may take:
    the same bits from 1 or 2 threads, from the main thread or another one."""
    import threading

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(768, 256, generator=g), torch.randn(32, 256, generator=g)
    packed, att = ops.pack_linear_weight(w), _attention_inputs(24, g)
    run = lambda: (ops.packed_linear(x, packed, 768), ops.paged_attention(*att, 0.17),  # noqa: E731
                   ops.rms_norm(x, w[0], 1e-6))
    before = ops.get_num_threads()
    try:
        ops.set_num_threads(2)
        main = run()
        elsewhere = []
        t = threading.Thread(target=lambda: elsewhere.extend(run()))
        t.start(), t.join()
        ops.set_num_threads(1)
        single = run()
    finally:
        ops.set_num_threads(before)
    for a, b, c in zip(main, elsewhere, single):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_thread_pool_survives_back_to_back_jobs(ops):
    """Many small jobs in a row, of alternating chunk counts, with more threads than cores
    (so any thread may be descheduled anywhere): every result complete and right. (A race
    where a late worker took a chunk of the next job once crashed the served engine; it
    needs a preemption within nanoseconds, which this does not reliably reproduce.)"""
    import threading

    g = torch.Generator().manual_seed(4)
    shapes = [(768, 256), (4096, 64), (100, 256)]
    weights = [torch.randn(n, k, generator=g) for n, k in shapes]
    packed = [ops.pack_linear_weight(w) for w in weights]
    xs = [torch.randn(1, k, generator=g) for _, k in shapes]
    expected = [ops.packed_linear(x, p, w.shape[0]) for x, p, w in zip(xs, packed, weights)]
    wrong = []

    def hammer():
        for i in range(20000):
            j = i % 3
            if not torch.equal(ops.packed_linear(xs[j], packed[j], weights[j].shape[0]), expected[j]):
                wrong.append(i)

    before = ops.get_num_threads()
    try:
        ops.set_num_threads(2)
        others = [threading.Thread(target=hammer) for _ in range(3)]
        for t in others:
            t.start()
        hammer()
        for t in others:
            t.join()
    finally:
        ops.set_num_threads(before)
    assert not wrong


def test_thread_pool_passes_a_kernels_error_on(ops):
    """An error raised inside a pool job (here a position past the block table) reaches the caller."""
    q, k_cache, v_cache, tables, q_seq, q_pos = _attention_inputs(24, torch.Generator().manual_seed(2))
    q_pos[17] = 200
    with pytest.raises(RuntimeError, match="past the sequence's block table"):
        ops.paged_attention(q, k_cache, v_cache, tables, q_seq, q_pos, 0.17)
    q_pos[17] = 3  # the pool still works afterwards
    assert ops.paged_attention(q, k_cache, v_cache, tables, q_seq, q_pos, 0.17).isfinite().all()


def test_thread_pool_works_in_a_forked_child(ops):
    """A forked child has none of its parent's pool threads: it starts its own."""
    import os

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(300, 256, generator=g), torch.randn(40, 256, generator=g)
    packed = ops.pack_linear_weight(w)
    expected = ops.packed_linear(x, packed, 300)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send the bytes, leave without running pytest's teardown
        try:
            os.write(write_end, ops.packed_linear(x, packed, 300).numpy().tobytes())
        finally:
            os._exit(0)
    os.close(write_end)
    got = b""
    with os.fdopen(read_end, "rb") as f:
        while chunk := f.read():
            got += chunk
    os.waitpid(pid, 0)
    assert got == expected.numpy().tobytes()


def test_module_calls_forward_directly_but_honours_hooks_on_the_instance():
    from models.module import Module

    class Double(Module):
        def forward(self, x):
            return 2 * x

    m, one = Double(), torch.ones(1)
    assert m(one).item() == 2
    seen = []
    hook = m.register_forward_hook(lambda mod, args, out: seen.append(out.item()))
    pre = m.register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    assert m(one).item() == 6 and seen == [6.0]
    hook.remove()
    pre.remove()
    assert m(one).item() == 2 and seen == [6.0]


def test_module_keeps_what_it_reads_until_it_is_assigned_or_converted():
    """Module keeps a read submodule or parameter in its __dict__: an assignment, a deletion
    or a conversion that replaces parameters (here: on conversion, new Parameter objects)
    must never leave the old one visible."""
    from torch import nn

    from models.module import Module

    class M(Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.w = nn.Parameter(torch.ones(2))

    m = M()
    assert m.w is m._parameters["w"] and "w" in m.__dict__ and m.lin is m._modules["lin"]
    m.w = nn.Parameter(torch.full((2,), 3.0))
    assert m.w is m._parameters["w"] and float(m.w.detach().sum()) == 6
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        old = m.w
        m.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)
    assert m.w is not old and m.w is m._parameters["w"] and m.w.dtype == torch.float64
    m.w = None
    assert m.w is None
    del m.w
    assert not hasattr(m, "w")
    m.lin = nn.Linear(3, 3)
    assert m.lin.in_features == 3 and sorted(m.state_dict()) == ["lin.bias", "lin.weight"]


def test_attention_batch_from_python_equals_the_numpy_build():
    """AttnBatch.build does a few tokens' index arithmetic in plain Python and longer batches in
    numpy: the same tensors either way, and the same error for a position past every table."""
    import numpy as np

    from models.attention import PYTHON_TOKENS, AttnBatch

    rng = np.random.default_rng(0)
    fields = ("positions", "slots", "q_seq", "q_col", "tables", "last_index")
    checked = 0
    for _ in range(500):
        n = int(rng.integers(1, 6))
        lens = [int(x) for x in rng.integers(1, 4, n)]  # at most 15 tokens: the Python path
        starts = [int(x) for x in rng.integers(0, 100, n)]
        tables = [[int(x) for x in rng.integers(0, 50, max((s + q) // 16 + 1 - int(rng.integers(0, 2)), 1))]
                  for s, q in zip(starts, lens)]
        assert sum(lens) <= PYTHON_TOKENS
        try:
            want = AttnBatch._build_numpy(starts, lens, tables, 16, "cpu")
        except IndexError:
            with pytest.raises(IndexError):
                AttnBatch.build(starts, lens, tables, 16)
            continue
        got = AttnBatch.build(starts, lens, tables, 16)
        for f in fields:
            assert torch.equal(getattr(got, f), getattr(want, f)) and getattr(got, f).dtype == torch.int64, f
        assert (got.starts, got.lens, got.short) == (want.starts, want.lens, want.short)
        checked += 1
    assert checked > 200


def test_speed_check_warns_when_the_packed_kernel_is_slow(caplog):
    """Loading the kernels times the packed linear against torch's and warns where it is
    several times slower (a compiler once made it 10x slower with nothing else to show it)."""
    import time

    class Ops:
        def __init__(self, delay_s):
            self.delay_s = delay_s

        def pack_linear_weight(self, w):
            return w

        def get_num_threads(self):
            return 2

        def set_num_threads(self, n):
            self.threads = n

        def packed_linear(self, x, packed, n, bias):
            if self.delay_s:  # time.sleep(0) gives up the CPU: on a busy machine the "fast" kernel waited ms for it
                time.sleep(self.delay_s)
            return torch.zeros(x.shape[0], n)

    before = torch.get_num_threads()
    with caplog.at_level("WARNING", logger="adaspec.kernels"):
        fast = Ops(0.0)
        assert kernels.speed_check(fast) < kernels.SLOW_VS_TORCH
    assert not caplog.records and fast.threads == 2 and torch.get_num_threads() == before  # both put back
    with caplog.at_level("WARNING", logger="adaspec.kernels"):
        assert kernels.speed_check(Ops(0.05)) > kernels.SLOW_VS_TORCH
    assert "slower than torch" in caplog.text


def test_bfloat16_panels_compute_in_float32_from_rounded_weights(ops):
    """Weights packed as bfloat16 (a draft's, speculative.draft_weights): the product of the
    rounded weights, accumulated in float32, batch-invariant like the float32 panels."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(300, 256, generator=g), torch.randn(300, generator=g)
    packed = ops.pack_linear_weight(w.to(torch.bfloat16))
    assert packed.dtype == torch.bfloat16
    x = torch.randn(37, 256, generator=g)
    full = ops.packed_linear(x, packed, 300, b)
    torch.testing.assert_close(full, F.linear(x, w.to(torch.bfloat16).float(), b), rtol=1e-4, atol=1e-4)
    assert (full - F.linear(x, w, b)).abs().max() > 1e-3  # the rounding is there
    for rows in (slice(0, 1), slice(3, 11), slice(30, 37), slice(0, 6), slice(9, 17)):
        assert torch.equal(ops.packed_linear(x[rows].contiguous(), packed, 300, b), full[rows])
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8"):
        ops.pack_linear_weight(w.half())


@pytest.mark.parametrize("n,k", [(300, 256), (17, 5), (4096, 32)])
def test_int8_panels_compute_in_float32_from_the_quantised_weights(ops, n, k):
    """Weights packed as int8 (speculative.draft_weights=int8): each output is its row's scale
    times the product with the quantised weights, plus the bias, for every tile height, and
    batch-invariant like the other panels."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    w[1] = 0.0  # a row of zeros: scale 1, all zero
    q, scale = kernels.quantise_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert (w - q.float() * scale[:, None]).abs().max() <= scale.max() / 2 + 1e-6  # rounded to the nearest step
    packed, padded = kernels.pack(ops, w, torch.int8)
    assert packed.dtype == torch.int8 and len(padded) % 16 == 0
    x = torch.randn(37, k, generator=g)
    full = ops.packed_linear(x, packed, n, b, padded)
    torch.testing.assert_close(full, F.linear(x, q.float() * scale[:, None], b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ops.packed_linear(x, packed, n, None, padded), F.linear(x, q.float() * scale[:, None]),
                               rtol=1e-4, atol=1e-4)
    for rows in (slice(0, 1), slice(3, 11), slice(30, 37), slice(0, 4), slice(0, 6), slice(9, 17), slice(2, 14)):
        assert torch.equal(ops.packed_linear(x[rows].contiguous(), packed, n, b, padded), full[rows])
    with pytest.raises(RuntimeError, match="need their scales"):
        ops.packed_linear(x, packed, n, b)
    with pytest.raises(RuntimeError, match="only with int8"):
        ops.packed_linear(x, ops.pack_linear_weight(w), n, b, padded)


def test_pack_weights_as_moves_a_module_to_bfloat16_panels(ops):
    """kernels.pack_weights_as: the module's linear layers pack their (unchanged) float32
    weights as bfloat16 from then on, and back."""
    from models.parallel import ReplicatedLinear

    layer = ReplicatedLinear(64, 48)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 64)
    with torch.no_grad():
        exact = layer(x)
        kernels.pack_weights_as(layer, torch.bfloat16)
        rounded = layer(x)
        assert layer.weight.dtype == torch.float32
        torch.testing.assert_close(rounded, F.linear(x, layer.weight.to(torch.bfloat16).float()), rtol=1e-4, atol=1e-4)
        assert not torch.equal(rounded, exact)
        kernels.pack_weights_as(layer, torch.float32)
        assert torch.equal(layer(x), exact)
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        kernels.pack_weights_as(layer, torch.float16)
    with torch.no_grad():  # int8: the rows' quantised weights, scaled
        kernels.pack_weights_as(layer, torch.int8)
        q, scale = kernels.quantise_rows(layer.weight)
        torch.testing.assert_close(layer(x), F.linear(x, q.float() * scale[:, None]), rtol=1e-4, atol=1e-4)
        assert layer.weight.dtype == torch.float32
