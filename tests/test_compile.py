"""The codec inside torch.compile graphs: the custom ops (fakes, opcheck, seeded bytes) and
`compress` around a compiled model (exact gradients, the packed bytes the graph holds, graph
breaks, new shapes, eval, the refused combinations). Compiles are slow on 2 cores: tiny models."""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import freqact
import freqact.kernels as K
from freqact.kernels import cpu

OPS = torch.ops.freqact
BACKEND = "cpu" if cpu.available() else "torch"
# opcheck without its dynamic-shape AOT pass (minutes on 2 cores); the compiled tests trace them
OPCHECK = ("test_schema", "test_autograd_registration", "test_faketensor",
           "test_aot_dispatch_static")


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=OPCHECK)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 10))


def _grads(model: nn.Module, x: torch.Tensor, block=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if block is None:
        model(x).square().sum().backward()
    else:
        with block:
            out = model(x)
        out.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: every compiled module shares one frame
    (torch 2.13's `external_utils.inner`) and so dynamo's recompile limit (8 cache entries, plain
    and compressed graphs alike), past which a later test's model would run eagerly."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --- the custom ops ------------------------------------------------------------------------------


def test_ops_opcheck_and_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    backend = BACKEND
    for shape in [(2, 13), (2, 3, 11), (2, 3, 7, 9), (1, 2, 3, 9, 10)]:
        x = torch.randn(shape)
        seed = torch.tensor(5)
        real = OPS.division_encode(x, 4, 2, None, seed, backend)
        with FakeTensorMode() as mode:
            fake = OPS.division_encode(mode.from_tensor(x), 4, 2, None, mode.from_tensor(seed),
                                       backend)
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    x = torch.randn(2, 3, 5, 6)
    noise = torch.rand(x.shape)
    _opcheck(OPS.division_encode.default, (x, 4, 2, noise, torch.tensor(1), backend))
    parts = OPS.division_encode(x, 4, 2, noise, torch.tensor(1), backend)
    _opcheck(OPS.division_decode.default, (*parts, list(x.shape), x.dtype, 4, 2, backend))
    _opcheck(OPS.pack_mask.default, (x, 0.0, None, backend))
    _opcheck(OPS.pack_mask.default, (x, -0.5, 0.5, backend))
    packed = OPS.pack_mask(x, 0.0, None, backend)
    assert torch.equal(packed, K.pack_mask(x, 0.0, backend="torch"))
    _opcheck(OPS.unpack_mask.default, (packed, list(x.shape), x.dtype, 0.0, 1.0, backend))
    assert torch.equal(OPS.unpack_mask(packed, list(x.shape), x.dtype, 0.0, 1.0, backend),
                       (x > 0).float())


@pytest.mark.skipif(not cpu.available(), reason="the C kernels cannot be built here")
def test_seeded_encode_same_bytes_eager_op_and_compiled():
    x = torch.randn(2, 3, 10, 12)
    want = K.division_encode(x, 4, 2, seed=123, backend="cpu")
    assert not torch.equal(want.codes, K.division_encode(x, 4, 2, seed=124, backend="cpu").codes)

    def f(x, seed):
        return OPS.division_encode(x, 4, 2, None, seed, "cpu")

    for parts in (f(x, torch.tensor(123)), torch.compile(f, fullgraph=True)(x, torch.tensor(123))):
        for name, got in zip(("lfc", "lo", "step", "codes"), parts):
            assert torch.equal(got.view(torch.uint8), getattr(want, name).view(torch.uint8)), name
    with pytest.raises(ValueError, match="seed"):
        K.division_encode(x, 4, 2, seed=-1)


def test_pack_bits_layout_of_the_mask_kernel():
    from freqact.engine import compiled

    for n in (64, 61, 8 * 4096 + 3):  # padded tails too
        mask = torch.rand(n) > 0.5
        bits = compiled.pack_bits(mask.view(1, -1))
        assert torch.equal(bits, K.pack_mask(mask.float(), 0.5, backend="torch"))
        assert torch.equal(compiled.unpack_bits(bits, (1, n)), mask.view(1, -1))


@pytest.mark.parametrize("backend", sorted({BACKEND, "torch"}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_decode_with_a_relu_mask_is_where_after_the_decode(backend, dtype):
    # the relu-mask route's decode: the C kernels apply the mask in their decode pass, bit for
    # bit what torch.where after the plain decode gives (540 elements: a partial last byte;
    # NaN and Inf blocks; decoded values below the dtype's smallest normal where x > 0)
    from freqact.engine import compiled

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 9, 10, generator=gen).relu()
    clean = OPS.division_encode(x, 4, 2, None, torch.tensor(9), backend)
    _opcheck(OPS.division_decode.default,  # (opcheck compares outputs without equal_nan)
             (*clean, list(x.shape), x.dtype, 4, 2, backend, compiled.pack_bits(x > 0)))
    x[0, 0, 0, :3] = torch.tensor([float("nan"), 1e-30, float("inf")])
    x[1, 2, 4, 4] = 1e-6
    x = x.to(dtype)
    mask = compiled.pack_bits(x > 0)
    parts = OPS.division_encode(x, 4, 2, None, torch.tensor(9), backend)
    args = (*parts, list(x.shape), dtype, 4, 2, backend)
    got = OPS.division_decode(*args, mask)
    plain = OPS.division_decode(*args)
    want = torch.where(compiled.unpack_bits(mask, x.shape),
                       plain.clamp_min(torch.finfo(dtype).tiny), 0.0)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got == 0, ~(x > 0)) and got.isnan().any()
    with pytest.raises((TypeError, ValueError), match="positive"):
        OPS.division_decode(*args, mask[:-1])


def test_graph_relu_output_keeps_exact_signs():
    # ReLU's backward reads `out > 0` from the saved output: the decoded output must give the
    # same mask bit for bit (zeros exactly zero, the rest > 0), so its gradient mask is exact.
    from types import SimpleNamespace

    from torch._functorch._aot_autograd import graph_compile
    from torch.fx.experimental.proxy_tensor import make_fx

    from freqact.engine import compiled

    pack, unpack = compiled.graph_hooks(compiled.GraphCodec("division", 4, 2, BACKEND))
    x = torch.randn(2, 8, 16, 16).relu()
    relu = SimpleNamespace(target=torch.ops.aten.relu.default, name="relu", users={}, args=())
    with graph_compile._saved_tensor_hook_context({"_node": relu}):
        graph = make_fx(lambda t: unpack(pack(t)), tracing_mode="fake")(x)
    out = graph(x)
    assert torch.equal(out > 0, x > 0) and torch.equal(out == 0, x == 0)


def test_graph_hooks_traced_round_trip():
    # The hook graphs as AOTAutograd traces them (fake tensors), run on real ones: no Inductor.
    from torch.fx.experimental.proxy_tensor import make_fx

    from freqact.engine import compiled

    pack, unpack = compiled.graph_hooks(compiled.GraphCodec("division", 4, 2, BACKEND))

    def traced(t):
        graph = make_fx(lambda t: unpack(pack(t)), tracing_mode="fake")(t)
        return graph, {n.target for n in graph.graph.nodes if n.op == "call_function"}

    mask = torch.randn(2, 64, 64) > 0  # Inductor's saved ReLU masks: 1 bit each, lossless
    bits, shape = make_fx(pack, tracing_mode="fake")(mask)(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == mask.numel() // 8
    graph, ops = traced(mask)
    assert torch.equal(graph(mask), mask)
    x = torch.randn(2, 8, 16, 16)
    graph, ops = traced(x)
    assert OPS.division_encode.default in ops and OPS.division_decode.default in ops
    out = graph(x)
    assert out.shape == x.shape and 0 < float((out - x).abs().max()) < float(x.abs().max())
    small = torch.randn(2, 3, 4)  # under the threshold: kept, no op in the graph
    graph, ops = traced(small)
    assert OPS.division_encode.default not in ops
    assert torch.equal(graph(small), small)


def test_a_torch_without_the_hook_context_is_refused_not_coded_blind(monkeypatch):
    # without the graph context the rule cannot tell q, k, logsumexp or ReLU outputs apart
    from torch._functorch._aot_autograd import graph_compile
    from torch.fx.experimental.proxy_tensor import make_fx

    from freqact.engine import compiled

    pack, _ = compiled.graph_hooks(compiled.GraphCodec("division", 4, 2, BACKEND))
    monkeypatch.delattr(graph_compile, "_get_saved_tensor_hook_context")
    with pytest.raises(RuntimeError, match="^compress: torch .* does not give saved-tensor hooks"):
        make_fx(pack, tracing_mode="fake")(torch.randn(2, 8, 16, 16))


def test_graph_hooks_on_real_tensors_keep_what_is_saved():
    # Where the model runs eagerly (a graph break), autograd calls the same hooks on real tensors
    # without the graph's context: nothing says which op saved them (SDPA's q and k, a ReLU's
    # output), so they are kept, detached (a saved output's own grad_fn would close a cycle)
    from freqact.codecs.base import ExactPacked
    from freqact.engine import compiled

    pack, unpack = compiled.graph_hooks(compiled.GraphCodec("division", 4, 2, "auto"))
    x = torch.randn(2, 8, 16, 16, requires_grad=True) * 2
    packed = pack(x)
    assert isinstance(packed, ExactPacked) and packed.tensor.grad_fn is None
    assert torch.equal(unpack(packed), x)


def test_compiled_exact_matches_compiled_normal():
    model, x = _net(), torch.randn(4, 3, 16, 16)
    compiled = torch.compile(model)
    plain = _grads(compiled, x)
    exact = _grads(compiled, x, freqact.compress(compiled, "exact"))
    eager = _grads(model, x)
    for p, e, g in zip(plain, exact, eager):
        assert torch.equal(p, e)  # the exact hooks leave the graph as it was
        torch.testing.assert_close(p, g, rtol=1e-4, atol=1e-5)  # Inductor reorders sums


def _compiled_forward(model: nn.Module, x: torch.Tensor, make_spy, **division):
    """(compiled normal gradients, the spy, the meter, the output) of one compiled + division
    forward of model under the spy `make_spy()` makes."""
    compiled = torch.compile(model)
    exact = _grads(compiled, x)
    spy = make_spy()
    model.zero_grad(set_to_none=True)
    with freqact.compress(compiled, "division", **division) as meter:
        out = compiled(x)
    return exact, spy, meter, out


class _Spy:
    """Records the C kernels' encode outputs and decode inputs as the compiled graph calls them."""

    def __init__(self, monkeypatch):
        self.encoded, self.decoded, self.masked = [], [], 0
        encode, decode = cpu.encode, cpu.decode

        def spy_encode(x, geom, bits, noise, seed):
            out = encode(x, geom, bits, noise, seed)
            self.encoded.append((x.clone(), seed, [t.clone() for t in out]))
            return out

        def spy_decode(lfc, lo, step, codes, geom, bits, dtype, positive=None):
            self.decoded.append([t.clone() for t in (lfc, lo, step, codes)])
            self.masked += positive is not None
            return decode(lfc, lo, step, codes, geom, bits, dtype, positive)

        monkeypatch.setattr(cpu, "encode", spy_encode)
        monkeypatch.setattr(cpu, "decode", spy_decode)


@pytest.mark.skipif(not cpu.available(), reason="the C kernels cannot be built here")
def test_compiled_division_holds_the_eager_codec_bytes(monkeypatch):
    model, x = _net(), torch.randn(4, 3, 16, 16)
    exact, spy, meter, out = _compiled_forward(model, x, lambda: _Spy(monkeypatch), block=4,
                                               bits=2)
    # encoded in the forward, nothing decoded before backward: the graph holds the packed form
    assert len(spy.encoded) >= 1 and not spy.decoded
    node = out.grad_fn
    while type(node).__name__ != "CompiledFunctionBackward":
        node = node.next_functions[0][0]
    weights = {p.shape: p for p in model.parameters() if p.dim() == 4}
    # no channels-last copy of a weight is held (Inductor's layout optimization is off)
    assert all(t.untyped_storage().data_ptr() == weights[t.shape].untyped_storage().data_ptr()
               for t in node.saved_tensors if t.shape in weights)
    out.square().sum().backward()
    assert len(spy.decoded) == len(spy.encoded)
    monkeypatch.undo()  # the eager encodes below must not be recorded
    first_conv = model[0](x)
    assert any(torch.allclose(xs, first_conv, atol=1e-5) for xs, _, _ in spy.encoded)
    # the meter's rows: the first conv's output, its division bytes against its own
    rows = {row.layer: row for row in meter.per_layer()}
    assert rows["0"].routes == ("division",) and rows["2"].routes == ("relu-mask",)
    assert spy.masked >= 1  # the ReLU output's mask applied in the C decode's pass
    coded = K.division_encode(first_conv, 4, 2, seed=0, backend="cpu")
    assert rows["0"].exact_bytes == first_conv.nbytes
    assert rows["0"].saved_bytes == sum(getattr(coded, n).nbytes for n in
                                        ("lfc", "lo", "step", "codes"))
    assert meter.saved_bytes < meter.exact_bytes == sum(r.exact_bytes for r in rows.values())
    for xs, seed, parts in spy.encoded:
        want = K.division_encode(xs, 4, 2, seed=seed, backend="cpu")
        assert all(torch.equal(p, getattr(want, n)) for p, n in
                   zip(parts, ("lfc", "lo", "step", "codes")))
        assert any(all(torch.equal(a, b) for a, b in zip(parts, d)) for d in spy.decoded)
    assert len({seed for _, seed, _ in spy.encoded}) == len(spy.encoded)  # fresh noise each
    grads = [p.grad for p in model.parameters()]
    assert all(g.isfinite().all() for g in grads)
    flat = torch.cat([g.flatten() for g in grads])
    want = torch.cat([e.flatten() for e in exact])
    # eager division's error on this net is 0.006 at 8 bits; ReLU outputs keep exact signs
    assert 0 < float((flat - want).norm() / want.norm()) < 0.3


def test_compiled_refused_combinations():
    compiled = torch.compile(_net())
    with pytest.raises(ValueError, match="codec: 'lfc' cannot run inside a torch.compile"):
        freqact.compress(compiled, "lfc", ratio=0.5)
    with pytest.raises(ValueError, match="include/exclude"):
        freqact.compress(compiled, "division", include=[nn.Conv2d])
    outer = nn.Sequential(torch.compile(nn.Linear(4, 4)), nn.ReLU())
    with pytest.raises(ValueError, match="submodule '0' is compiled"):
        freqact.compress(outer, "division")
    in_place = _net()
    in_place.compile()  # dynamo traced the hooks as Python there: an empty meter, wrong grads
    for codec in ("division", "exact"):
        with pytest.raises(ValueError, match=r"^model: '\(model\)' is compiled in place"):
            freqact.compress(in_place, codec)
    part = _net()
    part[0].compile()  # inside a torch.compile(model): its frames trace the hooks alike
    with pytest.raises(ValueError, match=r"^model: '0' is compiled in place"):
        freqact.compress(torch.compile(part), "division")


@pytest.mark.slow
@pytest.mark.skipif(not cpu.available(), reason="the C kernels cannot be built here")
def test_compiled_division_graph_break_new_shape_and_eval(monkeypatch):
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)

        def forward(self, x):
            y = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(y * 2).mean((2, 3))

    torch.manual_seed(0)
    model = Broken()
    compiled = torch.compile(model)
    spy = _Spy(monkeypatch)
    for n in (4, 6):  # a new batch size: a recompile (or a dynamic graph), both compress
        spy.encoded.clear()
        x = torch.randn(n, 3, 12, 12)
        with freqact.compress(compiled, "division", block=4, bits=2):
            out = compiled(x)
        assert {xs.shape[0] for xs, _, _ in spy.encoded} == {n}
        # y crosses the break (an output of one graph, an input of the next: not a donated
        # intermediate, so kept); the first graph's own intermediates are encoded
        assert spy.encoded
        out.sum().backward()
        assert all(p.grad.isfinite().all() for p in model.parameters())
    model.eval()
    with torch.no_grad(), freqact.compress(compiled, "division"):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


# --- token tensors inside graphs (the ViT) --------------------------------------------------------


def test_layout_ops_opcheck_and_eager_bytes():
    from freqact.engine import graph_ops
    from freqact.engine.layouts import TokenLayout

    x = torch.randn(3, 13, 24)
    seed = torch.tensor(7)
    # q of a qkv projection, (N, heads, T, d) strided, read as (N * heads, T, d) in place
    q = torch.randn(3, 13, 3, 2, 12).permute(2, 0, 3, 1, 4)[0]
    for layout in graph_ops.LAYOUTS:
        _opcheck(OPS.layout_encode.default, (x, list(x.shape), layout, 4, 2, seed, BACKEND))
        _opcheck(OPS.layout_encode.default, (q, [6, 13, 12], layout, 4, 2, seed, BACKEND))
        state = torch.get_rng_state()
        parts = OPS.layout_encode(x, list(x.shape), layout, 4, 2, seed, BACKEND)
        assert torch.equal(torch.get_rng_state(), state)  # torch's generator neither read nor reseeded
        codec = TokenLayout(freqact.codecs.get("division", block=4, bits=2, backend=BACKEND),
                            *layout.split("/"))
        want = codec.encode(x, seed=7)
        for got, name in zip(parts, ("lfc", "lo", "step", "codes")):
            ref = want.lfc.lfc if name == "lfc" else getattr(want.quant, name)
            assert torch.equal(got, ref), (layout, name)
        _opcheck(OPS.layout_decode.default, (*parts, list(x.shape), x.dtype, layout, 4, 2,
                                             BACKEND))
        out = OPS.layout_decode(*parts, list(x.shape), x.dtype, layout, 4, 2, BACKEND)
        assert torch.equal(out, codec.decode(want))
    with pytest.raises(ValueError, match="layout"):
        OPS.layout_encode(x, list(x.shape), "grid64/chan", 4, 2, seed, BACKEND)
    with pytest.raises(ValueError, match="^view: expected a"):
        OPS.layout_encode(q, [3, 2, 13, 12], "tile/chan", 4, 2, seed, BACKEND)


class _LayoutSpy:
    """Records each TokenLayout encode (layout, input read as its view, seed, output, the input
    as given: its shape and whether it was contiguous) and decode."""

    def __init__(self, monkeypatch):
        from freqact.engine.layouts import TokenLayout

        self.encoded, self.decoded = [], []
        encode, decode = TokenLayout.encode, TokenLayout.decode

        def spy_encode(codec, x, noise=None, seed=None, view=None):
            out = encode(codec, x, noise, seed, view)
            self.encoded.append((codec.layout, x.reshape(out.shape).clone(), seed, out,
                                 tuple(x.shape), x.is_contiguous()))
            return out

        def spy_decode(codec, packed):
            self.decoded.append(packed)
            return decode(codec, packed)

        monkeypatch.setattr(TokenLayout, "encode", spy_encode)
        monkeypatch.setattr(TokenLayout, "decode", spy_decode)


@pytest.mark.skipif(not cpu.available(), reason="the C kernels cannot be built here")
def test_compiled_division_vit_token_layouts(monkeypatch):
    # A 1-block ViT (65 tokens of 32 features, 2 heads): its Linear inputs are saved as rank-2
    # (N * T, F) views, GELU's input as an addmm output, LayerNorm's normalised output and
    # statistics, SDPA's q/k/v/out/logsumexp.
    from freqact.engine import routes
    from freqact.engine.layouts import TokenLayout

    torch.manual_seed(0)
    model = freqact.models.get("vit", dim=32, depth=1, heads=2)
    x = torch.randn(8, 3, 32, 32)
    exact, spy, meter, out = _compiled_forward(model, x, lambda: _LayoutSpy(monkeypatch),
                                               block=8, bits=2)
    encoded = list(spy.encoded)
    assert encoded and not spy.decoded  # the graph holds the packed forms until backward
    out.square().sum().backward()
    assert len(spy.decoded) == len(encoded)
    monkeypatch.undo()
    rows = {row.layer: row for row in meter.per_layer()}
    assert rows["blocks.0.attn.qkv"].routes == ("division tile/chan",)
    assert rows["blocks.0.mlp.0"].routes == ("division tile/chan",)  # its input, GELU's input
    assert "division tile/tok" in rows["blocks.0.norm2"].routes
    # SDPA is rerun in backward from the decoded q, k, v: they are coded, out and logsumexp
    # not saved (eager's SdpaCall)
    assert rows["blocks.0.attn"].routes == ("division feat/chan",)
    assert meter.ratio > 6
    # q, k, v reach the encode as the (N, heads, T, d) views of the qkv output the graph saves,
    # read as (N * heads, T, d) in place: no copy before the encode
    attention = [e for e in encoded if e[0] == "feat/chan"]
    assert len(attention) == 3
    assert all(e[3].shape == (16, 65, 16) and e[4] == (8, 2, 65, 16) and not e[5]
               for e in attention)
    feat_chan = TokenLayout(freqact.codecs.get("division", block=8, bits=2), "feat", "chan")
    for _, xs, seed, packed, *_ in attention:  # the eager encode's bytes, given the graph's seed
        want = feat_chan.encode(xs, seed=seed)
        assert torch.equal(packed.quant.codes, want.quant.codes)
        assert torch.equal(packed.lfc.lfc, want.lfc.lfc)
    # the qkv Linear's input: the eager route's codec and view, the same bytes given the noise
    block = model.blocks[0]
    tokens = torch.cat([model.cls_token.expand(8, -1, -1),
                        model.patch_embed(x).flatten(2).transpose(1, 2)], 1) + model.pos_embed
    qkv_input = block.norm1(tokens).detach()
    eager = routes.Routes.for_codec(freqact.codecs.get("division", block=8, bits=2)).features
    assert eager.layout == "tile/chan"
    found = [e for e in encoded if e[0] == "tile/chan" and e[1].shape == qkv_input.shape
             and torch.allclose(e[1], qkv_input, atol=1e-5)]
    assert found
    layout, xs, seed, packed = found[0][:4]
    assert seed is not None  # the graph's own seed, drawn per step
    want = eager.codec.encode(xs, seed=seed)
    assert torch.equal(packed.quant.codes, want.quant.codes)
    assert torch.equal(packed.lfc.lfc, want.lfc.lfc)
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref = torch.cat([e.flatten() for e in exact])
    assert flat.isfinite().all()
    assert float(flat @ ref / flat.norm() / ref.norm()) > 0.8


@pytest.mark.slow
def test_compiled_division_leaves_a_users_joint_pass(monkeypatch):
    # With the user's own joint_custom_pre_pass the attention is not recomputed in backward:
    # SDPA's q, k and logsumexp are then kept exact (the eager rule where it cannot rerun).
    from torch._inductor import config as inductor

    calls = []
    torch._dynamo.reset()  # dynamo would reuse another test's graphs of the same ViT
    torch.manual_seed(0)
    model = freqact.models.get("vit", dim=32, depth=1, heads=2)
    compiled = torch.compile(model)
    with inductor.patch(joint_custom_pre_pass=calls.append):
        with freqact.compress(compiled, "division", block=8, bits=2) as meter:
            out = compiled(torch.randn(8, 3, 32, 32))
    out.sum().backward()
    assert calls  # the user's pass ran
    rows = {row.layer: row for row in meter.per_layer()}
    assert set(rows["blocks.0.attn"].routes) == {"kept", "division feat/chan"}


def test_graph_rule_reads_short_sequences_as_the_eager_routes_do():
    # Swin's 16-token windows: (64, 16, 96) is read 4 windows at a time, (16, 64, 96), in eager
    # (routes.view_shape) and in the graph rule alike
    from freqact.engine import compiled, graph_rules
    from freqact.engine.layouts import GROUP_TOKENS, token_view

    spec = compiled.GraphCodec("division", 8, 2, BACKEND)
    chosen = graph_rules.route(spec, torch.empty(64, 16, 96), None)
    assert chosen.view == token_view((64, 16, 96), False, group=GROUP_TOKENS) == (16, 64, 96)


def test_graph_rule_keeps_softmax_inputs_small_views_and_masked_values():
    from types import SimpleNamespace

    from freqact.engine import compiled, graph_rules

    spec = compiled.GraphCodec("division", 8, 2, BACKEND)
    aten = torch.ops.aten
    # a kept view holding under half of its storage (the class token of a norm's output) is
    # copied; the whole tensor is kept as it is
    norm_out = torch.randn(16, 65, 32)
    assert graph_rules.route(spec, norm_out[:, 0], None).name == "kept copy"
    assert graph_rules.route(spec, torch.randn(16, 32), None).name == "kept"
    # attention scores an SDPA with dropout decomposes to (bmm -> view -> mul -> amax): kept
    fw = torch.fx.Graph()
    scores = fw.placeholder("scores")
    scaled = fw.call_function(aten.mul.Tensor, (fw.call_function(
        aten.view.default, (scores, [16, 2, 65, 65])), 0.25))
    fw.call_function(aten.amax.default, (scaled, [-1], True))
    t = torch.randn(32, 65, 65)
    assert graph_rules.route(spec, t, {"_node": scores}).name == "kept"
    plain = torch.fx.Graph().placeholder("x")
    assert graph_rules.route(spec, t, {"_node": plain}).name.startswith("division")
    # a ReLU output keeps its signs beside any coded form, tokens included
    relu = SimpleNamespace(target=aten.relu.default, name="relu", users={}, args=())
    assert graph_rules.route(spec, torch.randn(4, 32, 256), {"_node": relu}).name == (
        "relu-mask tile/chan")
    # SDPA's value under a mask: the CPU kernel's `attn_mask`, the CUDA kernels' `attn_bias`
    value = torch.fx.Graph().placeholder("v")
    for efficient in (False, True):
        for masked in (False, True):
            bw = torch.fx.Graph()
            grad, q, k, v, mask, out, lse, seed, offset = (bw.placeholder(name) for name in (
                "grad", "q", "k", "v", "mask", "out", "lse", "seed", "offset"))
            if efficient:
                bw.call_function(aten._scaled_dot_product_efficient_attention_backward.default,
                                 (grad, q, k, v, mask if masked else None, out, lse, seed,
                                  offset, 0.0, [True] * 4, False))
            else:
                bw.call_function(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                                 (grad, q, k, v, out, lse, 0.0, False),
                                 {"attn_mask": mask if masked else None})
            chosen = graph_rules.route(spec, torch.randn(8, 2, 256, 16),
                                       {"_node": value, "_bw_graph": bw})
            assert chosen.name == ("kept" if masked else "division feat/chan"), (efficient, masked)


def _attention(dropout: float, broken: bool = False) -> nn.Module:
    """A one-head-pair attention block; `broken`: SDPA runs eagerly (torch._dynamo.disable), and
    the block's `outputs` list gets a weak reference to each SDPA output."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outputs = []

    @torch._dynamo.disable
    def eager_sdpa(q, k, v, dropout_p):
        y = sdpa(q, k, v, dropout_p=dropout_p)
        outputs.append(weakref.ref(y))  # SDPA saves its own output: a cycle unless detached
        return y

    attend = eager_sdpa if broken else sdpa

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)

        def forward(self, x):
            n, t, d = x.shape
            q, k, v = self.qkv(x).reshape(n, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
            y = attend(q, k, v, dropout_p=dropout)
            return self.proj(y.transpose(1, 2).reshape(n, t, d))

    torch.manual_seed(0)
    model = Attention()
    model.outputs = outputs
    with torch.no_grad():
        model.qkv.weight *= 3  # large scores: an error on them shows in exp
    return model


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    flat = [torch.cat([g.flatten() for g in grads]) for grads in (got, want)]
    return float((flat[0] - flat[1]).norm() / flat[1].norm())


class _Conv1D(nn.Module):
    """GPT-2's Conv1D (transformers.pytorch_utils): addmm with an (in, out) weight."""

    def __init__(self, nx: int, nf: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], -1)


def test_compiled_division_codes_linear_inputs_saved_transposed(fresh_dynamo):
    # addmm(b, x, w) saves x.t() (F, N * T) for the weight's gradient: it was kept exact (GPT-2
    # compiled: 2.1x vs eager's 10.6x); coded in tile/chan as the (N * T, F) tensor it transposes
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), _Conv1D(32, 128), nn.GELU(approximate="tanh"),
                          _Conv1D(128, 32))
    x = torch.randn(4, 64, 32)
    compiled = torch.compile(model)
    want = _grads(compiled, x)
    block = freqact.compress(compiled, "division", block=8, bits=8)
    got = _grads(compiled, x, block)
    rows = {row.layer: row for row in block.meter.per_layer()}
    assert rows["1"].routes == rows["3"].routes == ("division tile/chan",)
    assert 3 * block.meter.saved_bytes < block.meter.exact_bytes
    assert _relative_error(got, want) < 0.01  # transposed back right (0.0015; wrong: ~1)


def test_compiled_division_keeps_the_scores_of_attention_with_dropout(monkeypatch):
    # On the CPU, dropout decomposes SDPA (bmm, amax, exp, ...) and the partitioner saves the
    # scores, recomputing the softmax in backward from the exact max: coded, the relative
    # gradient error was 2e4 (eager division: 0.5); the same dropout mask in both runs
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    model = _attention(dropout=0.1)
    compiled = torch.compile(model)
    x = torch.randn(8, 65, 32)
    torch.manual_seed(1)
    want = _grads(compiled, x)
    torch.manual_seed(1)
    got = _grads(compiled, x, freqact.compress(compiled, "division", block=8, bits=2))
    assert _relative_error(got, want) < 1.0


def test_compiled_division_keeps_and_meters_what_runs_eagerly():
    # SDPA past a graph break: its q and k coded blind gave a relative gradient error of 249;
    # kept, the gradients are compiled training's, and the meter charges what is kept there
    model = _attention(dropout=0.0, broken=True)
    compiled = torch.compile(model)
    x = torch.randn(4, 64, 32)
    want = _grads(compiled, x)
    block = freqact.compress(compiled, "division", block=8, bits=2)
    assert _relative_error(_grads(compiled, x, block), want) < 1e-6
    meter = block.meter
    kept = [row for row in meter.per_layer() if "kept" in row.routes]
    assert kept and meter.exact_bytes >= 3 * x.numel() * 4  # q, k, v at least
    # nothing saved there outlives its forward (a detached hold: no cycle through grad_fn)
    model.outputs.clear()
    with freqact.compress(compiled, "division", block=8, bits=2):
        out = compiled(x)
    ref = weakref.ref(out.grad_fn)
    del out
    gc.collect()
    assert ref() is None and len(model.outputs) == 1 and model.outputs[0]() is None


def _held_bytes(out: torch.Tensor, model: nn.Module, batch: torch.Tensor) -> int:
    """Bytes of the storages the autograd graph behind out holds for backward, parameters and the
    batch aside (each storage once)."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), batch)}
    seen, stack, storages = set(), [out.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
        for t in getattr(node, "saved_tensors", ()):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def test_compiled_meter_charges_activations_crossing_a_graph_break(fresh_dynamo):
    # y, an output of the first graph and an input of the second, is held as it is by the
    # second graph for its conv's backward (and by the first for ReLU's): no hook sees it, and
    # the meter left it out (2,048 B metered of 34,816 held)
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            y = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(y).relu().mean((2, 3))

    torch.manual_seed(0)
    model = Broken()
    compiled = torch.compile(model)
    x = torch.randn(4, 3, 16, 16)
    with freqact.compress(compiled, "division") as meter:
        out = compiled(x)
    assert meter.saved_bytes == _held_bytes(out, model, x) >= 4 * 8 * 16 * 16 * 4
    assert "kept" in {route for row in meter.per_layer() for route in row.routes}


def test_a_forward_past_the_recompile_limit_warns_that_it_kept_its_saves(fresh_dynamo):
    # past dynamo's recompile limit a new size runs eagerly: its saves are kept as they are,
    # which only the meter's ratio showed; one warning per block names the cause
    torch.manual_seed(0)
    tokens = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    compiled = torch.compile(tokens)
    with torch._dynamo.config.patch(recompile_limit=1):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with freqact.compress(compiled, "division") as meter:
                compiled(torch.randn(4, 64, 32)).sum().backward()  # compiled: no warning
        compressed = meter.ratio
        with pytest.warns(RuntimeWarning, match="ran without any compiled graph.*recompile_limit"):
            with freqact.compress(compiled, "division") as meter:
                for _ in range(2):  # warned once
                    compiled(torch.randn(6, 64, 32)).sum().backward()
    assert compressed > 4 and meter.ratio == 1.0


def test_a_no_grad_forward_after_a_training_step_does_not_warn(fresh_dynamo):
    # the loss's eager saves (cross_entropy's, between forwards) were counted as the next
    # forward's: a no_grad (validation) forward, which runs no graph with history, warned
    torch.manual_seed(0)
    tokens = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    compiled = torch.compile(tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with freqact.compress(compiled, "division"):
            out = compiled(torch.randn(4, 64, 32))
            nn.functional.cross_entropy(out.reshape(-1, 32), torch.randint(0, 32, (256,))).backward()
            with torch.no_grad():
                compiled(torch.randn(4, 64, 32))


@pytest.mark.parametrize(("shape", "route"), [((2, 8, 2, 1), "kept"), ((2, 8, 4, 4), "division")])
def test_compiled_batchnorm_over_few_values_per_channel_is_kept(shape, route):
    # the eager rule (routes.MIN_BATCH_VALUES): a BatchNorm input with fewer than 8 values per
    # channel is kept; the graph rule coded it (4 values per channel here: 2 x 2 x 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 2048, 1), nn.BatchNorm2d(2048), nn.ReLU(), nn.Conv2d(2048, 4, 1))
    compiled = torch.compile(model)
    with freqact.compress(compiled, "division") as meter:
        compiled(torch.randn(shape)).sum().backward()
    routes = {row.layer: row.routes for row in meter.per_layer()}
    assert routes["0"] == (route,)  # the conv's output, the BatchNorm's input
    with freqact.compress(model, "division") as meter:
        model(torch.randn(shape)).sum().backward()
    assert route in {r for row in meter.per_layer() if row.type == "BatchNorm2d" for r in row.routes}


def test_frozen_weights_saved_where_the_model_runs_eagerly_are_not_charged():
    @torch._dynamo.disable
    def frozen_linear(h, weight):
        # saves the (frozen) weight, and for the product its two (N, 64) factors
        return torch.nn.functional.linear(h, weight) * h

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.frozen = nn.Linear(64, 64), nn.Linear(64, 64)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return frozen_linear(torch.tanh(self.a(x)), self.frozen.weight)

    compiled = torch.compile(Model())
    x = torch.randn(8, 64)
    with freqact.compress(compiled, "division") as meter:
        compiled(x).sum().backward()
    assert meter.exact_bytes == 2 * x.numel() * 4  # the factors; not the weight (16 KiB)


def test_compiled_division_relu_signs_on_conv1d_maps():
    # rank-3 ReLU outputs of Conv1d maps: coded without their sign mask, ReLU's backward leaked
    # gradient (relative error 0.19 at 8 bits, eager 0.0005)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv1d(32, 32, 3, padding=1), nn.AdaptiveAvgPool1d(1), nn.Flatten())
    x = torch.randn(8, 4, 256)
    compiled = torch.compile(model)
    want = _grads(compiled, x)
    got = _grads(compiled, x, freqact.compress(compiled, "division", bits=8))
    assert _relative_error(got, want) < 0.01


def test_compiled_division_new_sizes_recompile_dynamic_graphs_are_refused():
    torch.manual_seed(0)
    tokens = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    compiled = torch.compile(tokens)
    for n in (8, 6):  # a second size made a dynamic graph, whose token routes crashed
        with freqact.compress(compiled, "division") as meter:
            out = compiled(torch.randn(n, 65, 32))
        out.sum().backward()
        assert isinstance(meter.saved_bytes, int) and 0 < meter.saved_bytes < meter.exact_bytes
    with pytest.raises(ValueError, match=r"^model: compiled with dynamic=True"):
        freqact.compress(torch.compile(tokens, dynamic=True), "division")
    x = torch.randn(4, 65, 32)
    torch._dynamo.mark_dynamic(x, 0)  # seen only when the graph is traced
    with pytest.raises(Exception, match="compress: a compiled graph with dynamic shapes"):
        with freqact.compress(compiled, "division"):
            compiled(x)


def test_compiled_division_a_batch_from_a_dynamic_plain_step_compiles_static(fresh_dynamo):
    # a second size made the plain graph dynamic (automatic dynamic shapes), and AOTAutograd
    # stamped the batch it saved with `_dynamo_propagated_dynamic_indices`; dynamo read that as
    # dynamic inside the block too, and the same batch was refused as "dynamic=True"
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    compiled = torch.compile(model)
    compiled(torch.randn(8, 65, 32)).sum().backward()
    x = torch.randn(6, 65, 32)
    compiled(x).sum().backward()
    with freqact.compress(compiled, "division") as meter:
        out = compiled(x)
    out.sum().backward()
    assert 0 < meter.saved_bytes < meter.exact_bytes


def test_compiled_division_retained_graph_and_dropped_forwards(monkeypatch):
    model = _net()
    compiled = torch.compile(model)
    x = torch.randn(4, 3, 16, 16)
    with freqact.compress(compiled, "division", block=4, bits=2):
        refs = []
        for _ in range(3):  # forwards dropped inside the block free their packed forms at once
            out = compiled(x)
            refs.append(weakref.ref(out.grad_fn))
            del out
        gc.collect()
        assert all(ref() is None for ref in refs)
        loss = compiled(x).sum()
    # a second backward over the retained graph: with donated buffers off, as PyTorch says
    monkeypatch.setattr(torch._functorch.config, "donated_buffer", False)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    for once, twice in zip(first, model.parameters()):
        torch.testing.assert_close(twice.grad, 2 * once)


def test_sink_decodes_moves_each_decode_to_its_first_use():
    # the unpack hook's ops (a decode and its view), inlined before the graph's first op, run
    # just before the op that reads them, and the graph computes the same
    from freqact.engine import graph_ops

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    a, bits = graph.placeholder("a"), graph.placeholder("bits")
    mask = graph.call_function(OPS.unpack_mask.default, (bits, [4, 8], torch.float32, 0.0, 1.0))
    view = graph.call_function(aten.view.default, (mask, [32]))
    noise = graph.call_function(aten.rand_like.default, (view,))  # random: stays where it is
    early = graph.call_function(aten.mul.Tensor, (a, 2.0))
    late = graph.call_function(aten.add.Tensor, (early, view))
    graph.output((late, noise))
    module = torch.fx.GraphModule(nn.Module(), graph)
    args = (torch.randn(32), K.pack_mask(torch.randn(4, 8), 0.0))
    want = module(*args)[0]
    graph_ops._sink_decodes(graph)
    graph.lint()
    module.recompile()
    assert [n for n in graph.nodes if n.op == "call_function"] == [mask, view, noise, early, late]
    graph.erase_node(graph.output_node())
    graph.output(late)
    graph.erase_node(noise)
    graph_ops._sink_decodes(graph)
    graph.lint()
    module.recompile()
    assert [n for n in graph.nodes if n.op == "call_function"] == [early, mask, view, late]
    assert torch.equal(module(*args), want)


@pytest.mark.skipif(not cpu.available(), reason="the C kernels cannot be built here")
def test_compiled_division_recomputes_gelu_outputs(monkeypatch):
    # Linear -> GELU -> Linear on tokens: GELU's output (the second Linear's input) is
    # recomputed in backward from GELU's decoded input, neither saved nor coded
    from freqact.engine import graph_ops

    x = torch.randn(8, 65, 32)

    def run(recompute: bool):
        torch._dynamo.reset()  # each run compiles its own graphs
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        compiled = torch.compile(model)
        exact = torch.cat([g.flatten() for g in _grads(compiled, x)])
        with monkeypatch.context() as patch:
            if not recompute:
                patch.setattr(graph_ops, "_recompute_gelu", lambda graph: None)
            model.zero_grad(set_to_none=True)
            with freqact.compress(compiled, "division", block=8, bits=2) as meter:
                out = compiled(x)
            out.square().sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        return meter, float(grads @ exact / grads.norm() / exact.norm())

    meter, cosine = run(True)
    saved, saved_cosine = run(False)
    rows, saved_rows = ({r.layer: r.routes for r in m.per_layer()} for m in (meter, saved))
    assert saved_rows["2"] == ("division tile/chan",) and "2" not in rows
    assert rows["0"] == saved_rows["0"]  # the first Linear's input and GELU's input, coded
    assert meter.saved_bytes < saved.saved_bytes
    assert cosine > 0.9 and saved_cosine > 0.9
