"""rwkvx_c.util.atomic: the one way every file is replaced."""
import os

import pytest

from rwkvx_c.util.atomic import replace_with, replacing, temp_path, writer_pid


def test_replacing_writes_and_leaves_no_temporary(tmp_path):
    dest = tmp_path / "sub" / "f.bin"
    with replacing(str(dest)) as f:
        f.write(b"new")
    assert dest.read_bytes() == b"new"
    assert os.listdir(dest.parent) == ["f.bin"]


@pytest.mark.parametrize("how", ["with", "path"])
def test_failed_write_keeps_the_old_file(tmp_path, how):
    dest = tmp_path / "f.txt"
    dest.write_text("old")

    def fail(path):
        with open(path, "w") as f:
            f.write("torn")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        if how == "with":
            with replacing(str(dest), "w") as f:
                f.write("torn")
                raise OSError(28, "No space left on device")
        else:
            replace_with(str(dest), fail)
    assert dest.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_temporary_names_carry_the_writer():
    t = temp_path("/x/loss.png", keep_ext=True)
    assert os.path.basename(t) == f".loss.png.tmp{os.getpid()}.png"
    assert writer_pid(os.path.basename(t)) == os.getpid()
    assert writer_pid(os.path.basename(temp_path("/x/c.safetensors"))) == os.getpid()
    assert writer_pid("tok-ab12.tmp77") == 77            # a corpus cache folder
    assert writer_pid("notes.txt") is None and writer_pid("x.tmp") is None


def test_replace_with_keeps_the_extension_for_format_picking_writers(tmp_path):
    seen = []
    replace_with(str(tmp_path / "p.png"), lambda p: (seen.append(p), open(p, "wb").close()),
                 keep_ext=True)
    assert seen[0].endswith(".png") and (tmp_path / "p.png").exists()


def test_replacing_refuses_other_modes(tmp_path):
    with pytest.raises(ValueError, match="mode"), replacing(str(tmp_path / "f"), "a"):
        pass
