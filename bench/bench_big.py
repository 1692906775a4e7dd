"""Fine-tuning the official RWKV-7 shapes on one CPU box: for the 0.4B, 1.5B,
2.9B, 7.2B and 13.3B shapes (C 1024/24, 2048/24, 2560/32, 4096/32, 4096/61
blocks (13.3B's block count from its parameter count), head
size 64, ffn 4C, the World vocabulary) and a frozen base of each dtype,
the time from reading the source to the model (build), the first step,
the peak RSS and the state and LoRA tokens/s at T 512, through the
functions `rwkvx-c train --init-from` runs (read_source, from_source,
Trainer).

    python bench/bench_big.py --shape 1.5B --base-dtype bf16 [--tune state|lora|both]
        [--source pth|hf|gguf] [--precision bf16] [--seq-len 512] [--steps 3] [--threads N]
        [--work DIR] [--paired ROUNDS] [--no-grad-cp]

The source is an official-layout bf16 .pth with random weights, written
once per shape into WORK (the names and layouts of
tests/test_interop.py's _official_dict, generated tensor by tensor at a
scale that keeps a deep model's activations finite); with --source hf the
same weights as a bf16 Hugging Face rwkv7 folder (safetensors, streamed
as the .pth is; needs safetensors); with --source gguf the same shapes and
scales as llama.cpp's rwkv7 GGUF with Q8_0 matrices (official_gguf: drawn
and quantized a tensor at a time; needs gguf), whose blocks a q8_0 base
takes as they are. Each tune runs in a
child process, so its peak RSS is its own; a row that the memory check
refuses prints the check's line. Prints one markdown row per tune and one
JSON line each, with the CPU. Needs torch (to write the .pth) and the
World tokenizer (".[torch,world]"); the data is the repository's docs/.

--paired R builds the tune twice in one child, on the --base-dtype base and
on a float32 base (the arena, as before the frozen base existed), and
times their steps alternating for R rounds (each round one step of each,
the order swapped every round, so both sample the same machine drift): it
prints each round's tokens/s ratio and their median.
"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import common  # noqa: E402,F401 -- an in-place build wins over an installed one

# C, blocks, the RWKV-7 LoRA sizes of each official shape (rwkvx_c.model.config.lora_sizes)
SHAPES = {"0.4B": (1024, 24), "1.5B": (2048, 24), "2.9B": (2560, 32), "7.2B": (4096, 32),
          "13.3B": (4096, 61)}
V, N = 65536, 64


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def official_tensors(C, L):
    """Random bf16 torch tensors in the x070 names and layouts, built one
    tensor at a time (peak: the bf16 model's size plus one float32 tensor)."""
    import torch

    from rwkvx_c.model.config import lora_sizes
    d = lora_sizes(C)
    Dw, Da, Dv, Dg, F, H = d["Dw"], d["Da"], d["Dv"], d["Dg"], 4 * C, C // N
    rng = np.random.default_rng(0)
    sd = {}

    def put(name, shape, s, shift=0.0):
        a = ((rng.random(shape, dtype=np.float32) - 0.5) * s + shift).astype(np.float32)
        sd[name] = torch.from_numpy(a).to(torch.bfloat16)

    def lin(name, out, inp, s=1.0):   # a Linear [out, in] of about unit gain
        put(name, (out, inp), s * 3.4 / np.sqrt(inp))

    put("emb.weight", (V, C), 2.0)
    put("blocks.0.ln0.weight", (C,), 0.2, 1.0)
    put("blocks.0.ln0.bias", (C,), 0.2)
    for i in range(L):
        p, a = f"blocks.{i}.", f"blocks.{i}.att."
        for ln in ("ln1", "ln2"):
            put(p + ln + ".weight", (C,), 0.2, 1.0)
            put(p + ln + ".bias", (C,), 0.2)
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "a0", "k_k", "k_a"):
            put(a + x, (1, 1, C), 1.0)
        put(a + "w0", (1, 1, C), 2.0, -2.0)   # decays e^-e^(w) in a usual range
        for nm, D in (("w", Dw), ("a", Da), ("v", Dv), ("g", Dg)):
            if nm == "v" and i == 0:
                continue
            put(a + nm + "1", (C, D), 1.0 / np.sqrt(C))
            put(a + nm + "2", (D, C), 1.0 / np.sqrt(D))
        if i > 0:
            put(a + "v0", (1, 1, C), 1.0)
        put(a + "r_k", (H, N), 0.5)
        for w in ("receptance", "key", "value"):
            lin(a + w + ".weight", C, C)
        lin(a + "output.weight", C, C, 0.3)
        put(a + "ln_x.weight", (C,), 0.2, 1.0)
        put(a + "ln_x.bias", (C,), 0.2)
        put(p + "ffn.x_k", (1, 1, C), 1.0)
        lin(p + "ffn.key.weight", F, C)
        lin(p + "ffn.value.weight", C, F, 0.3)
    put("ln_out.weight", (C,), 0.2, 1.0)
    put("ln_out.bias", (C,), 0.2)
    lin("head.weight", V, C, 0.3)
    return sd


def official_pth(path, C, L):
    """official_tensors as a .pth."""
    import torch
    torch.save(official_tensors(C, L), path)


def official_hf(folder, C, L):
    """official_tensors as a bf16 Hugging Face rwkv7 folder (config.json,
    model.safetensors; no tokenizer files: 65,536 ids read as World)."""
    from safetensors.torch import save_file

    from rwkvx_c.interop import hf
    from rwkvx_c.model.config import lora_sizes
    sd = {}
    for name, t in official_tensors(C, L).items():
        theirs, kind = hf._hf_name(name)
        sd[theirs] = t.T.contiguous() if kind == "T" else t.reshape(-1) if kind == "flat" else t
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, hf.HF_WEIGHTS))
    config = dict(n_embd=C, n_head=C // N, head_size=N, n_rwkv_layer=L, n_attn_layer=0,
                  vocab_size=V, ffn_dim=4 * C, chunk_size=32, moba_top_k=2, ln0=1,
                  **{k: lora_sizes(C)[k] for k in ("Dw", "Da", "Dv", "Dg")})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf.hf_config(config), f)


def _gguf_scale(name, shape, C):
    """(scale, shift) of official_tensors' draw for a GGUF tensor of numpy
    shape (a matrix [out, in])."""
    last = name.rsplit(".", 2)[-2]
    if name == "token_embd.weight":
        return 2.0, 0.0
    if "norm" in name or last in ("time_mix_ln", "time_mix_ln_x"):
        return (0.2, 1.0) if name.endswith(".weight") else (0.2, 0.0)
    if last == "time_mix_w0":
        return 2.0, -2.0
    if last == "time_mix_r_k":
        return 0.5, 0.0
    if len(shape) == 2 and last[-1] in "12":   # the time-mix LoRAs
        return 1.0 / np.sqrt(shape[-1]), 0.0
    if len(shape) == 2:   # a Linear of about unit gain, the outputs a third of it
        small = last in ("time_mix_output", "channel_mix_value", "output")
        return (0.3 if small else 1.0) * 3.4 / np.sqrt(shape[-1]), 0.0
    return 1.0, 0.0


def official_gguf(path, C, L, dtype="q8_0"):
    """A random model of official_tensors' shapes and scales as llama.cpp's
    rwkv7 GGUF, its matrices GGUF blocks of dtype (q8_0, q4_0), written a
    tensor at a time (peak: one matrix's blocks), with the World vocabulary
    inside."""
    import gguf

    from rwkvx_c.interop.gguf import STAND_INS, gguf_pairs, gguf_writer, keeps_f32
    from rwkvx_c.model.config import lora_sizes
    config = dict(n_embd=C, n_head=C // N, head_size=N, n_rwkv_layer=L, n_attn_layer=0,
                  vocab_size=V, ffn_dim=4 * C, chunk_size=32, moba_top_k=2, ln0=1,
                  **{k: lora_sizes(C)[k] for k in ("Dw", "Da", "Dv", "Dg")})
    shapes = {n: a.shape for n, a in
              __import__("rwkvx_c").RxPtModel(config, init=False).params.items()}
    info = {}
    for ours, theirs, how in gguf_pairs(config):
        info[theirs] = (6, 1, 1, C) if how.startswith("lerp") else \
            shapes[ours][::-1] if how == "t" else shapes[ours]
    info.update({v: info[a] for v, a in STAND_INS.items()})
    q = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[dtype]
    per, nbytes = gguf.GGML_QUANT_SIZES[q]
    w = gguf_writer(path, config, dtype)
    kinds = {}
    for name, shape in info.items():
        f32 = keeps_f32(name, np.empty((0,) * len(shape)))
        kinds[name] = f32
        if f32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            w.add_tensor_info(name, (shape[0], shape[1] // per * nbytes), np.dtype(np.uint8),
                              shape[0] * shape[1] // per * nbytes, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape in info.items():
        s, shift = _gguf_scale(name, shape, C)
        if kinds[name]:
            a = ((rng.random(shape, dtype=np.float32) - 0.5) * s + shift).astype(np.float32)
            w.write_tensor_data(a)
            continue
        # the blocks drawn directly (quantizing billions of floats takes an hour):
        # values uniform over [-s/2, s/2] as the float32 draw's, quantized
        blocks = np.empty((shape[0], shape[1] // per, nbytes), np.uint8)
        levels = 127 if dtype == "q8_0" else 8
        blocks[:, :, :2] = np.full(1, s / 2 / levels, np.float16).view(np.uint8)
        if dtype == "q8_0":
            blocks[:, :, 2:] = rng.integers(-127, 128, blocks[:, :, 2:].shape,
                                            dtype=np.int8).view(np.uint8)
        else:
            blocks[:, :, 2:] = rng.integers(0, 256, blocks[:, :, 2:].shape, dtype=np.uint8)
        w.write_tensor_data(blocks.reshape(shape[0], -1))
    w.close()


def peak_rss():
    """This process's peak RSS in bytes: VmHWM, its own memory's high-water
    mark (ru_maxrss also counts the forking parent's, which wrote the source)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trainer(a, base_dtype):
    """The tune of a's options on a base of base_dtype, as --init-from makes it."""
    from rwkvx_c.interop.source import read_source
    from rwkvx_c.train import Trainer, TrainOptions
    from rwkvx_c.train.finetune import from_source
    src = read_source(a.src)
    opts = TrainOptions(data=os.path.join(ROOT, "docs"), tokenizer="world", tune=a.tune,
                        base_dtype=base_dtype, precision=a.precision,
                        grad_cp=not a.no_grad_cp,
                        batch=1, seq_len=a.seq_len, steps=max(a.steps, a.paired) + 2,
                        eval_tokens=a.seq_len, eval_every=10**6, save_every=10**6, lr=1e-4,
                        warmup_steps=1, threads=a.threads,
                        cache_dir=os.path.join(a.work, "cache"))
    return Trainer(from_source(opts, src.config, src.tokenizer, a.src),
                   os.path.join(a.work, f"run-{a.shape}-{base_dtype}-{a.tune}"),
                   _weights=src.weights)


def paired(a):
    """a.paired rounds of one step on each base, alternating (module doc)."""
    trs = {d: trainer(a, d) for d in (a.base_dtype, "fp32")}
    for tr in trs.values():   # the first step allocates its scratch: not timed
        tr.step()
    ratios = []
    for i in range(a.paired):
        dt = {}
        for d in (list(trs) if i % 2 == 0 else list(trs)[::-1]):
            t = time.perf_counter()
            trs[d].step()
            dt[d] = time.perf_counter() - t
        ratios.append(dt["fp32"] / dt[a.base_dtype])
        print(json.dumps({"round": i + 1, **{f"{d}_s": round(v, 3) for d, v in dt.items()},
                          "tokens_per_s_ratio": round(ratios[-1], 3)}), flush=True)
    print(f"# {a.shape} {a.tune} at --precision {a.precision}: tokens/s on a {a.base_dtype} "
          f"base over a float32 base, median of {a.paired} alternating rounds: "
          f"{float(np.median(ratios)):.2f}x (CPU: {cpu_name()}, {os.cpu_count()} cores)")
    for tr in trs.values():
        tr.close()


def child(a):
    """One tune in this process: build, then steps; one JSON line."""
    from rwkvx_c.errors import RwkvxError
    t0 = time.perf_counter()
    row = dict(shape=a.shape, source=a.source, base=a.base_dtype, tune=a.tune,
               precision=a.precision, seq_len=a.seq_len, grad_cp=not a.no_grad_cp)
    try:
        tr = trainer(a, a.base_dtype)
    except RwkvxError as e:
        row.update(fits=False, why=str(e))
        print(json.dumps(row))
        return
    row["build_s"] = time.perf_counter() - t0
    times, first = [], None
    for _ in range(a.steps):
        t = time.perf_counter()
        tr.step()
        times.append(time.perf_counter() - t)
        first = first or time.perf_counter() - t0
    row.update(fits=True, first_step_s=round(first, 1),
               tokens_per_s=round(a.seq_len / min(times[1:] or times), 1),
               peak_rss_gib=round(peak_rss() / 2**30, 2),
               base_gib=round(tr.model.base_bytes / 2**30, 2), trained=int(tr.optim.m.size),
               build_s=round(row["build_s"], 1))
    tr.close()
    print(json.dumps(row))


def main():
    from rwkvx_c import BASE_DTYPES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), required=True)
    ap.add_argument("--base-dtype", choices=["fp32", *BASE_DTYPES], required=True)
    ap.add_argument("--tune", choices=["state", "lora", "both"], default="both")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (the fastest counts)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "rwkvx_bench_big"))
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="alternate steps on this base and on a float32 base (one tune)")
    ap.add_argument("--no-grad-cp", action="store_true",
                    help="keep every block's activations (the trainer's default) instead of "
                    "recomputing them in the backward (--grad-cp, this script's default)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--source", choices=["pth", "hf", "gguf"], default="pth",
                    help="the random model as an x070 .pth, a Hugging Face folder or a "
                    "Q8_0 GGUF (llama.cpp's rwkv7)")
    ap.add_argument("--src", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return paired(a) if a.paired else child(a)
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, f"official-{a.shape}" + {"pth": ".pth", "hf": "-hf",
                                                        "gguf": "-Q8_0.gguf"}[a.source])
    if not os.path.exists(src):
        t = time.perf_counter()
        {"pth": official_pth, "hf": official_hf, "gguf": official_gguf}[a.source](
            src + ".tmp", *SHAPES[a.shape])
        os.replace(src + ".tmp", src)
        size = os.path.getsize(os.path.join(src, "model.safetensors")) if a.source == "hf" \
            else os.path.getsize(src)
        print(f"# wrote {src} ({size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s",
              flush=True)
    print(f"# CPU: {cpu_name()}, {os.cpu_count()} cores")
    print("| shape | base | tune | precision | base GiB | build s | to first step s | "
          "peak RSS GiB | tokens/s |" + ("  (no --grad-cp)" if a.no_grad_cp else ""))
    for tune in (["state", "lora"] if a.tune == "both" else [a.tune]):
        cmd = [sys.executable, __file__, "--child", "--src", src, "--source", a.source,
               "--shape", a.shape,
               "--base-dtype", a.base_dtype, "--tune", tune, "--precision", a.precision,
               "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--work", a.work,
               "--paired", str(a.paired)] + (["--no-grad-cp"] if a.no_grad_cp else [])
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        if a.paired:
            subprocess.run(cmd, check=True)
            continue
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
        if out.returncode or not lines:
            print(f"| {a.shape} | {a.base_dtype} | {tune} | failed: "
                  f"{(out.stderr.strip().splitlines() or ['?'])[-1]} |")
            continue
        r = json.loads(lines[-1])
        if not r["fits"]:
            print(f"| {a.shape} | {a.base_dtype} | {tune} | {a.precision} | does not fit: "
                  f"{r['why']} |")
        else:
            print(f"| {a.shape} | {a.base_dtype} | {tune} | {a.precision} | {r['base_gib']} | "
                  f"{r['build_s']} | {r['first_step_s']} | {r['peak_rss_gib']} | "
                  f"{r['tokens_per_s']} |")
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
