"""freqact.demo: data choice (never touching the network), the end-to-end run and its report."""
from __future__ import annotations

import inspect
import re
import shlex
import threading
import time

import pytest

from freqact import cli, demo, figures, train


def _never(*args, **kwargs):
    raise AssertionError("must not be called")


def _offline_fetch(name, root):
    raise FileNotFoundError(f"{name}: could not download (offline)")


def test_choose_data_takes_cifar10_from_the_data_dir_without_the_network(cifar_dir):
    choice = demo.choose_data(cifar_dir.parent, check_online=_never, fetch=_never)
    assert (choice.dataset, choice.data_dir) == ("cifar10", str(cifar_dir.parent))
    assert "found" in choice.note


def test_choose_data_falls_back_to_digits_offline_in_one_line(tmp_path):
    choice = demo.choose_data(tmp_path, check_online=lambda: False, fetch=_never)
    assert (choice.dataset, choice.data_dir) == ("digits", None)
    assert choice.note.startswith(f"CIFAR-10 not found in {tmp_path}; using scikit-learn digits "
                                  "(offline fallback")
    assert "\n" not in choice.note


def test_choose_data_reads_freqact_data(monkeypatch, tmp_path):
    monkeypatch.setenv("FREQACT_DATA", str(tmp_path))
    assert str(tmp_path) in demo.choose_data(check_online=lambda: False, fetch=_never).note


def test_choose_data_download_failure_falls_back_and_says_why(tmp_path):
    calls = []

    def fetch(name, root):
        calls.append((name, root))
        raise FileNotFoundError("no route to host")

    choice = demo.choose_data(tmp_path, download=True, check_online=_never, fetch=fetch)
    assert calls == [("cifar10", tmp_path)]
    assert choice.dataset == "digits" and "download failed: no route to host" in choice.note


def test_choose_data_uses_the_download_when_online(cifar_dir, tmp_path):
    def fetch(name, root):  # stands in for the official archive: unpacks the real files
        (root / cifar_dir.name).symlink_to(cifar_dir, target_is_directory=True)

    choice = demo.choose_data(tmp_path, check_online=lambda: True, fetch=fetch)
    assert (choice.dataset, choice.data_dir) == ("cifar10", str(tmp_path))
    assert "downloaded" in choice.note


def test_online_gives_up_after_its_timeout(monkeypatch):
    release = threading.Event()

    def hang(address, timeout):  # a DNS lookup that does not answer in time
        release.wait(10)
        raise OSError("answered too late")

    monkeypatch.setattr(demo.socket, "create_connection", hang)
    start = time.perf_counter()
    try:
        assert demo.online(timeout=0.1) is False
        assert time.perf_counter() - start < 2
    finally:
        release.set()  # let the abandoned probe thread finish


def test_online_true_when_the_connection_opens(monkeypatch):
    class Connection:
        def close(self):
            pass

    seen = []
    monkeypatch.setattr(demo.socket, "create_connection",
                        lambda address, timeout: seen.append(address) or Connection())
    assert demo.online(timeout=1.0) is True and seen == [demo.CIFAR_HOST]


def test_online_false_when_refused(monkeypatch):
    def refuse(address, timeout):
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(demo.socket, "create_connection", refuse)
    assert demo.online(timeout=1.0) is False


def test_run_refuses_an_out_that_holds_runs(tmp_path):
    (tmp_path / "runs" / "normal").mkdir(parents=True)
    with pytest.raises(ValueError, match="already holds a demo"):
        demo.run(tmp_path, offline=True, log=_never)


@pytest.mark.parametrize("kwargs,error", [({"epochs": 0}, ValueError), ({"subset": 1.5}, TypeError),
                                          ({"download": True}, ValueError)])
def test_run_validates_the_plan_overrides(kwargs, error, tmp_path):
    with pytest.raises(error, match=next(iter(kwargs))):
        demo.run(tmp_path, offline=True, log=_never, **kwargs)


@pytest.mark.slow
def test_quick_demo_end_to_end_on_digits(tmp_path):
    lines = []
    report = demo.run(tmp_path / "out", data_dir=tmp_path / "no-data", quick=True, device="cpu",
                      check_online=_never, fetch=_never, offline=True, log=lines.append)
    out = tmp_path / "out"
    assert report == out / "report.md"
    stages = [line for line in lines if re.match(r"\[\d/7\] ", line)]
    assert [s[:5] for s in stages] == [f"[{i}/7]" for i in range(1, 8)]
    assert [line for line in lines if "using scikit-learn digits (offline fallback" in line]
    for mode in demo.MODES:
        ckpts = sorted(p.name for p in (out / "runs" / mode / "ckpt").glob("epoch-*.pt"))
        assert ckpts == [f"epoch-{e:04d}.pt" for e in range(1, demo.QUICK_PLAN.epochs + 1)]
    text = report.read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links and all((out / link).exists() for link in links)
    for name in figures.FIGURES:
        assert f"figures/{name}.png" in links and (out / "figures" / f"{name}.pdf").is_file()
    # the training table is the runs' own metrics, with W/N and compression named apart
    assert "| settings | final test acc (%) |" in text and "| compression × |" in text
    for mode in demo.MODES:
        final = train.read_metrics(out / "runs" / mode)[-1]
        row = next(line for line in text.splitlines() if line.startswith(f"| {mode} |"))
        assert row.split("|")[3].strip() == f"{100 * final['test_acc']:.1f}"
    # one W/N: LFC-ACT/HFC-ACT train with the W/N the λ and Theorem 3.1 analyses use
    for mode in ("lfc", "hfc"):
        assert train.read_config(out / "runs" / mode)["ratio"] == demo.QUICK_PLAN.ratio
        assert f"| {mode} | W/N={demo.QUICK_PLAN.ratio} |" in text
    assert f"W/N = {demo.QUICK_PLAN.ratio} (as LFC-ACT/HFC-ACT)" in text


def test_cli_demo_maps_arguments_to_run(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(demo, "run", lambda out, **kwargs: seen.update(out=out, **kwargs))
    assert cli.main(["demo", "--out", str(tmp_path), "--quick", "--offline", "--epochs", "2",
                     "--data-dir", "d"]) == 0
    assert seen == {"out": str(tmp_path), "data_dir": "d", "download": False, "offline": True,
                    "quick": True, "epochs": 2, "subset": None, "device": None}


def test_cli_demo_download_and_offline_exclude_each_other():
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--download", "--offline"])
    assert exit_info.value.code == 2


def test_a_second_demo_into_one_folder_is_refused(tmp_path, held_by_another):
    from freqact import rundir

    with held_by_another(tmp_path / "demo"):  # a first demo (a thread here; another process alike)
        with pytest.raises(rundir.RunDirBusy, match="is in use by another freqact process"):
            demo.run(tmp_path / "demo", quick=True, offline=True, device="cpu", log=lambda line: None)
        assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [".lock"]


@pytest.mark.parametrize("quick", [False, True])
def test_the_report_regenerate_line_redraws_with_the_settings_the_demo_drew_with(monkeypatch, tmp_path, quick):
    """Parsed by the real `freqact figures` parser, the command gives `make_all` exactly what the
    demo passed it, and make_all's defaults for the rest (where it ran and its log aside)."""
    class Drawn(Exception):
        pass

    drawn = {}
    defaults = {name: p.default for name, p in inspect.signature(figures.make_all).parameters.items()}

    def make_all(run_dirs, out, **settings):
        drawn.update(run_dirs=[str(r) for r in run_dirs], out=str(out), **settings)
        raise Drawn

    monkeypatch.setattr(demo.train, "train", lambda config: None)
    monkeypatch.setattr(demo.figures, "make_all", make_all)
    with pytest.raises(Drawn):
        demo.run(tmp_path, data_dir=tmp_path / "no-data", quick=quick, offline=True, device="cpu",
                 log=lambda line: None)
    plan = demo.QUICK_PLAN if quick else demo.PLAN
    words = shlex.split(demo.regenerate_command(plan, drawn.pop("run_dirs"), drawn.pop("out"), drawn["device"]))
    assert words[:2] == ["freqact", "figures"]
    args = vars(cli.build_parser(["figures"]).parse_args(words[1:]))
    assert args.pop("runs") == [str(tmp_path / "runs" / mode) for mode in demo.MODES]
    assert args.pop("out") == str(tmp_path / "figures")
    for name in ("command", "handler"):
        args.pop(name)
    del drawn["progress"]
    parsed = {{"window_rule": "rule"}.get(dest, dest): value for dest, value in args.items()}
    assert parsed == {**{name: defaults[name] for name in parsed}, **drawn}


def test_the_report_regenerate_line_names_the_device_the_demo_drew_on(tmp_path):
    """report.md's line carries the device the runs recorded ("cuda:1": `figures` defaults to cpu)."""
    results = {mode: {"config": demo.train.RunConfig(mode=mode, device="cuda:1").to_dict(),
                      "run_dir": str(tmp_path / "demo dir" / "runs" / mode)} for mode in demo.MODES}
    choice = demo.DataChoice("digits", None, "digits")
    lines = demo._run_lines(demo.QUICK_PLAN, choice, results, str, 0.0)
    command = next(line for line in lines if "freqact figures" in line).split("`")[-2]
    args = cli.build_parser(["figures"]).parse_args(shlex.split(command)[1:])
    assert args.device == "cuda:1" and args.runs[0] == str(tmp_path / "demo dir" / "runs" / "normal")


def test_the_regenerate_command_keeps_a_path_with_spaces_one_argument():
    command = demo.regenerate_command(demo.QUICK_PLAN, ["my runs/normal", "runs/lfc"], "my figures")
    words = shlex.split(command)
    assert words[2:4] == ["my runs/normal", "runs/lfc"]
    assert words[words.index("--out") + 1] == "my figures"
