"""``lowgrad demo`` refuses bad arguments with a one-line error before running anything."""
from __future__ import annotations

from pathlib import Path

import pytest

from lowgrad.cli.main import main


@pytest.mark.parametrize("args, message", [
    (["--world", "0"], "--world: must be at least 1, got 0"),  # ran world 2 before
    (["--world", "-2"], "--world: must be at least 1"),
    (["--world", "two"], "--world: expected an integer, got 'two'"),
    (["--layers", "0"], "--layers: must be at least 1"),
    (["--micro-steps", "0"], "--micro-steps: must be at least 1"),
    (["--steps", "-1"], "--steps: must be at least 1"),
    (["--seed", "-1"], "--seed: must be in [0, 2**64)"),
    (["--seed", str(1 << 64)], "--seed: must be in [0, 2**64)"),
])
def test_bad_numbers_are_argparse_errors(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--backend", "host", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--world", "3"], "not divisible by world 3"),
    (["--config", "no-such-preset"], "neither a preset"),
    (["--json", "/no/such/dir/out.json"], "no such directory"),
])
def test_bad_setups_exit_with_one_line_before_running(capsys: pytest.CaptureFixture[str], args: list[str],
                                                      message: str) -> None:
    assert main(["demo", "--backend", "host", *args], prog="lowgrad") == 2
    out = capsys.readouterr()
    assert out.err.startswith("lowgrad demo: error:") and message in out.err and out.err.count("\n") == 1
    assert out.out == ""  # nothing ran


@pytest.mark.timeout(60)
def test_bad_config_file_names_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": "64"}')
    assert main(["demo", "--backend", "host", "--config", str(path), "--layers", "2"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "hidden_size" in err


@pytest.mark.parametrize("args, offload", [([], "both"), (["--offload"], "on"), (["--offload", "off"], "off"),
                                           (["--offload", "--steps", "1"], "on")])
def test_offload_alone_is_on_as_in_train_lm(args: list[str], offload: str) -> None:
    from lowgrad.cli.main import parser

    assert parser("lowgrad").parse_args(["demo", *args]).offload == offload
