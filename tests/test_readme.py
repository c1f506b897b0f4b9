"""The pages run as written, from a fresh clone's point of view (after ``make install`` and ``source
.venv/bin/activate``):

- every ```` ```python ```` block of README.md and docs/*.md runs (each in a fresh namespace); a block whose
  first line is ``# from examples/NAME.py`` is an excerpt of that file and must appear in it, line for line;
- every command of a ```` ```bash ```` block is checked: ``make TARGET`` names a target (``make -n``), ``python -m
  MODULE ARGS`` (also under ``torchrun``, ``accelerate launch`` or after ``VAR=value``) imports and parses its
  arguments, and so does a script: all of them in one process (``tests/readme_parse.py``), which imports each module
  once, after the launcher's own parser has parsed the launcher's options. A block opened with ```` ```bash run
  ```` is run as written, each command within a deadline, and must exit 0 and leave every tracked file as it was;
- every relative link of those pages (and of the generated pages at the root) resolves to a file and, with
  ``#anchor``, to a heading of it; the counts the README quotes match the tables they count.

``python``, ``python3`` and ``torchrun`` are this interpreter's (the venv's, as activated).
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), i, code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]
EXCERPT = re.compile(r"# from (examples/[\w/]+\.py)\n")
# pages whose links are checked: the docs, and the generated pages at the root (BENCHMARKS.md, MODELS.md, ...)
LINK_PAGES = sorted({*PAGES, *ROOT.glob("*.md")})
MAKEFILE = (ROOT / "Makefile").read_text()
MAKE_DEFAULTS = dict(re.findall(r"^([A-Z_]+)\s*\?=\s*(\S+)", MAKEFILE, re.M))
# pages a make target generates (`--md PATH` in the Makefile, with its variables' defaults): a link to one is right
# before it is first generated
GENERATED = {
    (ROOT / re.sub(r"\$\((\w+)\)", lambda m: MAKE_DEFAULTS.get(m.group(1), m.group(0)), p)).resolve()
    for p in re.findall(r"--md\s+(\S+)", MAKEFILE)
}
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_readme_has_python_examples():
    assert any(page == "README.md" for page, _, _ in BLOCKS), "README.md shows no ```python blocks"


@pytest.mark.parametrize("page, index, code", BLOCKS, ids=[f"{page}-block{i}" for page, i, _ in BLOCKS])
def test_readme_block_runs(page, index, code, capsys):
    excerpt = EXCERPT.match(code)
    if excerpt:
        source = [line.strip() for line in (ROOT / excerpt.group(1)).read_text().splitlines()]
        lines = [line.strip() for line in code[excerpt.end():].rstrip().splitlines()]
        found = any(source[i : i + len(lines)] == lines for i in range(len(source) - len(lines) + 1))
        assert found, f"{page} block {index}: expected an excerpt of {excerpt.group(1)}, line for line; it is not one"
        return
    if "# readme-test: skip" in code:
        pytest.skip("block marked '# readme-test: skip': it needs a launcher (torchrun) or several processes")
    if "from transformers" in code or "import transformers" in code:
        pytest.importorskip("transformers", reason="this block needs the hf extra (transformers)")
    exec(compile(code, f"{page} block {index}", "exec"), {"__name__": "__readme__"})


def prose(text: str, spans: bool = False) -> str:
    """``text`` without fenced code blocks, and without inline code spans unless ``spans`` (links in code are
    not links; a heading's code span is part of its anchor)."""
    kept, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)
        elif fence is not None and marker and marker.group(1).startswith(fence):
            fence = None
        elif fence is None:
            kept.append(line if spans else re.sub(r"(`+).+?\1", "", line))
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a Markdown page: its headings' (duplicates numbered as GitHub does) and explicit ids."""
    text = page.read_text()
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(text, spans=True), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[tuple[str, Path | None, str]]:
    """(link as written, target file or None for this page, anchor) of every relative link of ``page``."""
    found = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found.append((target, (page.parent / path).resolve() if path else None, anchor))
    return found


def test_link_checker_sees_links_and_anchors(tmp_path):
    """The checker itself: a link in a code span or block is not a link; anchors follow GitHub's rule."""
    page = tmp_path / "p.md"
    page.write_text("# Top\n\n## The vision tower's cost: `x.y` K/V\n\n## Top\n\n[a](q.md#z) `[b](no.md)`\n\n"
                    "```\n[c](no.md)\n```\n")
    assert anchors(page) == {"top", "the-vision-towers-cost-xy-kv", "top-1"}
    assert links(page) == [("q.md#z", tmp_path / "q.md", "z")]


@pytest.mark.parametrize("page", LINK_PAGES, ids=[p.relative_to(ROOT).as_posix() for p in LINK_PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target, path, anchor in links(page):
        file = path or page
        if not file.exists():
            if file not in GENERATED:
                broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_docs_index_lists_every_page():
    index = ROOT / "docs" / "README.md"
    listed = {path for _, path, _ in links(index) if path is not None}
    missing = [p.name for p in PAGES if p.parent == index.parent and p != index and p not in listed]
    assert not missing, f"docs/README.md does not link {missing}"


# ---- shell commands ---------------------------------------------------------------------------------------
SHELL_BLOCK = re.compile(r"^```bash( run)?[ \t]*\n(.*?)^```", re.S | re.M)
PROGRAMS = ("python", "python3", "torchrun", "accelerate", "make", "source")  # what the pages' commands start with (after VAR=value)
RUN_DEADLINE = 280.0  # seconds, one command of a ```bash run block


def shell_commands(text: str) -> list[tuple[str, bool]]:
    """``(command, run)`` of every command of the ```` ```bash ```` blocks of ``text``, in order: continuation
    lines joined, comments and blank lines dropped; ``run`` for a block opened with ```` ```bash run ````."""
    found = []
    for m in SHELL_BLOCK.finditer(text):
        for line in m.group(2).replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append((shlex.join(words), bool(m.group(1))))
    return found


COMMANDS = [(page.relative_to(ROOT).as_posix(), cmd, run) for page in PAGES for cmd, run in shell_commands(page.read_text())]

# Parse-only commands of python, torchrun and accelerate share one process (tests/readme_parse.py): it imports
# each module or script once and runs its argparse parser on each command's arguments (launchers' options parsed
# by the launcher's own parser first), so torch is imported once, not once per command.
IN_PROCESS = ("python", "python3", "torchrun", "accelerate")
PARSE_DEADLINE = 240.0  # seconds, all the in-process parse-only commands together (under pytest's 300 s per test)
PARSER = Path(__file__).resolve().with_name("readme_parse.py")
# commands the checker must fail, each through the same mechanism as the pages' commands: (command, what is wrong,
# a line its output must show)
BROKEN = [
    ("python -m verify plan --seqlens 5,2,5 --cp 4 --no-such-flag", "a bad flag", "unrecognized arguments: --no-such-flag"),
    ("python examples/trl_sft.py --steps 10 --no-such-flag", "a script's bad flag", "unrecognized arguments: --no-such-flag"),
    ("python -m verify.no_such_module --cp 2", "an unknown module", "No module named verify.no_such_module"),
    ("python examples/no_such_script.py", "an unknown script", "no_such_script.py"),
    ("python -m blockdiag_ref.layout --cp 2", "a module that parses no arguments", "finished without parsing any"),
    ("torchrun --nproc-per-node 2 --no-such-option -m verify", "a bad torchrun option", "--no-such-option"),
    ("accelerate launch --no-such-option examples/trl_sft.py", "a bad accelerate option", "--no-such-option"),
    ("make no-such-target", "an unknown make target", "no-such-target"),
]


def split_command(command: str) -> tuple[dict[str, str], str, list[str]]:
    """``(VAR=value assignments, program, its arguments)`` of a command as the shell splits it."""
    words = shlex.split(command)
    i = next((i for i, w in enumerate(words) if not re.match(r"\w+=", w)), len(words))
    return dict(w.split("=", 1) for w in words[:i]), (words[i] if i < len(words) else ""), words[i + 1:]


def _clean_env(path_first: Path) -> dict[str, str]:
    """The environment the pages' commands see: the activated venv's programs (``path_first``) first on PATH, this
    tree importable, none of pytest's or a launcher's variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k not in ("RANK", "WORLD_SIZE")}
    return {**clean, "PATH": f"{path_first}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH") else str(ROOT)}


@pytest.fixture(scope="module")
def shims(tmp_path_factory) -> dict[bool, Path]:
    """Two directories to put first on PATH: ``python``, ``python3``, ``torchrun``, ``accelerate`` and ``make`` as this
    interpreter (the activated venv) runs them (``True``), and ``make`` that only parses (``make -n``, ``False``)."""
    base = tmp_path_factory.mktemp("shims")
    make = shutil.which("make") or "make"
    exe = sys.executable
    scripts = {
        True: {"python": f'exec "{exe}" "$@"', "python3": f'exec "{exe}" "$@"',
               "torchrun": f'exec "{exe}" -m torch.distributed.run "$@"', "make": f'exec "{make}" "$@"',
               "accelerate": f'exec "{exe}" -m accelerate.commands.accelerate_cli "$@"'},
        False: {"make": f'exec "{make}" -n "$@"'},
    }
    dirs = {}
    for run, table in scripts.items():
        d = base / ("run" if run else "parse")
        d.mkdir()
        for name, body in table.items():
            (d / name).write_text(f"#!/bin/sh\n{body}\n")
            (d / name).chmod(0o755)
        dirs[run] = d
    return dirs


@pytest.fixture(scope="module")
def parsed(shims, tmp_path_factory) -> dict[str, tuple[int | None, str]]:
    """Command -> ``(exit code, output)`` of every parse-only python/torchrun/accelerate command of the pages and
    of ``BROKEN``, all parsed by one process; the code is ``None`` for a command that process did not reach (the
    output says why, with the process's own last output)."""
    commands = [cmd for _, cmd, run in COMMANDS if not run and split_command(cmd)[1] in IN_PROCESS]
    commands += [cmd for cmd, _, _ in BROKEN if split_command(cmd)[1] in IN_PROCESS]
    commands = list(dict.fromkeys(commands))
    base = tmp_path_factory.mktemp("parse")
    jobs, results, log = base / "jobs.json", base / "results.jsonl", base / "log.txt"
    jobs.write_text(json.dumps([dict(zip(("env", "program", "args"), split_command(cmd)), command=cmd)
                                for cmd in commands]))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(PARSER), str(jobs), str(results)], cwd=ROOT,
                                env=_clean_env(shims[False]), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=PARSE_DEADLINE)
            why = f"the parse process exited {proc.returncode} before reaching it"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = f"the parse process did not reach it within {PARSE_DEADLINE:.0f} s (it was killed)"
    done = {r["command"]: (r["code"], r["output"])
            for r in map(json.loads, results.read_text().splitlines() if results.exists() else [])}
    tail = log.read_text()[-2000:]
    return {cmd: done.get(cmd) or (None, f"{why}\n{tail}") for cmd in commands}


def _git_status() -> str | None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_shell_commands_are_found():
    """The extractor itself, and the pages: commands are found, and at least one block of README.md runs."""
    text = "x\n```bash run\nmake a  # c\npython -m m \\\n  --x 1\n```\n```bash\n# only a comment\nmake b\n```\n"
    assert shell_commands(text) == [("make a", True), ("python -m m --x 1", True), ("make b", False)]
    assert any(page == "README.md" and run for page, _, run in COMMANDS), "README.md has no ```bash run block"
    assert split_command("A=1 B=x=y python3 -m m --k 'a b'") == ({"A": "1", "B": "x=y"}, "python3", ["-m", "m", "--k", "a b"])


def check_command(page: str, command: str, run: bool, shims: dict[bool, Path], request) -> None:
    """Fail, naming ``page`` and ``command``, unless the command is one the pages may show and it runs (``run``) or
    parses (its program's arguments, then its module's or script's; ``make -n`` for make)."""
    env_vars, program, args = split_command(command)
    assert program in PROGRAMS, f"{page}: {command!r}: expected a command starting with one of {PROGRAMS}, got {program!r}"
    if program == "source":  # the venv's activation: the script `make install` creates
        venv = MAKE_DEFAULTS.get("VENV")
        assert args == [f"{venv}/bin/activate"] and not env_vars and "-m venv $(VENV)" in MAKEFILE, (
            f"{page}: {command!r}: expected 'source {venv}/bin/activate', the venv the Makefile creates")
        return
    what = "ran" if run else "parsed (nothing run)"
    if not run and program in IN_PROCESS:
        code, output = request.getfixturevalue("parsed")[command]
        assert code == 0, f"{page}: {command!r} {what}: expected exit 0, got {code}\n{output[-4000:]}"
        return
    before = _git_status() if run else None
    deadline = RUN_DEADLINE if run else 120.0
    proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=_clean_env(shims[run]), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the command's whole group: launchers' workers too
        proc.communicate()
        pytest.fail(f"{page}: {command!r} did not finish within {deadline:.0f} s (its process group was killed)")
    assert proc.returncode == 0, f"{page}: {command!r} {what}: expected exit 0, got {proc.returncode}\n{output[-4000:]}"
    if before is not None:
        assert _git_status() == before, f"{page}: {command!r} changed the clone:\n{_git_status()}"


# each distinct command once, naming every page that shows it (a command two pages show runs once)
DISTINCT: dict[tuple[str, bool], list[str]] = {}
for _page, _cmd, _run in COMMANDS:
    DISTINCT.setdefault((_cmd, _run), []).append(_page)


@pytest.mark.parametrize("pages, command, run", [(", ".join(p), c, r) for (c, r), p in DISTINCT.items()],
                         ids=[f"{p[0]}:{'run' if r else 'parse'}:{c[:70]}" for (c, r), p in DISTINCT.items()])
def test_shell_command(pages, command, run, shims, request):
    check_command(pages, command, run, shims, request)


@pytest.mark.parametrize("command, wrong, shown", BROKEN, ids=[wrong for _, wrong, _ in BROKEN])
def test_shell_check_fails_on_broken_command(command, wrong, shown, shims, request):
    """The parse check itself: a command with something ``wrong`` fails it, through the same mechanism as the pages'
    commands, with a message naming the page and the command and showing the command's error."""
    with pytest.raises(AssertionError) as failure:
        check_command("docs/broken.md", command, False, shims, request)
    message = str(failure.value)
    assert message.startswith(f"docs/broken.md: {command!r} parsed (nothing run): expected exit 0, got "), message
    assert shown in message, f"expected the failure of {command!r} ({wrong}) to show {shown!r}; it is:\n{message}"


def test_shell_check_refuses_other_programs(shims, request):
    for command in ("pip install blockdiag", "source other/bin/activate", "cd docs"):
        with pytest.raises(AssertionError, match=r"docs/broken\.md: .*expected"):
            check_command("docs/broken.md", command, False, shims, request)


# ---- counts the README quotes, from the tables they count ----------------------------------------------
def _table_rows(text: str, section: str) -> list[str]:
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z0-9_-]+)` \|", body, re.M)


def test_readme_counts_match_their_tables():
    readme = (ROOT / "README.md").read_text()
    malformed = len(_table_rows((ROOT / "docs" / "faults.md").read_text(), "## Malformed input"))
    assert f"{malformed} kinds of malformed input" in readme, f"README: expected '{malformed} kinds of malformed input' (docs/faults.md's table)"

    catalogue = (ROOT / "docs" / "models.md").read_text()
    classes = {c: [int(n) for n in re.findall(rf"^\| {c} \| (\d+) \| (\d+) \|$", catalogue, re.M)[0]]
               for c in ("pass", "refused", "wrong", "cannot build", "cannot run on CPU", "crash", "hang")}
    per_cp = {c: n[0] for c, n in classes.items()}
    assert all(n[0] == n[1] for n in classes.values()), f"docs/models.md: CP 1 and CP 2 differ: {classes}"
    silent = per_cp["wrong"] + per_cp["crash"] + per_cp["hang"]
    quoted = (f"{sum(per_cp.values())} models at CP 1 and 2: {per_cp['pass']} pass, {per_cp['refused']} refused naming "
              f"the layer, {per_cp['cannot build'] + per_cp['cannot run on CPU']} cannot build or run on CPU, "
              f"**{silent} silently wrong**")
    assert quoted in readme, f"README: expected the catalogue's counts as in docs/models.md: {quoted!r}"

    presets = re.findall(r"^\| `\w+` \| [^|]+ \| (\S+) \| (\S+) \|", (ROOT / "MODELS.md").read_text(), re.M)
    passed = sum(cells == ("pass", "pass") for cells in presets)
    refused = sum(cells == ("unsupp.", "unsupp.") for cells in presets)
    quoted = f"a training step of {len(presets)} presets"
    assert quoted in readme and f"presets: {passed} pass" in readme and f"{refused} refused;" in readme, (
        f"README: expected {len(presets)} presets, {passed} pass, {refused} refused (MODELS.md)")
