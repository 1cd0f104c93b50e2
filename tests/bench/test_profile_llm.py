"""bench.profile_llm's summary of py-spy's raw output, with the stub and its engine process."""

from __future__ import annotations

from pathlib import Path

from bench.profile_llm import summarise


def test_threads_are_counted_by_thread_also_under_their_process(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(
        'process 7:"python3 -c spawn_main";thread (8): llm-engine;Engine._loop (e.py:1) 3\n'
        "thread (5): llm-writer;ResponseWriter._run (w.py:2) 1\n"
    )
    summary = summarise(raw, top=5)
    assert "4 samples holding the GIL" in summary
    assert " 75.0%  thread (8): llm-engine" in summary
    assert " 25.0%  thread (5): llm-writer" in summary
    assert " 75.0%  Engine._loop (e.py:1)" in summary
    assert "process 7" not in summary.split("top 5 frames")[1]
