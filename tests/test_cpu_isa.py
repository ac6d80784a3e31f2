"""The instruction sets of the CPU ops' hand-written loops (csrc/beam_ops_cpu.cpp) and FASTFORMER_CPU_ISA, the switch
that caps them: every set this CPU runs passes the ops' and the search's tests against their oracles, not only the
widest one that the rest of the suite runs. (ctest runs each set's loops against brute force as well.)"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastformer.decoding.compiled import extension

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent / "benchmarks"))
from cpu_info import cpu_name_and_flags  # noqa: E402  (benchmarks/: /proc/cpuinfo's flags, as the records read them)

ISAS = extension().cpu_isas()
# The oracles' tests of everything the loops compute: the ops against the reference attention, the search against
# the reference search and brute force, int8 (its row scales) against float64 products, and scoring (its
# block_attention) against the reference's teacher-forced log-softmax.
ORACLE_TESTS = ["test_extension.py", "test_beam_search.py", "test_compute_types.py", "test_scoring.py"]
# The CPU has AVX-VNNI (the flag itself, not avx_vnni_int8 and the like), which the avx2 loops keep unless
# FASTFORMER_CPU_VNNI=0 turns it off.
HAS_AVX_VNNI = "avx_vnni" in cpu_name_and_flags()[1]
ROUTES_CODE = ("import torch\n"
               "from fastformer.decoding.compiled import extension\n"
               "routes = [extension().PackedLinear(torch.ones(3, 4), None, 1, t).route for t in ('float32', 'int8')]\n"
               "print(extension().cpu_isa(), extension().int8_activation_max(), *routes)")


def run_python(code: str, isa: str, vnni: str = "", amx: str = "") -> subprocess.CompletedProcess:
    # From tests/, so that the installed package is imported, not the source tree (which has no extension).
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=TESTS,
                          env={**os.environ, "FASTFORMER_CPU_ISA": isa, "FASTFORMER_CPU_VNNI": vnni,
                               "FASTFORMER_CPU_AMX": amx})


@functools.cache
def amx_runs() -> bool:
    """Whether the AMX int8 GEMM runs here with FASTFORMER_CPU_AMX on: the CPU has AMX-INT8 and Linux grants the
    tile registers (asked in a process of its own, whatever this one's FASTFORMER_CPU_AMX says)."""
    done = run_python("from fastformer.decoding.compiled import extension\nprint(extension().cpu_has_amx())", ISAS[0])
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def test_the_widest_instruction_set_is_chosen_and_the_baseline_is_always_there():
    assert ISAS[-1] == "baseline" and len(set(ISAS)) == len(ISAS)
    assert set(ISAS) <= {"avx512", "avx2", "baseline"}
    assert extension().cpu_isa() == os.environ.get("FASTFORMER_CPU_ISA", ISAS[0])


# The float32 route (PackedLinear.route) of the CPU loops that have an own float32 GEMM.
OWN_FLOAT32_ROUTES = {"avx512": "avx512-float32", "avx2": "avx2-float32"}


@pytest.mark.parametrize("isa", ISAS)
def test_fastformer_cpu_isa_picks_the_loops_caps_vnni_and_picks_the_gemms(isa):
    done = run_python(ROUTES_CODE, isa)
    assert done.returncode == 0, done.stderr
    chosen, activation_max, float32_route, int8_route = done.stdout.split()
    assert chosen == isa
    if isa == "baseline":  # VNNI belongs to the instruction sets above the cap: 7-bit activations
        assert float(activation_max) == 63.0
    # fastformer's own float32 GEMMs in the AVX-512 and AVX2 loops, oneDNN's (or at::linear) in the baseline's
    assert float32_route == OWN_FLOAT32_ROUTES[isa] if isa in OWN_FLOAT32_ROUTES else float32_route in ("onednn",
                                                                                                        "aten")
    # Its own int8 GEMMs: with 8-bit rows AMX's or AVX512-VNNI's in the AVX-512 loops and AVX-VNNI's in the AVX2
    # ones (a CPU with AVX-VNNI under an avx2 cap), with 7-bit ones AVX2's; FBGEMM's in the baseline's loops.
    if isa == "baseline":
        assert int8_route == "fbgemm-int8"
    elif float(activation_max) == 127.0:
        assert int8_route == (("amx-int8" if amx_runs() else "vnni-int8") if isa == "avx512" else "avxvnni-int8")
    else:
        assert int8_route == "avx2-int8"


@pytest.mark.parametrize("isa", ISAS[:-1])
def test_fastformer_cpu_vnni_0_runs_the_int8_path_of_a_cpu_without_vnni(isa):
    done = run_python(ROUTES_CODE, isa, vnni="0")
    assert done.returncode == 0, done.stderr
    chosen, activation_max, float32_route, int8_route = done.stdout.split()
    assert (chosen, float(activation_max), int8_route) == (isa, 63.0, "avx2-int8")
    assert float32_route == OWN_FLOAT32_ROUTES[isa]  # the float32 GEMM does not depend on VNNI


def test_a_fastformer_cpu_vnni_other_than_0_or_1_is_a_one_line_error_naming_it():
    done = run_python(ROUTES_CODE, ISAS[0], vnni="off")
    assert done.returncode != 0
    assert "FASTFORMER_CPU_VNNI=off is neither 0 (VNNI off) nor 1" in done.stderr.strip().splitlines()[-1]


@pytest.mark.skipif("avx512" not in ISAS or not amx_runs(), reason="AMX's int8 GEMM does not run on this CPU")
def test_fastformer_cpu_amx_0_runs_the_avx512_vnni_int8_gemm_and_the_same_translations():
    done = run_python(ROUTES_CODE, "avx512", amx="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "vnni-int8"
    # AMX's tdpbusd sums exactly as vpdpbusd does, and the outputs leave through the same code: the same searches,
    # scores and all, at rows of both GEMMs (8 sentences, beam 4: 32 a step; greedy: 8, under AMX's min_rows)
    code = ("import torch, fastformer\n"
            "torch.manual_seed(0)\n"
            "config = fastformer.TransformerConfig(vocab_size=300, d_model=128, n_heads=4, d_ff=256, "
            "n_encoder_layers=2, n_decoder_layers=2)\n"
            "model = fastformer.Transformer(config).eval()\n"
            "src = torch.randint(4, 300, (8, 40))\n"
            "for beam in (4, 1):\n"
            "    for h in model.translate(src, beam_size=beam, compute_type='int8', max_len_a=0.0, max_len_b=30):\n"
            "        print(h[0].tokens, h[0].score)\n"
            "print([t.tolist() for t in model.score(src, [s[:20].tolist() for s in src], compute_type='int8')])")
    with_amx, without = run_python(code, "avx512", amx="1"), run_python(code, "avx512", amx="0")
    assert with_amx.returncode == 0 and without.returncode == 0, with_amx.stderr + without.stderr
    assert with_amx.stdout == without.stdout and len(with_amx.stdout.splitlines()) == 17


def test_a_fastformer_cpu_amx_other_than_0_or_1_is_a_one_line_error_naming_it():
    done = run_python(ROUTES_CODE, ISAS[0], amx="yes")
    assert done.returncode != 0
    assert "FASTFORMER_CPU_AMX=yes is neither 0 (AMX off) nor 1" in done.stderr.strip().splitlines()[-1]


def test_an_unknown_or_unrunnable_instruction_set_is_a_one_line_error_naming_the_valid_ones():
    code = ("import torch, fastformer\n"
            "model = fastformer.Transformer(fastformer.TransformerConfig.tiny(vocab_size=50)).eval()\n"
            "model.translate(torch.tensor([[5, 6, 2]]), beam_size=2)")
    for isa in ("sse9", *[name for name in ("avx512", "avx2") if name not in ISAS]):
        done = run_python(code, isa)
        assert done.returncode != 0
        last_line = done.stderr.strip().splitlines()[-1]
        assert f"FASTFORMER_CPU_ISA={isa} is not an instruction set" in last_line
        assert "use one of: " + ", ".join(ISAS) in last_line


# The widest is the one every other test runs; the AVX2 loops without AVX-VNNI also where the CPU has it (an AVX2
# CPU's int8 path: 7-bit rows and the AVX2 int8 GEMM), and the AVX-512 ones without AMX where it runs (the
# AVX512-VNNI int8 GEMM at every row count).
@pytest.mark.parametrize("isa, vnni, amx", [(isa, "", "") for isa in ISAS[1:]] +
                         [("avx2", "0", "")] * ("avx2" in ISAS and HAS_AVX_VNNI) +
                         [("avx512", "", "0")] * ("avx512" in ISAS and amx_runs()))
def test_the_oracle_tests_pass_in_the_loops_of(isa, vnni, amx):
    done = subprocess.run([sys.executable, "-m", "pytest", *ORACLE_TESTS, "-q", "-x", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=900, cwd=TESTS,
                          env={**os.environ, "FASTFORMER_CPU_ISA": isa, "FASTFORMER_CPU_VNNI": vnni,
                               "FASTFORMER_CPU_AMX": amx})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.strip().splitlines()[-1]


def vector_tail_calls(binary: str) -> list[str]:
    """The jumps in `binary`'s code to the start of a function that takes vector arguments (tail calls)."""
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", binary], capture_output=True, text=True,
                             check=True, timeout=300).stdout
    calls = []
    for line in listing.splitlines():
        target = re.search(r"\sjmp\s+[0-9a-f]+ <(.*)>\s*$", line)
        if target and "__vector" in target.group(1) and not re.search(r"\+0x[0-9a-f]+$", target.group(1)):
            calls.append(line.strip())
    return calls


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="reads x86-64 code with objdump")
def test_no_vector_code_returns_to_sse_code_with_dirty_upper_registers():
    # GCC returns from a function with vector arguments without vzeroupper. Reached by a tail call, such a function
    # returned straight into its caller's caller, baseline SSE code (int8_gemm_cpu.cpp's run_tiles), which then paid
    # the AVX-SSE transition on every instruction: half the 256-bit int8 GEMMs' time until 45ebd03 (70917c7's
    # library, the commit before, has 10 such jumps, each a tile's last call of finish_row).
    calls = vector_tail_calls(extension().__file__)
    assert not calls, f"{len(calls)} tail call(s) into functions with vector arguments, the first: {calls[0]}"
