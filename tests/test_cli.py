"""The examples' first hour: a wrong input prints one line (exit 2); --debug shows the traceback."""

from __future__ import annotations

import pathlib

import helpers
import pytest

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def cli():
    return helpers.load_script(EXAMPLES / "cli.py", "example_cli", [EXAMPLES])


@pytest.fixture(scope="module")
def generate():
    return helpers.load_script(EXAMPLES / "generate.py", "example_generate", [EXAMPLES])


# (argv, what the one line says): each refused before a model is built.
WRONG = {
    "typo'd path": (["--model", "/no/such/dir"], "no such directory"),
    "hub id offline": (["--model", "no-org/no-model"], "Hugging Face Hub download failed"),
    "no config.json": (["--model", "{tmp}"], "has no config.json: not a checkpoint directory"),
    "unknown implementation": (["--implementation", "foo"], "['foo'] not among"),
    "mgpu on float32": (["--implementation", "mgpu_interpret"], "add --dtype bfloat16"),
    "mgpu on a cpu": (["--implementation", "mgpu", "--dtype", "bfloat16"], "use mgpu_interpret"),
    "mtp with a mesh": (["--mtp", "1", "--mesh", "expert=2"], "drop --mesh"),
    "layers without preset": (["--layers", "2"], "add --preset NAME"),
    "mtp without a layer": (
        ["--model", str(ROOT / "tests/fixtures/qwen3_moe/float"), "--mtp", "1"],
        "has no MTP layer",
    ),  # fmt: skip
    "bad flag value": (["--max-new-tokens", "-3"], "--max-new-tokens"),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_a_wrong_input_prints_one_line(cli, generate, case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    argv, says = WRONG[case]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        cli.run(generate.main, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert says in err


def test_debug_shows_the_error_itself(cli, generate, capsys):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        cli.run(generate.main, ["--model", "/no/such/dir", "--debug"])


def test_a_preset_over_the_memory_is_refused_with_its_estimate(cli, generate, capsys, monkeypatch):
    """The estimate comes from an abstract model (nothing drawn): refused with the layers that
    fit, before a weight is drawn."""
    monkeypatch.setattr(generate, "available_memory", lambda mesh: (2 * 10**9, "this test"))
    with pytest.raises(SystemExit) as exit_:
        cli.run(generate.main, ["--preset", "qwen3-30b-a3b"])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert "about" in out and "GB of weights; this test has 2.00 GB free" in out
    assert "pass --layers" in err and "--no-memory-check" in err
