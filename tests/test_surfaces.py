"""One line, never a traceback, for every expected failure of the surfaces
hardened here: .pth reads and writes, tokenizer.json ids, .jsonl lines,
BPE vocabulary sizes, sample lengths, non-finite weights and logits, and
inputs that are FIFOs or devices (each risky case in a subprocess with a
timeout; where memory is the point, under RLIMIT_AS)."""
import contextlib
import json
import os

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.data.formats import iter_documents
from rwkvx_c.errors import DataError, InteropError, SampleError, TokenizerError
from rwkvx_c.run.rundir import CHECKPOINT
from rwkvx_c.sample import generate

from hostile import SMALL, cli, corpus, no_traceback, python, tiny_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(str(tmp_path_factory.mktemp("surf")))


def _one_line(capsys, argv, code=1):
    assert main(list(argv)) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------ .pth


def test_pth_write_failing_inside_torch_is_one_line(monkeypatch, tmp_path):
    from rwkvx_c.interop import pth

    @contextlib.contextmanager
    def disk_full(path, mode="wb"):
        with open("/dev/full", "wb") as f:
            yield f
    monkeypatch.setattr(pth, "replacing", disk_full)
    with pytest.raises(InteropError, match=r"cannot write .*No space left on device") as e:
        pth.save_pth({"a": np.zeros(1000, np.float32)}, str(tmp_path / "m.pth"))
    assert "\n" not in str(e.value) and "enforce" not in str(e.value)


def test_pth_holding_code_is_refused_plainly(tmp_path):
    r = python("import os, torch\n"
               "class Evil:\n    def __reduce__(self): return (os.system, ('touch PWNED',))\n"
               f"torch.save({{'w': Evil()}}, {str(tmp_path / 'evil.pth')!r})", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    r = cli("import", "evil.pth", "--out", "imp", cwd=str(tmp_path))
    err = no_traceback(r).strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1, err
    assert "holds Python code or objects (posix.system)" in err and "was not loaded" in err
    assert "weights_only" not in err and not (tmp_path / "PWNED").exists()


def test_import_refuses_non_finite_tensors_by_name(run, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    pth = str(tmp_path / "m.pth")
    assert main(["export", run, "--format", "rwkv7", "--out", pth]) == 0
    sd = torch.load(pth, weights_only=True)
    sd["blocks.1.att.key.weight"][3, 4] = float("nan")
    torch.save(sd, pth)
    err = _one_line(capsys, ["import", pth, "--out", str(tmp_path / "imp")])
    assert "blocks.1.att.key.weight holds 1 non-finite" in err
    assert not (tmp_path / "imp" / CHECKPOINT).exists()


# ------------------------------------------------------------- sampling


def test_nan_logits_are_one_line(run):
    model, tok = rx.sample.load_run(run)
    model.params["head"][5, :] = np.nan
    with pytest.raises(SampleError, match="logits are not finite"):
        list(generate(model, "def ", 5, tokenizer=tok))


def test_sample_billions_of_tokens(tmp_path, run, capsys):
    from rwkvx_c.run.checkpoint import save_checkpoint
    m = rx.RxPtModel(SMALL)   # with attention: every position costs a key and a value
    assert m.config["n_attn_layer"] == 1
    save_checkpoint(str(tmp_path / CHECKPOINT), m.params, m.config, {})
    for n in ("3000000000", "100000000000000"):
        err = _one_line(capsys, ["sample", str(tmp_path), "--max-new-tokens", n])
        assert "positions a sequence" in err and "--max-new-tokens" in err
    # without attention the state has a fixed size: nothing to refuse or allocate
    model, tok = rx.sample.load_run(run)
    assert next(generate(model, "a", 10**12, tokenizer=tok, temperature=0))


def test_sample_on_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    p = tmp_path / "notes.txt"
    p.write_text("hello, I am not a model\n" * 10)
    err = _one_line(capsys, ["sample", str(p)])
    assert "is not a checkpoint" in err and "corrupt" not in err


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_checkpoint_path_that_is_a_fifo_or_dev_zero(tmp_path, kind):
    p = tmp_path / "checkpoint.safetensors"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        os.symlink("/dev/zero", p)
    for cmd in (["sample", str(p)], ["export", str(p), "--format", "gguf", "--out", "x.gguf"]):
        r = cli(*cmd, cwd=str(tmp_path), timeout=30)
        err = no_traceback(r)
        assert r.returncode == 1 and "not a file" in err, err


# ----------------------------------------------------------- tokenizers


def _bpe(tmp_path):
    pytest.importorskip("tokenizers")
    from rwkvx_c.data.tokenizers import train_bpe
    out = str(tmp_path / "tok.json")
    train_bpe(iter([b"def return self import class " * 50]), 280, out, progress=False)
    with open(out) as f:
        return out, json.load(f)


def test_tokenizer_json_with_sparse_ids_loads(tmp_path):
    from rwkvx_c.data.tokenizers import load
    out, spec = _bpe(tmp_path)
    vocab = spec["model"]["vocab"]
    last = max(vocab, key=vocab.get)
    vocab[last] = 5000   # a hole from the old id up to 5000
    with open(out, "w") as f:
        json.dump(spec, f)
    tok = load(out)
    assert tok.vocab_size == 5001
    assert tok.decode([5000]) and tok.decode([4999]) == b""
    assert tok.token_lengths().shape == (5001,)


@pytest.mark.parametrize("bad", [2 ** 31, 2 ** 40, -3])
def test_tokenizer_json_with_out_of_range_ids_is_one_line(tmp_path, bad):
    from rwkvx_c.data.tokenizers import load
    out, spec = _bpe(tmp_path)
    vocab = spec["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = bad
    with open(out, "w") as f:
        json.dump(spec, f)
    with pytest.raises(TokenizerError) as e:
        load(out)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n", ["1000000000", str(2 ** 70)])
def test_bpe_vocab_size_beyond_what_fits(tmp_path, n):
    r = cli("tokenizer", "train", corpus(str(tmp_path), 100), "--vocab-size", n, "--out",
            "t.json", cwd=str(tmp_path), timeout=60)
    err = no_traceback(r)
    assert r.returncode == 2 and "257..16777216" in err, err


# ---------------------------------------------------------------- .jsonl


@pytest.mark.parametrize("line,match", [("[" * 100_000, "nested too deeply"),
                                        ('{"text": 1' + "0" * 100_000 + "}", "digits"),
                                        ('{"text": "a", "n": ' + "9" * 100_000 + "}",
                                         "digits")])
def test_jsonl_hostile_lines_are_one_line(tmp_path, line, match):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=match) as e:
        list(iter_documents([("d", str(p), "jsonl")]))
    assert str(e.value).startswith(f"{p}:2: ")


def test_a_huge_jsonl_line_is_refused_in_bounded_memory(tmp_path):
    """A 200 MiB line, read under an address-space limit of 400 MiB more
    than the interpreter has: the line is refused by its size after at most
    MAX_LINE_BYTES are read (it used to be held, decoded and copied whole)."""
    p = tmp_path / "big.jsonl"
    with open(p, "w") as f:
        f.write('{"text": "')
        chunk = "x" * (1 << 20)
        for _ in range(200):
            f.write(chunk)
        f.write('"}\n')
    r = python("import resource\n"
               "from rwkvx_c.data.formats import iter_documents\n"
               "vm = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
               "resource.setrlimit(resource.RLIMIT_AS, (vm + (400 << 20),) * 2)\n"
               "from rwkvx_c.errors import DataError\n"
               "try:\n"
               f"    list(iter_documents([('b', {str(p)!r}, 'jsonl')]))\n"
               "except DataError as e:\n"
               "    print(e)\n", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "a line longer than 64 MiB" in r.stdout
