"""Data as it is published (rwkvx_c.data.tables, docs/training.md §Data):
parquet and arrow files, datasets.save_to_disk folders and the local
Hugging Face datasets cache give the tokens, masks and training losses of
the same records in .jsonl; ShareGPT and Alpaca records give the tokens
and masks of the equivalent messages records; memory stays flat over a
large table; a missing extra, column or cache entry is one line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_train import SMALL, _opts

from rwkvx_c.data import load_corpus
from rwkvx_c.data.chat import segments, turns
from rwkvx_c.errors import DataError
from rwkvx_c.train import Trainer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

HERE = os.path.dirname(os.path.abspath(__file__))
CHAT = os.path.join(HERE, "data", "chat.jsonl")
RWKV = dict(SMALL, n_attn_layer=0)


def _messages():
    """The conversations of tests/data/chat.jsonl, each as a messages record."""
    out = []
    with open(CHAT, encoding="utf-8") as f:
        for rec in (json.loads(line) for line in f if line.strip()):
            if "prompt" in rec:
                rec = {"messages": [{"role": "user", "content": rec["prompt"]},
                                    {"role": "assistant", "content": rec["response"]}]}
            out.append(rec)
    return out


def _texts():
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "(", ")", ":", "é"]
    return [{"text": " ".join(rng.choice(words, int(n))), "id": i}
            for i, n in enumerate(rng.integers(5, 60, 300))]


def _write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _table(recs):
    """The records as a table whose columns are every record's keys (a
    record without one holds null there)."""
    return pa.Table.from_struct_array(pa.array(recs))


def _write_parquet(path, recs, row_group_size=7):
    pq.write_table(_table(recs), str(path), row_group_size=row_group_size)
    return str(path)


def _write_arrow(path, recs, stream):
    t = _table(recs)
    with pa.OSFile(str(path), "wb") as sink:
        w = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, t.schema)
        w.write_table(t, max_chunksize=5)
        w.close()
    return str(path)


def _sharegpt(rec):
    who = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": who[m["role"]], "value": m["content"]}
                              for m in rec["messages"]]}


def _alpaca(rec):
    """An Alpaca record of a messages record of alternating user and
    assistant turns, maybe a system turn before them: the last exchange,
    the earlier ones its history; a user turn of two lines is instruction
    and input."""
    m = rec["messages"]
    out = {"system": m[0]["content"]} if m[0]["role"] == "system" else {}
    said = [x["content"] for x in m if x["role"] != "system"]
    pairs = [list(p) for p in zip(said[::2], said[1::2])]
    if len(pairs) > 1:
        out["history"] = pairs[:-1]
    instruction, _, query = pairs[-1][0].partition("\n")
    return dict(out, instruction=instruction, input=query, output=pairs[-1][1])


def _same(a, b):
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    for x, y in ((a.train_mask, b.train_mask), (a.val_mask, b.val_mask)):
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y))


def test_chat_formats_normalise_to_the_same_turns():
    rec = {"messages": [{"role": "system", "content": "Be terse."},
                        {"role": "user", "content": "Add\n2 and 3"},
                        {"role": "assistant", "content": "5."}]}
    want = turns(rec, "x")
    assert [tuple(t) for t in want] == [("system", "Be terse."), ("user", "Add\n2 and 3"),
                                        ("assistant", "5.")]
    assert turns(_sharegpt(rec), "x") == want
    assert turns(_alpaca(rec), "x") == want
    assert turns({"prompt": "Add\n2 and 3", "response": "5.", "system": "Be terse."}, "x") \
        == want
    # an empty or absent input is no line; history gives earlier turns
    assert turns({"instruction": "Hi", "input": "", "output": "Yo"}, "x") == \
        turns({"instruction": "Hi", "output": "Yo"}, "x") == \
        turns({"messages": [{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Yo"}]}, "x")
    hist = {"instruction": "b", "output": "B", "history": [["a", "A"]]}
    assert [t.content for t in turns(hist, "x")] == ["a", "A", "b", "B"]
    assert segments(hist, "x")[-1] == (" B\n\n", True)


@pytest.mark.parametrize("rec,why", [
    ({"conversations": [{"from": "bot", "value": "a"}]}, "is from 'bot'; ShareGPT speakers"),
    ({"conversations": [{"from": ["human"], "value": "a"}]}, r"is from \['human'\]"),
    ({"messages": [{"role": {"r": 1}, "content": "a"}]}, r"has role \{'r': 1\}"),
    ({"conversations": []}, "non-empty list"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": 3}]},
     "no text content"),
    ({"instruction": "a", "output": ""}, "no text content"),
    ({"instruction": "a", "input": 3, "output": "b"}, "input must be text"),
    ({"instruction": "a", "output": "b", "history": ["x"]}, "history must be"),
])
def test_bad_sharegpt_and_alpaca_records_are_one_line(tmp_path, rec, why):
    p = _write_jsonl(tmp_path / "bad.jsonl",
                     [{"instruction": "p", "output": "r"}, rec])
    with pytest.raises(DataError, match=f"^{p}:2: .*{why}") as e:
        load_corpus(p, seq_len=4, cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("form", ["sharegpt", "alpaca"])
def test_sharegpt_and_alpaca_files_give_the_tokens_and_masks_of_messages(tmp_path, form):
    recs = _messages()
    conv = _sharegpt if form == "sharegpt" else _alpaca
    want = load_corpus(_write_jsonl(tmp_path / "messages.jsonl", recs), seq_len=32,
                       cache_dir=str(tmp_path / "c"))
    assert want.train_mask is not None
    for path in (_write_jsonl(tmp_path / f"{form}.jsonl", [conv(r) for r in recs]),
                 _write_parquet(tmp_path / f"{form}.parquet", [conv(r) for r in recs])):
        got = load_corpus(path, seq_len=32, cache_dir=str(tmp_path / "c"))
        _same(got, want)
        assert "chat: 33 conversations" in got.description


def test_tables_give_the_tokens_of_the_same_jsonl(tmp_path):
    recs = _texts()
    want = load_corpus(_write_jsonl(tmp_path / "t.jsonl", recs), seq_len=32,
                       cache_dir=str(tmp_path / "c"))
    for path in (_write_parquet(tmp_path / "t.parquet", recs),
                 _write_arrow(tmp_path / "t.arrow", recs, stream=False),
                 _write_arrow(tmp_path / "s.arrow", recs, stream=True)):
        _same(load_corpus(path, seq_len=32, cache_dir=str(tmp_path / "c")), want)
    # another column, as --text-field names it; a folder finds tables by name
    body = [{"body": r["text"]} for r in recs]
    _same(load_corpus(_write_parquet(tmp_path / "b.parquet", body), seq_len=32,
                      cache_dir=str(tmp_path / "c"), text_field="body"), want)
    (tmp_path / "dir").mkdir()
    _write_parquet(tmp_path / "dir" / "a.parquet", recs[:150])
    _write_arrow(tmp_path / "dir" / "b.arrow", recs[150:], stream=True)
    _same(load_corpus(str(tmp_path / "dir"), seq_len=32, cache_dir=str(tmp_path / "c")), want)


def test_a_missing_column_or_a_broken_table_is_one_line(tmp_path):
    p = _write_parquet(tmp_path / "t.parquet", [{"body": "x" * 50, "n": 1}])
    with pytest.raises(DataError, match=r"t.parquet: no column 'text' \(it has body, n; "
                                        "choose the text column with --text-field"):
        load_corpus(p, seq_len=4, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"t.parquet row 0: column 'n' holds int, not text"):
        load_corpus(p, seq_len=4, cache_dir=str(tmp_path / "c"), text_field="n")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"cannot read parquet file .*bad\.parquet"):
        load_corpus(str(bad), seq_len=4, cache_dir=str(tmp_path / "c"))
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(DataError, match=r"cannot read arrow file .*bad\.arrow"):
        load_corpus(str(bad), seq_len=4, cache_dir=str(tmp_path / "c"))


def _losses(tmp_path, name, data):
    tr = Trainer(_opts(tmp_path, data=data, model=dict(RWKV), seq_len=32, batch=2, steps=4,
                       eval_tokens=64), str(tmp_path / name))
    rows = []
    tr.run(on_step=rows.append)
    return [r["loss"] for r in rows if "loss" in r] + [rows[-1].get("val_loss")]


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_parquet_and_a_datasets_folder_train_as_the_same_jsonl(tmp_path, kind):
    datasets = pytest.importorskip("datasets")
    recs = _texts() if kind == "text" else [_sharegpt(r) for r in _messages()]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", recs)
    want = _losses(tmp_path, "jsonl", jsonl)
    assert len(want) == 5 and all(np.isfinite(want))
    assert _losses(tmp_path, "parquet", _write_parquet(tmp_path / "d.parquet", recs)) == want
    folder = str(tmp_path / "saved")
    datasets.Dataset.from_list(recs).save_to_disk(folder)
    assert _losses(tmp_path, "saved", folder) == want
    # a DatasetDict folder: its train split
    both = str(tmp_path / "dict")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(recs),
                          "test": datasets.Dataset.from_list(recs[:3])}).save_to_disk(both)
    assert _losses(tmp_path, "dict", both) == want


def test_a_dataset_of_the_local_cache_by_name(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    recs = _texts()
    src = _write_parquet(tmp_path / "src.parquet", recs)
    # a cache entry where a download of the dataset "tiny_words" leaves it
    # (NAME/default/0.0.0/COMMIT/), made from a local file
    from datasets.packaged_modules.parquet.parquet import Parquet
    Parquet(cache_dir=str(cache), dataset_name="tiny_words", config_name="default",
            hash="0123abcd",
            data_files=datasets.data_files.DataFilesDict.from_patterns({"train": [src]})
            ).download_and_prepare()
    (made,) = (cache / "tiny_words").iterdir()   # default-HASH of its local data files
    made.rename(cache / "tiny_words" / "default")
    want = load_corpus(_write_jsonl(tmp_path / "t.jsonl", recs), seq_len=32,
                       cache_dir=str(tmp_path / "c"))
    code = (f"from rwkvx_c.data import load_corpus\n"
            f"import numpy as np, sys\n"
            f"c = load_corpus({{!r}}, seq_len=32, cache_dir={str(tmp_path / 'c')!r})\n"
            f"np.save(sys.argv[1], np.concatenate([c.train, c.val]))\n")
    out = str(tmp_path / "tokens.npy")
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-c", code.format("hf:tiny_words"), out],
                       capture_output=True, text=True, env=env, cwd=HERE, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert np.array_equal(np.load(out), np.concatenate([want.train, want.val]))
    r = subprocess.run([sys.executable, "-m", "rwkvx_c", "train", "--data", "hf:no_such_set",
                        "--steps", "1"], capture_output=True, text=True, env=env, cwd=HERE,
                       timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "hf:no_such_set: no such dataset in the local Hugging Face datasets cache" \
        in r.stderr and "nothing is downloaded" in r.stderr


_FLAT = """
import resource, sys
from rwkvx_c.data import tables
n = 0
for i, row in tables.table_rows(sys.argv[1], "parquet", ["text"]):
    n += len(row["text"])
    if i == 2000:
        early = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(n, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - early) * 1024)
"""


def test_a_large_table_streams_in_flat_memory(tmp_path):
    """Reading 200 MB of text rows raises the peak RSS by a few MB past
    its first rows: the rows come a batch at a time, never the table."""
    p = str(tmp_path / "big.parquet")
    row = "word " * 2000   # 10 kB a row
    w = pq.ParquetWriter(p, pa.schema([("text", pa.string())]))
    for _ in range(20):
        w.write_table(pa.table({"text": [row] * 1000}))
    w.close()
    r = subprocess.run([sys.executable, "-c", _FLAT, p], capture_output=True, text=True,
                       cwd=HERE, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    n, grew = map(int, r.stdout.split())
    assert n == 20000 * len(row)
    assert grew < 64 << 20, grew


def test_without_pyarrow_a_table_is_one_line_naming_the_extra(tmp_path):
    p = _write_parquet(tmp_path / "t.parquet", _texts())
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "from rwkvx_c.cli import main; sys.exit(main(['train', '--data', sys.argv[1], "
            "'--steps', '1', '--cache-dir', sys.argv[2]]))")
    r = subprocess.run([sys.executable, "-c", code, p, str(tmp_path / "c")],
                       capture_output=True, text=True, cwd=HERE, timeout=300)
    last = r.stderr.splitlines()[-1]   # after the tokenising progress bar
    assert r.returncode == 1 and r.stderr.count("error") == 1, r.stderr
    assert last == (f"rwkvx-c: error: reading parquet file {p} needs pyarrow: "
                    'pip install "rwkvx_c[datasets]"')
