"""What the CLI reads from its user, refused up front with one line naming the input (exit code 2),
before any request: no service runs here, and `LORALOOM_URL` points at a closed port, so an input
that got through would end in "cannot reach" (exit code 6) instead.

- YAML run files are read with YAML 1.2 scalars: `lr: 1e-3` was a string to PyYAML (YAML 1.1),
  then refused by the service as "must be a number"; `1:30` was silently the integer 90; `yes`,
  `on`, `off` were booleans.
- A recursive YAML anchor ended in "ValueError: Circular reference detected" (exit 1); non-string
  mapping keys were merged and renamed (`{1: 2, true: 3, null: 4}` stored as {"1": 3, "None": 4});
  a `name` that is no string, and `--name ""`, were replaced by the file's stem without a word.
- A --key that cannot be a header value raised a bare UnicodeEncodeError (exit 1); a --url with
  user:password@ replaced the key by Basic auth (a 401), one with a query got bare 404s.
- `worker --dry-run` printed a /v1 URL as fine that the real start refuses.
- An output path that cannot be written (`-o`, `--plot`) was a FileNotFoundError (exit 1).
- Ctrl-C while the command starts (its imports take seconds) printed a KeyboardInterrupt traceback
  (real processes: the installed `loraloom` script, paused inside its imports)."""

import math
import os
import signal
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from loraloom.cli import MAX_FILE_VALUES, cli, load_run_file
from loraloom.commands.errors import CliError

runner = CliRunner()
CLOSED = "http://127.0.0.1:9"
"""Nothing listens there: a command that sent a request exits 6 ("cannot reach")."""
SECRET = "llk_0123456789abcdef"
ENV: dict[str, str | None] = {
    "LORALOOM_URL": CLOSED,
    "LORALOOM_API_KEY": SECRET,
    "LORALOOM_ADMIN_KEY": None,
    "LORALOOM_DEBUG": None,
}


def _invoke(args: list[str], env: dict[str, str | None] | None = None) -> Any:
    return runner.invoke(cli, args, env={**ENV, **(env or {})})


def _refused(args: list[str], env: dict[str, str | None] | None = None, code: int = 2) -> str:
    """The command's one-line error (and hint): exit `code`, no traceback."""
    result = _invoke(args, env)
    assert result.exit_code == code, result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output, result.output
    return str(result.output)


# --- YAML 1.2 scalars ------------------------------------------------------------------------

YAML_SCALARS = [
    ("1e-3", 0.001),
    ("1E3", 1000.0),
    ("-2.5e-5", -2.5e-5),
    (".5", 0.5),
    ("5.", 5.0),
    ("1.0e-3", 0.001),
    (".inf", math.inf),
    ("-.Inf", -math.inf),
    ("10", 10),
    ("010", 10),  # decimal, not YAML 1.1's octal 8
    ("0o17", 15),
    ("0x1F", 31),
    ("-7", -7),
    ("true", True),
    ("False", False),
    ("1:30", "1:30"),  # YAML 1.1: the base-60 integer 90
    ("1:30.5", "1:30.5"),
    ("yes", "yes"),
    ("no", "no"),
    ("on", "on"),
    ("Off", "Off"),
    ("y", "y"),
    ("1_000", "1_000"),
    ("0b101", "0b101"),
    ("=", "="),  # YAML 1.1's "value" tag, which PyYAML has no constructor for
    ("~", None),
    ("null", None),
    ("", None),
    ("2026-11-27", date(2026, 11, 27)),  # timestamps stay: a date in metadata is sent as ISO text
    ("'1e-3'", "1e-3"),  # quoted: a string, as in any YAML
]


@pytest.mark.parametrize(("text", "value"), YAML_SCALARS, ids=[t or "empty" for t, _ in YAML_SCALARS])
def test_yaml_scalars_are_read_as_yaml_1_2(tmp_path: Path, text: str, value: Any) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"metadata:\n  v: {text}\n")
    got = load_run_file(path, None)[0]["config"]["metadata"]["v"]
    assert got == value and type(got) is type(value)


def test_a_learning_rate_in_e_notation_is_a_number(tmp_path: Path) -> None:
    path = tmp_path / "lr.yml"
    path.write_text("max_steps: 5\noptim:\n  lr: 1e-3\n")
    assert load_run_file(path, None) == (
        {"name": "lr", "config": {"max_steps": 5, "optim": {"lr": 0.001}}},
        "yaml",
    )


def test_yaml_keys_that_yaml_1_1_read_as_booleans_stay_strings(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("metadata:\n  on: 1\n  yes: 2\n  off: 3\n")
    assert load_run_file(path, None)[0]["config"]["metadata"] == {"on": 1, "yes": 2, "off": 3}


def test_an_explicit_tag_that_does_not_fit_is_a_yaml_error(tmp_path: Path) -> None:
    path = tmp_path / "tagged.yaml"
    path.write_text("max_steps: !!int ten\n")
    assert "not valid YAML: 'ten' is not a YAML 1.2 int at line 1" in _refused(["runs", "create", str(path)])


# --- config files: shapes that JSON cannot carry, and the run's name --------------------------

BAD_FILES = [
    ("rec.yaml", "metadata: &a\n  x: *a\n", "metadata.x refers to a table or list that holds it"),
    (
        "rec_list.yaml",
        "metadata:\n  l: &l [1, *l]\n",
        "metadata.l[1] refers to a table or list that holds it",
    ),
    (
        "keys.yaml",
        "metadata: {1: 2, true: 3, null: 4}\n",
        "the key 1 in metadata is not a string but an integer",
    ),
    ("bool_key.yaml", "metadata: {true: 3}\n", "the key true in metadata is not a string but a boolean"),
    ("null_key.yaml", "metadata: {null: 4}\n", "the key null in metadata is not a string but null"),
    (
        "deep_key.yaml",
        "metadata:\n  tags:\n    - {1.5: x}\n",
        "the key 1.5 in metadata.tags[0] is not a string but a float",
    ),
    ("top_key.yaml", "max_steps: 2\n3: x\n", "the key 3 at the top level is not a string but an integer"),
    ("name.toml", "name = 5\nmax_steps = 2\n", "name is not a string: 5"),
    ("name_list.yaml", "name: [a]\nconfig: {}\n", 'name is not a string: ["a"]'),
    ("name_null.yaml", "name:\nmax_steps: 2\n", "name is not a string: null"),
    ("name_empty.json", '{"name": "", "config": {"max_steps": 2}}', "name is empty"),
    ("deep.json", "[" * 50_000 + "]" * 50_000, "nested too deeply to read"),
]


@pytest.mark.parametrize(("file_name", "text", "said"), BAD_FILES, ids=[f for f, _, _ in BAD_FILES])
def test_a_file_json_cannot_carry_is_a_usage_error_naming_the_file(
    tmp_path: Path, file_name: str, text: str, said: str
) -> None:
    path = tmp_path / file_name
    path.write_text(text)
    out = _refused(["runs", "create", str(path)])
    assert f"error: {path}: {said}" in out, out


def test_yaml_aliases_that_expand_past_the_bound_are_refused(tmp_path: Path) -> None:
    """Nine levels of aliases share one list each in memory; the JSON sent would repeat them."""
    lines = ["l0: &l0 [" + ", ".join(["x"] * 10) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 7)]
    path = tmp_path / "bomb.yaml"
    path.write_text("metadata:\n" + "".join(f"  {line}\n" for line in lines))
    assert MAX_FILE_VALUES < 10**7  # what the file expands to
    assert f"expands to more than {MAX_FILE_VALUES} values" in _refused(["runs", "create", str(path)])


def test_shared_yaml_anchors_and_merge_keys_are_fine(tmp_path: Path) -> None:
    """An alias used twice (not inside itself) is no recursion."""
    path = tmp_path / "shared.yaml"
    path.write_text("base: &b {x: 1}\nmetadata:\n  a: *b\n  c: *b\n  merged:\n    <<: *b\n    y: 2\n")
    config = load_run_file(path, None)[0]["config"]
    assert config["metadata"] == {"a": {"x": 1}, "c": {"x": 1}, "merged": {"x": 1, "y": 2}}


def test_an_empty_name_option_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("max_steps = 2\n")
    assert "error: --name is empty" in _refused(["runs", "create", str(path), "--name", ""])
    with pytest.raises(CliError, match="--name is empty"):
        load_run_file(path, "")
    assert load_run_file(path, "other")[0]["name"] == "other"  # a name given still wins
    assert load_run_file(path, None)[0]["name"] == "run"  # none: the file's stem


# --- keys and URLs ---------------------------------------------------------------------------


def test_a_non_ascii_key_flag_is_a_usage_error_naming_the_flag() -> None:
    key = SECRET + "é"
    out = _refused(["runs", "list", "--key", key])
    assert "error: --key holds a non-ASCII character (U+00E9)" in out
    assert SECRET not in out and SECRET[4:] not in out


def test_a_key_variable_with_a_line_end_is_named() -> None:
    """A key exported from a file's contents (`export LORALOOM_API_KEY="$(cat key)"` keeps none, but
    `$(< key)` in some shells, or an .env file with CRLF, do)."""
    out = _refused(["runs", "list"], env={"LORALOOM_API_KEY": SECRET + "\r"})
    assert "error: LORALOOM_API_KEY holds a carriage return as character 21 of 21 (the last)" in out
    assert SECRET[4:] not in out


def test_an_admin_key_variable_is_named_by_admin_commands() -> None:
    out = _refused(["tenants", "list"], env={"LORALOOM_ADMIN_KEY": "adm in"})
    assert "error: LORALOOM_ADMIN_KEY holds a space as character 4 of 6" in out and "adm in" not in out


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://alice:hunter2@127.0.0.1:9", "--url holds user info"),
        ("http://127.0.0.1:9/?tenant=a", "--url holds a query (?...) or fragment"),
        ("http://127.0.0.1:9/#x", "--url holds a query (?...) or fragment"),
    ],
)
def test_a_url_with_user_info_or_a_query_is_refused(url: str, said: str) -> None:
    out = _refused(["runs", "list", "--url", url])
    assert f"error: {said}" in out and "hunter2" not in out


def test_a_url_variable_is_named_as_such() -> None:
    out = _refused(["runs", "list"], env={"LORALOOM_URL": "http://u:p@127.0.0.1:9"})
    assert "error: LORALOOM_URL holds user info" in out


@pytest.fixture
def worker_env(tmp_path: Path) -> dict[str, str | None]:
    """No LORALOOM_* of the caller's."""
    return {**{k: None for k in os.environ if k.startswith("LORALOOM_")}, "LORALOOM_URL": CLOSED}


def test_worker_dry_run_refuses_the_url_the_real_start_refuses(
    tmp_path: Path, worker_env: dict[str, str | None]
) -> None:
    out = _refused(["worker", "--dry-run", "--url", "http://127.0.0.1:9/v1"], env=worker_env)
    assert "ends with /v1: give the base URL without /v1" in out
    out = _refused(["worker", "--dry-run", "--url", "http://u:p@127.0.0.1:9"], env=worker_env)
    assert "--url holds user info" in out
    # With --runs-dir the pool never talks to a service: its URL is not looked at.
    (tmp_path / "runs").mkdir()
    args = ["worker", "--dry-run", "--url", "http://h/v1", "--runs-dir", str(tmp_path / "runs")]
    result = _invoke(args, env=worker_env)
    assert result.exit_code == 0, result.output


def test_worker_token_that_is_no_printable_token_is_refused(worker_env: dict[str, str | None]) -> None:
    pytest.importorskip("torch")  # the worker extra is checked first
    out = _refused(["worker", "--token", "tok\u00e9n-s3cret"], env=worker_env)
    assert "error: the worker token (from --token) holds a non-ASCII character (U+00E9)" in out
    assert "s3cret" not in out


# --- output paths ----------------------------------------------------------------------------


def _unwritable(tmp_path: Path) -> list[tuple[Path, str]]:
    """Places no file can be written, as any user (root included), with what the error says."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    places = [(a_file / "out", f"{a_file} is not a directory"), (a_file / "sub" / "out", "Not a directory")]
    if Path("/proc/self").is_dir():  # Linux: no file can be created in /proc
        places.append((Path("/proc/loraloom-out"), "No such file or directory"))
    return places


def test_an_unwritable_download_directory_is_a_usage_error(tmp_path: Path) -> None:
    for place, said in _unwritable(tmp_path):
        out = _refused(["adapters", "download", "run_0123456789ab", "-o", str(place)])
        assert out.startswith(f"error: -o {place}: cannot write there: {said}"), out


def test_an_unwritable_plot_file_is_a_usage_error(tmp_path: Path) -> None:
    for place, said in _unwritable(tmp_path):
        png = place.with_suffix(".png")
        out = _refused(["metrics", "run_0123456789ab", "--plot", str(png)])
        assert out.startswith(f"error: --plot {png}: cannot write there: {said}"), out


def test_output_paths_are_checked_before_any_request(tmp_path: Path) -> None:
    """The contrast: a writable place gets as far as the request (the closed port: exit 6)."""
    _refused(["adapters", "download", "run_0123456789ab", "-o", str(tmp_path / "new" / "adapter")], code=6)
    _refused(["metrics", "run_0123456789ab", "--plot", str(tmp_path / "plots" / "loss.png")], code=6)
    # Missing parents are created (as the SDK's download_adapter creates them): checked writable.
    assert (tmp_path / "new").is_dir() and (tmp_path / "plots").is_dir()
    assert list((tmp_path / "plots").iterdir()) == []  # the probe file is gone


# --- Ctrl-C while the command starts up -------------------------------------------------------

LORALOOM = Path(sys.executable).parent / "loraloom"
"""The console script `make install` put beside this interpreter (pyproject's [project.scripts])."""

PAUSE_AT_IMPORT = """\
import os, signal, sys

class PauseAtImport:
    # Pauses the process when it first imports the module named in LORALOOM_TEST_PAUSE_AT, after
    # saying so on stdout: the test's SIGINT then lands inside the CLI's imports, every time.
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("LORALOOM_TEST_PAUSE_AT"):
            sys.meta_path.remove(self)
            os.write(1, b"paused\\n")
            signal.pause()
        return None

sys.meta_path.insert(0, PauseAtImport())
"""


def _interrupt_while_importing(
    script: list[str], tmp_path: Path, module: str, *, pause: str = PAUSE_AT_IMPORT
) -> subprocess.CompletedProcess[str]:
    """Run `script` (`--version`) with a sitecustomize (`pause`) that pauses it on its first import
    of `module`; send SIGINT once it says it is paused; its exit code and output."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(pause)
    env = {**os.environ, "PYTHONPATH": str(site), "LORALOOM_TEST_PAUSE_AT": module}
    env.pop("LORALOOM_DEBUG", None)
    with subprocess.Popen(
        [*script, "--version"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        # As from a shell: pytest-xdist's workers ignore SIGINT, and a child inherits an ignored
        # signal (the CLI then rightly leaves it ignored, as under nohup).
        preexec_fn=_default_sigint,
    ) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first == "paused\n", (first, proc.communicate(timeout=60))
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:  # never left waiting on a paused child
                proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("module", ["typer", "httpx", "orchestrator.client"])
def test_ctrl_c_while_the_command_imports_exits_130_quietly(tmp_path: Path, module: str) -> None:
    if not LORALOOM.exists():
        pytest.skip(f"no installed loraloom command at {LORALOOM} (make install)")
    done = _interrupt_while_importing([str(LORALOOM)], tmp_path, module)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")


def test_a_program_importing_the_cli_keeps_its_own_ctrl_c(tmp_path: Path) -> None:
    """Only the `loraloom` script exits quietly: a program (or a test run) that imports loraloom.cli
    still gets its KeyboardInterrupt. The same wrapper as the console script's, under another name."""
    wrapper = tmp_path / "my_tool.py"
    wrapper.write_text("import sys\nfrom loraloom.cli import main\nsys.exit(main())\n")
    done = _interrupt_while_importing([sys.executable, str(wrapper)], tmp_path, "typer")
    assert done.returncode != 130 and "KeyboardInterrupt" in done.stderr


def test_ctrl_c_after_start_up_is_the_commands_again() -> None:
    """`main` puts Python's handler back before the command runs (commands clean up on
    KeyboardInterrupt: a download, `serve`, `worker`)."""
    code = (
        "import signal, sys\n"
        "sys.modules['__main__'].__file__ = '/x/bin/loraloom'\n"  # as the console script
        "import loraloom.cli as c\n"
        "assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler\n"
        "c.cli = lambda: print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
        "c.main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=_default_sigint
    )
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
