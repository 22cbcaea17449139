"""capture's staging: |x| copied at hook time, short copies joined (in length order) and counted
together. Every record must equal what the tensor alone gives, whatever sits beside it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampnb
from ampnb.formats import get_format
from ampnb.instruments import coverage_stats as cs
from ampnb.instruments.coverage_stats import exponent_histogram

FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
INF, NAN = math.inf, math.nan


class _Emit(nn.Module):
    """Returns a fixed tensor (the input only orders the calls)."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.t = t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.t.clone()


class _Many(nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(_Emit(t) for t in tensors)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [p(x) for p in self.parts]


def _awkward() -> list[torch.Tensor]:
    """Tensors that catch a wrong offset, a lost sign bit or a mixed-up segment: equal and
    unequal lengths interleaved, empty ones, zeros only, inf/NaN only (negative NaN too),
    subnormals, narrow and wide dtypes, a non-contiguous view."""
    g = torch.Generator().manual_seed(7)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    neg_nan = torch.tensor([-1], dtype=torch.int32).view(torch.float32)  # sign bit set
    return [
        r(64), r(3, 5, scale=1e-3), r(64, scale=1e4), torch.zeros(0), r(64, scale=1e-6),
        torch.zeros(7), torch.tensor([INF, -INF, NAN]), torch.cat([neg_nan, -r(4)]),
        torch.tensor([-0.0, 2.0**-149, -(2.0**-140), 0.0]), r(64).half(), r(5, 7).bfloat16(),
        (r(9, scale=1e3) * torch.tensor([1.0, -1.0] * 4 + [0.0])).double(),
        r(8, 6).t(), torch.tensor(-3.5), r(1000, scale=2.0**-20), r(64, scale=65504.0),
        torch.tensor([NAN, 0.0, -0.0]), r(64, scale=1e-30),
    ]


def _expected(t: torch.Tensor):
    """(counts per format, amax, min |x|>0, histogram) of one tensor on its own, from the
    general path (one bucketize over |x|) and torch's own reductions."""
    if not t.numel():
        return None
    wide = t.detach().reshape(-1)
    wide = wide if wide.dtype in (torch.float32, torch.float64) else wide.float()
    covs, _ = cs.per_segment(cs.bucketize_counts(wide, [wide.numel()], [get_format(f) for f in FORMATS]))[0]
    a = t.detach().double().abs()
    finite = a[a.isfinite()]
    amax = finite.max().item() if finite.numel() else NAN
    nz = finite[finite > 0]
    return ({f: _counts(covs[f]) for f in FORMATS}, amax, nz.min().item() if nz.numel() else NAN,
            tuple(exponent_histogram(t).tolist()))


def _counts(c):
    return (c.count, c.n_overflow, c.n_underflow, c.n_subnormal, c.n_normal, c.n_zero,
            c.n_nonfinite)


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check(record, t: torch.Tensor) -> None:
    assert record.shape == tuple(t.shape) and record.count == t.numel()
    assert record.dtype == str(t.dtype)[6:]
    exp = _expected(t)
    if exp is None:
        assert record.coverages == () and math.isnan(record.amax)
        return
    counts, amax, min_nz, hist = exp
    assert {f: _counts(record.coverage(f)) for f in FORMATS} == counts, record.name
    assert _same_float(record.amax, amax), (record.name, record.amax, amax)
    assert _same_float(record.min_nonzero, min_nz), (record.name, record.min_nonzero, min_nz)
    assert record.histogram == hist, record.name


@pytest.mark.parametrize("keep", [False, True])
def test_every_record_equals_its_tensor_alone(keep):
    tensors = _awkward()
    model = _Many(tensors)
    with ampnb.capture(model, kinds=["activation"], formats=FORMATS, keep=keep) as cap:
        model(torch.zeros(1))
    for i, t in enumerate(tensors):
        s = cap.get(f"parts.{i}", "activation")
        _check(s, t)
        if keep:  # the exact tensor, in its own dtype and shape
            assert s.tensor.dtype == t.dtype and torch.equal(s.tensor.nan_to_num(), t.nan_to_num())
        else:
            assert s.tensor is None


def test_many_small_segments_of_few_lengths_against_the_general_path():
    """Segments of one length side by side are reduced as one matrix: each row must stay its
    own segment, also where one row holds only zeros, only inf/NaN, or a tiny subnormal."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(24):
        n = (5, 5, 5, 9)[i % 4]
        x = torch.randn(n, generator=g) * 10.0 ** (i % 7 - 3)
        if i % 6 == 1:
            x.zero_()
        if i % 6 == 2:
            x[:] = torch.tensor([INF, NAN, -INF, NAN, -NAN, INF, 1.0, NAN, -INF])[:n]
            x[-1] = NAN if i % 12 == 2 else x[-1]
        if i % 6 == 3:
            x[0] = -(2.0**-149)
        rows.append(x)
    order = sorted(range(len(rows)), key=lambda i: rows[i].numel())
    flat = torch.cat([rows[i].abs() for i in order])
    lengths = [rows[i].numel() for i in order]
    fmts = [get_format(f) for f in FORMATS]
    fast = cs.segment_stats(flat, lengths, fmts, absolute=True)
    general = cs.per_segment(cs.bucketize_counts(flat, lengths, fmts))
    assert [h for _, h in fast] == [h for _, h in general]
    for (cf, _), (cg, _) in zip(fast, general):
        for f in cf:
            assert _counts(cf[f]) == _counts(cg[f])
            assert _same_float(cf[f].amax, cg[f].amax)
            assert _same_float(cf[f].min_nonzero, cg[f].min_nonzero)


@pytest.mark.parametrize("cached", [True, False])
def test_short_segments_joined_on_rows_keep_their_own_extremes(monkeypatch, cached):
    """Short segments are joined with zeros up to a whole row each, and reduced row by row: a
    row's result must land in its own segment, whatever sits in the next one. Lengths on
    either side of a row; inf, NaN and the largest value at a segment's first or last
    element; a segment of zeros after one of huge values."""
    from ampnb.instruments import _scratch
    if not cached:  # layouts too long to cache are made for each call
        monkeypatch.setattr(_scratch, "CACHE_LAYOUTS_UP_TO", 0)
    row = _scratch.ROW
    g = torch.Generator().manual_seed(9)
    lengths = [1, row - 1, row, row + 1, 2 * row + 3, 5, row, 3 * row - 1]
    parts = [torch.randn(n, generator=g) * 10.0 ** (i % 5 - 2) for i, n in enumerate(lengths)]
    parts[1][-1] = 2.0**100    # its max in the last element before the padding
    parts[2][0] = INF          # inf first: the finite max comes from the rest
    parts[3][-1] = NAN         # NaN last, in a row of its own
    parts[4][:] = 0.0          # zeros only, after a segment ending in NaN
    parts[5][0] = 2.0**-149    # float32's tiniest value, first
    parts[7][-1] = -(2.0**-140)
    flat = torch.cat(parts).abs()
    fmts = [get_format(f) for f in FORMATS]
    fast = cs.segment_stats(flat, lengths, fmts, absolute=True)
    general = cs.per_segment(cs.bucketize_counts(flat, lengths, fmts))
    assert [h for _, h in fast] == [h for _, h in general]
    for (cf, _), (cg, _), part in zip(fast, general, parts):
        for f in cf:
            assert _counts(cf[f]) == _counts(cg[f])
            assert _same_float(cf[f].amax, cg[f].amax)
            assert _same_float(cf[f].min_nonzero, cg[f].min_nonzero)
        finite = part.abs()[torch.isfinite(part)]
        assert _same_float(cf["fp16"].amax, finite.max().item() if finite.numel() else NAN)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_what_was_seen_is_a_copy_in_every_dtype(dtype):
    """An in-place change after the hook (ReLU(inplace=True)) does not reach the record."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(inplace=True)).to(dtype)
    x = torch.randn(16, 3).to(dtype)
    with ampnb.capture(model, kinds=["activation"], modules="0", keep=True) as cap:
        model(x)
    pre = model[0](x)
    assert (pre < 0).any()
    _check(cap.get("0", "activation"), pre)
    assert torch.equal(cap.get("0", "activation").tensor, pre)


def test_the_same_shapes_captured_twice_give_each_call_its_own_counts():
    """A training loop sees the same segments every step (their offsets are cached): the
    second capture must count its own values."""
    tensors = _awkward()
    model = _Many(tensors)
    for scale in (1.0, 1e3):
        for e, t in zip(model.parts, tensors):
            e.t = t * scale
        with ampnb.capture(model, kinds=["activation"], formats=FORMATS) as cap:
            model(torch.zeros(1))
        for i, e in enumerate(model.parts):
            _check(cap.get(f"parts.{i}", "activation"), e.t)


def test_segments_of_other_lengths_but_the_same_count_and_total():
    """Per-element segment indices are cached by the segments' lengths: [3, 5] then [5, 3]
    (same number, same total) must each be counted by its own lengths."""
    g = torch.Generator().manual_seed(5)
    fmts = [get_format(f) for f in FORMATS]
    for lengths in ([3, 5], [5, 3], [3, 5]):
        flat = (torch.randn(8, generator=g) * torch.tensor([1e-9, 1e3] * 4)).abs()
        fast = cs.segment_stats(flat, lengths, fmts, absolute=True)
        general = cs.per_segment(cs.bucketize_counts(flat, lengths, fmts))
        assert [h for _, h in fast] == [h for _, h in general], lengths
        for (cf, _), (cg, _) in zip(fast, general):
            assert [_counts(c) for c in cf.values()] == [_counts(c) for c in cg.values()]


def test_records_made_in_one_step_have_every_field_of_their_dataclass():
    """Records are built without the dataclasses' __init__ (cost): every field must be set,
    and a Coverage must equal (and hash like) one built the ordinary way."""
    import dataclasses

    model = _Many(_awkward()[:3])
    with ampnb.capture(model, kinds=["activation"], formats=FORMATS) as cap:
        model(torch.zeros(1))
    s = cap.get("parts.0", "activation")
    assert vars(s).keys() == {f.name for f in dataclasses.fields(type(s))}
    c = s.coverage("fp16")
    assert vars(c).keys() == {f.name for f in dataclasses.fields(type(c))}
    plain = type(c)(**vars(c))
    assert plain == c and hash(plain) == hash(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.count = 0


def test_flat_tuple_outputs_are_named_as_the_tree_walker_names_them():
    from ampnb._tree import named_tensors
    from ampnb.instruments.tensor_capture import _float_tensors

    t = torch.ones(2)
    for out in ((t, None, t.int(), t.half()), (t,), (), (t, (t, None)), [t, t], (None, 3, t)):
        expected = [(k, v) for k, v in named_tensors(out) if v.is_floating_point()]
        got = _float_tensors(out)
        assert [k for k, _ in got] == [k for k, _ in expected], out
        assert all(a is b for (_, a), (_, b) in zip(got, expected))


def _two_layers() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)), torch.randn(8, 3)


def test_gradients_are_those_at_the_end_of_their_backward():
    """Gradients are staged together when their backward ends: an in-place change after it
    (clipping, zero_grad(set_to_none=False)) must not reach the records."""
    model, x = _two_layers()
    with ampnb.capture(model, kinds=["gradient"], formats=FORMATS) as cap:
        model(x).pow(2).sum().backward()
        seen = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        model.zero_grad(set_to_none=False)
    for name, g in seen.items():
        _check(cap.get(name, "gradient"), g)


def test_gradients_of_two_backwards_count_twice_and_show_the_sum():
    model, x = _two_layers()
    with ampnb.capture(model, kinds=["gradient"], formats=FORMATS) as cap:
        model(x).sum().backward()
        model(2 * x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        s = cap.get(name, "gradient")
        assert s.calls == 2
        _check(s, p.grad)  # the accumulated gradient, as the last hook saw it


def test_a_backward_that_raises_keeps_the_gradients_it_accumulated():
    """A backward that stops part way never reaches its end: what it accumulated is staged
    when the records are read, and the next backward is recorded as usual."""
    model, x = _two_layers()

    def boom(_):
        raise RuntimeError("stop")

    with ampnb.capture(model, kinds=["gradient"], formats=FORMATS) as cap:
        h = model[1](model[0](x))
        h.register_hook(boom)  # the last layer's gradients come before this hook
        with pytest.raises(RuntimeError, match="stop"):
            model[2](h).sum().backward()
        assert model[0].weight.grad is None
        head = model[2].weight.grad.clone()
        assert {s.name for s in cap.records} == {"2.weight", "2.bias"}
        _check(cap.get("2.weight", "gradient"), head)
        model(x).sum().backward()  # a whole one: staged at its end, before what follows
        seen = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=False)
    for name, g in seen.items():
        s = cap.get(name, "gradient")
        assert s.calls == (2 if name.startswith("2.") else 1)
        _check(s, g)


def test_weights_of_mixed_dtypes_staged_together_equal_each_alone():
    """Weights are staged by one cat per counting dtype: fp16, bf16, fp32 and fp64
    parameters side by side must each give what the parameter alone gives."""
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(4, 5).half(), nn.Linear(5, 3), nn.Linear(3, 3).double(),
                           nn.Linear(3, 2).bfloat16(), nn.LayerNorm(2)])
    with torch.no_grad():
        model[1].weight[0, :3] = torch.tensor([INF, 1e-45, 0.0])
        model[0].weight[0, 0] = 65504.0
    with ampnb.capture(model, kinds=["weight"], formats=FORMATS) as cap:
        pass
    for name, p in model.named_parameters():
        _check(cap.get(name, "weight"), p)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradients_under_activation_checkpointing(reentrant):
    """Reentrant checkpointing runs a backward inside the backward: gradients accumulated in
    either are staged when their own backward ends, and each is recorded once."""
    from torch.utils.checkpoint import checkpoint

    model, x = _two_layers()

    def forward(inp):
        return model[2](checkpoint(lambda t: model[1](model[0](t)), inp,
                                   use_reentrant=reentrant))

    with ampnb.capture(model, kinds=["gradient"], formats=FORMATS) as cap:
        forward(x.requires_grad_()).pow(2).sum().backward()
        seen = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=False)
    for name, g in seen.items():
        s = cap.get(name, "gradient")
        assert s.calls == 1
        _check(s, g)


def test_coverage_objects_are_built_at_the_first_look_and_once(monkeypatch):
    """Reading the records counts every tensor but builds no Coverage; a record's first look
    builds its own (equal to the tensor counted alone), and later looks reuse them."""
    tensors = _awkward()[:6]
    model = _Many(tensors)
    with ampnb.capture(model, kinds=["activation"], formats=FORMATS) as cap:
        model(torch.zeros(1))
    built = []
    real = cs._coverage
    monkeypatch.setattr(cs, "_coverage", lambda *a: built.append(a[0]) or real(*a))
    records = cap.records
    assert len(records) >= len(tensors) and built == []
    s = cap.get("parts.2", "activation")
    first = s.coverages
    assert len(built) == len(FORMATS) and s.coverages is first
    assert s.coverage("bf16") is first[1] and len(built) == len(FORMATS)
    _check(s, tensors[2])
