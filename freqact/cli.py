"""The `freqact` command line: one parser function and one handler per subcommand.

Handlers only translate arguments into one library call and print where results went.
Expected errors (bad arguments, missing or unreadable files, a full disk) become one line on
stderr and exit code 2; any other exception is a bug and keeps its traceback.

Only the chosen subcommand's options are built, and each builder and handler imports the library
lazily, so `freqact --help` and `freqact --version` never import torch.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from freqact.errors import UsageError

# Each entry: (name, help, add_arguments(parser), handler(args) -> int).
Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _flag(setting: str) -> str:
    """The command-line flag of a codec setting: "--block"."""
    return f"--{setting.replace('_', '-')}"


def _add_codec_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting of the training modes' codecs, from the codecs' declarations.

    Defaults are None here so that `_train` can tell a flag given on the command line (refused
    when the mode does not use it) from one left at the codec's default.
    """
    from freqact import codecs

    for setting in codecs.mode_settings():
        users = [m for m in codecs.modes() if setting in codecs.codec_class(m).settings]
        parser.add_argument(
            _flag(setting.name), dest=setting.name, type=setting.type,
            default=None, choices=setting.choices if setting.type is str else None,
            help=f"{'/'.join(users)}: {setting.help}; {setting.expected()} "
                 f"(default {setting.default})")


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from freqact import data, train

    defaults = train.RunConfig()
    add = parser.add_argument
    add("--model", default=defaults.model, help="a freqact.models name (default %(default)s)")
    add("--dataset", default=defaults.dataset, choices=data.DATASETS)
    add("--mode", default=defaults.mode, choices=train.MODES,
        help="normal: plain PyTorch; others: the codec that stores cached activations")
    _add_codec_arguments(parser)
    for flag, what in (("--include", "compress only these; default: the engine's default "
                                     "types everywhere"),
                       ("--exclude", "keep these exact (wins over --include)")):
        add(flag, nargs="+", default=None, metavar="TYPE_OR_NAME",
            help="codec modes: module types (torch.nn class names: Conv2d, BatchNorm2d, Linear) "
                 f"and/or module names of the model (a name covers its submodules: fc, stages.0): "
                 f"{what}")
    add("--epochs", type=int, default=defaults.epochs, help="(default %(default)s)")
    add("--batch-size", type=int, default=defaults.batch_size,
        help="global batch over all ranks (default %(default)s)")
    add("--lr", type=float, default=defaults.lr,
        help="initial learning rate in [0, 10], cosine schedule (default %(default)s)")
    add("--momentum", type=float, default=defaults.momentum,
        help="SGD only, in [0, 1] (default %(default)s)")
    add("--weight-decay", type=float, default=defaults.weight_decay,
        help="in [0, 1]; adamw: decoupled, each step scales weights by 1 - lr * wd "
        "(default %(default)s; AdamW runs usually take 0.05)")
    add("--optimizer", default=defaults.optimizer, choices=train.OPTIMIZERS,
        help="sgd: momentum SGD (the paper's CNN recipe); adamw: AdamW, betas (0.9, 0.999), "
        "--momentum unused (transformers); both with the cosine schedule (default %(default)s)")
    add("--model-options", type=_json_object, default={}, metavar="JSON",
        help='the model\'s own settings as a JSON object, e.g. \'{"dim": 64, "depth": 2}\' '
        "(default: the family's defaults)")
    add("--subset", type=int, default=None, help="train on the first N training images only")
    add("--seed", type=int, default=defaults.seed, help="in [0, 2**32 - 1] (default %(default)s)")
    add("--amp", action="store_true",
        help="autocast: bfloat16 on CPU, float16 + GradScaler on CUDA")
    add("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    add("--workers", type=int, default=None,
        help="deprecated and ignored: data are in-memory tensors batched on the device")
    add("--data-dir", default=None,
        help="CIFAR folder's parent (default $FREQACT_DATA, else ./data)")
    add("--download", action="store_true", help="download CIFAR (md5-checked) when missing")
    add("--out", default=None, help="run directory (default runs/MODEL-DATASET-MODE)")
    add("--save-epochs", type=int, nargs="*", default=defaults.save_epochs, metavar="E",
        help="keep ckpt/epoch-XXXX.pt after these epochs (default %(default)s)")
    add("--save-every", type=int, default=None, metavar="K", help="also keep every K-th epoch")
    add("--resume", action="store_true", help="continue the run in --out from ckpt/last.pt (or start it)")
    add("--log-every", type=int, default=None, metavar="N",
        help="a progress line every N steps (default: every ~10%% of an epoch when not on a terminal)")
    add("--fsdp", action="store_true",
        help="under torchrun: shard the model with FSDP2 (fully_shard per block) instead of DDP")


def _json_object(value: str) -> dict:
    """--model-options: a JSON object, else argparse's one-line error."""
    import json

    try:
        options = json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object ({err})") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return options


def _unset_codec_flags(args: argparse.Namespace) -> set[str]:
    """The codec settings not given on the command line; a codec flag (or --include/--exclude)
    that the mode does not use is refused (`runconfig.refuse_unused`)."""
    from freqact import codecs, runconfig, train

    names = [s.name for s in codecs.mode_settings()] + list(train.SELECTORS)
    runconfig.refuse_unused(args.mode, [n for n in names if getattr(args, n) is not None],
                            name_of=_flag)
    return {s.name for s in codecs.mode_settings() if getattr(args, s.name) is None}


def _train(args: argparse.Namespace) -> int:
    import dataclasses

    from freqact import train

    unset = _unset_codec_flags(args)
    if args.workers is not None:
        print("freqact train: --workers is deprecated and ignored (data are in-memory tensors)", file=sys.stderr)
    fields = {f.name for f in dataclasses.fields(train.RunConfig)} - unset
    try:
        results = train.train(train.RunConfig(**{k: v for k, v in vars(args).items() if k in fields}))
    except train.Interrupted as stop:  # Ctrl-C / SIGTERM: the checkpoints are whole
        print(f"freqact train: {stop}", file=sys.stderr)
        return stop.exit_code
    final = results["final"]
    if final and results["rank"] == 0:
        print(f"{results['run_dir']}: epoch {final['epoch']}, "
              f"test accuracy {final['test_acc']:.4f}")
    return 0


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint written by `freqact train`")
    parser.add_argument("--data-dir", default=None,
                        help="CIFAR folder's parent (default: the run's)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    parser.add_argument("--batch-size", type=int, default=512)


def _eval(args: argparse.Namespace) -> int:
    from freqact import train

    result = train.evaluate_checkpoint(args.checkpoint, data_dir=args.data_dir, device=args.device,
                                       batch_size=args.batch_size)
    print(f"{args.checkpoint} (epoch {result['epoch']}): test loss {result['loss']:.4f}  "
          f"accuracy {result['accuracy']:.4f}  ({result['count']} {result['unit']})")
    return 0


def _add_analysis_arguments(parser: argparse.ArgumentParser, images: int) -> None:
    """The options every analysis command shares."""
    parser.add_argument("--images", type=int, default=images,
                        help="the first N test images of the run's dataset (default %(default)s)")
    parser.add_argument("--data-dir", default=None, help="CIFAR folder's parent (default: the run's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--out", default=None, help="output folder (default RUN/analysis)")


def _add_window_rule_argument(parser: argparse.ArgumentParser) -> None:
    from freqact.codecs.settings import WINDOW_RULE

    parser.add_argument("--window-rule", default=WINDOW_RULE.default, choices=WINDOW_RULE.choices,
                        help="how W/N becomes W: r*N rounded half up, or the DIVISION code's "
                             "round(r*N + 0.5) (default %(default)s)")


def _add_layers_argument(parser: argparse.ArgumentParser, who: str) -> None:
    """--layers, as every analysis command reads it (`analysis.common.select_layers`)."""
    from freqact.analysis import common, pipelines

    parser.add_argument("--layers", default=pipelines.LAYERS, choices=common.LAYER_SETS,
                        help=f"the maps {who}: block outputs (Fig. 4), conv/linear inputs (models "
                             "without residual blocks: mlp, mobilenet_v2/v3), or both "
                             "(default %(default)s)")


def _add_lambdas_arguments(parser: argparse.ArgumentParser) -> None:
    from freqact.analysis import pipelines

    parser.add_argument("checkpoints", nargs="+", metavar="RUN_DIR_OR_CKPT",
                        help="checkpoints, or run directories (all their ckpt/epoch-*.pt)")
    parser.add_argument("--ratio", type=float, default=pipelines.RATIO, help="kept fraction W/N (default %(default)s)")
    _add_layers_argument(parser, "λ reads")
    _add_window_rule_argument(parser)
    _add_analysis_arguments(parser, images=pipelines.LAMBDA_IMAGES)


def _checkpoints_and_out(args: argparse.Namespace) -> tuple[list[Path], Path]:
    """The checkpoints `args.checkpoints` names, and --out (default: beside the first one)."""
    from freqact.analysis import common

    paths = common.resolve_checkpoints(args.checkpoints)
    return paths, Path(args.out) if args.out else common.default_out_dir(paths[0])


def _lambdas(args: argparse.Namespace) -> int:
    from freqact.analysis import pipelines

    paths, out = _checkpoints_and_out(args)
    done = pipelines.lambdas_analysis(paths, out, ratio=args.ratio, layers=args.layers, rule=args.window_rule,
                                      images=args.images, data_dir=args.data_dir, device=args.device)
    for row in (r for r in done.extra if r["layer"] == "(all)"):
        print(f"{row['checkpoint']}: lam_L > lam_H in {row['share_L_gt_H']:.1%} of "
              f"{row['instances']} (layer, instance) pairs")
    print("wrote " + ", ".join(map(str, done.files)))
    return 0


def _add_theorem31_arguments(parser: argparse.ArgumentParser) -> None:
    from freqact.analysis import pipelines

    parser.add_argument("checkpoints", nargs="+", metavar="RUN_DIR_OR_CKPT",
                        help="checkpoints, or run directories (all their ckpt/epoch-*.pt)")
    parser.add_argument("--ratio", type=float, default=pipelines.RATIO, help="kept fraction W/N (default %(default)s)")
    _add_window_rule_argument(parser)
    parser.add_argument("--no-end-to-end", dest="end_to_end", action="store_false",
                        help="skip the per-layer errors with the whole network in LFC-ACT / HFC-ACT")
    _add_analysis_arguments(parser, images=pipelines.THEOREM_IMAGES)


def _theorem31(args: argparse.Namespace) -> int:
    from freqact.analysis import pipelines, theorem31

    paths, out = _checkpoints_and_out(args)
    done = pipelines.theorem31_analysis(paths, out, ratio=args.ratio, rule=args.window_rule, images=args.images,
                                        end_to_end=args.end_to_end, data_dir=args.data_dir, device=args.device)
    rows, fidelity, written = done.rows, done.extra, done.files
    for f in fidelity:
        s = theorem31.summarize([r for r in rows if r["checkpoint"] == f["checkpoint"]])
        print(f"{f['checkpoint']} (epoch {f['epoch']}): err <= GEB held in {s['bound_holds']}/{s['layers']} "
              f"conv layers; tightness err/GEB median {s['median_tightness_L'] or 0:.3g} (LFC cached), "
              f"{s['median_tightness_H'] or 0:.3g} (HFC cached); err_L < err_H in "
              f"{s['err_L_lt_err_H']}/{s['layers']}; whole-network gradient cosine with exact: "
              f"LFC-ACT {f['cos_L']:.4f}, HFC-ACT {f['cos_H']:.4f}")
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _add_pooling_arguments(parser: argparse.ArgumentParser) -> None:
    from freqact.analysis import pipelines

    parser.add_argument("checkpoint", help="a checkpoint written by `freqact train`")
    parser.add_argument("--blocks", type=int, nargs="+", default=list(pipelines.BLOCKS), metavar="B",
                        help="DIVISION block sizes (default %(default)s)")
    _add_layers_argument(parser, "pooling reads besides the input images")
    _add_analysis_arguments(parser, images=pipelines.POOLING_IMAGES)


def _pooling(args: argparse.Namespace) -> int:
    from freqact.analysis import common, pipelines

    out = Path(args.out) if args.out else common.default_out_dir(Path(args.checkpoint))
    done = pipelines.pooling_analysis(args.checkpoint, out, blocks=args.blocks, layers=args.layers,
                                      images=args.images, data_dir=args.data_dir, device=args.device)
    rows, written = done.rows, done.files
    worst = max(r["dc_identity_err"] for r in rows)
    epoch = done.extra[0]["epoch"]
    print(f"{args.checkpoint} (epoch {epoch}): {len(rows)} (map, B) pairs; "
          f"max |block mean - DC/sqrt(block size)| = {worst:.2e}")
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    from freqact import sweep

    parser.add_argument("spec", help="a study spec (.toml, .json, .yaml) or a preset: "
                        + ", ".join(sweep.presets()))
    parser.add_argument("--out", default=None, help="the study's folder (default sweeps/NAME)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes; with several GPUs each takes one (round robin); "
                        "on the CPU they share the cores (default %(default)s)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--data-dir", default=None, help="CIFAR folder's parent (default $FREQACT_DATA, else ./data)")
    parser.add_argument("--download", action="store_true", help="download CIFAR (md5-checked) when missing")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the runs and whether they are finished; train and write nothing")


def _sweep(args: argparse.Namespace) -> int:
    from freqact import sweep

    if args.dry_run:
        _, states = sweep.plan(args.spec, args.out, data_dir=args.data_dir)
        for run_dir, state in states.items():
            print(f"{state:9s} {run_dir}")
        return 0
    try:
        outcome = sweep.run(args.spec, args.out, jobs=args.jobs, device=args.device,
                            data_dir=args.data_dir, download=args.download)
    except sweep.Interrupted as stop:  # Ctrl-C / SIGTERM: every run's checkpoints are whole
        print(f"freqact sweep: {stop}", file=sys.stderr)
        return stop.exit_code
    for run_dir, message in outcome["failed"]:
        print(f"freqact sweep: {run_dir} failed: {message}", file=sys.stderr)
    if outcome["written"]:
        print("wrote " + ", ".join(map(str, outcome["written"])))
    return 1 if outcome["failed"] else 0


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from freqact import demo

    add = parser.add_argument
    add("--data-dir", default=None,
        help="CIFAR-10 folder's parent (default $FREQACT_DATA, else ./data); digits when absent")
    add("--out", default="demo", help="output folder for runs, figures and report.md (default %(default)s)")
    net = parser.add_mutually_exclusive_group()
    net.add_argument("--download", action="store_true",
                     help="download CIFAR-10 when missing, without the connectivity check")
    net.add_argument("--offline", action="store_true", help="never try to download CIFAR-10")
    add("--quick", action="store_true", help="a seconds-long smoke run (tiny subset, 2 epochs)")
    add("--epochs", type=int, default=None, help=f"epochs per mode (default {demo.PLAN.epochs})")
    add("--subset", type=int, default=None, help=f"training images (default {demo.PLAN.subset})")
    add("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")


def _demo(args: argparse.Namespace) -> int:
    from freqact import demo

    demo.run(args.out, data_dir=args.data_dir, download=args.download, offline=args.offline,
             quick=args.quick, epochs=args.epochs, subset=args.subset, device=args.device)
    return 0


def _add_figures_arguments(parser: argparse.ArgumentParser) -> None:
    from freqact.analysis import pipelines

    add = parser.add_argument
    add("runs", nargs="+", metavar="RUN", help="run directories written by `freqact train`")
    add("--out", default="figures", help="folder for the figures and tables (default %(default)s)")
    add("--analysis-run", default=None, metavar="RUN",
        help="the run whose checkpoints λ, Theorem 3.1 and pooling read (default: the normal run)")
    add("--ratio", type=float, default=pipelines.RATIO,
        help="kept fraction W/N for λ and Theorem 3.1 (default %(default)s)")
    _add_window_rule_argument(parser)
    _add_layers_argument(parser, "λ and pooling read")
    for flag, default, what in (("--lambda-images", pipelines.LAMBDA_IMAGES, "λ reads per checkpoint"),
                                ("--theorem-images", pipelines.THEOREM_IMAGES, "Theorem 3.1 reads"),
                                ("--pooling-images", pipelines.POOLING_IMAGES, "pooling reads")):
        add(flag, type=int, default=default, metavar="N", help=f"test images {what} (default %(default)s)")
    add("--memory-images", type=int, default=None, metavar="N",
        help="batch of the memory measurement (default: each run's batch size)")
    add("--data-dir", default=None, help="CIFAR folder's parent (default: the runs')")
    add("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")


def _figures(args: argparse.Namespace) -> int:
    from freqact import figures

    made = figures.make_all(args.runs, args.out, analysis_run=args.analysis_run, ratio=args.ratio,
                            rule=args.window_rule, layers=args.layers, lambda_images=args.lambda_images,
                            theorem_images=args.theorem_images, pooling_images=args.pooling_images,
                            memory_images=args.memory_images, data_dir=args.data_dir,
                            device=args.device, progress=print)
    print("wrote " + ", ".join(str(path) for fig in made.values() for path in fig.files))
    return 0


def _commands() -> list[Command]:
    """The registered subcommands, in the order `freqact --help` lists them."""
    return [
        ("train", "Train a model (normal or with compressed activations); writes a run directory.",
         _add_train_arguments, _train),
        ("eval", "Test loss and accuracy of a training checkpoint.", _add_eval_arguments, _eval),
        ("lambdas", "λ^L and λ^H per layer and instance from checkpoints (the paper's Fig. 4).",
         _add_lambdas_arguments, _lambdas),
        ("theorem31", "Theorem 3.1 per conv layer (bound holds, tightness, err^L vs err^H) and "
                      "whole-network gradient fidelity of LFC-ACT/HFC-ACT, per checkpoint.",
         _add_theorem31_arguments, _theorem31),
        ("pooling", "DIVISION's block-mean LFC vs the DCT low-pass on real activation maps.",
         _add_pooling_arguments, _pooling),
        ("sweep", "Run a study (a grid of training runs) where missing; write its results table and figure.",
         _add_sweep_arguments, _sweep),
        ("demo", "The whole study at CPU scale: train every mode briefly, analyse, write report.md.",
         _add_demo_arguments, _demo),
        ("figures", "Regenerate every figure (λ, accuracy and memory, Theorem 3.1, pooling, per-layer "
         "compression) from run directories.", _add_figures_arguments, _figures),
    ]


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every subcommand attached.

    Args:
        commands: the subcommands whose options are built (their builders import the library);
            None: all. The others are listed with their help only.
    """
    from freqact import __version__

    parser = argparse.ArgumentParser(
        prog="freqact",
        description="Activation maps in the frequency domain and training with compressed "
        "activations (DIVISION).",
    )
    parser.add_argument("--version", action="version", version=f"freqact {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, add_arguments, handler in _commands():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if commands is None or name in commands:
            add_arguments(cmd)
        cmd.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `freqact` with `argv` (default: sys.argv[1:]); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The top-level options (-h, --version) take no value: the first other word is the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser([command] if command else [])
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    # UsageError (bad arguments and settings, UsageTypeError included) and the ValueError that
    # the library documents for bad input files; OSError: missing or unreadable files, and a disk
    # that fills up while saving. Other TypeErrors and KeyErrors are bugs: their traceback stays.
    except (UsageError, ValueError, OSError) as err:
        print(f"freqact {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
