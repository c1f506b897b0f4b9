"""Parse-only checks of many documented commands in one process (used by ``tests/test_readme.py``).

``python tests/readme_parse.py JOBS RESULTS``: ``JOBS`` is a JSON file holding a list of ``{"command": str,
"env": {VAR: value}, "program": "python" | "python3" | "torchrun" | "accelerate", "args": [str, ...]}``; for each
job, in order, this process sets the job's ``VAR=value`` variables, runs the launcher's own option parser
(torchrun's, ``accelerate launch``'s) on the arguments, then runs the module (``-m MODULE``) or the script as
``__main__`` until its argparse parser has parsed its arguments: ``ArgumentParser.parse_args`` exits 0 right after
a successful parse, so nothing past the parse runs. Each job's result is appended to ``RESULTS`` as one JSON line
``{"command", "code", "output"}``: ``code`` is the exit status the command would have had (0: parsed; argparse's
2 for a bad option; 1 for an exception, with its traceback, or for a target that finished without parsing), and
``output`` its stdout and stderr together. Modules are imported once for all jobs (``sys.modules`` is kept), so
torch is imported once, not once per command; ``sys.argv``, ``sys.path``, ``os.environ`` and the working
directory are restored after each job.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import signal
import sys
import traceback

PARSE = argparse.ArgumentParser.parse_args  # the real one: launchers' own options are parsed with it
JOB_DEADLINE_S = 120  # one job; SIGALRM raises in the job (a hang in C code is caught by the caller's deadline)


def _parse_then_exit(self, args=None, namespace=None):
    PARSE(self, args, namespace)
    raise SystemExit(0)


class JobTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise JobTimeout(f"expected the arguments to be parsed within {JOB_DEADLINE_S} s; they were not")


def run_target(argv: list[str]) -> None:
    """``python ARGV`` in this process: ``-m MODULE ARGS`` or ``SCRIPT ARGS``, as ``__main__``."""
    if argv[:1] == ["-m"]:
        if len(argv) < 2:
            sys.exit("expected a module name after -m, got none")
        sys.argv, sys.path[0] = argv[1:], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        if not argv:
            sys.exit("expected a script or -m MODULE after python, got nothing")
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(f"expected {argv} to parse its arguments with argparse; it finished without parsing any")


def launch(program: str, args: list[str]) -> None:
    sys.argv = [program, *args]  # a launcher's parser names itself after sys.argv[0]
    if program in ("python", "python3"):
        run_target(args)
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = PARSE(get_args_parser(), args)
        run_target([*(["-m"] if ns.module else []), ns.training_script, *ns.training_script_args])
    elif program == "accelerate":
        if args[:1] != ["launch"]:
            sys.exit(f"expected 'accelerate launch ...', got 'accelerate {' '.join(args[:1])}'")
        from accelerate.commands.launch import launch_command_parser

        ns = PARSE(launch_command_parser(), args[1:])
        run_target([*(["-m"] if ns.module else []), ns.training_script, *ns.training_script_args])
    else:
        sys.exit(f"expected python, python3, torchrun or accelerate, got {program!r}")


def run_job(job: dict) -> dict:
    saved_argv, saved_path, saved_env, saved_cwd = list(sys.argv), list(sys.path), dict(os.environ), os.getcwd()
    out = io.StringIO()
    code = 0
    os.environ.update(job.get("env", {}))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            signal.alarm(JOB_DEADLINE_S)
            try:
                launch(job["program"], job["args"])
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except KeyboardInterrupt:
                raise
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                signal.alarm(0)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
    return {"command": job["command"], "code": code, "output": out.getvalue()}


def main(jobs_path: str, results_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    argparse.ArgumentParser.parse_args = _parse_then_exit
    signal.signal(signal.SIGALRM, _alarm)
    with open(results_path, "a") as results:
        for job in jobs:
            results.write(json.dumps(run_job(job)) + "\n")
            results.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
