"""trainer.threads unset on a busy machine: one line advising the idle cores (masrl.team_runner.busy_cores_note)."""
import pytest
import torch

from masrl.team_runner import busy_cores_note


@pytest.mark.parametrize("threads, load, cores, idle", [
    (2, 1.2, 2, 1),     # another job holds one of two cores: 1 thread
    (2, 0.4, 2, None),  # an idle machine: torch's default is fine
    (16, 9.7, 16, 6),   # 16 - 9.7 = 6.3 idle cores
    (8, 30.0, 8, 1),    # oversubscribed: at least one thread
    (1, 5.0, 2, None),  # already one thread
    (4, None, 4, None),  # no load average on this platform
])
def test_the_note_names_the_idle_cores(threads, load, cores, idle):
    note = busy_cores_note(threads, load, cores)
    if idle is None:
        assert note == ""
    else:
        assert note.count("\n") == 0 and f"trainer.threads={idle} " in note and f"runs {threads} threads" in note


def test_a_team_with_threads_unset_on_busy_cores_says_so(tiny_cfg, monkeypatch, capsys):
    import masrl.team_runner as team_runner
    from masrl.config import config_from_dict

    monkeypatch.setattr(team_runner, "_load_average", lambda: 3.0)
    monkeypatch.setattr(team_runner.os, "cpu_count", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with team_runner.TeamRunner(config_from_dict(tiny_cfg(**{"trainer.threads": None})), progress=False):
            pass
        noted = capsys.readouterr().err
        with team_runner.TeamRunner(config_from_dict(tiny_cfg(**{"trainer.threads": 1})), progress=False):
            pass
        quiet = capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
    assert "trainer.threads=1 " in noted and "load average is 3.0 on 4 cores" in noted
    assert "trainer.threads is unset" not in quiet
