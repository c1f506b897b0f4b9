"""The GPU check (``python -m verify gpu``): its dry run on CPU runs every step with tiny sizes, and its harness
reports a step that raises, hangs or dies while the next step still runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from verify.cases import SOURCES
from verify.families import SPECS
from verify.gpu import STEPS, main, multirank
from verify.gpu import matrix as gpu_matrix
from verify.gpu import mixers as gpu_mixers
from verify.gpu.backends import BackendRecorder
from verify.gpu.kernels import CONFIG
from verify.gpu.multirank import NEEDS, PROBES, cases, exchange_mode
from verify.runner import pack_expected, unpack_expected

ROOT = Path(__file__).resolve().parents[1]


def _check(tmp_path: Path, *args: str, block: tuple[str, ...] = ()) -> tuple[int, dict, str]:
    """Run ``python -m verify gpu --device cpu --quick`` in a fresh interpreter; modules in ``block`` fail to
    import there and in every step's process."""
    stubs = tmp_path / "stubs"
    for name in block:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked: the GPU check must not need it')\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stubs), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "verify", "gpu", "--device", "cpu", "--quick", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1150)
    assert (out / "report.json").exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads((out / "report.json").read_text()), (out / "summary.txt").read_text()


# The GPU's deadlines fit a quiet machine; on a shared one pool starts alone can take a minute, and this
# test is about the steps' results (the harness's deadlines are tested below).
ROOMY = ("--total", "1500", *(a for step in ("matrix", "mixers", "multirank", "kernels") for a in ("--deadline", f"{step}=300")))


@pytest.mark.timeout(1200)
def test_dry_run_runs_every_step_on_cpu(tmp_path):
    rc, report, summary = _check(tmp_path, *ROOMY, block=("rich", "hypothesis", "transformers"))
    steps = report["steps"]
    assert list(steps) == list(STEPS)
    assert {n: s["status"] for n, s in steps.items()} == dict.fromkeys(STEPS, "pass"), summary
    assert rc == 0 and report["verdict"] == "pass" and report["device"] == "cpu"

    assert steps["env"]["data"]["flash_path"]["D=128"] == "used" and "> 256" in steps["env"]["data"]["flash_path"]["D=264"]
    assert steps["env"]["data"]["topk_ties"]["rows_differing"] == 0 and "topk among equal scores: 0 of" in summary

    matrix = steps["matrix"]["data"]
    assert matrix["run"] == matrix["planned"] > 0 and matrix["tf32"] == {"matmul": False, "cudnn": False}
    # head dims 64 and 128 ran, bfloat16 / float16 varlen cases through flash-attn's strict emulation
    assert {64, 128} <= {c.dim for c in gpu_matrix.cases(quick=True)} and matrix["flash_calls"] > 0
    assert "emulated" in matrix["flash_attn"] and matrix["failed_cases"] == 0
    assert set(matrix["dtypes"]) == {"float32", "bfloat16", "float16"}
    for dtype, s in matrix["dtypes"].items():
        assert s["passed"] == s["cases"] > 0 and s["failed"] == [], dtype
        assert s["sources"] == sorted(SOURCES) and s["kernels"] == ["dense", "varlen"]
        assert 0 < s["max_err_over_limit"] <= 1 and s["worst"]["out"]["err"] > 0 and s["tolerance"]
        assert set(s["sdpa_backends"]) == {"baseline", "implementation varlen", "implementation dense"}
        assert sum(s["sdpa_backends"]["baseline"].values()) > 0 and sum(s["sdpa_backends"]["implementation dense"].values()) > 0
        assert s["fully_masked_rows"] == dict.fromkeys(s["sdpa_backends"], 0), dtype
    # varlen calls no attention op where every query sees only its own key (a window of 0, documents of one token:
    # the quick float32 cases), and its half-precision cases run flash-attn's emulation (flash_calls above); any call
    # it makes on the CPU is the fused op, called directly (the recorder's count of it: test_backend_recorder_...)
    assert all(k.startswith("_scaled_dot_product_flash_attention_for_cpu (called directly)")
               for s in matrix["dtypes"].values() for k in s["sdpa_backends"]["implementation varlen"])

    mixers = steps["mixers"]["data"]
    assert mixers["run"] == mixers["planned"] > 0 and mixers["failed_cases"] == 0 and mixers["triton_f32_default"] == "ieee"
    assert set(mixers["layers"]) == {f"{layer} {dtype}" for layer in gpu_mixers.LAYERS for dtype in gpu_mixers.DTYPES}
    assert mixers["fla_calls"] > 0 and "emulated" in mixers["fla"]  # float32 Gated DeltaNet through fla's emulation

    multi = steps["multirank"]["data"]
    assert set(multi["cps"]) == {"2", "4"}
    for cp, s in multi["cps"].items():
        assert s["backend"] == "gloo" and s["device"] == "cpu" and s["unsupported"] == {}
        assert s["collectives"].startswith("through host memory")
        ran = {c.name: c for c in multirank.cases(int(cp), quick=True)}
        assert "padding-rank" in ran and {c.layer for c in multirank.cases(int(cp), quick=True)} == {"attention", *SPECS}
        # flash-attn ran on the ranks holding tokens, never on the padding-only one (the last rank's)
        assert sum(s["calls_per_rank"]["flash_attn_varlen_func"][:-1]) > 0 and sum(s["calls_per_rank"]["chunk_gated_delta_rule"]) > 0
        assert s["probe"] == {op: {"float32": "ok", "bfloat16": "ok"} for op in PROBES}, cp
        assert s["run"] == s["planned"] == s["passed"] > 0 and s["failed"] == []
        assert set(s["by_exchange"]) == {"auto", "allgather", "halo", "a2a"}

    kern = steps["kernels"]["data"]
    assert kern["matmul_tflops"] > 0 and [r["S"] for r in kern["rows"]] == list(CONFIG["quick"]["sizes"])
    for row in kern["rows"]:
        assert set(row["kernels"]) == {"varlen", "dense", "per_doc_sdpa"}
        for name, m in row["kernels"].items():
            assert m["seconds"] > 0 and m["useful_tflops"] > 0 and m["peak_bytes"] is None, (row["S"], name, m)
            assert sum(m["sdpa_backends"].values()) > 0 or (name == "varlen" and m["flash_calls"] > 0)  # bf16: flash-attn's

    for name in STEPS:
        assert f"[{name}] PASS" in summary
    # what comes back from a GPU machine: a few files, at most 2 folders down
    files = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert files == sorted(["report.json", "summary.txt", *(f"logs/{n}.log" for n in STEPS)])


def test_a_failed_step_is_reported_and_the_next_one_runs(tmp_path):
    rc, report, summary = _check(
        tmp_path, "--steps", "matrix,multirank,kernels,env", "--inject", "matrix=raise", "--inject", "multirank=hang",
        "--inject", "kernels=exit", "--deadline", "multirank=4",
    )
    steps = report["steps"]
    assert steps["matrix"]["status"] == "error" and "injected failure in step 'matrix'" in steps["matrix"]["error"]
    assert steps["multirank"]["status"] == "timeout" and 4 <= steps["multirank"]["seconds"] < 30
    assert steps["kernels"]["status"] == "crash" and steps["kernels"]["returncode"] == 3
    assert steps["env"]["status"] == "pass" and steps["env"]["data"]["torch"] == torch.__version__
    assert rc == 1 and report["verdict"] == "fail"
    for line in ("[matrix] ERROR", "[multirank] TIMEOUT", "[kernels] CRASH", "[env] PASS"):
        assert line in summary


@pytest.mark.parametrize("args, message", [
    pytest.param(["--steps", "env,nope"], "steps: expected some of", id="unknown-step"),
    pytest.param(["--inject", "env=boom"], "--inject: expected STEP=raise|hang|exit", id="unknown-injection"),
    pytest.param(["--deadline", "env=-3"], "--deadline: expected a positive number", id="bad-deadline"),
])
def test_usage_errors_name_expected_and_got(tmp_path, capsys, args, message):
    assert main(["--out", str(tmp_path), "--device", "cpu", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_device_cuda_without_cuda_is_a_usage_error(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() == False" in capsys.readouterr().err


def test_cli_lists_the_gpu_subcommand():
    from verify.cli import _parser

    args = _parser().parse_args(["gpu", "--out", "x", "--quick"])
    assert args.command == "gpu" and args.quick and args.device is None


def test_backend_recorder_names_the_backend_torch_runs():
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    rec = BackendRecorder()
    with rec.role("forced"), sdpa_kernel(SDPBackend.MATH):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool).tril())
    with rec.role("direct"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
    with rec.role("outside"):
        pass
    assert rec.counts() == {"forced": {"MATH/float32": 1}, "outside": {},
                            "direct": {"_scaled_dot_product_flash_attention_for_cpu (called directly)/float32": 1}}
    on_cuda = BackendRecorder("cuda")  # a CUDA run's baseline stood in for on the CPU (verify.tolerances.STAND_INS)
    with on_cuda.role("baseline"), sdpa_kernel(SDPBackend.MATH):
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert on_cuda.counts() == {"baseline": {"MATH on cpu/float32": 1}}


def test_bfloat16_expected_results_travel_exactly():
    t = torch.randn(5, 3).to(torch.bfloat16)
    ref = torch.randn(5, 3, dtype=torch.float64)
    back = unpack_expected(pack_expected({"ref": {"out": ref}, "base": {"math": {"out": t}}}))
    assert torch.equal(back["ref"]["out"], ref) and torch.equal(back["base"]["math"]["out"], t.float())


def test_every_exchange_mode_of_the_multirank_cases_has_its_collectives_listed():
    modes = {exchange_mode(c) for cp in (2, 4) for c in cases(cp, quick=False)}
    assert None not in modes and modes <= set(NEEDS) and {"halo", "a2a", "allgather"} <= modes
    assert {op for ops in NEEDS.values() for op in ops} <= set(PROBES)


def test_the_multirank_cases_are_cases_the_matrix_runs():
    """A case whose requested exchange the implementation refuses (halo for a bidirectional block that crosses a rank
    edge: it needs keys from the right) is not planned: on an H200 four such cases per CP size were run and raised."""
    from verify.runner import applicable, impl_info

    info = impl_info("blockdiag_dist")
    planned = [c for cp in (2, 4) for c in cases(cp, quick=False)]
    refused = [c.label() for c in planned if c.layer == "attention" and not applicable(info, c)]
    assert not refused, refused
    assert any(c.bidirectional and c.exchange == "halo" for c in planned)  # the ones whose blocks stay on one rank


@pytest.mark.timeout(600)
def test_an_exchange_whose_collective_fails_is_reported_unsupported(tmp_path, monkeypatch):
    """What a GPU over gloo may show: one collective fails the probe; its exchange's cases are not run (one
    is, to show its error), every other case runs."""
    import time

    from verify.gpu import multirank
    from verify.gpu.step import StepContext

    real = multirank._probe_all

    def probe_without_p2p(pool, device, timeout):
        result = real(pool, device, timeout)
        result["batch_isend_irecv"] = {d: "RuntimeError: planted: no p2p here" for d in multirank.PROBE_DTYPES}
        return result

    monkeypatch.setattr(multirank, "_probe_all", probe_without_p2p)
    ctx = StepContext("cpu", True, time.monotonic() + 500, tmp_path / "step.json", {"cps": {}})
    multirank._run_cp(ctx, 2, "gloo", time.monotonic() + 500)
    out = ctx.data["cps"]["2"]
    every = multirank.cases(2, quick=True)
    halo = [c for c in every if multirank.exchange_mode(c) == "halo"]
    p2p = [c for c in every if "batch_isend_irecv" in NEEDS[multirank.exchange_mode(c)]]  # halo and the mixers
    assert halo and len(p2p) > len(halo) and out["planned"] == len(every) - len(p2p)
    assert out["run"] == out["passed"] == out["planned"] and "halo" not in out["by_exchange"]
    u = out["unsupported"]["halo"]
    assert u["cases_not_run"] == len(halo) and u["collective_errors"] == {"batch_isend_irecv": "RuntimeError: planted: no p2p here"}
    assert u["example"]["status"] == "pass"  # on CPU the collective works: the example case passes
    assert out["unsupported"]["mixer"]["cases_not_run"] == len(p2p) - len(halo)
    text = "\n".join(multirank.summarize(ctx.data))
    assert "batch_isend_irecv (float32: RuntimeError: planted" in text and "exchange halo unsupported here" in text


def test_summaries_show_failures_errors_and_partial_records():
    from verify.gpu import env, kernels, matrix, mixers, multirank

    row = {"S": 131072, "docs": 700, "longest_doc": 2048, "useful_tflop": 1.0, "kernels": {
        "varlen": {"seconds": 0.05, "useful_tflops": 20.0, "of_matmul": 0.03, "peak_bytes": 2**33},
        "dense": {"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 GiB"}}}
    text = "\n".join(kernels.summarize({"heads": [32, 8], "head_dim": 128, "matmul_tflops": 700.0, "matmul_n": 8192, "rows": [row]}))
    assert "varlen 50.0 ms (20 TFLOP/s = 0.03 of matmul, peak 8.0 GiB)" in text and "dense OutOfMemoryError" in text
    failed = {"label": "one-long cp1", "status": "fail", "details": "dq: err 1 > limit 0.5 on rank 0", "reproduce": "torchrun ..."}
    s = {"cases": 2, "passed": 1, "max_err_over_limit": 2.0, "tolerance": {}, "failed": [failed],
         "sdpa_backends": {"baseline": {"MATH/float32": 2}, "implementation varlen": {"EFFICIENT_ATTENTION/float32": 3}}}
    text = "\n".join(matrix.summarize({"run": 2, "planned": 180, "stopped": "step deadline near", "dtypes": {"float32": s}}))
    assert "2 of 180 cases run (step deadline near)" in text and "FAILED one-long cp1: dq: err 1" in text and "torchrun ..." in text
    assert "EFFICIENT_ATTENTION': 3" in text and "['MATH']" in text
    for module in (env, kernels, matrix, mixers, multirank):  # a step killed before it saved anything
        assert isinstance(module.summarize({}), list)


def test_staged_collectives_deliver_the_values_and_uninstall(session):
    """verify.gpu.staging on a CP 3 group: each collective (the ring of point-to-point ops included) delivers the
    values the probes expect through host copies, and every function is restored afterwards."""
    import mp_checks

    assert session.pool(3).run(mp_checks.staged_collectives, timeout=120, name="staged") == [list(PROBES)] * 3


def test_the_env_step_checks_that_topk_keeps_the_same_ties_for_a_row_whatever_the_call(monkeypatch):
    """DSA under CP calls ``topk`` on a rank's chunk of a document's rows, the model alone on all of them: the env
    step counts rows whose choice among equal scores differs (none on this CPU), and fails where one does."""
    from verify.gpu import env

    t = env.topk_ties("cpu", quick=True)
    assert t["rows_compared"] > 0 and t["rows_differing"] == 0 and "rows_vs_cpu" not in t
    real = torch.Tensor.topk

    def ties_by_call(self, k, dim=-1, **kw):  # a device whose choice among ties depends on the call's rows
        if self.dim() == 2 and self.shape[0] > 1:  # several rows: ties taken from the right
            values, indices = real(self.flip(-1), k, dim=dim, **kw)
            return torch.return_types.topk((values, self.shape[-1] - 1 - indices))
        return real(self, k, dim=dim, **kw)

    monkeypatch.setattr(torch.Tensor, "topk", ties_by_call)
    assert env.topk_ties("cpu", quick=True)["rows_differing"] > 0

    def later_keys_by_call(self, k, dim=-1, **kw):  # which later (-inf) keys fill a short row depends on the call:
        values, indices = real(self, k, dim=dim, **kw)  # DSA reads every one of them as -1, so no row differs
        if self.dim() == 2 and self.shape[0] > 1:
            later = torch.isinf(values) & (values < 0)
            indices = torch.where(later, self.shape[-1] - 1 - torch.arange(k).expand_as(indices), indices)
        return torch.return_types.topk((values, indices))

    monkeypatch.setattr(torch.Tensor, "topk", later_keys_by_call)
    t = env.topk_ties("cpu", quick=True)
    assert t["rows_compared"] > 0 and t["rows_differing"] == 0


def test_fla_is_compiled_beside_the_steps_and_stopped_before_a_timed_one(tmp_path):
    """The background ``warm`` runs step mixers' fla cases from the check's start (on CUDA with fla: its first call
    compiles Triton kernels for longer than a step's deadline); it is stopped before ``kernels``, which measures
    speed, judges nothing, and is reported apart from the steps."""
    from verify.gpu import harness

    assert not harness._wanted("warm", "cpu", ["mixers"])
    with pytest.raises(ValueError, match="background: expected one of"):
        harness._wanted("nope", "cuda", ["mixers"])
    rc = harness.run_check(tmp_path, device="cpu", quick=True, steps=["env", "kernels"], background=["warm"])
    report = json.loads((tmp_path / "report.json").read_text())
    warm = report["background"]["warm"]
    assert rc == 0 and report["verdict"] == "pass" and list(report["steps"]) == ["env", "kernels"]
    assert warm["status"] in ("pass", "stopped") and (tmp_path / warm["log"]).exists()
    if warm["status"] == "pass":  # it usually finishes within env's seconds; on a loaded machine it is stopped
        assert warm["data"]["planned"] == len(warm["data"]["cases"]) == 2 and warm["data"]["fla"].startswith("emulated")
        assert all(c["status"] == "pass" for c in warm["data"]["cases"])
    assert "[warm, beside the steps]" in (tmp_path / "summary.txt").read_text()


def test_fla_warm_stopped_by_the_check_is_no_crash(tmp_path):
    """Stopped before a timed step while still running, ``warm`` reads ``stopped``, with no error of a crash (its
    process was killed by the check, not failed)."""
    from verify.gpu import harness

    harness.run_check(tmp_path, device="cpu", quick=True, steps=["kernels"], background=["warm"])
    warm = json.loads((tmp_path / "report.json").read_text())["background"]["warm"]
    assert warm["status"] == "stopped" and "error" not in warm and "log_tail" not in warm, warm
    summary = (tmp_path / "summary.txt").read_text()
    assert "[warm, beside the steps] STOPPED" in summary and "exited with code" not in summary


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _gone(pid: int, within: float = 60.0) -> bool:
    """Whether process ``pid`` has exited (or is a zombie) before ``within`` seconds pass."""
    from verify.pool import _alive

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    return False


def _step_of(check: subprocess.Popen, within: float = 60.0) -> int:
    """The pid of the step process the check started (``python -m verify.gpu STEP``)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for pid in _children(check.pid):
            try:
                if b"verify.gpu" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                pass
        time.sleep(0.2)
    raise AssertionError("the check started no step")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)")
def test_no_step_outlives_the_check_stopped_by_sigterm_or_killed(tmp_path):
    """A launcher's timeout (SIGTERM) ends the check through its cleanup, which stops the running step; a check killed
    outright (SIGKILL) cannot clean up, and its step, watching it, exits by itself."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "verify", "gpu", "--device", "cpu", "--quick", "--steps", "env", "--inject", "env=hang"]
    for sig, rc in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        check = subprocess.Popen([*cmd, "--out", str(tmp_path / sig.name)], cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            step = _step_of(check)
            check.send_signal(sig)
            assert check.wait(timeout=60) == rc
            assert _gone(step), f"the step {step} outlived the check ({sig.name})"
        finally:
            check.kill()
