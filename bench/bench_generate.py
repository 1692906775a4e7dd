"""Generation speed of rwkvx_c's batched engine beside llama.cpp and the
rwkv package, on the same random model: prefill tokens/s (a 512-token
prompt), batch-1 decode tokens/s, and decode throughput with 8 and 64
sequences advancing together.

    python bench/bench_generate.py [--shape 0.1B|0.4B|1.5B] [--threads N] [--work DIR]
        [--engines rwkvx_c,rwkvx_c-fast,llama.cpp,rwkv]
        [--formats fp32,q8_0,bf16 (also q4_0, q4_k)] [--decode 64] [--repeat 2]

The model: an official-layout random .pth of the shape (bench_big's
writer, bf16), imported as a run (`rwkvx-c import`), exported as float32
GGUF (`rwkvx-c export --format gguf --dtype fp32`) for llama.cpp (through
llama-cpp-python, which is not a dependency: its rows say "not installed"
without it) and as a float32 x070 .pth (`--format rwkv7`) for the rwkv
package (strategy "cpu fp32"). Q8_0 against Q8_0: the run's Q8_0 GGUF
export (`--dtype q8_0`) for llama.cpp, and for rwkvx_c a one-step state
tune `--init-from` that file, whose frozen base holds the file's blocks as
they are (the rwkv package has no Q8_0), and the same for Q4_0 and Q4_K
(`--formats q4_0,q4_k`); "rwkvx_c-fast" is the same run with GenState's
fast_decode (int8 activations in integer dot products, as llama.cpp's
Q8_0 and Q4_0 paths; only over those bases). bf16 against bf16: the
bf16 .pth itself, for the rwkv package (strategy "cpu fp32": it widens
the weights as it loads; its "cpu bf16" is two orders slower) and for
rwkvx_c as the frozen bf16 base of a one-step state tune `--init-from` it
(what tuning an official .pth gives), and its BF16 GGUF export for
llama.cpp.
Each engine runs in a child
process of its own, --repeat times, the engines in turn (one run of each
a round, so on a shared machine they sample the same load); a column is
the best of an engine's runs. A
llama.cpp child killed by a signal runs again with llama.cpp's extra
weight buffers off (`use_extra_bufts`: its AMX matmul crashes on RWKV-7's
Q8_0 tensors on Sapphire Rapids), and its row says so.
Batched decode: rwkvx_c advances B slots in one GenState.step (the
last column: and draws each slot's next token from the step's logits, as
generate() does at Sampling()'s defaults, temperature 1 and top-p 0.9;
rwkvx_c only);
llama.cpp decodes one llama_batch holding one token of each of B sequences
(n_seq_max B); the rwkv package's forward takes one sequence, so its
batched rows are "n/a". Prints a markdown table and one JSON line per
engine, with the CPU.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
SHAPES = {"0.1B": (768, 12), "0.4B": (1024, 24), "1.5B": (2048, 24)}
PROMPT = 512
BATCHES = (8, 64)


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(1000, 60000, n).astype(np.int32)


def _best(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def child_rwkvx(a):
    import rwkvx_c as rx
    from rwkvx_c.generation.sampling import sample_rows
    from rwkvx_c.sample import load_model
    model = load_model(a.run, hold_base=True)   # a Q8_0 base read in place
    prompt = _tokens(PROMPT)
    g = rx.GenState(model, max(BATCHES), max_len=PROMPT + a.decode + 1, max_tokens=PROMPT,
                    fast_decode=a.fast)

    def prefill():
        g.reset(0)
        g.step([0], [PROMPT], prompt)
    out = {"prefill": PROMPT / _best(prefill)}
    for B in (1, *BATCHES):
        slots = np.arange(B, dtype=np.int32)
        ones = np.ones(B, np.int32)
        for k in range(B):
            g.reset(k)
        t = time.perf_counter()
        for i in range(a.decode):
            g.step(slots, ones, _tokens(B, i))
        out[f"decode{B}"] = B * a.decode / (time.perf_counter() - t)
    # B slots again, each step's tokens drawn from its logits as generate()
    # draws them at Sampling()'s defaults (temperature 1, top-p 0.9)
    B = max(BATCHES)
    slots, ones = np.arange(B, dtype=np.int32), np.ones(B, np.int32)
    rngs = [np.random.default_rng(k) for k in range(B)]
    for k in range(B):
        g.reset(k)
    ids = _tokens(B)
    t = time.perf_counter()
    for _ in range(a.decode):
        ids = sample_rows(g.step(slots, ones, ids), rngs, 1.0, 0.9).astype(np.int32)
    out[f"drawn{B}"] = B * a.decode / (time.perf_counter() - t)
    return out


def child_llama(a):
    try:
        import llama_cpp
    except ImportError:
        return {"note": "llama-cpp-python not installed"}
    if a.no_extra_bufts:
        # llama.cpp's extra weight buffers (AMX, repacked) off: its AMX
        # matmul crashes on RWKV-7 Q8_0 (llama-cpp-python 0.3.36, Sapphire Rapids)
        low = llama_cpp.llama_cpp   # the module Llama and _llama_batched take params from
        default = low.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p
        low.llama_model_default_params = params
    llm = llama_cpp.Llama(a.gguf, n_ctx=PROMPT + a.decode + 8, n_batch=PROMPT,
                          n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    prompt = [int(t) for t in _tokens(PROMPT)]

    def prefill():
        llm.reset()
        llm.eval(prompt)
    out = {"prefill": PROMPT / _best(prefill)}
    llm.reset()
    t = time.perf_counter()
    for i in range(a.decode):
        llm.eval([int(_tokens(1, i)[0])])
    out["decode1"] = a.decode / (time.perf_counter() - t)
    for B in BATCHES:
        try:
            out[f"decode{B}"] = _llama_batched(llama_cpp, a, B)
        except (AttributeError, TypeError, ValueError, RuntimeError) as e:   # an API it lacks
            out[f"decode{B}"] = f"n/a ({type(e).__name__}: {str(e)[:60]})"
    return out


def _llama_batched(llama_cpp, a, B):
    """Tokens/s of B sequences decoded together: one llama_batch a step
    holding one token of each sequence (seq_id b, position i)."""
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_load_model_from_file(a.gguf.encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = B * (a.decode + 8)
    cp.n_batch = cp.n_ubatch = max(B, 8)
    cp.n_seq_max = B
    cp.n_threads = cp.n_threads_batch = a.threads
    ctx = llama_cpp.llama_new_context_with_model(model, cp)
    batch = llama_cpp.llama_batch_init(B, 0, 1)
    try:
        t = time.perf_counter()
        for i in range(a.decode):
            toks = _tokens(B, i)
            batch.n_tokens = B
            for b in range(B):
                batch.token[b] = int(toks[b])
                batch.pos[b] = i
                batch.n_seq_id[b] = 1
                batch.seq_id[b][0] = b
                batch.logits[b] = 1
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        return B * a.decode / (time.perf_counter() - t)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_free_model(model)


def child_rwkv(a):
    os.environ.setdefault("RWKV_JIT_ON", "0")
    os.environ["RWKV_V7_ON"] = "1"   # the package reads x070 only with it
    import torch
    from rwkv.model import RWKV
    torch.set_num_threads(a.threads)
    # "cpu fp32" on the bf16 .pth too: its "cpu bf16" decodes 0.1B at 0.5
    # tokens/s (2-core Zen 3), unusable
    model = RWKV(model=a.pth[:-len(".pth")], strategy="cpu fp32")
    prompt = [int(t) for t in _tokens(PROMPT)]
    with torch.no_grad():
        out = {"prefill": PROMPT / _best(lambda: model.forward(prompt, None), repeat=2)}
        _, state = model.forward(prompt[:8], None)
        t = time.perf_counter()
        for i in range(a.decode):
            _, state = model.forward([int(_tokens(1, i)[0])], state)
        out["decode1"] = a.decode / (time.perf_counter() - t)
    for B in BATCHES:
        out[f"decode{B}"] = "n/a (forward takes one sequence)"
    return out


CHILDREN = {"rwkvx_c": child_rwkvx, "rwkvx_c-fast": child_rwkvx, "llama.cpp": child_llama,
            "rwkv": child_rwkv}


def _cli(*args):
    subprocess.run([sys.executable, "-m", "rwkvx_c", *args], check=True, stdout=subprocess.DEVNULL)


QUANTS = ("q8_0", "q4_0", "q4_k")   # GGUF block types: the run's export, held as they are
FORMATS = ("fp32", "bf16") + QUANTS
FAST = ("q8_0", "q4_0")             # the bases fast_decode reads


def prepare(a, formats):
    """(run, GGUF, .pth or None) of each format under a.work, each made once."""
    from bench_big import official_pth
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, f"random-{a.shape}.pth")
    if not os.path.exists(src):
        official_pth(src + ".tmp.pth", *SHAPES[a.shape])
        os.replace(src + ".tmp.pth", src)
    run = os.path.join(a.work, f"run-{a.shape}")
    if not os.path.isdir(run):
        _cli("import", src, "--out", run)

    def export(fmt, dtype, ext):
        out = os.path.join(a.work, f"model-{a.shape}-{fmt}.{ext}")
        if not os.path.exists(out):
            _cli("export", run, "--format", "gguf" if ext == "gguf" else "rwkv7", "--dtype",
                 dtype, "--out", out)
        return out
    made = {}
    for fmt in formats:
        if fmt == "fp32":
            made[fmt] = (run, export("f32", "fp32", "gguf"), export("f32", "fp32", "pth"))
        elif fmt == "bf16":
            made[fmt] = (_held(a, src, "bf16"), export("bf16", "bf16", "gguf"), src)
        else:
            gguf = export(fmt, fmt, "gguf")
            made[fmt] = (_held(a, gguf, fmt), gguf, None)
    return made


def _held(a, source, fmt):
    """A run whose frozen base holds source's weights in their own form:
    one step of a state tune at learning rate ~0 (made once)."""
    out = os.path.join(a.work, f"run-{a.shape}-{fmt}")
    if not os.path.isdir(out):
        text = os.path.join(a.work, "one-step.txt")
        with open(text, "w") as f:
            f.write("a short text for one step of a state tune.\n" * 64)
        _cli("train", "--init-from", source, "--tune", "state", "--steps", "1", "--lr", "1e-12",
             "--seq-len", "16", "--batch", "1", "--eval-tokens", "16", "--data", text,
             "--out", out)
    return out


def _fmt(v):
    return f"{v:,.1f}" if isinstance(v, float) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="0.1B")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--work", default="/tmp/rwkvx_bench_generate")
    ap.add_argument("--engines", default=",".join(CHILDREN))
    ap.add_argument("--formats", default="fp32,q8_0,bf16",
                    help="weight formats compared, of " + ",".join(FORMATS))
    ap.add_argument("--decode", type=int, default=64, help="decode steps timed")
    ap.add_argument("--repeat", type=int, default=2, help="child runs per engine (best kept)")
    ap.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--fast", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-extra-bufts", action="store_true", help=argparse.SUPPRESS)
    for k in ("run", "gguf", "pth"):
        ap.add_argument("--" + k, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(CHILDREN[a.child](a)))
        return
    from bench_big import cpu_name
    formats = a.formats.split(",")
    if not set(formats) <= set(FORMATS):
        ap.error(f"--formats: {','.join(sorted(set(formats) - set(FORMATS)))} is none of "
                 f"{','.join(FORMATS)}")
    made = prepare(a, formats)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    print(f"# CPU: {cpu_name()}, {os.cpu_count()} cores, {a.threads} threads; shape {a.shape}, "
          f"{PROMPT}-token prompt, {a.decode} decode steps, best of {a.repeat} runs")
    cols = ["prefill", "decode1"] + [f"decode{B}" for B in BATCHES] + [f"drawn{max(BATCHES)}"]
    print("| engine | weights | prefill tok/s | decode B=1 tok/s | "
          + " | ".join(f"decode B={B} tok/s" for B in BATCHES)
          + f" | B={max(BATCHES)} with each token drawn tok/s |")
    print("|---" * (len(cols) + 2) + "|")
    for fmt in formats:
        run, gguf, pth = made[fmt]
        # the rwkv package reads no GGUF blocks; the fast decode is a Q8_0 or Q4_0 base's
        names = [n for n in a.engines.split(",")
                 if not ((n == "rwkv" and pth is None)
                         or (n == "rwkvx_c-fast" and fmt not in FAST))]
        best: dict = {n: {} for n in names}
        # round-robin: each round runs every engine once, so on a shared
        # machine their bests sample the same stretch of load
        for _ in range(a.repeat):
            for name in names:
                best[name] = _best_of(best[name], _child(a, name, run, gguf, pth, env))
        for name in names:
            res = best[name]
            rated = any(isinstance(res.get(c), float) for c in cols)
            shown = f"{name} ({res['note']})" if rated and res.get("note") else name
            print(f"| {shown} | {fmt} | " + " | ".join(_fmt(res.get(c, res.get('note', '-')))
                                                       for c in cols) + " |")
            print(json.dumps({"engine": name, "weights": fmt, "shape": a.shape, **res}),
                  file=sys.stderr)


def _child(a, name, run, gguf, pth, env):
    def once(extra):
        return subprocess.run([sys.executable, __file__, "--child", name, "--run", run,
                               "--gguf", gguf, "--pth", str(pth), "--threads", str(a.threads),
                               "--decode", str(a.decode)] + extra
                              + (["--fast"] if name == "rwkvx_c-fast" else []),
                              capture_output=True, text=True, env=env)
    r = once([])
    note = None
    if r.returncode < 0 and name == "llama.cpp":
        # killed by a signal: again without llama.cpp's extra weight buffers
        note = f"killed by signal {-r.returncode}; rerun with use_extra_bufts off"
        r = once(["--no-extra-bufts"])
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"note": f"failed: {(r.stderr.strip().splitlines() or ['?'])[-1][:100]}"}
    return {**out, "note": note} if note else out


def _best_of(old, new):
    """Per column, the larger rate of two runs (a note when neither has one)."""
    out = dict(new)
    for k, v in old.items():
        if isinstance(v, float) and (not isinstance(out.get(k), float) or out[k] < v):
            out[k] = v
    return out


if __name__ == "__main__":
    main()
