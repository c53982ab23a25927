"""FSDP2 (`fully_shard`): `compress` on sharded models and `freqact train --fsdp`, 2 gloo processes.

tests/_fsdp_worker.py runs every engine case in one torchrun launch (two SGD steps each, and one
step of resnet20 sharded as `freqact train --fsdp` does) and saves the gathered gradients and
meters; the tests below read that file.

Bit-identity is against one process on the same global batch run as the ranks' two halves with the
gradients accumulated and halved: a 2-rank sum is commutative and halving is exact, so that is
what FSDP2's averaging reduce-scatter computes. One backward over the whole batch sums the samples
inside the kernels in another order (differences ~1e-8), so it is compared with a tolerance.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_fsdp_worker.py")
REPO = Path(__file__).resolve().parents[1]


def _torchrun(args: list, cwd) -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               *args]
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[:3000]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    _torchrun([str(WORKER), str(folder / "results.pt")], folder)
    return torch.load(folder / "results.pt", weights_only=True)


def _equal(grads: list, ref: list, names=None, steps=2) -> list:
    """(step, name) of the gradients of the first `steps` steps that differ in any bit."""
    return [(step, name) for step in range(steps) for name in (names or ref[step])
            if not torch.equal(grads[step][name], ref[step][name])]


@pytest.mark.parametrize("case", ["exact-reshard", "exact-keep", "exact-mixed", "exact-ckpt"])
def test_exact_is_bit_identical_to_one_process_on_the_global_batch(results, case):
    # reshard: unsharded weights freed after forward and gathered again (new storage) for
    # backward; keep: reshard_after_forward=False; mixed: stem and head stay plain parameters;
    # ckpt: torch.utils.checkpoint inside each FSDP2 unit.
    assert _equal(results[case][0], results["reference"]) == []
    assert _equal(results["plain"][0], results["reference"]) == []
    for name, value in results["whole"].items():
        torch.testing.assert_close(results[case][0][0][name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", ["bf16", "autocast"])
def test_exact_under_mixed_precision_equals_fsdp_without_compress(results, case):
    # bf16: MixedPrecisionPolicy(param_dtype=bfloat16) (unsharded weights gathered in bf16);
    # autocast: torch.autocast with a frozen stem, whose autocast copy has no history.
    assert _equal(results[f"exact-{case}"][0], results[f"plain-{case}"][0]) == []


@pytest.mark.parametrize("case", ["division", "exact-bf16", "exact-autocast"])
def test_meter_equals_the_single_process_meter_of_the_rank_batch(results, case):
    # Unsharded weights (bf16 gathers, autocast copies) are never counted as activations, on
    # either rank, on the first step and after the re-gathers of the second.
    for rank, local in enumerate(results["local-meters"]):
        meters = results[f"{case}-meters"][rank]
        assert meters[0] == local[case] and meters[1] == local[case], rank
    assert results["division-meters"][0][0]["exact"] > 2 * results["division-meters"][0][0]["saved"]


def test_division_trains_and_checkpointed_units_stay_exact(results):
    ref = results["reference"]
    for case in ("division", "division-ckpt"):
        for step in range(2):
            got = torch.cat([results[case][0][step][n].flatten() for n in ref[step]])
            want = torch.cat([ref[step][n].flatten() for n in ref[step]])
            assert torch.isfinite(got).all()
            assert torch.nn.functional.cosine_similarity(got, want, 0) > 0.95, (case, step)
    # checkpoint's own hooks hold what the units save, so only the stem and head inputs are
    # compressed: the first step's unit gradients are exact (later steps start from other weights)
    inside = [n for n in ref[0] if n.startswith("blocks.")]
    assert _equal(results["division-ckpt"][0], ref, inside, steps=1) == []
    assert _equal(results["division"][0], ref, inside, steps=1) != []


def test_tensor_parallel_parameters_are_refused_on_entry(results):
    message = results["tensor-parallel"]
    assert message.startswith("model: 0.weight is a DTensor with placements (Shard(dim=0),)")
    assert "not tensor or pipeline parallel" in message


def test_train_sharding_of_a_residual_network(results):
    # distributed.wrap (what `freqact train --fsdp` does): one unit per block, then the root
    resnet = results["resnet"]
    assert resnet["units"] == ["", *resnet["blocks"]] and len(resnet["blocks"]) == 9
    assert _equal([resnet["grads"]], [resnet["reference"]], steps=1) == []
    for meter, local in results["resnet-meters"]:
        assert meter == local


# --- freqact train --fsdp -----------------------------------------------------------------------

ARGS = ["-m", "freqact", "train", "--fsdp", "--model", "mlp", "--dataset", "synthetic",
        "--subset", "8", "--batch-size", "8", "--device", "cpu", "--seed", "3", "--mode", "exact",
        "--epochs", "2", "--save-epochs", "1"]


def test_train_fsdp_checkpoints_whole_models_and_resumes(tmp_path):
    from freqact import checkpoint, train

    out = tmp_path / "fsdp"
    _torchrun([*ARGS, "--out", str(out)], tmp_path)
    done = checkpoint.load(out / "ckpt" / "last.pt")
    net, first = checkpoint.load_model(out / "ckpt" / "epoch-0001.pt")  # what `freqact eval` reads
    assert done["config"]["fsdp"] and done["config"]["world_size"] == 2
    single = train.train(train.RunConfig(model="mlp", dataset="synthetic", subset=8, batch_size=8,
                                         device="cpu", seed=3, mode="exact", epochs=2,
                                         out=str(tmp_path / "single")))
    want = checkpoint.load(single["last_checkpoint"])
    assert set(done["model"]) == set(want["model"]) == set(net.state_dict())
    for name, value in want["model"].items():
        torch.testing.assert_close(done["model"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    # resume from epoch 1 (sharded model and optimizer loaded from the whole state dicts): the
    # second epoch comes out bit-identical, so the momentum buffers were restored
    (out / "ckpt" / "last.pt").unlink()
    _torchrun([*ARGS, "--out", str(out), "--resume"], tmp_path)
    resumed = checkpoint.load(out / "ckpt" / "last.pt")
    assert first["epoch"] == 1 and resumed["epoch"] == 2
    for name, value in done["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    for key in ("train_loss", "test_loss", "test_acc"):
        assert resumed["metrics"][1][key] == done["metrics"][1][key]


def test_runs_written_before_the_fsdp_setting_resume(tmp_path):
    from freqact import checkpoint, train

    config = {"model": "mlp", "dataset": "synthetic", "subset": 8, "batch_size": 8, "seed": 3,
              "device": "cpu", "epochs": 2, "save_epochs": [1], "out": str(tmp_path / "run")}
    done = train.train(train.RunConfig(**config))
    first = Path(done["checkpoints"][0])
    old = checkpoint.load(first)
    del old["config"]["fsdp"]
    checkpoint.save(first, old)
    Path(done["last_checkpoint"]).unlink()
    resumed = train.train(train.RunConfig(**config, resume=True))
    assert resumed["metrics"][1]["train_loss"] == done["metrics"][1]["train_loss"]


def test_fsdp_evaluation_gives_every_rank_as_many_batches():
    # each FSDP2 forward gathers weights from every rank: a rank with one batch fewer would hang
    from freqact import data, distributed, evaluation, models

    net = models.get("mlp")
    ds = data.load_synthetic(8, num_test=33, shape=net.input_shape)

    def sizes(rank, **kwargs):
        ctx = distributed.Context(rank=rank, world_size=2)
        return [len(y) for _, y in evaluation.eval_batches(ds, net, ctx, 8, **kwargs)]

    assert sizes(0, even=True) == [6, 6, 5] and sizes(1, even=True) == [6, 5, 5]
    assert sizes(0) == [8, 8, 1] and sizes(1) == [8, 8]
