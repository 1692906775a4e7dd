"""One line, never a traceback, for every expected failure of the surfaces
hardened here: .pth reads and writes, tokenizer.json ids, .jsonl lines,
BPE vocabulary sizes, sample lengths, non-finite weights and logits,
inputs that are FIFOs or devices (each risky case in a subprocess with a
timeout; where memory is the point, under RLIMIT_AS); config files and the
config.toml a run saves, preference options and datasets folders, numeric
options that allocate, trackers' threads, and --base."""
import contextlib
import json
import os
import time

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


def _special(p, kind):
    """p made a FIFO (kind "fifo": open blocks) or a link to /dev/zero (read never ends)."""
    if kind == "fifo":
        os.mkfifo(p)
    else:
        os.symlink("/dev/zero", p)
    return str(p)


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_checkpoint_path_that_is_a_fifo_or_dev_zero(tmp_path, kind):
    p = _special(tmp_path / "checkpoint.safetensors", kind)
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


# ------------------------------------------------- --config, a saved config


def _refused(r, *words):
    """r (a CompletedProcess) ended with status 1 and one error line holding words."""
    err = no_traceback(r).strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("content,words", [
    (b'preset = "tiny"\nsteps = \xff\n', ["not UTF-8"]),
    (b"a = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", ["nests", "too deeply"]),
    (b'preset = ["tiny"]\n', ["preset must be one of", "list"]),
    (b"steps = {a = 1}\n", ["steps must be an integer > 0"]),
    (b'[model]\nn_embd = "x"\n', ["model.n_embd must be"]),
    (b"x" * (2 << 20), ["larger than"]),
])
def test_config_content_is_one_line(tmp_path, content, words):
    p = tmp_path / "c.toml"
    p.write_bytes(content)
    _refused(cli("train", "--config", str(p), cwd=str(tmp_path), timeout=60), *words)


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_config_that_is_a_fifo_or_dev_zero(tmp_path, kind):
    p = _special(tmp_path / "c.toml", kind)
    _refused(cli("train", "--config", p, cwd=str(tmp_path), timeout=30), "not a file")


def test_a_saved_config_without_its_non_utf8_data_path_refuses(tmp_path):
    """A --data path that is not UTF-8 cannot be a TOML value: the saved
    config names it in a comment, and training from that config refuses
    until --data gives it (it used to train on the default corpus)."""
    name = os.fsencode(str(tmp_path)) + b"/c\xff.txt"
    os.rename(corpus(str(tmp_path)), name)
    a = str(tmp_path / "a")
    common = ["--preset", "tiny", "--batch", "2", "--seq-len", "16", "--steps", "1",
              "--eval-tokens", "32", "--no-progress", "--threads", "2"]
    r = cli("train", "--data", name, *common, "--out", a, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    cfg = os.path.join(a, "config.toml")
    with open(cfg, encoding="utf-8") as f:
        assert "# data: not UTF-8, give it as a flag" in f.read()
    _refused(cli("train", "--config", cfg, "--out", str(tmp_path / "b"), cwd=str(tmp_path)),
             "data is not UTF-8", "give it with --data")
    assert not os.path.exists(tmp_path / "b" / CHECKPOINT)
    r = cli("train", "--config", cfg, "--data", name, "--out", str(tmp_path / "c"),
            cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
@pytest.mark.parametrize("flag", ["--data", "--val-data", "--tokenizer", "--init-from"])
def test_paths_that_are_a_fifo_or_dev_zero(tmp_path, flag, kind):
    p = _special(tmp_path / "x.jsonl", kind)
    argv = ["train", "--data", corpus(str(tmp_path)), "--steps", "1", "--no-progress"]
    argv = [p if a == argv[2] and flag == "--data" else a for a in argv]
    if flag != "--data":
        argv += [flag, p]
    _refused(cli(*argv, "--out", str(tmp_path / "o"), cwd=str(tmp_path), timeout=30),
             "name a regular file or a folder")


def test_an_hf_folders_json_that_is_a_fifo(tmp_path):
    """A FIFO as a Hugging Face folder's config.json, tokenizer_config.json
    or safetensors index: refused or passed over, never waited on."""
    from rwkvx_c.interop.safetensors_file import ShardedTensors
    folder = tmp_path / "hf"
    folder.mkdir()
    _special(folder / "config.json", "fifo")
    _refused(cli("import", str(folder), "--out", str(tmp_path / "o"), cwd=str(tmp_path),
                 timeout=30), "config.json", "not a file")
    _special(folder / "model.safetensors.index.json", "fifo")
    with pytest.raises(InteropError, match="not a file"):
        ShardedTensors(str(folder / "model.safetensors.index.json"))
    _special(folder / "tokenizer_config.json", "fifo")   # unread: no byte mark there
    r = python("from rwkvx_c.interop.hf_tokenizer import hf_tokenizer\n"
               f"print(hf_tokenizer({str(folder)!r}, 65536).name)\n", timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "world", r.stderr


# -------------------------------------------------- preference options, data

PAIRS = [{"prompt": "def f(", "chosen": " return self", "rejected": " import class"},
         {"prompt": "for x in", "chosen": " self:", "rejected": " ) ("}] * 6
PREF = ["--batch", "2", "--seq-len", "48", "--steps", "1", "--eval-tokens", "32",
        "--no-progress", "--threads", "2"]


@pytest.fixture(scope="module")
def tunes(run, tmp_path_factory):
    """A LoRA and a state run on `run` (each naming it as its base), and pairs."""
    d = tmp_path_factory.mktemp("tunes")
    data = corpus(str(d))
    for tune in ("lora", "state"):
        extra = ["--lora-r", "4"] if tune == "lora" else []
        r = cli("train", "--init-from", run, "--tune", tune, *extra, "--data", data, "--batch",
                "2", "--seq-len", "16", "--steps", "2", "--eval-tokens", "32", "--no-progress",
                "--threads", "2", "--out", str(d / tune), cwd=str(d))
        assert r.returncode == 0, r.stderr
    with open(d / "pairs.jsonl", "w") as f:
        f.write("\n".join(json.dumps(p) for p in PAIRS) + "\n")
    return d


@pytest.mark.parametrize("ref", ["lora", "state"])
def test_ref_from_a_fine_tune_reads_its_base(run, tunes, ref):
    """--ref-from a LoRA or a state run (whose checkpoints name their base):
    the reference is that run's model, its base read under its tensors."""
    from rwkvx_c.data.preferences import read_pairs
    from rwkvx_c.data.tokenizers import load as load_tokenizer
    from rwkvx_c.sample import load_model
    from rwkvx_c.train.objectives import REF_FILE, pair_logps
    from rwkvx_c.train.options import auto_precision
    d = tunes
    out = d / f"dpo_{ref}"
    r = cli("train", "--init-from", run, "--objective", "dpo", "--data", str(d / "pairs.jsonl"),
            "--ref-from", str(d / ref), *PREF, "--val-data", str(d / "pairs.jsonl"),
            "--out", str(out), cwd=str(d))
    assert r.returncode == 0, r.stderr
    got = np.load(out / REF_FILE)
    pairs = read_pairs(str(d / "pairs.jsonl"), load_tokenizer("byte"), 48)
    model = load_model(str(d / ref))
    model.precision = auto_precision()   # the DPO run's ("auto": bf16 where it pays)
    want = pair_logps(model, pairs, 1)
    assert np.array_equal(got[:len(pairs)], want)


@pytest.mark.parametrize("objective", ["simpo", "lm"])
def test_ref_from_without_a_reference_objective_is_refused(tmp_path, objective):
    from rwkvx_c.errors import TrainError
    from rwkvx_c.train import TrainOptions
    with pytest.raises(TrainError, match=f"--ref-from .* no effect with --objective {objective}"):
        TrainOptions(objective=objective, ref_from="x").resolved()


@pytest.mark.parametrize("state", ['{"_data_files": 5}', "[1]", '{"_data_files": []}',
                                   '{"_data_files": [{"filename": 3}]}', "{nope",
                                   '{"_data_files": [{"filename": "data-00000-of-00001.arrow"}],'
                                   ' "_split": 7}'])
def test_a_datasets_folder_with_a_malformed_state_json(tmp_path, capsys, state):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["def f(x): return x"]
                                                               * 50})}).save_to_disk(str(folder))
    (folder / "train" / "state.json").write_text(state)
    capsys.readouterr()
    err = _one_line(capsys, ["train", "--data", str(folder), "--steps", "1", "--no-progress",
                             "--out", str(tmp_path / "o")])
    assert "datasets" in err


def test_an_alpaca_record_with_a_stray_prompt_key_is_one_line():
    """Found by test_fuzz_preference_and_chat_records: an Alpaca record that
    also holds "prompt" (and no "response") was read as the prompt format
    and ended in KeyError."""
    from rwkvx_c.data.chat import segments
    rec = {"instruction": "Hi", "output": "Hello.", "prompt": {}}
    assert segments(rec, "r") == [("User: Hi\n\nAssistant:", False), (" Hello.\n\n", True)]
    with pytest.raises(DataError, match="assistant turn"):
        segments(dict(rec, output=None), "r")


# ------------------------------------------------------ numeric bounds


@pytest.mark.parametrize("n", ["1000000000", str(2 ** 62)])
def test_grad_accum_beyond_memory_is_one_line_before_allocation(tmp_path, n):
    """It grew to 11.5 GB before it was killed (1e9), or ended in NumPy's
    ValueError (2^62): the step's windows are checked against memory first."""
    t0 = time.monotonic()
    r = cli("train", "--preset", "tiny", "--data", corpus(str(tmp_path)), "--batch", "2",
            "--seq-len", "16", "--steps", "1", "--grad-accum", n, "--no-progress",
            "--threads", "2", "--out", str(tmp_path / "o"), cwd=str(tmp_path), timeout=120)
    _refused(r, "lower --batch or --grad-accum")
    assert time.monotonic() - t0 < 60


def test_a_preference_seq_len_beyond_memory_is_one_line(run, tunes, tmp_path):
    """The pairs' windows (P x 2 x --seq-len) are checked before they are
    allocated: they were filled record by record until memory ran out."""
    t0 = time.monotonic()
    r = cli("train", "--init-from", run, "--objective", "dpo", "--data",
            str(tunes / "pairs.jsonl"), "--batch", "2", "--seq-len", str(10 ** 9), "--steps", "1",
            "--no-progress", "--out", str(tmp_path / "o"), cwd=str(tmp_path), timeout=120)
    _refused(r, "preference pairs", "lower --seq-len")
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------- trackers


def test_an_unwritable_tensorboard_folder_is_one_warning(tmp_path):
    """RUN/tensorboard where nothing can be written (a link to /proc/self:
    refused to root too): one warning, the run finishes, no traceback from
    any thread."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "o"
    out.mkdir()
    os.symlink("/proc/self", out / "tensorboard")
    r = python("from rwkvx_c.train import Trainer, TrainOptions\n"
               f"Trainer(TrainOptions(preset='tiny', data={corpus(str(tmp_path))!r}, batch=2, "
               "seq_len=16, steps=2, eval_tokens=32, threads=2, log_to='tensorboard'), "
               f"{str(out)!r}).run()\n", cwd=str(tmp_path))
    err = no_traceback(r)
    assert r.returncode == 0, err
    assert err.count("tracker tensorboard failed") == 1, err


def test_a_tracker_librarys_own_thread_failing_is_one_warning():
    """A thread of a tracker's library (code under a tensorboard/ path)
    ending in an exception is the tracker's warning line; another thread's
    exception is Python's as before."""
    r = python("import threading, warnings\n"
               "from rwkvx_c.train.trackers import Trackers\n"
               "t = Trackers([], '.', {})\n"
               "from rwkvx_c.train import trackers\n"
               "hook = trackers._quiet_threads(['tensorboard'])\n"
               "code = compile('def run():\\n    raise OSError(30, \"Read-only\")\\n',\n"
               "               '/x/site-packages/tensorboard/writer.py', 'exec')\n"
               "ns = {}\n"
               "exec(code, ns)\n"
               "with warnings.catch_warnings(record=True) as w:\n"
               "    warnings.simplefilter('always')\n"
               "    th = threading.Thread(target=ns['run']); th.start(); th.join()\n"
               "print('warned:', [str(x.message) for x in w])\n"
               "def mine():\n"
               "    raise KeyError('ours')\n"
               "th = threading.Thread(target=mine); th.start(); th.join()\n")
    assert "warned: ['tracker tensorboard failed (OSError" in r.stdout, r.stdout + r.stderr
    assert "KeyError: 'ours'" in r.stderr and "Read-only" not in r.stderr


# ----------------------------------------------------------------- --base


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_base_that_is_a_fifo_or_dev_zero(tunes, tmp_path, kind):
    p = _special(tmp_path / "base", kind)
    for cmd in ("sample", "export"):
        extra = ["--format", "rwkv7", "--out", str(tmp_path / "x.pth")] if cmd == "export" else \
            ["--max-new-tokens", "2"]
        _refused(cli(cmd, str(tunes / "lora"), "--base", p, *extra, cwd=str(tmp_path),
                     timeout=30), "--base", "name a regular file or a folder")


def test_base_on_a_run_that_names_none_is_refused(run, tmp_path):
    for argv in (["sample", run, "--base", "X", "--max-new-tokens", "2"],
                 ["export", run, "--base", "/nonexistent", "--format", "rwkv7", "--out",
                  str(tmp_path / "x.pth")]):
        _refused(cli(*argv, cwd=str(tmp_path), timeout=60), "names no base", "leave --base out")
    assert not os.path.exists(tmp_path / "x.pth")


def test_a_base_trusted_on_size_and_mtime_says_so_and_export_rehashes(tunes, tmp_path):
    """A base replaced by a same-size file with its mtime restored: sample
    trusts it on the recorded sizes and mtimes and says so in one line;
    export (which reads every weight anyway) hashes it again and refuses."""
    lora = str(tunes / "lora")
    from rwkvx_c.run.checkpoint import read_state
    rec = read_state(os.path.join(lora, CHECKPOINT))["base"]
    # the tune's pin of its source run (a folder base: its checkpoint)
    ck = rec["path"] if os.path.isfile(rec["path"]) else os.path.join(rec["path"], CHECKPOINT)
    with open(ck, "rb") as f:
        saved = f.read()
    st = os.stat(ck)
    try:
        r = cli("sample", lora, "--max-new-tokens", "2", cwd=str(tmp_path))
        assert r.returncode == 0 and b"taken as the one recorded" in r.stderr, r.stderr
        flipped = bytearray(saved)
        flipped[-1] ^= 1   # the last byte of the last tensor
        with open(ck, "wb") as f:
            f.write(flipped)
        os.utime(ck, ns=(st.st_atime_ns, st.st_mtime_ns))
        _refused(cli("export", lora, "--format", "rwkv7", "--out", str(tmp_path / "x.pth"),
                     cwd=str(tmp_path)), "is not the base")
    finally:
        with open(ck, "wb") as f:
            f.write(saved)
        os.utime(ck, ns=(st.st_atime_ns, st.st_mtime_ns))
