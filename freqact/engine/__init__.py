"""Training with compressed activations: `compress(model, codec)` around the forward pass.

::

    with freqact.compress(model, "division", block=8, bits=2) as meter:
        loss = criterion(model(x), y)
    loss.backward()
    meter.ratio, meter.saved_bytes, meter.exact_bytes, meter.per_layer()
    print(meter)  # the per-layer table

One `torch.autograd.graph.saved_tensors_hooks` pair is active inside the `with` block, and forward
pre-/post-hooks on every module keep a stack telling the pack hook which module is running. Each
tensor autograd saves is routed by that module and by what the tensor is:

- a parameter or buffer, a view of one (`weight.t()`) or an autocast copy of one: kept as is and not
  counted (it is not activation memory);
- the input of a Conv/Linear/BatchNorm/LayerNorm/GroupNorm (or of an `include`d type): the codec,
  unless the codec declines it (`codec.accepts(x)` False: lfc/hfc on (N, F) inputs), then kept;
  a BatchNorm's (N, C) input is read per channel over the batch (the layout of its statistics);
- a ReLU's output (`nn.ReLU`, and `F.relu`/`torch.relu` by the function that saved it): 1-bit
  `relu-mask`; a ReLU6/Hardtanh input: 1-bit `hardtanh-mask`; a LeakyReLU
  input or output: 1-bit `sign-mask`; dropout's scaled noise: 1-bit `dropout-mask` (under `exact`
  the three activation masks are not made: the same storage is kept, counted once);
- MaxPool's int64 indices: uint8 window offsets (`maxpool-indices`); MaxPool/AvgPool inputs, whose
  values backward never reads: `shape-only` (0 bytes);
- before the module's rule, the torch function that saved the tensor (`engine.tracker`): Linear/
  GPT-2 Conv1D inputs of token tensors in any layout, GELU/SiLU/Hardswish/... inputs, softmax
  probabilities, SDPA's v/out (not causal, no mask) and nn.MultiheadAttention's projections go
  through the codec in 64-element blocks per feature column (`tile/chan`; `grid64/chan` on
  (N, H, W, C) grids; attention tensors `feat/chan`), LayerNorm/functional RMSNorm inputs per
  token (`tile/tok`); SDPA on the CPU flash kernel or the MATH backend: q/k/v packed, the rest
  recomputed in backward (`attention`, `sdpa_math`); elsewhere SDPA q/k, causal or masked
  attention and statistics stay exact;
- anything else (tensors under 4096 elements saved by ops, statistics), float8, sparse, nested and
  meta tensors, and tensors whose packed form would not be smaller: kept as is (sparse and nested ones
  are not counted in bytes); a storage one save keeps as is is kept for every later save of it
  (a coded copy beside it would hold more than plain PyTorch).

The choice is a table (`freqact.engine.routes`): torch function, then module kind -> a chooser
that looks at the saved tensor and returns a named `Route` (its layout in the meter's route name,
"division tile/chan"). Decoded tensors keep a channels-last memory format.

Kept tensors are checked for in-place modification at unpack (an error, as in plain PyTorch);
compressing codecs copy, so their gradients reflect the values at save time. A tensor saved by
several ops is packed once per route. Modules are never replaced: weights, initialisation and state
are untouched, and all hooks are removed on exit; only the meter survives the `with` block.
Non-finite values stay visible, never turn into finite garbage: a NaN/Inf in a map the codec
stores makes that map decode non-finite (all NaN for division, division-no-lfc and quant, see
docs/ARCHITECTURE.md; its block for division-no-hfc; the DCT spreads it for lfc/hfc), so gradients
that read it come out NaN as in plain PyTorch; the 1-bit masks treat NaN as PyTorch's own
backward does (NaN > 0 is false), except ReLU's: a NaN output gets bit 0, so its gradient is
zero there, where PyTorch's backward (`out <= 0` is false for NaN) passes it (the loss downstream
is NaN either way). A zero-size batch saves nothing and is kept as is.
A functional ReLU's own save is told from a later op's save of the same output by the torch
function running (`engine.tracker`: `relu` then, the next op's name later).

Not supported (refused or documented): nesting `compress` blocks in one thread, and opening a block
on a model (or a module of it) that another thread's block hooks (RuntimeError: one block per
model at a time; forwards of a hooked model in other threads are not compressed). A
`torch.compile`d model gets the graph-level hooks instead (`engine.compiled`); a model compiled
in place (`model.compile()`) is refused. `torch.utils.checkpoint(..., use_reentrant=False)` inside the block works: the
checkpointed regions save through checkpoint's own hooks (recomputation never reaches the codec)
and the meter counts only what the block saves itself, checkpoint's saved inputs included.
"""
from freqact.engine.block import compress
from freqact.engine.meter import LayerRow, Meter
from freqact.engine.routes import DEFAULT_TYPES, Route

__all__ = ["DEFAULT_TYPES", "LayerRow", "Meter", "Route", "compress"]
