"""Robustness sweep (issue 8), part 4: concurrency and reuse of `compress`.

Nested blocks and two models at once are refused clearly (their container works), and so is a
model that another thread's block hooks (issue 15); encode/decode from several threads, one block
per thread, another thread's plain forward of a hooked model, backward twice with
retain_graph=True, and a model after its block closed all give exactly the gradients plain
PyTorch gives.
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import freqact
from freqact import kernels
from tests.robustness.helpers import grads, tiny


def test_nested_blocks_and_two_models_at_once_are_refused_clearly():
    x = torch.randn(2, 3, 8, 8)
    a, b = tiny(0), tiny(1)
    with freqact.compress(a, "exact"):
        for inner in (a, b):
            with pytest.raises(RuntimeError, match="cannot be nested.*nn.ModuleList"):
                with freqact.compress(inner, "division"):
                    pass
        out = a(x)
    out.sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads(tiny(0), x), a.parameters()))
    # Two models in one block: hook their container.
    pair = nn.ModuleList([tiny(0), tiny(1)])
    with freqact.compress(pair, "exact") as meter:
        loss = pair[0](x).sum() + pair[1](x).sum()
    loss.backward()
    assert {row["layer"].split(".")[0] for row in meter.per_layer()} == {"0", "1"}
    for seed, model in enumerate(pair):
        plain = grads(tiny(seed), x)
        assert all(torch.equal(g, p.grad) for g, p in zip(plain, model.parameters()))


def test_encode_decode_from_several_threads_matches_one_thread():
    torch.manual_seed(3)
    xs = [torch.randn(4, 8, 14, 14) for _ in range(8)]
    noises = [torch.rand(x.shape) for x in xs]
    expected = [kernels.division_decode(kernels.division_encode(x, 8, 2, u))
                for x, u in zip(xs, noises)]
    got = [None] * len(xs)

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = kernels.division_decode(kernels.division_encode(xs[i], 8, 2, noises[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(e, g) for e, g in zip(expected, got))


def test_compress_in_several_threads_each_with_its_own_model():
    x = torch.randn(2, 3, 8, 8)
    nets = [tiny(seed) for seed in range(4)]  # seeding is global: build them before the threads
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            results[seed] = grads(nets[seed], x, "exact")
        except BaseException as err:  # surfaced below: a thread's exception is otherwise lost
            errors.append(err)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for seed in range(4):
        assert all(torch.equal(a, b) for a, b in zip(grads(tiny(seed), x), results[seed]))


def test_retain_graph_decodes_twice_to_the_same_gradients():
    model, x = tiny(), torch.randn(2, 3, 8, 8)
    with freqact.compress(model, "division"):
        loss = model(x).sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))


def test_model_after_its_block_closed_is_plain_pytorch_again():
    model, x = tiny(), torch.randn(2, 3, 8, 8)
    with freqact.compress(model, "exact"):
        out = model(x)
    out.sum().backward()  # the graph outlives the block: its packed forms are still decoded
    inside = [p.grad.clone() for p in model.parameters()]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    after = grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(inside, after))
    with pytest.raises(KeyError):  # an error inside a block closes it too
        with freqact.compress(model, "division"):
            raise KeyError("boom")
    with freqact.compress(model, "division") as meter:
        model(x)
    assert meter.ratio > 1


def test_a_second_writer_of_a_run_directory_gets_one_line_and_exit_2(tmp_path, capsys):
    """Two `freqact train --out RUN` at once would mix their checkpoints: the second is refused
    while the first holds RUN's lock (here this process, through a descriptor of its own)."""
    from freqact.rundir import RunDir
    from tests.robustness.helpers import run_cli

    out = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--dataset", "synthetic", "--epochs", "1", "--subset", "16",
            "--batch-size", "16", "--out", out, "--device", "cpu", "--save-epochs"]
    with RunDir(out).lock():
        code, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{out} is in use by another freqact process" in err
    assert not (out / "ckpt").exists()
    assert run_cli(argv, capsys)[0] == 0  # the lock went with its holder


def _in_thread(fn) -> BaseException | None:
    """Run fn in another thread; the exception it raised, or None."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except Exception as err:  # surfaced to the caller
            caught.append(err)

    thread = threading.Thread(target=run, name="other")
    thread.start()
    thread.join()
    return caught[0] if caught else None


def test_a_model_in_another_threads_block_is_refused_clearly():
    x = torch.randn(2, 3, 8, 8)
    model, pair = tiny(0), nn.ModuleList([tiny(1)])
    with freqact.compress(model, "division"):
        err = _in_thread(lambda: freqact.compress(model, "division").__enter__())
        assert isinstance(err, RuntimeError)
        assert "already inside a compress block of thread 'MainThread'" in str(err)
        # a container holding a hooked module is the same model
        pair.append(model)
        err = _in_thread(lambda: freqact.compress(pair, "exact").__enter__())
        assert isinstance(err, RuntimeError) and "'1'" in str(err)
        # the refusal claimed nothing: the container's other module is free
        assert _in_thread(lambda: grads(pair[0], x, "exact")) is None
        out = model(x)
    out.sum().backward()
    # after the block the model is free for any thread
    assert _in_thread(lambda: grads(model, x, "exact")) is None


def test_another_threads_plain_forward_does_not_disturb_the_block():
    x = torch.randn(2, 3, 8, 8)
    model = tiny(0)
    plain = grads(tiny(0), x)
    with freqact.compress(model, "exact") as meter:
        # the other thread's forward runs the hooked modules but has no saved-tensor hooks
        assert _in_thread(lambda: model(x).sum().backward()) is None
        assert meter.per_layer() == []
        model.zero_grad(set_to_none=True)
        out = model(x)
    out.sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(plain, model.parameters()))
    assert {row.layer for row in meter.per_layer()} == {"conv", "bn", "relu", "pool", "fc"}
