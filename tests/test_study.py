"""Optuna storages (``search/study.py``): a file that is not a study is refused and left untouched."""
import pytest


def test_storages_that_are_not_studies_are_refused_untouched(tmp_path):
    """Trial 3, D1-D3: a prompt file or a note given as ``--storage`` had an Optuna line appended (or a
    traceback after the model load); a sqlite file that is not a database gave a 168-line traceback."""
    from knnssd.search.study import check_storage

    for text in ('{"id": "a", "prompt": "x"}\n', "precious line\n"):
        note = tmp_path / "note.txt"
        note.write_text(text)
        with pytest.raises(ValueError, match="is not an Optuna journal"):
            check_storage(str(note))
        assert note.read_text() == text
    garbage = tmp_path / "bad.db"
    garbage.write_text("garbage\n" * 100)
    with pytest.raises(ValueError, match="cannot be opened"):
        check_storage(f"sqlite:///{garbage}")
    journal = tmp_path / "j.log"
    journal.write_text('{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}\n')
    check_storage(str(journal))  # a journal, a new file and a new sqlite file pass
    check_storage(str(tmp_path / "new.log"))
    check_storage(f"sqlite:///{tmp_path / 'new.db'}")
