"""No output path can destroy an input: export, import and tokenizer train
refuse an --out that is an input or a run folder's own file, replace an
unrelated file atomically, and sweep the temporaries of killed writes."""
import os

import pytest

from rwkvx_c.cli import main
from rwkvx_c.errors import OutputError
from rwkvx_c.run.rundir import (
    CHECKPOINT,
    LOCK,
    PINS,
    REFERENCE,
    RUN_FILES,
    SNAPSHOTS,
    TOKENIZER,
    RunDir,
    claim_output,
)

from hostile import corpus, tiny_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(str(tmp_path_factory.mktemp("out")))


def _digest(run_dir):
    out = {}
    for n in sorted(os.listdir(run_dir)):
        with open(os.path.join(run_dir, n), "rb") as f:
            out[n] = f.read()
    return out


def _refused(capsys, *argv):
    assert main(list(argv)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# every file a run owns (RUN_FILES), a snapshot and a pin by one of their names
_NAMED = {SNAPSHOTS: os.path.basename(RunDir("x").snapshot(12)),
          PINS: os.path.basename(RunDir("x").pin("0123456789abcdef" * 4))}
OWN = [_NAMED.get(f.name, f.name) for f in RUN_FILES]


@pytest.mark.parametrize("fmt", ["gguf", "rwkv7"])
@pytest.mark.parametrize("name", OWN)
def test_export_never_writes_a_run_file(run, capsys, fmt, name):
    before = _digest(run)
    err = _refused(capsys, "export", run, "--format", fmt, "--out", os.path.join(run, name))
    assert "would destroy the run" in err or "is the input" in err
    assert _digest(run) == before
    assert not os.path.exists(os.path.join(run, LOCK))


def test_export_through_a_link_or_onto_its_input_file(run, capsys, tmp_path):
    before = _digest(run)
    link = str(tmp_path / "model.gguf")
    os.symlink(os.path.join(run, CHECKPOINT), link)
    _refused(capsys, "export", run, "--format", "gguf", "--out", link)
    hard = str(tmp_path / "copy.safetensors")   # the input named by a hard link
    os.link(os.path.join(run, CHECKPOINT), hard)
    err = _refused(capsys, "export", hard, "--format", "rwkv7", "--out", hard)
    assert "is the input" in err
    err = _refused(capsys, "export", run, "--format", "rwkv7", "--out", run)
    assert "is a folder" in err
    assert _digest(run) == before


def test_export_replaces_an_unrelated_file_and_sweeps_orphans(run, capsys, tmp_path):
    out = tmp_path / "model.pth"
    out.write_bytes(b"old")
    ino = out.stat().st_ino
    # what a killed export leaves: a temporary naming a dead process
    orphan = tmp_path / ".model.pth.tmp999999999"
    orphan.write_bytes(b"half")
    assert main(["export", run, "--format", "rwkv7", "--out", str(out)]) == 0
    assert out.read_bytes()[:2] == b"PK" and out.stat().st_ino != ino   # renamed over
    assert not orphan.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.pth"]


def test_import_refuses_its_own_input_and_a_foreign_folder(run, capsys, tmp_path):
    assert main(["export", run, "--format", "rwkv7", "--out", str(tmp_path / "m.pth")]) == 0
    err = _refused(capsys, "import", str(tmp_path / "m.pth"), "--out", run)
    assert "already holds a checkpoint" in err
    err = _refused(capsys, "import", str(tmp_path / "m.pth"), "--out", str(tmp_path))
    assert "m.pth" in err and "new folder" in err
    assert main(["import", str(tmp_path / "m.pth"), "--out", str(tmp_path / "new")]) == 0


def test_tokenizer_train_refuses_its_corpus_and_a_run_tokenizer(run, capsys, tmp_path):
    pytest.importorskip("tokenizers")
    data = corpus(str(tmp_path), 500)
    with open(data, "rb") as f:
        before = f.read()
    err = _refused(capsys, "tokenizer", "train", data, "--vocab-size", "300", "--out", data,
                   "--no-progress")
    with open(data, "rb") as f:
        assert "is the input" in err and f.read() == before
    err = _refused(capsys, "tokenizer", "train", data, "--vocab-size", "300", "--out",
                   os.path.join(run, TOKENIZER), "--no-progress")
    assert "would destroy the run" in err


def test_own_files_are_what_claim_output_guards(run):
    assert [os.path.basename(p) for p in RunDir(run).own_files()] == \
        [f.name for f in RUN_FILES if f.name not in _NAMED] \
        + [os.path.basename(p) for p in RunDir(run).snapshots()]
    for name in OWN:   # with no input named: the folder's run alone forbids it
        with pytest.raises(OutputError, match="would destroy the run"):
            claim_output(os.path.join(run, name))


def test_a_preference_runs_reference_is_its_own(tmp_path):
    """The reference log-probabilities are the run's: never a foreign entry,
    never an output's target."""
    for name in (CHECKPOINT, REFERENCE):
        (tmp_path / name).write_bytes(b"x")
    assert RunDir(str(tmp_path)).foreign_entries() == []
    with pytest.raises(OutputError, match="would destroy the run"):
        claim_output(str(tmp_path / REFERENCE))


def test_a_finished_run_leaves_no_lock(run, tmp_path):
    from rwkvx_c.run.lock import RunLock
    assert not os.path.exists(os.path.join(run, LOCK))
    held = RunLock(str(tmp_path))
    r = subprocess_lock(str(tmp_path))
    assert "in use" in r
    held.release()
    assert not os.path.exists(tmp_path / LOCK)
    again = RunLock(str(tmp_path))   # a fresh file, lockable at once
    assert os.path.exists(tmp_path / LOCK)
    assert "in use" in subprocess_lock(str(tmp_path))
    again.release()
    assert subprocess_lock(str(tmp_path)) == ""


def subprocess_lock(folder):
    from hostile import python
    r = python(f"from rwkvx_c.run.lock import RunLock\ntry:\n    RunLock({folder!r})\n"
               f"except Exception as e:\n    print(e)")
    return r.stdout


def test_train_into_a_folder_of_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "data").mkdir()
    err = _refused(capsys, "train", "--out", str(tmp_path), "--steps", "1", "--no-progress")
    assert "already holds data, notes.txt and no run" in err and "new folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]
