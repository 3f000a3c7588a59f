"""The documentation against the code, so it cannot drift from it.

The documentation is the README and the pages of the site under ``docs/`` (every check reads
them all, wherever a table or a command now lives). Fast checks only (no training, no
compilation): the preset and binding tables against the dataclasses, every path, gin file,
module and command line the docs, ``configs/`` and ``launch/`` name, the XLA flags the
launchers set, the layout of the package, and the links. The site's build is
``tests/test_docs_site.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import gin
import pytest

from boost_jax.config import Data, Model, Parallel, Train
from boost_jax.models.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
#: every page of the documentation, README first: ``{path from the repository root: text}``
PAGES = {"README.md": README, **{p.relative_to(REPO).as_posix(): p.read_text()
                                 for p in sorted((REPO / "docs").rglob("*.md"))}}
DOCS = "\n\n".join(PAGES.values())
LAUNCH = {p.name: p.read_text() for p in sorted((REPO / "launch").iterdir()) if p.is_file()}
CONFIGS = {p.relative_to(REPO / "configs").as_posix(): p.read_text()
           for p in sorted((REPO / "configs").rglob("*.gin"))}
CLASSES = {c.__name__: c for c in (Model, Parallel, Train, Data)}
FIELDS = {name: {f.name: f for f in dataclasses.fields(c)} for name, c in CLASSES.items()}
# what a run writes into its workdir, not a file of the repository
RUN_OUTPUTS = {"config.gin"}


def _split(markdown: str, name: str = "README.md") -> tuple[str, list[str]]:
    """``(prose, code blocks)``: the text outside fenced code blocks, and each block's body."""
    prose, blocks, block = [], [], None
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block = []
            else:
                blocks.append("\n".join(block))
                block = None
        elif block is None:
            prose.append(line)
        else:
            block.append(line)
    assert block is None, f"an unclosed code block in {name}"
    return "\n".join(prose), blocks


SPLIT = {name: _split(text, name) for name, text in PAGES.items()}
PROSE = "\n\n".join(prose for prose, _ in SPLIT.values())
BLOCKS = [block for _, blocks in SPLIT.values() for block in blocks]
SPANS = re.findall(r"`([^`]+)`", PROSE)  # inline code, possibly across a line break


def _table(header_start: str) -> list[list[str]]:
    """The rows (cells stripped) of the docs' table whose header starts with ``header_start``."""
    lines = PROSE.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))  # not at an escaped \|
        rows.append([c.strip() for c in cells])
    return [rows[0]] + rows[2:]  # without the |---| line


def _commands() -> list[str]:
    """Every shell command of the docs' code blocks, continuation lines joined, comments and
    ``&&`` chains split off."""
    out = []
    for block in BLOCKS:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line)
            out += [c.strip() for c in line.split("&&") if c.strip()]
    return out


# ---------------------------------------------------------------- (a) the preset table

def test_preset_table_is_the_presets():
    header, *rows = _table("| size |")
    assert header[:8] == ["size", "d", "layers", "heads (kv)", "d_ff", "rank", "vocab", "tied"], (
        "the preset table's columns changed: update this test with them")
    shown = {}
    for row in rows:
        size, d, layers, heads, d_ff, rank, vocab, tied = row[:8]
        shown[size.strip("`")] = (d, layers, heads, d_ff, rank, vocab, tied)
    assert list(shown) == list(PRESETS), "the table lists other presets than PRESETS"
    for size in PRESETS:
        m = Model(size=size)
        heads = str(m.n_heads) if m.n_kv_heads == m.n_heads else f"{m.n_heads} ({m.n_kv_heads})"
        assert m.attn_rank == m.mlp_rank
        code = (str(m.d_model), str(m.n_layers), heads, str(m.d_ff), str(m.attn_rank),
                str(m.vocab_size), "yes" if m.tie_embeddings else "no")
        assert shown[size] == code, f"preset {size!r}: docs {shown[size]}, code {code}"


# ---------------------------------------------------------------- (c) bindings and modules

def test_binding_table_lists_every_field_with_its_default():
    header, *rows = _table("| binding |")
    assert header == ["binding", "default", "meaning"]
    listed = set()
    for binding, default, _ in rows:
        names = re.findall(r"`([\w.]+)`", binding)
        cls, first = names[0].split(".")
        fields = [first] + names[1:]
        for f in fields:
            assert f in FIELDS[cls], f"binding table: {cls}.{f} is not a field of {cls}"
            listed.add(f"{cls}.{f}")
        values = [v.strip().strip("`") for v in default.split(", ")]
        if len(values) != len(fields):
            continue
        for f, text in zip(fields, values):
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                continue  # prose: "preset", "device table", "10% of the horizon"
            assert FIELDS[cls][f].default == value, (
                f"binding table: {cls}.{f} default {text}, code {FIELDS[cls][f].default!r}")
    every = {f"{c}.{f}" for c, fields in FIELDS.items() for f in fields}
    assert not every - listed, f"fields missing from the binding table: {sorted(every - listed)}"


def test_every_binding_the_docs_name_is_a_field():
    named = re.findall(r"\b(Model|Parallel|Train|Data)\.(\w+)", DOCS)
    assert len(named) > 50
    unknown = sorted({f"{c}.{f}" for c, f in named if f not in FIELDS[c]})
    assert not unknown, f"the docs name bindings that do not exist: {unknown}"
    gin_params = re.findall(r"--gin_param=[\"']?(\w+)\.(\w+)\s*=", DOCS)
    assert len(gin_params) > 10
    for cls, field in gin_params:
        assert cls in FIELDS and field in FIELDS[cls], f"--gin_param={cls}.{field}"


def _module_file(module: str) -> Path | None:
    """The file ``python -m module`` runs, or None."""
    path = REPO.joinpath(*module.split("."))
    if (path / "__main__.py").is_file():
        return path / "__main__.py"
    if path.with_suffix(".py").is_file():
        source = path.with_suffix(".py").read_text()
        return path.with_suffix(".py") if '__name__ == "__main__"' in source else None
    return None


def test_every_module_the_docs_run_exists():
    texts = [DOCS, *LAUNCH.values(), *CONFIGS.values()]
    modules = sorted({m for t in texts for m in re.findall(r"python -m (boost_jax[\w.]*\w)", t)})
    assert "boost_jax.train" in modules and len(modules) >= 5
    missing = [m for m in modules if _module_file(m) is None]
    assert not missing, f"`python -m` of modules that do not run: {missing}"


def _benchmarks() -> list[str]:
    tree = ast.parse((REPO / "boost_jax/commands/bench.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "BENCHMARKS")
    return [k.value for k in node.value.keys]


def test_every_benchmark_the_docs_name_exists():
    named = set(re.findall(r"python -m boost_jax\.bench (\w+)", DOCS))
    assert named and named <= set(_benchmarks()), sorted(named - set(_benchmarks()))
    listed = re.search(r"python -m boost_jax\.bench\s+((?:\w+\s*\|\s*)+\w+)", DOCS)
    assert listed, "the package layout lists the benchmarks"
    assert re.split(r"\s*\|\s*", listed.group(1)) == _benchmarks()


# flags of other programs in the docs' commands: pip's, sbatch's, srun's, mkdocs's,
# pytest-xdist's
OTHER_PROGRAMS_FLAGS = {"index-url", "no-deps", "target", "nodes", "signal", "kill-on-bad-exit",
                        "strict", "no-loadscope-reorder",
                        # the LORO authors' run_c4.py, cited in the LORO section
                        "loro_lr_scaler", "loro_refresh", "lr_adjust_steps", "weight_decay",
                        # the CoLA authors' main.py, cited in the reproduction guide, and the
                        # generator that runs it (tests/golden/make_cola_protocol.py)
                        "grad_clipping", "num_training_steps", "cola_repo"}
ABSL_FLAGS = {"help", "helpfull", "helpshort", "flagfile", "verbosity"}


def _defined_flags(path: Path) -> set[str]:
    return set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", path.read_text()))


def _module_flags(module: str) -> set[str]:
    """The absl flags ``python -m module`` defines: in its file and in the boost_jax modules
    that file imports."""
    main = _module_file(module)
    alias = re.search(r'runpy\.run_module\("(boost_jax[\w.]*)"', main.read_text())
    if alias:  # a thin alias (boost_jax/eval.py ...): the command it runs
        main = _module_file(alias[1])
    files = [main]
    for node in ast.walk(ast.parse(main.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("boost_jax"):
            base_path = REPO.joinpath(*node.module.split("."))
            files.append(base_path.with_suffix(".py"))
            files += [base_path / f"{a.name}.py" for a in node.names]
    return ABSL_FLAGS.union(*(_defined_flags(f) for f in files if f.is_file()))


def test_every_command_line_flag_is_defined():
    """Each ``python -m boost_jax...`` (or launcher) command's flags are its program's; any
    other ``--flag`` in the docs is some boost_jax program's, XLA's or another program's."""
    checked = 0
    for command in _commands() + [s for s in SPANS if s.startswith("python -m boost_jax")]:
        m = re.search(r"python -m (boost_jax[\w.]*\w)", command)
        module = m[1] if m else "boost_jax.train" if "launch/" in command else None
        if module is None:
            continue
        used = set(re.findall(r"(?<![\w-])--([a-zA-Z]\w*)", command)) - OTHER_PROGRAMS_FLAGS
        unknown = used - _module_flags(module)
        assert not unknown, f"`{command}`: {module} has no flags {sorted(unknown)}"
        checked += 1
    assert checked >= 20
    every = ABSL_FLAGS.union(*(_defined_flags(f) for f in (REPO / "boost_jax").rglob("*.py")))
    named = set(re.findall(r"(?<![\w-])--([a-zA-Z][\w-]*)", DOCS))
    unknown = {n for n in named - every - OTHER_PROGRAMS_FLAGS if not n.startswith("xla_")}
    assert not unknown, f"the docs name flags no program defines: {sorted(unknown)}"


def _gin_arguments(command: str) -> tuple[list[str], list[str]] | None:
    files, params = [], []
    for token in shlex.split(command):
        for flag, into in (("--gin_file=", files), ("--gin_param=", params)):
            if token.startswith(flag):
                into.append(token[len(flag):])
    if not files and not params or any("..." in a for a in files + params):
        return None
    return files, params


def test_docs_command_lines_make_valid_configs():
    """Each trainer, launcher and report command in the docs (code blocks and inline), and
    each inline set of bindings, parses and validates: its gin files exist, its bindings are
    fields and their values are valid."""
    from boost_jax.config import ConfigError
    from boost_jax.gin_io import load_config, parse_gin

    runs = ("boost_jax.train", "launch/", "comm_report", "boost_jax.bench model")
    commands = [c.replace("\n", " ") for c in _commands() + SPANS
                if any(r in c for r in runs) or c.startswith("--gin_param=")]  # bare bindings
    checked = 0
    for command in commands:
        args = _gin_arguments(command)
        if args is None or set(args[0]) & _emitted():  # written by a docs command first
            continue
        gin.clear_config()
        try:
            parse_gin(args[0], args[1], search_paths=[str(REPO / "configs")])
            load_config()
        except ConfigError as err:
            pytest.fail(f"docs command `{command}`: {err}")
        checked += 1
    assert checked >= 15


def _emitted() -> set[str]:
    """Gin files a docs command writes for the next one to read: ``--emit_gin=``, and a train
    run's operative config, ``<--workdir>/config.gin`` (the quickstart's ``comm_report``)."""
    return (set(re.findall(r"--emit_gin=(\S+\.gin)", DOCS))
            | {f"{w}/config.gin" for w in re.findall(r"--workdir=([\w./-]+)", DOCS)})


# ---------------------------------------------------------------- (b) paths and gin files

_PATH = re.compile(r"(?<![\w./<>$~-])((?:boost_jax|configs|launch|tests|docs|notebooks|\.ci)"
                   r"/[\w./<>*:-]*)")
_GIN = re.compile(r"(?<![\w./<>-])([\w./-]+\.gin)\b")


def _named_paths(text: str) -> set[str]:
    out = set()
    for path in _PATH.findall(text):
        path = path.split("::")[0].rstrip(".,:")
        if "<" not in path and "*" not in path:
            out.add(path)
    return out


@pytest.mark.parametrize("where", ["docs", "launch", "configs"])
def test_every_path_named_exists(where):
    texts = {"docs": list(PAGES.values()), "launch": list(LAUNCH.values()),
             "configs": list(CONFIGS.values())}[where]
    paths = set().union(*map(_named_paths, texts))
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"{where} names paths that do not exist: {missing}"
    gins = {g for t in texts for g in _GIN.findall(t)} - RUN_OUTPUTS - _emitted()
    missing = sorted(g for g in gins
                     if not (REPO / g).is_file() and not (REPO / "configs" / g).is_file())
    assert not missing, f"{where} names gin files that are not in the repository: {missing}"
    if where == "docs":
        assert len(paths) > 20 and len(gins) >= 9


def test_every_config_parses_as_the_trainer_reads_it_and_is_in_the_docs():
    """Looked up under configs/ as ``--gin_file`` is (so ``include`` lines resolve), parsed and
    built into the dataclasses; no mesh is built (the paper configs need many devices)."""
    from boost_jax.gin_io import load_config, parse_gin

    for name, text in CONFIGS.items():
        for included in re.findall(r"^include\s+['\"]([^'\"]+)['\"]", text, re.M):
            assert (REPO / "configs" / included).is_file() or (REPO / included).is_file(), (
                f"configs/{name} includes {included!r}, which does not exist")
        gin.clear_config()
        parse_gin([name], search_paths=[str(REPO / "configs")])
        load_config()
    unnamed = [name for name in CONFIGS if f"`{name}`" not in DOCS]
    assert not unnamed, f"configs the docs do not list: {unnamed}"


def _layout() -> list[tuple[str, str]]:
    """``(entry, description)`` of each ``boost_jax/`` line of the package-layout block."""
    block = next(b for b in BLOCKS if b.startswith("boost_jax/\n"))
    entries = []
    for line in block.splitlines()[1:]:
        if re.match(r"  \S", line):
            entry, _, rest = line.strip().partition(" ")
            entries.append([entry, rest])
        elif line.startswith("   ") and entries:
            entries[-1][1] += " " + line.strip()
        else:
            break
    return [tuple(e) for e in entries]


def test_package_layout_is_the_package():
    layout = _layout()
    package = REPO / "boost_jax"
    named = set()
    for entry, description in layout:
        assert (package / entry).exists(), f"package layout: boost_jax/{entry} does not exist"
        named.add(entry.split("/")[0] + ("/" if "/" in entry else ""))
        if entry.endswith("/"):
            for part in re.findall(r"(?<![\w./-])(\w+\.py|\w+/)(?![\w.])", description):
                assert (package / entry / part).exists(), (
                    f"package layout: boost_jax/{entry}{part} does not exist")
            # a package whose line lists its modules lists all of them (bench/ lists its
            # benchmarks instead)
            if entry != "bench/" and re.search(r"\w\.py", description):
                mods = {p.name for p in (package / entry).glob("*.py")} - {"__init__.py",
                                                                           "__main__.py"}
                unlisted = sorted(m for m in mods if not re.search(rf"\b{m}\b", description))
                assert not unlisted, f"package layout: boost_jax/{entry} does not list {unlisted}"
    top = {p.name + ("/" if p.is_dir() else "") for p in package.iterdir()
           if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert not top - named, f"package layout does not list boost_jax/{sorted(top - named)}"
    tail = next(b for b in BLOCKS if b.startswith("boost_jax/\n")).splitlines()[-1]
    scripts = re.search(r"launch/ \(([^)]*)\)", tail)
    assert scripts and sorted(s.strip() for s in scripts.group(1).split(",")) == sorted(LAUNCH)


def test_checkpoint_items_are_the_checkpointers():
    tree = ast.parse((REPO / "boost_jax/checkpointing/checkpointer.py").read_text())
    items = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", None) == "ITEMS")
    match = re.search(r"with (\w+) items: (.{0,400})", PROSE, re.S)
    assert match, "the docs say which items a checkpoint holds"
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
    assert match.group(1) == words[len(items)], (
        f"docs: {match.group(1)} checkpoint items, code: {len(items)} {items}")
    assert re.findall(r"`(\w+)`\s+\(", match.group(2))[:len(items)] == list(items)


def test_progress_line_example_is_what_the_trainer_prints():
    """The docs' progress line of the default run, redone by the trainer's own formatter
    from the example's step, loss and seconds per step (so its throughput and ETA agree)."""
    from boost_jax.operations.progress import Window

    example = next(b for b in BLOCKS if b.startswith("step ")).strip()
    m = re.match(r"step +(\d+)/(\d+) .*\| loss ([\d.]+) \|.*\| ([\d.]+) s/step", example)
    assert m, example
    step, total, loss, per_step = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    train = Train()
    assert total == train.steps and step % train.log_every == 0
    window = Window(total, train.batch_size * train.seq_len, 0.0, None)  # no MFU on a CPU
    window.add(per_step)
    assert window.line(step, loss) == example


# ---------------------------------------------------------------- launchers: XLA flags

def test_xla_flags_of_the_launchers_and_docs_are_known_to_jaxlib():
    """A flag XLA does not know aborts every process at start-up; the flag set is the same in
    the CPU and the CUDA builds of one jaxlib version."""
    from boost_jax import gpu_settings

    texts = [DOCS, *LAUNCH.values()]
    flags = {}
    for name, value in re.findall(r"--(xla_\w+)(=[\w.-]+)?", "\n".join(texts)):
        if value or name not in flags:
            flags[name] = value
    assert "xla_gpu_enable_latency_hiding_scheduler" in flags
    flags.update({f.name: f"={f.value}" for f in gpu_settings.FLAGS_LIST})  # the candidates too
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(f"--{k}{v}" for k, v in flags.items()))
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, text=True, timeout=120)
    unknown = re.findall(r"Unknown flags? in XLA_FLAGS: (.*)", done.stderr)
    assert done.returncode == 0, unknown or done.stderr[-2000:]


# ---------------------------------------------------------------- (d) links, internal notes

# the project's internal notes, which a user of the repository does not have
INTERNAL = re.compile(r"\bSPEC\b|DESIGN\.md|JAX_NOTES|ENV_NOTES|\.\./shared|\bseeds/|\bNOTES\.md")


@pytest.mark.parametrize("where", ["docs", "launch", "configs"])
def test_no_reference_to_documents_a_user_does_not_have(where):
    texts = {"docs": PAGES, "launch": LAUNCH, "configs": CONFIGS}[where]
    found = [f"{name}: {line.strip()}" for name, text in texts.items()
             for line in text.splitlines() if INTERNAL.search(line)]
    assert not found, "\n".join(found)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def site_anchor(heading: str) -> str:
    """The site's anchor of a heading (MkDocs' ``toc`` extension): its text without markup
    (code, links), ASCII, punctuation dropped, runs of spaces and hyphens to one hyphen."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "")
    return slugify(text, "-")


def _anchors(prose: str, site: bool = False) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets ``-1``, ``-2`` (GitHub) or
    ``_1``, ``_2`` (the site)."""
    seen, anchors = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose, re.M):
        base = (site_anchor if site else github_anchor)(heading)
        n = seen.get(base, 0)
        anchors.add(base if n == 0 else f"{base}{'_' if site else '-'}{n}")
        seen[base] = n + 1
    return anchors


def test_github_anchor_rules():
    assert github_anchor("Pipeline, data parallelism and multi-host runs") == \
        "pipeline-data-parallelism-and-multi-host-runs"
    assert github_anchor("Packing: `Data.packing`") == "packing-datapacking"
    assert github_anchor("Preparing a corpus (C4 end to end)") == "preparing-a-corpus-c4-end-to-end"


def test_site_anchor_rules():
    assert site_anchor("What `--verify` checks") == "what-verify-checks"
    assert site_anchor("Packing: `Data.packing`") == "packing-datapacking"
    assert site_anchor("The paper's layouts vs the planner's choice") == \
        "the-papers-layouts-vs-the-planners-choice"


def generated_pages() -> tuple[str, ...]:
    """The pages the site's build hook generates (``docs/_hooks/generate.py``), under docs/."""
    tree = ast.parse((REPO / "docs/_hooks/generate.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "GENERATED")
    return ast.literal_eval(node.value)


def test_links_resolve():
    """Every link of the README and of the site's pages reaches a file and, with ``#``, a
    heading: the README's as GitHub renders it, the pages' as the site does (links among the
    pages stay inside ``docs/``, which is all the site has)."""
    generated = {f"docs/{page}" for page in generated_pages()}
    checked = 0
    for name, (prose, _) in SPLIT.items():
        site = name != "README.md"
        for link in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose):
            if link.startswith(("http://", "https://")):
                continue
            path, _, anchor = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
            target = target.replace(os.sep, "/")
            if site:
                assert target.startswith("docs/"), f"{name}: link {link} leaves the site"
            assert (REPO / target).exists() or target in generated, (
                f"{name}: link {link}: no such file")
            if anchor:
                assert target in PAGES, f"{name}: link {link}: an anchor in no page of the docs"
                anchors = _anchors(SPLIT[target][0], site=site)
                assert anchor in anchors, f"{name}: link {link}: no such heading in {target}"
            checked += 1
    assert checked > 100


def test_sections_other_files_point_to_exist():
    """pyproject.toml, the launchers, the configs and the package refer to sections of the docs
    by name (``README, "GPU hosts"`` or ``docs, "GPU hosts"``): each is a heading of the README
    or of a page."""
    headings = set(re.findall(r"^#{1,6} +(.+?)\s*$", PROSE, re.M))
    texts = [(REPO / "pyproject.toml").read_text(), *LAUNCH.values(), *CONFIGS.values(),
             *(p.read_text() for p in sorted((REPO / "boost_jax").rglob("*.py")))]
    named = {s for t in texts for s in re.findall(r'(?:README|docs), "([^"]+)"', t)}
    assert len(named) >= 2
    assert not named - headings, f"sections that do not exist: {sorted(named - headings)}"


def test_version_ranges_quoted_are_the_pins():
    """A version range the docs quote (```>=a,<b```) is one that pyproject.toml pins (the
    dependencies or an extra), so the docs cannot keep an old pin."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = project["dependencies"] + [p for extra in project["optional-dependencies"].values()
                                      for p in extra]
    specs = {re.sub(r"^[\w.-]+(\[[\w,-]+\])?", "", p).split(";")[0].strip() for p in pins}
    quoted = set(re.findall(r"`(>=[\w.]+,<[\w.]+)`", DOCS))
    assert quoted, "the docs quote jax's range (GPU hosts)"
    assert quoted <= specs, (
        f"ranges the docs quote that pyproject.toml does not pin: {sorted(quoted - specs)}")


def test_each_documented_run_has_a_workdir_of_its_own():
    """Issue 49: on every page, two ``python -m boost_jax.train`` commands of different
    configurations (gin files, and the bindings a resume must match: config_fields.MATCH)
    never share a workdir (``runs/default`` when none is given): the second would stop with
    ``the checkpoints in ... were written for another model`` instead of running as printed.
    A resume (the same files, other steps or mesh: operating.md's elastic restart) may.
    Seen failing on the C4 page before its commands got their own ``--workdir``."""
    from boost_jax.config_fields import MATCH

    def matters(arg: str) -> bool:
        if arg.startswith("--gin_file="):
            return True
        group, _, field = arg.removeprefix("--gin_param=").partition("=")[0].partition(".")
        return FIELDS[group][field].metadata["resume"] == MATCH

    shared = []
    for name, (_, blocks) in SPLIT.items():
        runs: dict[str, set] = {}
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*", "", line).strip()
                if not line.startswith("python -m boost_jax.train") or "--print_config" in line:
                    continue
                args = shlex.split(line)[3:]
                workdir = next((a.split("=", 1)[1] for a in args if a.startswith("--workdir=")),
                               "runs/default")
                config = tuple(sorted(a for a in args if a.startswith(("--gin_file=",
                                                                         "--gin_param="))
                                      and matters(a)))
                runs.setdefault(workdir, set()).add(config)
        shared += [(name, w, sorted(c)) for w, c in runs.items() if len(c) > 1]
    assert not shared, shared


def test_the_prepared_corpora_directory_is_ignored_by_git():
    """Issue 49: ``data/`` at the repository's root, where the docs prepare corpora
    (``--output=data/c4-t5``), is in .gitignore -- and only that one: the package's
    ``boost_jax/data/`` is not. Seen failing on the old .gitignore (no entry)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0
    assert ignored("data/c4-t5/manifest.json")
    assert not ignored("boost_jax/data/loader.py") and not ignored("tests/data/test_loader.py")



def test_the_site_keeps_names_whole_and_long_lines_in_view():
    """Issue 49, checked in headless Chromium (docs/_hooks/screenshots.sh): the site's
    stylesheet keeps a table's first-column name whole (the configuration reference broke
    ``Model.d_mode|l``) and wraps a code block's long lines (the ``--print_config`` sample's
    meaning column ran out of view). Seen failing on the old stylesheet (neither rule)."""
    css = (REPO / "docs" / "stylesheets" / "extra.css").read_text()
    assert re.search(r"table[^{]*td:first-child code \{\s*white-space: nowrap;", css)
    assert re.search(r"\.md-typeset pre > code \{\s*white-space: pre-wrap;", css)
