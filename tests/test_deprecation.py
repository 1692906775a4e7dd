"""The legacy section of csrc/rx_pretrain.h: under GCC and Clang every
legacy form (NULL / NaN / void on failure) is declared deprecated with a
message naming the int-returning form to call instead, and defining
RX_NO_DEPRECATION_WARNINGS declares them plainly. The programs are only
compiled (-fsyntax-only), never linked or run."""
import os
import re
import shlex
import shutil
import subprocess

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
HEADER = os.path.join(CSRC, "rx_pretrain.h")

# legacy form -> (its replacement, the arguments of a call to the legacy form
# over the variables PROGRAM declares)
LEGACY = {
    "rx_model_new_random": ("rx_model_create", "&pc, 1"),
    "rx_model_new_random_flags": ("rx_model_create", "&pc, 0, 1"),
    "rx_pt_acts_new": ("rx_pt_acts_create", "m, 4"),
    "rx_pt_acts_new_batch": ("rx_pt_acts_create", "m, 1, 4"),
    "rx_infer_new": ("rx_infer_create", "m, 4"),
    "rx_pretrain_backward": ("rx_pretrain_backward_loss", "m, a, t, 1, -1"),
    "rx_pretrain_backward_batch": ("rx_pretrain_backward_loss", "m, a, t, 1, 1, -1"),
    "rx_cross_entropy_forward": ("rx_cross_entropy", "f, t, 1, 4, -1"),
    "rx_cross_entropy_backward": ("rx_cross_entropy", "f, t, 1, 4, -1, f"),
    "rx_grad_norm": ("rx_grad_norm_l2", "f, 4"),
    "rx_embedding_forward": ("rx_embedding_gather", "f, t, 1, 4, f"),
    "rx_embedding_backward": ("rx_embedding_scatter", "t, 1, 4, 1, f, f"),
    "rx_head_forward": ("rx_head_logits", "f, f, 1, 2, 2, f"),
    "rx_head_backward": ("rx_head_grads", "f, f, f, 1, 2, 2, f, f"),
}

PROGRAM = """#include "rx_pretrain.h"
int main(void) {
    rx_pt_config pc = {0};
    rx_ptmodel *m = 0;
    rx_pt_acts *a = 0;
    float f[4] = {0};
    int t[1] = {0};
    (void)pc; (void)m; (void)a; (void)f; (void)t;
%s
    return 0;
}
"""


@pytest.fixture(scope="module")
def cc():
    cc = shlex.split(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "")
    if not cc or shutil.which(cc[0]) is None:
        pytest.skip("no C compiler (set CC)")
    return cc


def compile_calls(cc, tmp_path, names, *flags):
    """Compiles a program calling each legacy form in names against the
    header; the compiler's result, its messages in the C locale."""
    src = tmp_path / "legacy_call.c"
    src.write_text(PROGRAM % "\n".join(f"    {n}({LEGACY[n][1]});" for n in names))
    return subprocess.run(cc + ["-std=c11", "-fsyntax-only", "-I", CSRC, *flags, str(src)],
                          capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))


def test_a_legacy_call_fails_under_werror_naming_the_replacement(cc, tmp_path):
    r = compile_calls(cc, tmp_path, ["rx_model_new_random"], "-Werror=deprecated-declarations")
    assert r.returncode != 0, "a call of rx_model_new_random compiled under -Werror"
    assert "rx_model_new_random" in r.stderr and "use rx_model_create(" in r.stderr, r.stderr


def test_the_opt_out_macro_declares_them_plainly(cc, tmp_path):
    r = compile_calls(cc, tmp_path, list(LEGACY), "-DRX_NO_DEPRECATION_WARNINGS", "-Wall",
                      "-Werror")
    assert r.returncode == 0, r.stderr


def test_every_legacy_form_names_its_replacement(cc, tmp_path):
    # the table above is the header's legacy section, no more and no less
    with open(HEADER) as f:
        marked = set(re.findall(r'^RX_DEPRECATED\("[^"]*"\)\s*\n[^(]*?\b(rx_\w+)\(', f.read(),
                                re.M))
    assert marked == set(LEGACY)
    r = compile_calls(cc, tmp_path, list(LEGACY), "-Wdeprecated-declarations")
    assert r.returncode == 0, r.stderr
    for name, (replacement, _) in LEGACY.items():
        said = re.search(r"\b%s\b\W* is deprecated: use (\w+)\(" % name, r.stderr)
        assert said, f"no deprecation warning for {name}:\n{r.stderr}"
        assert said.group(1) == replacement, said.group(0)
