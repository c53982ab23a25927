"""engine/attention.py: SDPA packed as a unit (q, k, v coded; out, logsumexp recomputed)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import freqact
from freqact import codecs, models
from freqact.engine import attention, sdpa_math
from freqact.engine.layouts import TokenLayout, packed_nbytes
from freqact.kernels import cpu


class Attend(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


class _Traced(dict):
    """A `sdpa_math._DIRECT` that never lets a kind take the direct rerun."""

    def get(self, key, default=None):
        return False


@pytest.fixture(autouse=True)
def fresh_direct_checks(monkeypatch):
    """Each test starts with no kind of MATH-backend call checked for the direct rerun (so that
    which rerun a test meets does not depend on the tests before it)."""
    monkeypatch.setattr(sdpa_math, "_DIRECT", {})


def _qkv(seed=0, shape=(2, 3, 48, 16)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for _ in range(3)]


def _run(model, q, k, v, codec=None, grad=None):
    """(gradients of q, k, v and the model's parameters (None where unused), output, meter)."""
    params = list(model.parameters())
    for t in (q, k, v, *params):
        t.grad = None
    if codec is None:
        out, meter = model(q, k, v), None
    else:
        with freqact.compress(model, codec) as meter:
            out = model(q, k, v)
    out.backward(grad)
    return [None if t.grad is None else t.grad.clone() for t in (q, k, v, *params)], out, meter


def _input_grads(model, q, k, v, codec=None, grad=None):
    grads, _, meter = _run(model, q, k, v, codec, grad)
    return grads, meter


def _rel(a, b):
    num = sum(((x - y) ** 2).sum() for x, y in zip(a, b))
    return float((num / sum((y ** 2).sum() for y in b)).sqrt())


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"scale": 0.5}])
def test_exact_is_bit_identical_and_division_error_is_small(kwargs):
    q, k, v = _qkv()
    grad = torch.randn(2, 3, 48, 16, generator=torch.Generator().manual_seed(9))
    model = Attend(**kwargs)
    plain, _ = _input_grads(model, q, k, v, grad=grad)
    exact, meter = _input_grads(model, q, k, v, "exact", grad)
    assert all(torch.equal(a, b) for a, b in zip(plain, exact))
    assert meter.saved_bytes <= meter.exact_bytes
    division, meter = _input_grads(model, q, k, v, "division", grad)
    assert all(torch.isfinite(g).all() for g in division)
    # random q, k (scores of std 1-2): 1.2-1.6 at 2 bits (with the exact logsumexp: 1e8 and more)
    assert 0 < _rel(division, plain) < 2
    assert meter.by_route()["recomputed"]["count"] == 2
    fine, _ = _input_grads(model, q, k, v, codecs.get("division", bits=8), grad)
    assert _rel(fine, plain) < 0.05  # the error is the codec's: it shrinks with its step


def test_a_boolean_mask_reruns_as_the_additive_mask_sdpa_makes_of_it():
    # Hugging Face models hand SDPA a boolean padding mask: the kernel's rerun raised ("attention
    # mask is the same data type as query") until it was given SDPA's additive form
    q, k, v = _qkv(3)
    keep = torch.ones(48, 48, dtype=torch.bool).tril()
    keep[:, :5] = True  # padding-like columns besides the causal part
    additive = torch.zeros(48, 48).masked_fill(~keep, float("-inf"))
    grad = torch.randn(2, 3, 48, 16, generator=torch.Generator().manual_seed(5))
    grads = []
    for mask in (keep, additive):
        torch.manual_seed(4)  # the same noise for both encodes
        got, meter = _input_grads(Attend(attn_mask=mask), q, k, v, "division", grad)
        assert meter.by_route()["recomputed"]["count"] == 2  # the flash kernel is rerun
        grads.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    plain, _ = _input_grads(Attend(attn_mask=keep), q, k, v, grad=grad)
    assert 0 < _rel(grads[0], plain) < 2


def _spy_decoded(monkeypatch) -> dict:
    """role -> the (N, heads, T, d) q, k, v the codec decoded (filled as backward decodes)."""
    decoded, real = {}, attention.SdpaCall._decode

    def spy(self, role):
        x = real(self, role)
        decoded[role] = x.view(self.shapes[role]).detach().clone()
        return x
    monkeypatch.setattr(attention.SdpaCall, "_decode", spy)
    return decoded


def test_gradient_is_attention_at_the_decoded_point(monkeypatch):
    # out and logsumexp recomputed from the decoded q, k, v: backward is exactly the gradient of
    # attention evaluated at (q_hat, k_hat, v_hat), the error model of every other route
    q, k, v = _qkv(1)
    grad = torch.randn(2, 3, 48, 16, generator=torch.Generator().manual_seed(2))
    decoded = _spy_decoded(monkeypatch)
    got, _ = _input_grads(Attend(is_causal=True), q, k, v, "division", grad)
    hats = [decoded[r].requires_grad_() for r in attention.ROLES]
    assert not torch.equal(hats[0], q)
    F.scaled_dot_product_attention(*hats, is_causal=True).backward(grad)
    for g, h in zip(got, hats):
        torch.testing.assert_close(g, h.grad, rtol=1e-5, atol=1e-6)


def test_one_backward_decodes_each_input_once_and_reruns_the_kernel_once(monkeypatch):
    # q, k, v are unpacked by autograd and read again by the recomputation; out and logsumexp
    # come from one kernel call: per backward 3 decodes and 1 forward kernel per SDPA call, also
    # on a second backward over a retained graph
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    decodes = []
    real = TokenLayout.decode
    monkeypatch.setattr(TokenLayout, "decode", lambda self, p: decodes.append(1) or real(self, p))
    q, k, v = _qkv(3)
    model = Attend(is_causal=True)
    with freqact.compress(model, "division"):
        out = model(q, k, v)
    with Count():
        out.sum().backward(retain_graph=True)
        assert (len(decodes), Count.calls) == (3, 1)
        first = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        out.sum().backward()
    assert (len(decodes), Count.calls) == (6, 2)
    assert all(torch.equal(a, t.grad) for a, t in zip(first, (q, k, v)))


def test_bytes_are_the_packed_forms_and_nothing_for_out_and_logsumexp():
    q, k, v = _qkv()
    model = Attend(is_causal=True)
    with freqact.compress(model, "division") as meter:
        model(q, k, v)
    routes = meter.by_route()
    codec = TokenLayout(codecs.get("division"))
    assert routes["division feat/chan"]["saved_bytes"] == 3 * packed_nbytes(codec, (6, 48, 16))
    assert routes["recomputed"]["saved_bytes"] == 0
    # plain PyTorch would hold q, k, v, out (fp32) and the (N, heads, T) logsumexp
    assert meter.exact_bytes == 4 * q.numel() * 4 + 2 * 3 * 48 * 4


class AttendQkv(nn.Module):
    """Attention on the (N, 2 heads, T, 16) q, k, v views of one qkv projection (ViT's split)."""

    def __init__(self, mask: torch.Tensor | None = None):
        super().__init__()
        self.qkv, self.mask = nn.Linear(32, 3 * 32), mask

    def forward(self, x):
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


@pytest.mark.skipif(not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}")
@pytest.mark.parametrize("math", [False, True])
def test_qkv_views_reach_the_kernel_uncopied(math, monkeypatch):
    # q, k, v are strided views of the projection's output: the fused encode reads them in
    # place as (N * heads, T, d) sequences (a 5-D view of that storage), flash and math paths alike
    torch.manual_seed(0)
    model = AttendQkv(torch.randn(2, 64, 64) if math else None)
    outputs = []
    model.qkv.register_forward_hook(lambda module, args, out: outputs.append(out))
    read, encode = [], cpu.token_encode
    monkeypatch.setattr(cpu, "token_encode", lambda t, *a: read.append(t) or encode(t, *a))
    with freqact.compress(model, "division") as meter:
        model(torch.randn(4, 64, 32)).sum().backward()
    assert meter.by_route()["division feat/chan"]["saved_bytes"] > 0
    qkv = outputs[0].untyped_storage().data_ptr()
    attention = [t for t in read if t.untyped_storage().data_ptr() == qkv]
    assert len(attention) == 3 and all(t.shape == (4, 2, 1, 64, 16) for t in attention)


@pytest.mark.parametrize("case", ["small", "same-qk", "math-q-without-grad"])
def test_q_and_k_stay_exact_where_nothing_can_be_recomputed(case):
    q, k, v = _qkv(shape=(1, 2, 8, 8) if case == "small" else (2, 3, 48, 16))
    if case == "same-qk":
        k = q
    if case == "math-q-without-grad":  # the rerun could not save what the forward saved
        q = q.detach()
    model = Attend(is_causal=True)
    with (sdpa_kernel(SDPBackend.MATH) if case.startswith("math") else torch.enable_grad()), \
            freqact.compress(model, "division") as meter:
        model(q, k, v)
    assert "recomputed" not in meter.by_route()
    kept = meter.by_route()["kept"]["exact_bytes"]
    assert kept >= (1 if case == "same-qk" else 2) * q.numel() * 4


def test_zoo_gpt_recomputes_every_layer_and_trains():
    torch.manual_seed(0)
    model = models.get("gpt", num_classes=64, dim=32, depth=2, heads=2, context=32)
    ids = torch.randint(0, 64, (4, 33))

    def grads(codec):
        model.zero_grad(set_to_none=True)
        with freqact.compress(model, codec) as meter:
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), meter
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    plain = torch.cat([p.grad.flatten() for p in model.parameters()])
    exact, _ = grads("exact")
    assert torch.equal(exact, plain)
    division, meter = grads("division")
    assert meter.by_route()["recomputed"]["count"] == 2 * 2  # out and logsumexp per layer
    assert float((division - plain).norm() / plain.norm()) < 2


# --- the math backend (a float attn_mask of rank 3 / requiring grad, dropout) ------------------

class BiasAttend(nn.Module):
    """SDPA with a learned (heads, T, T) bias, plus a constant (windows, T, T) mask repeated
    over the images when `windows` (Swin's shifted windows), dropout and is_causal optional."""

    def __init__(self, heads=3, tokens=48, windows=0, dropout=0.0, causal=False):
        super().__init__()
        gen = torch.Generator().manual_seed(4)
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens, generator=gen))
        shift = torch.zeros(windows, tokens, tokens)
        for w in range(windows):  # a different -inf pattern per window, the diagonal kept
            cut = torch.rand(tokens, tokens, generator=gen) < 0.3 * w / max(windows, 1)
            shift[w][cut & ~torch.eye(tokens, dtype=torch.bool)] = float("-inf")
        self.register_buffer("shift", shift if windows else None)
        self.dropout, self.causal = dropout, causal

    def mask(self, n):
        if self.causal:  # SDPA takes no mask with is_causal
            return None
        if self.shift is None:
            return self.bias
        return (self.bias + self.shift[:, None]).repeat(n // self.shift.shape[0], 1, 1, 1)

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q.shape[0]),
                                              dropout_p=self.dropout, is_causal=self.causal)


_MATH_CASES = {"bias": {}, "bias+shift-mask": {"windows": 2}, "dropout": {"dropout": 0.3},
               "causal+dropout": {"dropout": 0.2, "causal": True},
               "shift-mask+dropout": {"windows": 2, "dropout": 0.1}}


def _grads_with_bias(model, q, k, v, codec, grad):
    """`_run` from one seed (the same dropout draws); the last gradient is the bias's."""
    torch.manual_seed(7)
    return _run(model, q, k, v, codec, grad)


@pytest.mark.parametrize("case", list(_MATH_CASES))
def test_math_path_exact_is_bit_identical_and_division_recomputes(case):
    model = BiasAttend(**_MATH_CASES[case])
    q, k, v = _qkv(3, (4, 3, 48, 16))
    grad = torch.randn(4, 3, 48, 16, generator=torch.Generator().manual_seed(8))
    plain, out, _ = _grads_with_bias(model, q, k, v, None, grad)
    exact, out_exact, meter = _grads_with_bias(model, q, k, v, "exact", grad)
    assert torch.equal(out, out_exact) and all(
        torch.equal(a, b) for a, b in zip(plain, exact) if a is not None)
    assert meter.saved_bytes <= meter.exact_bytes
    division, out_division, meter = _grads_with_bias(model, q, k, v, "division", grad)
    if not model.dropout:  # the forward is plain PyTorch's (with dropout the codec drew first)
        assert torch.equal(out_division, out)
    routes = meter.by_route()
    # bmm(q, k^T), softmax and bmm(P, v) save 5 tensors (P twice); dropout adds its noise
    assert routes["recomputed"]["count"] + routes["division feat/chan"]["count"] == (
        6 if model.dropout else 5)
    assert "kept" not in routes
    assert all(torch.isfinite(g).all() for g in division if g is not None)
    assert 0 < _rel(division[:3], plain[:3]) < 2
    fine, _, _ = _grads_with_bias(model, q, k, v, codecs.get("division", bits=8), grad)
    if not model.dropout:  # with dropout the masks differ (the codec draws from the generator)
        assert _rel(fine, plain) < 0.05 and _rel(fine[3:], plain[3:]) < 0.05


def _decomposed(q, k, v, mask, noise, causal):
    """Attention written out in plain autograd ops: softmax(q k^T / sqrt(d) + mask) * noise @ v."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores + mask
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(),
                                    float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return (p if noise is None else p * noise) @ v


@pytest.mark.parametrize("case", list(_MATH_CASES))
def test_math_path_gradient_is_attention_at_the_decoded_point(case, monkeypatch):
    # every save recomputed from the decoded q, k, v with the exact mask and the forward's own
    # dropout noise: backward equals plain autograd at (q_hat, k_hat, v_hat), the bias included
    model = BiasAttend(**_MATH_CASES[case])
    q, k, v = _qkv(5, (4, 3, 48, 16))
    grad = torch.randn(4, 3, 48, 16, generator=torch.Generator().manual_seed(6))
    decoded, noises = _spy_decoded(monkeypatch), []
    real_encode = sdpa_math.MathSaves.encode

    def spy_encode(self, x):
        if x.grad_fn is None:  # the forward's dropout noise, as plain autograd saved it
            noises.append(x.detach().clone())
        return real_encode(self, x)
    monkeypatch.setattr(sdpa_math.MathSaves, "encode", spy_encode)
    got, _, _ = _grads_with_bias(model, q, k, v, "division", grad)
    assert len(noises) == (1 if model.dropout else 0)
    hats = [decoded[r].requires_grad_() for r in attention.ROLES]
    assert not torch.equal(hats[0], q)
    bias = model.bias.detach().clone().requires_grad_()
    mask = bias if model.shift is None else (bias + model.shift[:, None]).repeat(2, 1, 1, 1)
    _decomposed(*hats, None if model.causal else mask, noises[0] if noises else None,
                model.causal).backward(grad)
    assert (bias.grad is None) == model.causal
    for g, want in zip(got, [*(h.grad for h in hats), bias.grad]):
        if want is not None:
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)


def test_math_path_replays_the_rng_state_without_touching_the_callers_stream(monkeypatch):
    model = BiasAttend(dropout=0.3)
    q, k, v = _qkv(2, (4, 3, 48, 16))
    calls = []
    real_encode = sdpa_math.MathSaves.encode

    def spy_encode(self, x):
        calls.append(self)
        return real_encode(self, x)
    monkeypatch.setattr(sdpa_math.MathSaves, "encode", spy_encode)
    with freqact.compress(model, "division"):
        out = model(q, k, v)
    state = torch.get_rng_state()
    out.sum().backward(retain_graph=True)
    assert torch.equal(torch.get_rng_state(), state)  # backward drew nothing from the stream
    first = q.grad.clone()
    q.grad = None
    out.sum().backward(retain_graph=True)  # a second rerun: the same noise, the same gradient
    assert torch.equal(q.grad, first)
    assert len(set(map(id, calls))) == 1
    calls[0].replay = torch.Generator().manual_seed(1).get_state()  # another mask is drawn
    with pytest.raises(RuntimeError, match="dropout mask"):
        out.sum().backward()


def test_math_path_bytes_hold_the_packed_inputs_and_one_period_of_the_mask():
    model = BiasAttend(windows=2)
    q, k, v = _qkv(shape=(8, 3, 48, 16))
    with freqact.compress(model, "division") as meter:
        model(q, k, v)
    routes = meter.by_route()
    codec = TokenLayout(codecs.get("division"))
    period = 2 * 3 * 48 * 48 * 4  # (windows, heads, T, T) of the (8, 3, T, T) repeated mask
    assert routes["division feat/chan"]["saved_bytes"] == (
        3 * packed_nbytes(codec, (24, 48, 16)) + period)
    assert routes["recomputed"]["saved_bytes"] == 0
    # plain PyTorch holds the scaled q and k^T, the softmax output and v (a view of it)
    assert meter.exact_bytes == 3 * q.numel() * 4 + 8 * 3 * 48 * 48 * 4


def test_zoo_swin_compresses_over_8x_and_its_gradient_stays_bounded():
    torch.manual_seed(0)
    model = models.get("swin", num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])

    def grads(codec):
        model.zero_grad(set_to_none=True)
        with freqact.compress(model, codec) as meter:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), meter
    plain, _ = grads("exact")
    division, meter = grads(codecs.get("division", block=8, bits=2))
    assert meter.ratio >= 8, meter.table()
    attention_rows = [r for r in meter.per_layer() if r.type == "WindowAttention"]
    assert len(attention_rows) == 6 and all("recomputed" in r.routes for r in attention_rows)
    assert float((division - plain).norm() / plain.norm()) < 2


@pytest.mark.parametrize("kwargs", [{"is_causal": True}, {"dropout_p": 0.2}])
def test_two_calls_with_the_same_arguments_are_two_units(kwargs, monkeypatch):
    # the same q, k, v (alive, equal argument tuples): the tracker's call number tells them apart,
    # and each call's backward reads its own decoded q, k, v (one unit for both would decode the
    # second call's packing twice)
    q, k, v = _qkv(4, (2, 3, 48, 16))
    model = Attend(**kwargs)
    decoded, real = {}, attention.SdpaCall._decode

    def spy(self, role):
        x = real(self, role)
        decoded.setdefault(self.call_id, {})[role] = x.view(self.shapes[role]).detach().clone()
        return x
    monkeypatch.setattr(attention.SdpaCall, "_decode", spy)
    with freqact.compress(model, "division") as meter:
        out = model(q, k, v) + model(q, k, v)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert meter.by_route()["division feat/chan"]["count"] == (2 if kwargs.get("dropout_p") else 6)
    if kwargs.get("dropout_p"):
        return  # the math path's rerun checks its saves itself (a merged unit raises there)
    assert len(decoded) == 2
    want = [torch.zeros_like(t) for t in (q, k, v)]
    for hats in decoded.values():
        hats = [hats[r].requires_grad_() for r in attention.ROLES]
        F.scaled_dot_product_attention(*hats, **kwargs).sum().backward()
        for w, h in zip(want, hats):
            w += h.grad
    for t, w in zip((q, k, v), want):
        torch.testing.assert_close(t.grad, w, rtol=1e-4, atol=1e-5)


def test_math_path_under_autocast_reruns_on_the_decoded_float32_inputs(monkeypatch):
    # CPU autocast casts q, k, v to bfloat16 inside SDPA, where the pack hook cannot see it
    # (autocast reads as off inside the op): the rerun computes in float32 on q_hat, k_hat,
    # v_hat, and the forward graph's casts round the gradients to bfloat16 on the way back
    model = BiasAttend()
    q, k, v = _qkv(6, (4, 3, 48, 16))
    decoded = _spy_decoded(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16), freqact.compress(model, "division"):
        out = model(q, k, v)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    hats = [decoded[r].requires_grad_() for r in attention.ROLES]
    bias = model.bias.detach().clone().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(*hats, attn_mask=bias).sum().backward()
    for g, h in zip((q.grad, k.grad, v.grad, model.bias.grad), (*hats, bias)):
        torch.testing.assert_close(g, h.grad.bfloat16().float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_mixed_dtypes_under_autocast_are_routed_as_before_the_rerun(causal):
    # Rotary embeddings make q and k float32 while v stays bfloat16 (HF Llama, Mistral under
    # CPU autocast): SDPA casts them to one dtype inside the op, unseen by the hooks, where the
    # rerun chose the MATH backend on the mixed inputs and raised in backward
    model = Attend(is_causal=causal)
    q, k, v = _qkv(7, (4, 2, 64, 32))
    grads = []
    for codec in (None, "division"):
        for t in (q, k, v):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), (
                freqact.compress(model, codec) if codec else contextlib.nullcontext()):
            out = model(q, k, v.bfloat16())
        out.float().sum().backward()
        grads.append(torch.cat([t.grad.flatten() for t in (q, k, v)]))
    plain, coded = grads
    assert torch.isfinite(coded).all() and _rel([coded], [plain]) < 1


def test_held_mask_keeps_the_values_in_the_fewest_bytes():
    gen = torch.Generator().manual_seed(0)
    window = torch.randn(2, 3, 16, 16, generator=gen)
    window[0, :, 0, 1] = float("-inf")
    # Swin-like: the first windows alike (no shift mask there), so only a whole period repeats
    windows = torch.cat([window[:1].expand(3, 3, 16, 16), window[1:]])
    cases = {"periodic": (window.repeat(4, 1, 1, 1), 2, window.numel() * 4),
             "alike-first": (windows.repeat(2, 1, 1, 1), 4, windows.numel() * 4),
             "broadcast": (torch.randn(4, 1, 16, 16, generator=gen).expand(4, 3, 16, 16), 0,
                           4 * 16 * 16 * 4),
             "other": (torch.randn(8, 3, 16, 16, generator=gen), 0, 8 * 3 * 16 * 16 * 4)}
    for mask, period, nbytes in cases.values():
        held = sdpa_math.HeldMask(mask.requires_grad_() if mask.is_leaf else mask)
        assert (held.period, held.nbytes) == (period, nbytes)
        rebuilt = held.rebuild()
        assert torch.equal(rebuilt, mask) and rebuilt.requires_grad == mask.requires_grad
    mask = torch.randn(8, 3, 16, 16)
    held = sdpa_math.HeldMask(mask)
    mask.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        held.rebuild()


@pytest.mark.parametrize("math", [False, True])
def test_a_call_is_freed_with_its_graph_without_the_cycle_collector(monkeypatch, math):
    # the routes' codecs refer back to their SdpaCall; once backward starts the call drops them,
    # so reference counting frees it (and its packed q, k, v) when the graph goes
    import gc
    import weakref

    calls = []
    real = attention.SdpaCall.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        calls.append(weakref.ref(self))
    monkeypatch.setattr(attention.SdpaCall, "__init__", init)
    q, k, v = _qkv(7)
    model = BiasAttend() if math else Attend(is_causal=True)
    gc.collect()
    gc.disable()
    try:
        with freqact.compress(model, "division") as meter:
            out = model(q, k, v)
        assert meter.by_route()["recomputed"]["count"] >= 2  # the recomputed path was taken
        out.sum().backward()
        del out
        assert calls and all(ref() is None for ref in calls)
    finally:
        gc.enable()


@pytest.mark.parametrize("rerun", ["traced", "direct"])
def test_math_path_rerun_leaves_nothing_behind(rerun, monkeypatch):
    # the traced rerun's graph is never differentiated: it must go with its saves (a pack hook
    # returning a saved output as is would tie it to its own node, a cycle through C++ no
    # collector frees: Swin's resident set grew 24 MB per step)
    import gc

    if rerun == "traced":  # every step traces (else only the first would: the check)
        monkeypatch.setattr(sdpa_math, "_DIRECT", _Traced())
    model = BiasAttend(windows=2)
    q, k, v = _qkv(7, (4, 3, 48, 16))

    def step():
        with freqact.compress(model, "division") as meter:
            out = model(q, k, v)
        assert meter.by_route()["recomputed"]["count"] >= 2  # the math path was taken
        out.sum().backward()

    def live_tensors():
        gc.collect()
        return sum(type(o) is torch.Tensor for o in gc.get_objects())

    step()
    before = live_tensors()
    for _ in range(3):
        step()
    assert live_tensors() == before


def _math_saves(q, k, v, mask, scale):
    """What SDPA on the MATH backend saves for its backward (without dropout), in order."""
    saved = []

    def keep(t):
        saved.append(t.detach())
        return saved[-1]
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        F.scaled_dot_product_attention(*inputs, attn_mask=mask, scale=scale)
    return saved


@pytest.mark.parametrize("scale", [None, 0.3, -0.3])
@pytest.mark.parametrize("mask", ["none", "bias", "rows-masked", "nan"])
def test_direct_saves_are_the_math_backends_bit_for_bit(mask, scale):
    q, k, v = (t.detach() for t in _qkv(11, (2, 3, 24, 16)))
    v = torch.randn(2, 3, 24, 8)  # another last dim for v
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(2, 1, 24, 24, generator=gen).index_fill(2, torch.tensor([0, 5]),
                                                                float("-inf"))
    masks = {"none": None, "bias": torch.randn(3, 24, 24, generator=gen),
             "rows-masked": rows,  # whole rows at -inf: zeros
             "nan": rows.index_fill(3, torch.tensor([2]), float("nan"))}  # NaN rows stay NaN
    want = _math_saves(q, k, v, masks[mask], scale)
    got = sdpa_math.direct_saves(q, k, v, masks[mask], scale)
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    if mask == "rows-masked":
        assert torch.equal(got[2][:, :, 0], torch.zeros(2, 3, 24))
    if mask == "nan":
        assert got[2].isnan().all()


def _two_backwards(model):
    """Division gradients of two identical calls of model (the same noise), and what the first
    call's check recorded: the first reruns traced, the second as the check decided."""
    q, k, v = _qkv(5, (4, 3, 48, 16))
    grad = torch.randn(4, 3, 48, 16, generator=torch.Generator().manual_seed(6))
    first, _, _ = _grads_with_bias(model, q, k, v, "division", grad)
    checks = list(sdpa_math._DIRECT.values())
    second, _, _ = _grads_with_bias(model, q, k, v, "division", grad)
    return first, checks, second


def _equal(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b) if x is not None)


@pytest.mark.parametrize("case", ["bias", "bias+shift-mask"])
def test_math_path_reruns_directly_once_checked_with_the_same_gradients(case, monkeypatch):
    # the first rerun of a kind of call traces SDPA and checks the direct saves against it; the
    # next ones compute them directly, and backward gives the same bits
    traced, real = [], sdpa_math.MathSaves._traced

    def spy(self, inputs, mask):
        traced.append(1)
        return real(self, inputs, mask)
    monkeypatch.setattr(sdpa_math.MathSaves, "_traced", spy)
    first, checks, second = _two_backwards(BiasAttend(**_MATH_CASES[case]))
    assert checks == [True] and len(traced) == 1  # the second backward did not trace
    assert _equal(first, second)


def test_math_path_keeps_tracing_a_kind_whose_direct_saves_differ(monkeypatch):
    # another PyTorch decomposing otherwise: the check fails once, and that kind stays traced
    real = sdpa_math.direct_saves
    monkeypatch.setattr(sdpa_math, "direct_saves",
                        lambda *args: [t * 1.0001 for t in real(*args)])
    first, checks, second = _two_backwards(BiasAttend())
    assert checks == [False]
    monkeypatch.setattr(sdpa_math, "direct_saves", real)
    monkeypatch.setattr(sdpa_math, "_DIRECT", {})
    reference = _two_backwards(BiasAttend())[0]  # the first of its kind: traced
    assert _equal(first, second) and _equal(first, reference)


def test_a_direct_path_that_raises_counts_as_differing(monkeypatch):
    def raising(*args):
        raise RuntimeError("another decomposition")
    monkeypatch.setattr(sdpa_math, "direct_saves", raising)
    first, checks, second = _two_backwards(BiasAttend())  # the second would raise if direct
    assert checks == [False] and _equal(first, second)


def test_differing_saves_with_nans_are_checked_again(monkeypatch):
    # a NaN bias makes every save after the scores NaN: NaN payloads may differ between the two
    # reruns, so a difference there decides nothing and the next call checks again
    real, checked = sdpa_math.direct_saves, []

    def perturbed(*args):
        checked.append(1)
        return [t * 1.0001 for t in real(*args)]
    monkeypatch.setattr(sdpa_math, "direct_saves", perturbed)
    model = BiasAttend()
    with torch.no_grad():
        model.bias[0, 0, 0] = float("nan")
    _two_backwards(model)
    assert sdpa_math._DIRECT == {} and len(checked) == 2


def test_direct_rerun_check_compares_bits():
    nan, zero = torch.tensor([float("nan")]), torch.tensor([0.0])
    assert sdpa_math._same_bits(nan, nan.clone())  # a NaN is the same bits as itself
    assert not sdpa_math._same_bits(zero, -zero)  # equal values, other bits
    assert not sdpa_math._same_bits(zero, zero.double())


def test_math_path_backward_under_autocast_reruns_as_outside(monkeypatch):
    # the rerun turns autocast off: the first backward (traced, then checked) and the next
    # (direct) give the same bits inside an autocast block, and the check passes
    model = BiasAttend()
    q, k, v = _qkv(5, (4, 3, 48, 16))

    def grads():
        torch.manual_seed(7)
        with freqact.compress(model, "division"):
            out = model(q, k, v)
        for t in (q, k, v):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out.sum().backward()
        return [t.grad.clone() for t in (q, k, v)]
    first = grads()
    assert list(sdpa_math._DIRECT.values()) == [True]
    assert all(torch.equal(a, b) for a, b in zip(first, grads()))


def test_math_path_with_a_negative_scale_reruns_directly():
    # ATen scales q by -sqrt(|s|) and k by +sqrt(|s|); the direct rerun does the same
    class Negative(BiasAttend):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, scale=-0.25)
    first, checks, second = _two_backwards(Negative())
    assert checks == [True] and _equal(first, second)


@pytest.mark.parametrize("case", ["dropout", "causal+dropout", "shift-mask+dropout"])
def test_math_path_with_dropout_or_causal_always_traces(case):
    model = BiasAttend(**_MATH_CASES[case])
    q, k, v = _qkv(5, (4, 3, 48, 16))
    grad = torch.ones(4, 3, 48, 16)
    for _ in range(2):
        _grads_with_bias(model, q, k, v, "division", grad)
    assert sdpa_math._DIRECT == {}
