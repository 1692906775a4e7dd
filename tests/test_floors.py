"""The C core's floors (docs/architecture.md §Floors): every csrc/*.c is on
a floor of the table there, and calls only files on lower floors. Each file
is compiled on its own and its object's symbols read with nm: an undefined
`rx_` symbol must be defined by a file on a strictly lower floor. The
checker is shown to fail on a deliberately wrong pair of objects."""
import glob
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
GUIDE = os.path.join(ROOT, "docs", "architecture.md")
FLAGS = ["-std=gnu11", "-O0", "-I" + CSRC]
# nm's letters of a symbol an object defines (text, data, read-only, bss, common)
DEFINED = set("TDRBCVW")


def tools():
    """(cc, nm) or a skip naming what is missing."""
    cc = os.environ.get("CC", "cc").split()[0]
    missing = [t for t in (cc, "nm") if not shutil.which(t)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found: the floors are read from objects")
    return cc, "nm"


def read_floors(text):
    """{file: floor} from the table between the guide's floors markers."""
    m = re.search(r"<!-- floors:.*?-->(.*?)<!-- /floors -->", text, re.S)
    assert m, "docs/architecture.md has no floors table"
    floors = {}
    for row in m.group(1).splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([^`]+\.c)`", cells[2]):
            assert name not in floors, f"{name} is on two floors"
            floors[name] = int(cells[0])
    return floors


def compile_objects(cc, sources, out, flags=FLAGS):
    """{file name: object path}, each source compiled on its own."""
    def one(src):
        obj = os.path.join(out, os.path.basename(src)[:-2] + ".o")
        r = subprocess.run([cc, *flags, "-c", src, "-o", obj], capture_output=True, text=True)
        assert r.returncode == 0, f"{src}: {r.stderr[-2000:]}"
        return os.path.basename(src), obj
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(pool.map(one, sources))


def symbols(nm, obj):
    """(defined, undefined) `rx_` symbols of an object."""
    out = subprocess.run([nm, obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if not parts or not parts[-1].startswith("rx_"):
            continue
        if parts[-2] == "U":
            undefined.add(parts[-1])
        elif parts[-2] in DEFINED:
            defined.add(parts[-1])
    return defined, undefined


def violations(floors, objects, nm):
    """Every call that does not go strictly down a floor, as messages."""
    syms = {f: symbols(nm, o) for f, o in objects.items()}
    owner = {s: f for f, (defined, _) in syms.items() for s in defined}
    bad = []
    for f, (_, undefined) in sorted(syms.items()):
        for s in sorted(undefined):
            g = owner.get(s)
            if g is None:
                bad.append(f"{f} calls {s}, which no file defines")
            elif floors[g] >= floors[f]:
                bad.append(f"{f} (floor {floors[f]}) calls {s} of {g} (floor {floors[g]})")
    return bad


def test_every_file_is_on_a_floor():
    with open(GUIDE) as fh:
        floors = read_floors(fh.read())
    files = {os.path.basename(p) for p in glob.glob(os.path.join(CSRC, "*.c"))}
    assert sorted(files - set(floors)) == [], "csrc files missing from the floors table"
    assert sorted(set(floors) - files) == [], "the floors table names files csrc lacks"
    # inference stands above the model and the blocks
    assert floors["infer.c"] > max(floors["model.c"], floors["block.c"], floors["attn.c"])


def test_calls_go_down_the_floors(tmp_path):
    cc, nm = tools()
    with open(GUIDE) as fh:
        floors = read_floors(fh.read())
    sources = sorted(glob.glob(os.path.join(CSRC, "*.c")))
    objects = compile_objects(cc, sources, str(tmp_path))
    assert violations(floors, objects, nm) == []


def test_the_checker_finds_an_upward_and_a_peer_call(tmp_path):
    cc, nm = tools()
    src = {
        "low.c": "int rx_high_thing(void);\nint rx_low_thing(void) { return rx_high_thing(); }\n",
        "peer.c": "int rx_low_thing(void);\nint rx_peer_thing(void) { return rx_low_thing(); }\n",
        "high.c": "int rx_high_thing(void) { return 1; }\n",
    }
    for name, text in src.items():
        (tmp_path / name).write_text(text)
    objects = compile_objects(cc, [str(tmp_path / n) for n in src], str(tmp_path), ["-O0"])
    bad = violations({"low.c": 1, "peer.c": 1, "high.c": 6}, objects, nm)
    assert bad == ["low.c (floor 1) calls rx_high_thing of high.c (floor 6)",
                   "peer.c (floor 1) calls rx_low_thing of low.c (floor 1)"]
    # the same objects on floors that fit pass
    assert violations({"low.c": 1, "peer.c": 2, "high.c": 0}, objects, nm) == []
