"""The OpenMP waiting policy rwkvx_c sets at import (rwkvx_c/_omp.py) and
the openmp_runtimes diagnostic, each in a fresh interpreter (the runtime
reads its environment once, when it is loaded)."""
import json
import os
import subprocess
import sys

import pytest

import rwkvx_c as rx

# the package the tests import (installed, or the in-place build), never a source
# tree in the working folder: the probe runs in the tests folder
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(rx.__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = ("import json, os, rwkvx_c as rx; print(json.dumps("
         "[os.environ.get('GOMP_SPINCOUNT'), rx.openmp_runtimes()]))")


def _probe(env_extra, pre=""):
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_extra)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", pre + PROBE], env=env, capture_output=True,
                       text=True, check=True, cwd=HERE)
    return json.loads(r.stdout.splitlines()[-1])


def test_bounded_spin_set_when_user_chose_nothing():
    spin, runtimes = _probe({})
    assert spin == rx._omp.SPIN_DEFAULT
    if rx.has_openmp() and sys.platform.startswith("linux"):
        assert runtimes   # the C core's runtime, found in the process's maps


@pytest.mark.parametrize("env,want", [({"GOMP_SPINCOUNT": "300000"}, "300000"),
                                      ({"OMP_WAIT_POLICY": "active"}, None)])
def test_user_policy_wins(env, want):
    assert _probe(env)[0] == want


@pytest.mark.skipif(not rx.has_openmp() or not sys.platform.startswith("linux"),
                    reason="needs the OpenMP build on Linux")
def test_runtime_loaded_first_is_left_alone():
    # a runtime already loaded has read its environment: setting it now
    # would only mislead
    pre = "import ctypes; ctypes.CDLL('libgomp.so.1'); "
    spin, runtimes = _probe({}, pre)
    assert spin is None and runtimes
