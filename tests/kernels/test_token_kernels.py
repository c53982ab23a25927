"""The fused token-layout kernels (`freqact_token_encode`/`_decode` in cpu_division.c, called by
`engine.layouts.TokenLayout` on the CPU) against the torch two-kernel path that specifies them:
byte for byte on dyadic data, every layout, odd shapes and tails, any memory layout, edge values;
their own noise is the quant kernel's stream on the stats view."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import freqact.kernels as K
from freqact import codecs
from freqact.engine.layouts import BLOCKS, STATS, TokenLayout
from freqact.kernels import cpu
from tests.kernels.helpers import (
    assert_same_bytes,
    at_thread_counts,
    bytes_of,
    dyadic,
    stream_uniforms,
)

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason=f"C kernels unavailable: {cpu.unavailable_reason()}")

LAYOUTS = [(b, s) for b in BLOCKS for s in STATS]
# Tails everywhere: T and F not multiples of 8 or 64, fewer than 8 tokens or features, a class
# token before a square grid (1 + 6 * 6), (N, H, W, C) grids with edge blocks and H, W < 8, and
# maps of exactly 16 tokens (one step of the 16-lane quantise loop, no tail: Swin's windows).
SHAPES = [(3, 65, 24), (2, 130, 13), (2, 7, 5), (1, 1, 1), (2, 37, 20), (2, 6, 5, 16),
          (2, 17, 13, 9), (1, 3, 20, 8), (4, 16, 32)]


def _pair(blocks, stats, bits=2):
    """(torch path, fused path) codecs of one layout."""
    return tuple(TokenLayout(codecs.get("division", block=8, bits=bits, backend=b), blocks, stats)
                 for b in ("torch", "cpu"))


def _assert_same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype and a.nbytes == b.nbytes
    assert a.lfc.shape == b.lfc.shape and a.lfc.block == b.lfc.block
    assert torch.equal(bytes_of(a.lfc.lfc), bytes_of(b.lfc.lfc))
    assert a.quant.shape == b.quant.shape
    assert_same_bytes(a.quant, b.quant, ("lo", "step", "codes"))
    assert (a.head is None) == (b.head is None)
    if a.head is not None:  # the class token: its own `division` map, drawing its own noise
        assert_same_bytes(a.head, b.head, ("lfc", "lo", "step"))


def _layouts_of(x):
    """x in its memory layout and three others with the same values: transposed storage (ViT's
    `flatten(2).transpose(1, 2)`), every dim reversed, and a strided slice."""
    wide = torch.stack([x, -x], dim=-1)[..., 0]
    return [x, x.transpose(1, -1).contiguous().transpose(1, -1),
            x.permute(*reversed(range(x.dim()))).contiguous().permute(*reversed(range(x.dim()))),
            wide]


def _noise(fused, shape, gen):
    geom = fused._geometry(shape)[0]
    return torch.rand(geom.quant_shape, generator=gen)


@pytest.mark.parametrize(("blocks", "stats"), LAYOUTS)
def test_fused_bytes_and_decode_equal_the_torch_path(blocks, stats):
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        ref, fused = _pair(blocks, stats)
        x = dyadic(shape, torch.float32, gen)
        noise = _noise(fused, shape, gen)
        want = ref.encode(x, noise)
        for view in _layouts_of(x):
            got = fused.encode(view, noise)
            _assert_same(got, want)
            for packed in (got, want):
                y = fused.decode(packed)
                assert torch.equal(y, ref.decode(packed))
                assert y.is_contiguous() and y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_other_dtypes_and_bits_equal_the_torch_path(dtype, bits):
    gen = torch.Generator().manual_seed(1)
    for blocks, stats in LAYOUTS:
        ref, fused = _pair(blocks, stats, bits)
        x = dyadic((2, 37, 12), dtype, gen)
        noise = _noise(fused, tuple(x.shape), gen)
        got, want = fused.encode(x, noise), ref.encode(x, noise)
        _assert_same(got, want)
        y = fused.decode(got)
        assert y.dtype == dtype and torch.equal(y, ref.decode(got))


def test_edge_values_equal_the_torch_path():
    """Block sums that overflow, residuals and spans past FLT_MAX, decoded sums redone at a
    quarter scale: the same bytes; NaN/Inf: the same NaNs where the format says (their code
    bytes and NaN sign bits are unspecified), finite elsewhere."""
    gen = torch.Generator().manual_seed(2)
    for blocks, stats in LAYOUTS:
        ref, fused = _pair(blocks, stats)
        x = dyadic((2, 65, 24), torch.float32, gen) * 2.0**125  # up to ~1e38: sums overflow
        noise = _noise(fused, tuple(x.shape), gen)
        got, want = fused.encode(x, noise), ref.encode(x, noise)
        _assert_same(got, want)
        y = fused.decode(got)
        assert torch.equal(y, ref.decode(got)) and y.isfinite().all()  # finite in, finite out
        x = x * 2.0**-125  # non-finite values where sums do not overflow (else the order of the
        x[0, 5, 3], x[1, 40, 17], x[1, 2, 9] = float("nan"), float("inf"), -float("inf")  # sum
        got, want = fused.encode(x, noise), ref.encode(x, noise)
        for a, b in ((got.lfc.lfc, want.lfc.lfc), (got.quant.lo, want.quant.lo),
                     (got.quant.step, want.quant.step), (fused.decode(got), ref.decode(got))):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # decides inf/NaN)
        assert not fused.decode(got)[0, 5, 3].isfinite()


@pytest.mark.parametrize(("blocks", "stats"), [("tile", "chan"), ("tile", "tok"),
                                               ("grid64", "chan")])
def test_own_noise_is_the_quant_kernels_stream_and_thread_independent(blocks, stats):
    """Without noise the fused kernel draws what `quantize_encode` (C) would draw for the
    residual in the stats view from the same seed of torch's generator."""
    x = dyadic((3, 1 + 8 * 8, 40), torch.float32, torch.Generator().manual_seed(3))
    ref, fused = _pair(blocks, stats)
    results = at_thread_counts(lambda: fused.encode(x), seed=7)
    _assert_same(results[0], results[1])
    used, head, _ = ref._plan(tuple(x.shape))
    body = x[:, head:]
    h = body - ref._from_block_view(K.division_decode(results[0].lfc), used).reshape(body.shape)
    h = h.transpose(1, 2).contiguous() if stats == "chan" else h
    torch.manual_seed(7)
    if head:
        K.division_encode(x[:, :head], 8, 2, backend="cpu")  # the class token draws first
    quant = K.quantize_encode(h, 2, backend="cpu")
    for part in ("lo", "step", "codes"):
        assert torch.equal(bytes_of(getattr(results[0].quant, part)), bytes_of(getattr(quant, part)))


def _attention_views(n, t, heads, d, gen):
    """q, k and v of a qkv projection as attention reads them: (N, heads, T, d) views of one
    (N, T, 3 * heads * d) output (ViT's `view(n, t, 3, heads, d).permute(2, 0, 3, 1, 4)`), and
    of a (3, N, T, heads * d) stack transposed (GPT's per-projection `view(...).transpose(1, 2)`)."""
    qkv = dyadic((n, t, 3 * heads * d), torch.float32, gen)
    vit = qkv.view(n, t, 3, heads, d).permute(2, 0, 3, 1, 4)
    gpt = dyadic((3, n, t, heads * d), torch.float32, gen).view(3, n, t, heads, d).transpose(2, 3)
    return [*vit, *gpt]


@pytest.mark.parametrize(("blocks", "stats"), LAYOUTS)
def test_attention_views_are_read_in_place_as_their_sequences(blocks, stats, monkeypatch):
    """encode(x, view=(N * heads, T, d)) of a (N, heads, T, d) view gives the bytes of
    encode(x.reshape(view)) (given noise and own noise, at any thread count), and the fused
    kernel reads the view in place (no copy) where its blocks run on sequences."""
    gen = torch.Generator().manual_seed(11)
    ref, fused = _pair(blocks, stats)
    read = []
    token_encode = cpu.token_encode
    monkeypatch.setattr(cpu, "token_encode", lambda x, *a: read.append(x) or token_encode(x, *a))
    for n, t, heads, d in ((2, 65, 3, 16), (3, 17, 2, 9), (1, 16, 4, 8)):
        for x in _attention_views(n, t, heads, d, gen):
            view = (n * heads, t, d)
            noise = _noise(fused, view, gen)
            want = ref.encode(x.reshape(view), noise)
            read.clear()
            got = fused.encode(x, noise, view=view)
            _assert_same(got, want)
            assert got.shape == view and torch.equal(fused.decode(got), ref.decode(got))
            in_place = fused._geometry(view).geom.panel[1] == 1  # not a 2D grid of tokens
            assert (read[0].data_ptr() == x.data_ptr() and read[0].dim() == 5) == in_place
            own = at_thread_counts(lambda x=x, view=view: fused.encode(x, view=view), seed=3)
            copied = at_thread_counts(lambda x=x, view=view: fused.encode(x.reshape(view)),
                                      counts=(2,), seed=3)
            for packed in (*own, *copied):
                _assert_same(packed, own[0])
    with pytest.raises(ValueError, match=r"^view: expected a \(M, T, F\) or \(N, H, W, C\) shape of x's 512 elements"):
        fused.encode(x, view=(n * heads, t, d + 1))


def test_grouped_sequences_are_checked_before_c():
    layout = TokenLayout(codecs.get("division", block=8, bits=2), "tile", "chan")
    geom = layout._geometry((6, 16, 8)).geom
    x = torch.randn(2, 3, 1, 16, 8)
    assert len(cpu.token_encode(x, geom, 2, None, 0)) == 4  # 2 groups of 3 sequences
    for bad in (torch.randn(2, 2, 1, 16, 8), torch.randn(2, 3, 1, 16, 4),
                torch.randn(6, 1, 1, 1, 16, 8)):
        with pytest.raises(ValueError, match=r"^x: expected float32 of shape \(6, 1, 16, 8\)"):
            cpu.token_encode(bad, geom, 2, None, 0)
    # the group size is a divisor the C code divides by: refused unless it divides M
    for strides in ((0, 0, 0, 0, 0, 1), (0, 4, 0, 0, 0, 1), (0, 1, 0, 0, 1)):
        with pytest.raises(ValueError, match="^x: expected sequences in groups"):
            cpu._token_args.__wrapped__(geom, 2, strides)


def test_bad_noise_and_mismatched_parts_are_refused():
    _, fused = _pair("tile", "chan")
    x = torch.randn(2, 20, 16)
    with pytest.raises(ValueError, match="^noise: expected float32 \\(2, 16, 20\\)"):
        fused.encode(x, torch.rand(2, 20, 16))
    with pytest.raises(ValueError, match="^noise"):
        fused.encode(x, torch.rand(2, 16, 20).double())
    for view in ((-2, -20, 16), (640,)):  # the elements' count, not a token view
        with pytest.raises(ValueError, match="^view: expected a \\(M, T, F\\)"):
            fused.encode(x, view=view)
    packed = fused.encode(x)
    other = fused.encode(torch.randn(2, 24, 16))
    with pytest.raises(ValueError, match="^packed"):
        fused.decode(dataclasses.replace(packed, quant=other.quant))
    with pytest.raises(ValueError, match="^packed"):
        fused.decode(dataclasses.replace(packed, shape=torch.Size([2, 24, 16])))
    with pytest.raises(ValueError, match="^packed: parts"):  # was a torch.finfo TypeError
        fused.decode(dataclasses.replace(packed, dtype=torch.int32))
    with pytest.raises(ValueError, match="^packed.codes"):
        fused.decode(dataclasses.replace(packed, quant=dataclasses.replace(
            packed.quant, codes=packed.quant.codes[:, :, :1])))
    geom = fused._geometry((2, 20, 16))[0]
    with pytest.raises(ValueError, match="^x: expected float32"):
        cpu.token_encode(x.double(), geom, 2, None, 0)
    parts = (packed.lfc.lfc, packed.quant.lo, packed.quant.step, packed.quant.codes)
    with pytest.raises(ValueError, match="^out: expected float32"):  # right shape, wrong strides
        cpu.token_decode(*parts, geom, 2, torch.empty(2, 16, 20).transpose(1, 2))
    with pytest.raises(ValueError, match="^out: expected float32"):  # panels overlapping
        cpu.token_decode(*parts, geom, 2, torch.empty(20, 16).expand(2, 20, 16))
    # values the C code indexes with are refused before the call: bits (the codes' row bytes)
    # and a geometry whose block indices leave its lfc
    with pytest.raises(ValueError, match="^bits"):
        cpu.token_decode(*parts, geom, 3, torch.empty(2, 20, 16))
    panel = x.view(geom.panel)
    assert len(cpu.token_encode(panel, geom, 2, None, 0)) == 4  # the calls below differ in one value
    with pytest.raises(ValueError, match="^bits"):
        cpu.token_encode(panel, geom, 3, None, 0)
    bad = dataclasses.replace(geom, lfc_strides=tuple(s + 1 for s in geom.lfc_strides))
    with pytest.raises(ValueError, match="^geom: inconsistent"):
        cpu.token_encode(panel, bad, 2, None, 0)
    with pytest.raises(ValueError, match="^noise: expected shape"):
        cpu.token_encode(panel, geom, 2, torch.rand(2, 20, 16), 0)
    with pytest.raises(TypeError, match="^seed: expected an integer"):  # was a ctypes error
        cpu.token_encode(panel, geom, 2, None, 1.5)


def test_geometries_that_do_not_map_blocks_one_to_one_onto_the_lfc_are_refused():
    # Each was written past (ASan: heap-buffer-overflow in store_means8, quantize_group) or left
    # lfc entries unwritten before 2026-12-03: the C code steps a sequence's lfc by its number
    # of blocks and branches on chan == 1
    x = torch.randn(4, 1, 1, 64)
    good = cpu.TokenGeometry((4, 1, 1, 64), (1, 1, 8), (4, 8), (0, 0, 1), True)
    assert len(cpu.token_encode(x, good, 2, None, 1)) == 4
    for bad in (dataclasses.replace(good, lfc_shape=(4, 1), lfc_strides=(0, 0, 0)),  # too short
                dataclasses.replace(good, lfc_strides=(0, 0, 0)),  # all blocks on one entry
                dataclasses.replace(good, lfc_shape=(4, 16), lfc_strides=(0, 0, 2))):  # gaps
        with pytest.raises(ValueError, match="^geom: inconsistent"):
            cpu.token_encode(x, bad, 2, None, 1)


def test_token_geometries_of_another_structure_are_refused_when_made():
    # The C code reads exactly T_LEN values: a fourth extent or lfc stride shifted every value
    # after it (ASan: heap-buffer-overflow in gather_panel, and in the decode's panel stores), a
    # missing stride was read past the array (SIGFPE in sequence_offset); a float equal to an
    # int found that int's cached C array; chan == 2 was refused only at the first call
    good = cpu.TokenGeometry((2, 1, 9, 16), (1, 1, 8), (2, 9, 2), (0, 2, 1), False)
    for name, bad in (("extents", (1, 1, 8, 1)), ("extents", (1, 1)), ("lfc_strides", (0, 2)),
                      ("lfc_strides", (0, 2, 1, 0)), ("panel", (2, 1, 9)), ("panel", [2, 1, 9, 16]),
                      ("panel", (2, 1, 9.0, 16)), ("lfc_shape", ()), ("extents", (1, 1, True)),
                      ("chan", 2), ("chan", 1)):
        with pytest.raises(TypeError, match=f"^geom.{name}: expected a"):
            dataclasses.replace(good, **{name: bad})
    x, out = torch.randn(good.panel), torch.empty(2, 9, 16)
    cpu.token_decode(*cpu.token_encode(x, good, 2, None, 1), good, 2, out)


def test_negative_views_overlapping_outputs_and_shrunk_storages():
    # The C code reads and writes memory: a view with the negative bit (z.conj().imag) was read
    # as its stored negation, an out sharing memory with a part was written while that part was
    # read (other values), and a view read or written in place whose storage was resized
    # afterwards was read or written past the storage's end (ASan: heap-buffer-overflow in
    # gather_panel, token_range and the decode's stores)
    gen = torch.Generator().manual_seed(3)
    x = dyadic((2, 9, 16), torch.float32, gen)
    _, layout = _pair("feat", "tok")
    geom = layout._geometry(tuple(x.shape)).geom
    noise = torch.rand(geom.quant_shape, generator=gen)
    want = cpu.token_encode((-x).view(geom.panel), geom, 2, noise, 0)
    z = torch.complex(torch.zeros(geom.panel), x.view(geom.panel))
    for got in (cpu.token_encode(z.conj().imag, geom, 2, noise, 0),
                cpu.token_encode(torch._neg_view(x.view(geom.panel)), geom, 2, noise, 0),
                cpu.token_encode(-x.view(geom.panel), geom, 2, torch._neg_view(-noise), 0)):
        for a, b in zip(got, want):
            assert torch.equal(bytes_of(a), bytes_of(b))
    parts = cpu.token_encode(x.view(geom.panel), geom, 2, noise, 0)
    out = torch.empty(2, 9, 16)
    cpu.token_decode(*parts, geom, 2, out)
    got = torch.empty(2, 9, 16)
    cpu.token_decode(parts[0], torch._neg_view(-parts[1]), *parts[2:], geom, 2, got)
    assert torch.equal(got, out)
    with pytest.raises(ValueError, match="^out: expected float32"):
        cpu.token_decode(*parts, geom, 2, torch._neg_view(torch.empty(2, 9, 16)))
    shared = torch.empty(2, 9, 16)
    lo = shared.view(-1)[:parts[1].numel() // 2].view(torch.bfloat16).view(parts[1].shape)
    lo.copy_(parts[1])
    with pytest.raises(ValueError, match="^out: expected memory apart from the parts'"):
        cpu.token_decode(parts[0], lo, *parts[2:], geom, 2, shared)

    # two storages over one memory (from_numpy of two views of one array): their data pointers
    # differ, their bytes overlap (was decoded into while read: other values)
    memory = np.zeros(out.numel() + parts[3].numel(), dtype=np.float32)
    aliased_out = torch.from_numpy(memory[:out.numel()]).view(out.shape)
    codes = torch.from_numpy(memory.view(np.uint8)[4:4 + parts[3].numel()]).view(parts[3].shape)
    codes.copy_(parts[3])
    assert codes.untyped_storage().data_ptr() != aliased_out.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="^out: expected memory apart from the parts'"):
        cpu.token_decode(*parts[:3], codes, geom, 2, aliased_out)
    cpu.token_decode(*parts, geom, 2, aliased_out)  # parts of their own memory: decoded
    assert torch.equal(aliased_out, out)

    def shrunk(t):
        view = t.clone()[:]
        view.untyped_storage().resize_(4)
        return view

    step = torch.rand(2, 9, generator=gen).bfloat16()
    for name, call in (("x", lambda: cpu.token_encode(shrunk(x.view(geom.panel)), geom, 2, noise, 0)),
                       ("out", lambda: cpu.token_decode(*parts, geom, 2, shrunk(out))),
                       ("x", lambda: cpu.token_flat(shrunk(x), step))):
        with pytest.raises(ValueError, match=f"^{name}: its sizes and strides reach"):
            call()


def test_a_class_token_part_of_another_shape_is_refused():
    layout = _pair("grid64", "chan")[1]
    x = torch.randn(3, 1 + 4 * 4, 16)
    packed = layout.encode(x)
    for head in (K.division_encode(x[:1, :1], 8, 2), K.division_encode(x[:, :1, :1], 8, 2),
                 K.lfc_encode(x[:, :1], 8)):
        with pytest.raises(ValueError, match="^packed: parts"):  # was broadcast into every row
            layout.decode(dataclasses.replace(packed, head=head))
    assert torch.equal(layout.decode(packed), layout.decode(dataclasses.replace(packed)))


# Quant maps of n elements around the kernels' vector widths (tokens for chan, features for tok:
# 8 lanes for the min/max, a lane group for the quantise/pack/dequantise steps and one noise
# step; odd n leave tails), 64 features for chan: eight
# feature blocks of 8 (one step of the block means' lanes).
LENGTHS = [1, 7, 8, 9, 15, 16, 17, 31, 33]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize(("blocks", "stats"), LAYOUTS)
def test_map_lengths_around_the_vector_widths_with_own_noise(blocks, stats, bits):
    ref, fused = _pair(blocks, stats, bits)
    seed = 0x0123456789ABCDEF
    gen = torch.Generator().manual_seed(bits)
    for n in LENGTHS:
        shape = ((2, n, 64) if stats == "chan" else (2, 9, n)) if blocks != "grid64" else (
            (2, 2, n, 64) if stats == "chan" else (2, 3, 3, n))
        x = dyadic(shape, torch.float32, gen)
        # ReLU-like rows with zeros of both signs: a zero min or max is +0 in every lane order
        x[0] = x[0].clamp(min=0)
        x[0][(x[0] == 0) & (torch.rand(x[0].shape, generator=gen) < 0.5)] = -0.0
        geom, head = fused._geometry(shape)[:2]
        maps, count = geom.quant_shape[0] * geom.quant_shape[1], geom.quant_shape[2]
        noise = stream_uniforms(seed, maps, count).reshape(geom.quant_shape)
        want = ref.encode(x, noise)
        lfc, lo, step, codes = cpu.token_encode(TokenLayout._panel(x, head, geom), geom, bits,
                                                None, seed)
        for got_part, want_part in ((lfc, want.lfc.lfc), (lo, want.quant.lo),
                                    (step, want.quant.step), (codes, want.quant.codes)):
            assert torch.equal(bytes_of(got_part), bytes_of(want_part)), (n, shape)
        out = torch.empty(geom.panel[0], geom.panel[1] * geom.panel[2], geom.panel[3])
        cpu.token_decode(lfc, lo, step, codes, geom, bits, out)
        body = ref.decode(want).reshape(shape[0], -1, shape[-1])[:, head:]
        assert torch.equal(out, body), (n, shape)


def _own_noise_pair(layout, x, seed):
    """(the C kernel's lfc, lo, step, codes with its own noise, the torch path's encode with that
    noise given) for a body without a class token."""
    geom, head = layout[1]._geometry(tuple(x.shape))[:2]
    assert head == 0
    maps, count = geom.quant_shape[0] * geom.quant_shape[1], geom.quant_shape[2]
    want = layout[0].encode(x, stream_uniforms(seed, maps, count).reshape(geom.quant_shape))
    return cpu.token_encode(TokenLayout._panel(x, head, geom), geom, 2, None, seed), want


@pytest.mark.parametrize("block", [8, 4])
@pytest.mark.parametrize("blocks", BLOCKS)
def test_chan_strips_with_own_noise_equal_the_torch_path(blocks, block):
    """Chan maps of whole 16-column strips without given noise (`quantize_strips`, the residual
    made a strip at a time; `feat` blocks of one token go the other way): the bytes of the torch
    path, blocks of whole lane groups or not (block 4, 8 x 8 tiles, 64 tokens by one feature),
    any memory layout; residuals past FLT_MAX (the panel then encoded the other way) too, and
    NaN/Inf where the format says."""
    layout = tuple(TokenLayout(codecs.get("division", block=block, bits=2, backend=b), blocks,
                               "chan") for b in ("torch", "cpu"))
    gen = torch.Generator().manual_seed(block)
    shapes = [(2, 6, 10, 16), (1, 9, 9, 32)] if blocks == "grid64" else [(2, 66, 48), (3, 9, 16)]
    for shape in shapes:
        for scale in (1.0, 2.0**125):  # 2**125: block sums and residuals overflow
            for x in _layouts_of(dyadic(shape, torch.float32, gen) * scale):
                (lfc, lo, step, codes), want = _own_noise_pair(layout, x, seed=5)
                for got_part, want_part in ((lfc, want.lfc.lfc), (lo, want.quant.lo),
                                            (step, want.quant.step), (codes, want.quant.codes)):
                    assert torch.equal(bytes_of(got_part), bytes_of(want_part)), (shape, scale)
        x = dyadic(shape, torch.float32, gen)
        x.view(-1)[[3, 40, 77]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        (lfc, lo, step, _), want = _own_noise_pair(layout, x, seed=6)
        for a, b in ((lfc, want.lfc.lfc), (lo, want.quant.lo), (step, want.quant.step)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # NaN signs: free


@pytest.mark.parametrize("bits", [True, 2.0, 3])
def test_bits_are_checked_at_every_call_even_after_a_cached_geometry(bits):
    layout = TokenLayout(codecs.get("division", block=8, bits=2), "tile", "chan")
    x = torch.randn(2, 16, 16)
    geom = layout._geometry(x.shape).geom
    panel = TokenLayout._panel(x, 0, geom)
    lfc, lo, step, codes = cpu.token_encode(panel, geom, 1, None, 0)  # caches the geometry
    cpu.token_encode(panel, geom, 2, None, 0)
    with pytest.raises((TypeError, ValueError), match="bits"):
        cpu.token_encode(panel, geom, bits, None, 0)
    with pytest.raises((TypeError, ValueError), match="bits"):
        cpu.token_decode(lfc, lo, step, codes, geom, bits, torch.empty(2, 16, 16))


def _flat_cases(gen):
    """(x, step) pairs: tokens of random spread against random steps, with constant tokens,
    NaN and infinite values and steps, and spreads equal to their step (not below it)."""
    cases = []
    for trial in range(300):
        m, t = (int(v) for v in torch.randint(1, 7, (2,), generator=gen))
        f = int(torch.randint(1, 40, (1,), generator=gen))
        x = torch.randn(m, t, f, generator=gen) * float(torch.rand(1, generator=gen) * 8)
        step = (torch.rand(m, t, generator=gen) * float(torch.rand(1, generator=gen) * 4))
        kind = trial % 8
        if kind == 1:
            x[-1, -1] = float(x[-1, -1, 0])  # a constant token
        elif kind == 2:
            x.view(-1)[int(torch.randint(0, x.numel(), (1,), generator=gen))] = float("nan")
        elif kind == 3:
            x[0, 0, :] = float("inf")  # inf - inf is NaN: not flat
        elif kind == 4:
            x[0, 0, -1] = -float("inf")
        elif kind == 5:
            step[0, 0] = float(("inf", "nan")[trial % 2])
        elif kind == 6:  # every token spans exactly its step: none is below it
            x = torch.zeros(m, t, f)
            x[..., -1] = 0.75
            step.fill_(0.75)
        cases.append((x, step.bfloat16()))
    return cases


def test_token_flat_equals_the_reference_in_any_memory_layout():
    # moments.NormLayout asks whether a norm input has a token spanning less than its
    # quantisation step; the C pass must answer as the torch definition does, whatever strides
    gen = torch.Generator().manual_seed(11)
    answers = set()
    for x, step in _flat_cases(gen):
        for view in _layouts_of(x):
            expected = K.reference.token_flat(view, step)
            assert cpu.token_flat(view, step) == expected, (view.shape, view.stride())
            answers.add(expected)
    assert answers == {True, False}
    # the exact-tie cases really tie, and a constant token really is flat
    tie = torch.zeros(2, 3, 9)
    tie[..., -1] = 0.75
    assert not cpu.token_flat(tie, torch.full((2, 3), 0.75, dtype=torch.bfloat16))
    assert cpu.token_flat(tie, torch.full((2, 3), 0.8, dtype=torch.bfloat16))


def test_token_flat_is_thread_independent_on_large_inputs():
    x = torch.randn(8, 300, 96, generator=torch.Generator().manual_seed(2))
    step = torch.full((8, 300), 0.05, dtype=torch.bfloat16)
    x[5, 217] = 1.0  # one flat token, in the second thread's share
    assert at_thread_counts(lambda: cpu.token_flat(x, step), (1, 2, 3)) == [True] * 3
    x[5, 217, 0] = 2.0
    assert at_thread_counts(lambda: cpu.token_flat(x, step), (1, 2, 3)) == [False] * 3


@pytest.mark.parametrize(("x", "step", "match"), [
    (torch.zeros(2, 3, 4, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.bfloat16), "x:"),
    (torch.zeros(2, 3), torch.zeros(2, dtype=torch.bfloat16), "x:"),
    (torch.zeros(2, 3, 0), torch.zeros(2, 3, dtype=torch.bfloat16), "x:"),
    (torch.zeros(2, 3, 4), torch.zeros(2, 3), "step"),
    (torch.zeros(2, 3, 4), torch.zeros(3, 2, dtype=torch.bfloat16), "step"),
])
def test_token_flat_refuses_what_it_cannot_read(x, step, match):
    with pytest.raises((TypeError, ValueError), match=match):
        cpu.token_flat(x, step)
