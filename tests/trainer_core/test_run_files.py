"""The pool removes a deleted run's files from its checkpoint home, and only those (trainer_core.run_files).

The reconcile against a scripted service answer: which runs are asked about, what is removed, what
stays (runs that exist, runs the pool holds, anything that is not a run directory, whatever a link
points to), and that an unanswered question removes nothing. The trainer and the real service:
tests/trainer_core/test_worker_run_files.py and tests/e2e/test_pool_run_files_e2e.py.
"""

from pathlib import Path

import pytest

from contracts.http import NotFound, ServerError
from trainer_core.run_files import TRASH_DIR, RunFiles, remove_run_files

DELETED, ALIVE, UNKNOWN, HELD = (f"run_{i:012x}" for i in (1, 2, 3, 4))


class Service:
    """What the service says is deleted (or raises `fails`); every question recorded."""

    def __init__(self, deleted: set[str], fails: Exception | None = None) -> None:
        self.deleted, self.fails = deleted, fails
        self.asked: list[list[str]] = []

    def deleted_runs(self, run_ids: list[str]) -> set[str]:
        self.asked.append(list(run_ids))
        if self.fails is not None:
            raise self.fails
        return self.deleted & set(run_ids)


def _run_dir(home: Path, run_id: str) -> Path:
    step = home / run_id / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / "adapter.safetensors").write_bytes(b"weights")
    (step / "STABLE").write_text("3\n")
    (home / run_id / "tinker_states" / "s1").mkdir(parents=True)
    return home / run_id


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "runs"
    for run_id in (DELETED, ALIVE, UNKNOWN, HELD):
        _run_dir(home, run_id)
    (home / "notes").mkdir()  # not a run: never asked about, never removed
    (home / "run_manual-name").mkdir()  # a directory-mode name, not an id the service issues
    return home


def test_start_removes_the_runs_the_service_names_deleted_only(tmp_path: Path) -> None:
    home = _home(tmp_path)
    outside = tmp_path / "elsewhere"
    _run_dir(outside, "run_00000000beef")
    (home / "run_00000000beef").symlink_to(outside / "run_00000000beef")
    (home / TRASH_DIR / "run_0000000000aa.1234").mkdir(parents=True)  # a removal a crash cut short
    # UNKNOWN: a run the service holds no row for (another service's): it never names it deleted.
    service = Service({DELETED, HELD, "run_00000000beef"})

    removed = RunFiles(home, service).start(held={HELD})

    assert removed == sorted([DELETED, "run_00000000beef"])
    assert sorted(p.name for p in home.iterdir()) == sorted(
        [ALIVE, UNKNOWN, HELD, "notes", "run_manual-name", TRASH_DIR]
    )
    assert list((home / TRASH_DIR).iterdir()) == []
    # The link went, not what it pointed to outside the home.
    assert (outside / "run_00000000beef" / "checkpoints" / "step_3" / "adapter.safetensors").exists()
    # One question, about the run directories the pool does not hold.
    assert service.asked == [sorted([DELETED, ALIVE, UNKNOWN, "run_00000000beef"])]


@pytest.mark.parametrize("fails", [ServerError("down", status=503), ConnectionError("refused")])
def test_no_answer_removes_nothing_and_the_next_pass_asks_again(tmp_path: Path, fails: Exception) -> None:
    home = _home(tmp_path)
    service = Service({DELETED}, fails=fails)
    files = RunFiles(home, service, interval_s=60)
    files.left(DELETED)

    assert files.start() == []
    assert (home / DELETED).is_dir()
    assert files.check(held=(), now=10**9) == []  # the service still down
    asked = len(service.asked)
    assert files.check(held=(), now=10**9 + 1) == []  # not at every turn of the loop: a quiet while
    assert len(service.asked) == asked
    service.fails = None
    assert files.check(held=(), now=2 * 10**9) == [DELETED]
    assert not (home / DELETED).exists()


def test_a_run_that_left_is_asked_about_at_once_and_kept_unless_deleted(tmp_path: Path) -> None:
    home = _home(tmp_path)
    service = Service(set())
    files = RunFiles(home, service, interval_s=1e9)
    files.start()
    service.asked.clear()

    files.left(ALIVE)  # evicted or completed: it keeps its checkpoints
    assert files.check(held=()) == []
    files.left(DELETED)
    service.deleted = {DELETED}
    assert files.check(held=()) == [DELETED]
    assert files.check(held=()) == []  # asked once: an answered question is not asked again
    assert service.asked == [[ALIVE], [DELETED]]
    assert (home / ALIVE / "checkpoints" / "step_3" / "STABLE").exists()


def test_sweeps_ask_in_bounded_pages_that_go_round_the_home(tmp_path: Path) -> None:
    home = tmp_path / "runs"
    ids = [f"run_{i:012x}" for i in range(5)]
    for run_id in ids:
        _run_dir(home, run_id)
    service = Service({ids[4]})
    files = RunFiles(home, service, interval_s=1, batch=2)
    for now in range(4):
        files.check(held=(), now=now)
    assert service.asked == [ids[0:2], ids[2:4], [ids[4], ids[0]], ids[1:3]]
    assert sorted(p.name for p in home.iterdir() if p.name != TRASH_DIR) == ids[:4]


def test_an_older_service_without_the_route_turns_the_removal_off(tmp_path: Path) -> None:
    home = _home(tmp_path)
    service = Service({DELETED}, fails=NotFound("Not Found", status=404))
    files = RunFiles(home, service, interval_s=0)
    files.start()
    files.left(DELETED)
    assert files.check(held=(), now=10**9) == []
    assert len(service.asked) == 1  # asked once, then never again
    assert (home / DELETED).is_dir()


@pytest.mark.parametrize("bad", ["run_../../etc", "..", "run_0123456789AB", "run_x/y", ""])
def test_only_an_issued_run_id_names_what_is_removed(tmp_path: Path, bad: str) -> None:
    home = _home(tmp_path)
    with pytest.raises(ValueError, match="not a run id"):
        remove_run_files(home, bad)
    assert remove_run_files(home, "run_0000000000ff") is False  # nothing there: nothing to do
