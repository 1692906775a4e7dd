"""Seeded, time-bounded fuzzing of the command line and of checkpoint
headers. Each runs in one subprocess (a crash fails the test, not the suite)
that tries cases until its time is up (FUZZ_SECONDS, ~8 s each on 2 cores)
and fails on the first case that ends in anything but a clean exit: status
0, 1 or 2 with no uncaught exception, or a CheckpointError / TrainError /
DataError (each one line at the CLI).
Checkpoint mutations are written with valid checksums, so they reach the
code that interprets the header instead of stopping at the CRC."""
import os

from hostile import corpus, python

FUZZ_SECONDS = float(os.environ.get("RWKVX_FUZZ_SECONDS", "8"))

CLI_WORKER = r'''
import contextlib, io, os, random, sys, time, traceback
from rwkvx_c.cli import main
rng = random.Random(16)
data, work = sys.argv[1], sys.argv[2]
HOSTILE = ["0", "-1", "1", "2", "nan", "inf", "-inf", "1e308", "1e-308", "-0",
           "99999999999999999999", "", "abc", "\udcff\udcfe", "3.5", "0x10", "\uff11",
           "/dev/null", os.path.join(data, "x"), data, " 2", "1_000"]   # data/x: not a folder
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.train.options import TrainOptions
from rwkvx_c.util.registry import entries
# every declared flag (rwkvx_c.util.registry), the model shape's too, and --out
TRAIN = [e.flag for cls in (TrainOptions, ModelConfig) for e in entries(cls) if e.flag] + ["--out"]
SAMPLE = ["--prompt", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--threads"]
base = ["train", "--preset", "tiny", "--data", data, "--batch", "2", "--seq-len", "16",
        "--steps", "2", "--time-budget", "0.02", "--eval-tokens", "32", "--no-progress",
        "--cache-dir", os.path.join(work, "cache")]
assert main(base + ["--out", os.path.join(work, "good")]) == 0
deadline = time.monotonic() + float(sys.argv[3])
n = 0
while time.monotonic() < deadline:
    n += 1
    if rng.random() < 0.75:
        argv = base + ["--out", os.path.join(work, "r%d" % n)]
        if rng.random() < 0.2:
            argv += ["--resume"]
        for _ in range(rng.randint(1, 2)):
            flag = rng.choice(TRAIN)
            v = rng.choice(HOSTILE)
            if flag in ("--steps", "--time-budget") and v == "99999999999999999999":
                v = "3"   # the other bound is the fuzzed one: keep the run short
            argv += [flag, v]
    else:
        argv = ["sample", rng.choice([os.path.join(work, "good"), os.path.join(data, "x"), data,
                                      work])]
        for _ in range(rng.randint(1, 2)):
            flag = rng.choice(SAMPLE)
            v = rng.choice(HOSTILE)
            if flag == "--max-new-tokens" and v.isdigit() and int(v) > 50:
                v = "50"
            argv += [flag, v]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code
    except BaseException:
        print("CASE", ascii(argv)); traceback.print_exc(); sys.exit(3)
    if rc not in (0, 1, 2, 130):
        print("CASE", ascii(argv), "status", rc); sys.exit(3)
    if rc in (1, 2) and len(err.getvalue().strip().splitlines()) != 1:
        print("CASE", ascii(argv), "not one line:", ascii(err.getvalue())); sys.exit(3)
print("cases", n)
'''


def _run_worker(tmp_path, worker, *args):
    """Runs a fuzz worker with sys.argv = ['w', *args, FUZZ_SECONDS] in a
    subprocess (a crash is its exit status, not pytest's) in tmp_path, where
    relative paths land; it exits 0 after printing its case count."""
    argv = ["w", *args, str(FUZZ_SECONDS)]
    r = python(f"import sys\nsys.argv = {argv!r}\n" + worker, timeout=FUZZ_SECONDS + 240,
               cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "cases" in r.stdout


def test_fuzz_cli_flags(tmp_path):
    _run_worker(tmp_path, CLI_WORKER, corpus(str(tmp_path), 4000), str(tmp_path))


CKPT_WORKER = r'''
import copy, json, math, os, random, sys, time, traceback
import numpy as np
from rwkvx_c.run.checkpoint import CheckpointError, read_checkpoint, save_checkpoint
from rwkvx_c.data import DataError
from rwkvx_c.sample import load_model
from rwkvx_c.train import TrainError, TrainOptions, Trainer
from hostile import SMALL
data, work, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
run = os.path.join(work, "run")
tr = Trainer(TrainOptions(preset="tiny", data=data, model=dict(SMALL), batch=2, seq_len=16,
                          steps=2, eval_tokens=32, cache_dir=os.path.join(work, "c")), run)
tr.run()
tensors, config, state = read_checkpoint(os.path.join(run, "checkpoint.safetensors"))
tensors = {k: np.array(v) for k, v in tensors.items()}
rng = random.Random(16)
WILD = [0, -1, 1, 2 ** 31, 2 ** 63, 2 ** 64 + 1, -2 ** 70, 1.5, float("nan"), float("inf"),
        "7", "", None, True, [], {}, [1, 2], 10 ** 400, 1e308, "\udcff"]

def paths(obj, pre=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, pre + (k,))
    elif isinstance(obj, list) and obj and not isinstance(obj[0], (int, float)):
        for i, v in enumerate(obj):
            yield from paths(v, pre + (i,))
    yield pre

def mutate(obj):
    obj = copy.deepcopy(obj)
    p = rng.choice(list(paths(obj)))
    if not p:
        return rng.choice(WILD)
    tgt = obj
    for k in p[:-1]:
        tgt = tgt[k]
    if rng.random() < 0.15 and isinstance(tgt, dict):
        del tgt[p[-1]]
    else:
        tgt[p[-1]] = rng.choice(WILD)
    return obj

deadline = time.monotonic() + seconds
n = 0
dest = os.path.join(work, "fz")
os.makedirs(dest, exist_ok=True)
while time.monotonic() < deadline:
    n += 1
    c, s, t = config, state, tensors
    what = rng.choice(["config", "state", "tensors"])
    if what == "config":
        c = mutate(config)
    elif what == "state":
        s = mutate(state)
    else:
        t = dict(tensors)
        k = rng.choice(list(t))
        if rng.random() < 0.5:
            del t[k]
        else:
            t[k] = np.zeros(rng.choice([(0,), (1,), (3, 5), (10 ** 6,)]), np.float32)
    try:
        json.dumps(c, allow_nan=True); json.dumps(s, allow_nan=True)
        save_checkpoint(os.path.join(dest, "checkpoint.safetensors"), t, c, s)
    except (TypeError, ValueError, OverflowError):
        continue   # not writable as JSON: no file can hold it
    for load in (lambda: load_model(dest), lambda: Trainer.resume(dest, steps=3).close()):
        try:
            load()
        except (CheckpointError, TrainError, DataError):   # the CLI's one-line errors
            pass
        except BaseException:
            print("CASE", what, ascii(c), ascii(s)[:400]); traceback.print_exc(); sys.exit(3)
print("cases", n)
'''


def test_fuzz_checkpoint_header(tmp_path):
    _run_worker(tmp_path, CKPT_WORKER, corpus(str(tmp_path), 4000), str(tmp_path))


SIDECAR_WORKER = r'''
import contextlib, io, json, os, random, sys, time, traceback
import numpy as np
from rwkvx_c.cli import main
from rwkvx_c.data import DataError, load_corpus
work, seconds = sys.argv[1], float(sys.argv[2])
rng = random.Random(16)
VOCAB = 300
path = os.path.join(work, "tokens.bin")
(np.arange(4000) % VOCAB).astype(np.uint16).tofile(path)
side = path + ".json"
GOOD = {"dtype": "uint16", "vocab_size": VOCAB}
WILD = [0, -1, 1, 255, 256, 299, 2 ** 31, 2 ** 63, -2 ** 70, 1.5, 300.0, float("nan"),
        float("inf"), "300", "uint16", "u8", "float32", "", None, True, [], {}, ["uint16"],
        10 ** 400, 1e308, "\udcff"]

def text_case():
    r = rng.random()
    if r < 0.15:
        return rng.choice(WILD)
    obj = dict(GOOD)
    for _ in range(rng.randint(1, 2)):
        k = rng.choice(["dtype", "vocab_size", "other"])
        if rng.random() < 0.2:
            obj.pop(k, None)
        else:
            obj[k] = rng.choice(WILD)
    return obj

def blob_case():
    good = json.dumps(GOOD).encode()
    r = rng.random()
    if r < 0.25:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    if r < 0.5:
        return good[:rng.randrange(len(good))]
    b = bytearray(good)
    for _ in range(rng.randint(1, 3)):
        b[rng.randrange(len(b))] = rng.choice([0x80, 0xff, 0xc3, 0x00, 0x22, 0x7b, 0x5c])
    return bytes(b)

def write(case):
    if isinstance(case, bytes):
        with open(side, "wb") as f:
            f.write(case)
        return
    try:
        text = json.dumps(case, allow_nan=True)
    except (TypeError, ValueError, OverflowError):
        text = repr(case)   # not JSON at all: the loader must say so
    with open(side, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)

deadline = time.monotonic() + seconds
n = 0
while time.monotonic() < deadline:
    n += 1
    case = blob_case() if rng.random() < 0.3 else text_case()
    write(case)
    if rng.random() < 0.85:
        try:
            c = load_corpus(path, seq_len=16, val_fraction=0.1)
        except DataError as e:
            if len(str(e).splitlines()) != 1:
                print("CASE", ascii(case), "not one line:", ascii(str(e))); sys.exit(3)
            continue
        except BaseException:
            print("CASE", ascii(case)); traceback.print_exc(); sys.exit(3)
        top = max(int(np.max(c.train)), int(np.max(c.val)))
        if not (isinstance(c.vocab_size, int) and top < c.vocab_size):
            print("CASE", ascii(case), "accepted vocab", ascii(c.vocab_size)); sys.exit(3)
    else:
        argv = ["train", "--preset", "tiny", "--data", path, "--batch", "2", "--seq-len", "16",
                "--steps", "1", "--eval-tokens", "32", "--no-progress",
                "--out", os.path.join(work, "r%d" % n)]
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException:
            print("CASE", ascii(case)); traceback.print_exc(); sys.exit(3)
        if rc not in (0, 1) or (rc == 1 and len(err.getvalue().strip().splitlines()) != 1):
            print("CASE", ascii(case), "status", rc, ascii(err.getvalue())); sys.exit(3)
print("cases", n)
'''


def test_fuzz_token_sidecar(tmp_path):
    """The .bin.json sidecar of a token file (dtype, vocab_size): wrong types,
    huge, negative and non-finite numbers, missing keys, garbage and
    non-UTF-8 bytes give a one-line DataError (at the CLI: status 1, one
    line), and an accepted sidecar's vocabulary covers every token."""
    _run_worker(tmp_path, SIDECAR_WORKER, str(tmp_path))


CONFIG_WORKER = r'''
import datetime, math, os, random, sys, time, traceback
from rwkvx_c.errors import RwkvxError
from rwkvx_c.train.config_file import load_config
from rwkvx_c.train.options import TrainOptions, schema
rng = random.Random(49)
work = sys.argv[1]
ENTRIES = list(schema())   # every declared key: TrainOptions', then model.KEY
GOOD = {"pos_int": lambda: rng.choice([1, 2, 3, 16, 2 ** 31, 2 ** 62, 2 ** 63 - 1]),
        "nonneg_int": lambda: rng.choice([0, 1, 7, 2 ** 40]),
        "pos_float": lambda: rng.choice([1e-9, 0.5, 3.0, 1e308]),
        "nonneg_float": lambda: rng.choice([0.0, 0.25, 1e300]),
        "unit_float": lambda: rng.choice([0.0, 0.5, 1.0]),
        "unit_open": lambda: rng.choice([0.0, 0.5, 0.999]),
        "bit": lambda: rng.choice([0, 1]),
        "flag": lambda: rng.choice([True, False]),
        "str": lambda: rng.choice(["", "x", "byte", "world", "stop", "\u00e9\u4e2d"]),
        "names": lambda: rng.choice(["", "att.key", "att.key,ffn.value", "nope,,"]),
        "path": lambda: rng.choice(["", "/dev/null", "nope", "."]),
        "paths": lambda: rng.choice(["nope", ["a", "b"], "/dev/zero"]),
        "texts": lambda: rng.choice(["def ", ["a", "\u00e9\u4e2d"], [""]]),
        "config": lambda: {"n_embd": rng.choice([16, 0, -1, "x"])}}
WRONG = [lambda: -1, lambda: 0, lambda: 2 ** 64, lambda: -2 ** 63, lambda: 1.5, lambda: -0.0,
         lambda: math.inf, lambda: -math.inf, lambda: math.nan, lambda: True, lambda: "",
         lambda: "\x00", lambda: "1", lambda: [], lambda: [1, "a"], lambda: [[[]]],
         lambda: {}, lambda: {"a": {"b": 1}}, lambda: datetime.date(2020, 1, 1),
         lambda: datetime.time(1, 2), lambda: datetime.datetime(2020, 1, 1, 1, 2, 3)]


def toml(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else "inf" if v == math.inf else "-inf" \
            if v == -math.inf else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + "".join(c if c.isalnum() or c in " ./,_-" else "\\u%04x" % ord(c)
                             for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml(x)}" for k, x in v.items()) + "}"
    return v.isoformat()


def case():
    top, model = [], []
    for e in rng.sample(ENTRIES, rng.randint(1, 5)):
        if e.choices and rng.random() < 0.4:
            v = rng.choice(e.choices)
        else:
            v = GOOD[e.kind]() if rng.random() < 0.5 else rng.choice(WRONG)()
        key = e.key.split(".", 1)[-1]
        (model if e.key.startswith("model.") else top).append(f"{key} = {toml(v)}")
    text = "\n".join(top) + ("\n[model]\n" + "\n".join(model) if model else "") + "\n"
    data = text.encode()
    if rng.random() < 0.15:   # bytes mutated, cut or grown
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        data = bytes(b[:rng.randint(0, len(b))]) if rng.random() < 0.3 else bytes(b)
    return data


deadline = time.monotonic() + float(sys.argv[2])
path = os.path.join(work, "c.toml")
n = 0
while time.monotonic() < deadline:
    n += 1
    data = case()
    with open(path, "wb") as f:
        f.write(data)
    try:
        TrainOptions(**load_config(path)).resolved()
    except RwkvxError as e:
        if "\n" in str(e).strip():
            print("CASE", ascii(data), "not one line:", ascii(str(e))); sys.exit(3)
    except BaseException:
        print("CASE", ascii(data)); traceback.print_exc(); sys.exit(3)
print("cases", n)
'''


def test_fuzz_config_file(tmp_path):
    """Random config files over the schema's keys (rwkvx_c.train.options.schema):
    values of each key's kind, of every wrong TOML type, and mutated bytes;
    load_config and resolved() end in a value or one RwkvxError line."""
    _run_worker(tmp_path, CONFIG_WORKER, str(tmp_path))


RECORD_WORKER = r'''
import json, os, random, sys, time, traceback
from rwkvx_c.data.chat import segments
from rwkvx_c.data.pipeline import load_corpus
from rwkvx_c.data.preferences import pair_segments, read_pairs
from rwkvx_c.data.tokenizers import load
from rwkvx_c.errors import RwkvxError
rng = random.Random(49)
work = sys.argv[1]
tok = load("byte")
TEXT = ["", "hi", "a\n\n\nb", " \t", "\ud800"[:0] + "\u00e9", "x" * 300, "User: x", "\r\n"]
def val(depth=0):
    r = rng.random()
    if r < 0.35 or depth > 2:
        return rng.choice(TEXT + [None, 0, -1, 1.5, True, 2 ** 70])
    if r < 0.65:
        return [val(depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): val(depth + 1) for _ in range(rng.randint(0, 3))}
KEYS = ["messages", "conversations", "role", "content", "from", "value", "prompt", "response",
        "system", "instruction", "input", "output", "history", "chosen", "rejected", "text",
        "user", "assistant", "human", "gpt"]
TEMPLATES = [
    lambda: {"messages": [{"role": rng.choice(["system", "user", "assistant", "tool", 3]),
                           "content": val(2)} for _ in range(rng.randint(0, 4))]},
    lambda: {"conversations": [{"from": rng.choice(["human", "gpt", "system", "x"]),
                                "value": val(2)} for _ in range(rng.randint(0, 4))]},
    lambda: {"prompt": val(1), "response": val(1), **({"system": val(2)} if rng.random() < .3
                                                      else {})},
    lambda: {"instruction": val(1), "input": val(2), "output": val(1), "history": val(1)},
    lambda: {"prompt": val(1), "chosen": val(1), "rejected": val(1)},
    lambda: {"chosen": [{"role": "user", "content": val(2)},
                        {"role": "assistant", "content": val(2)}],
             "rejected": [{"role": "user", "content": val(2)},
                          {"role": "assistant", "content": val(2)}]},
    lambda: val(),
]
def record():
    rec = rng.choice(TEMPLATES)()
    if isinstance(rec, dict) and rng.random() < 0.2 and rec:
        rec.pop(rng.choice(list(rec)))
    return rec
def call(f, *a):
    try:
        f(*a)
    except RwkvxError as e:
        if "\n" in str(e).strip():
            raise AssertionError("not one line: " + ascii(str(e)))
deadline = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < deadline:
    n += 1
    recs = [record() for _ in range(rng.randint(1, 6))]
    try:
        for rec in recs:
            call(segments, rec, "r")
            call(pair_segments, rec, "r")
        if n % 10 == 0:   # whole files: the readers of both, with their caches
            path = os.path.join(work, "d%d.jsonl" % n)
            with open(path, "w", encoding="utf-8") as f:
                for rec in recs:
                    f.write(json.dumps(rec) + "\n")
            call(read_pairs, path, tok, 32)
            call(lambda: load_corpus(path, seq_len=8, cache_dir=os.path.join(work, "cache")))
    except BaseException:
        print("CASE", ascii(recs)); traceback.print_exc(); sys.exit(3)
print("cases", n)
'''


def test_fuzz_preference_and_chat_records(tmp_path):
    """Random records in the four chat formats and both preference forms,
    with wrong types, missing keys and nesting: the record readers and the
    file readers (read_pairs, load_corpus) end in a value or one RwkvxError
    line."""
    _run_worker(tmp_path, RECORD_WORKER, str(tmp_path))
