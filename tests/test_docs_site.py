"""The documentation site: it builds with ``mkdocs build --strict``, every page is in its
navigation, the README stays short and keeps the set-up commands CI runs, and every section of
the README as it was before the site (commit 303f86a) has a home in it.

The checks of the text against the code are ``tests/test_docs.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.test_docs import PAGES, REPO, SPLIT, generated_pages

MKDOCS_YML = (REPO / "mkdocs.yml").read_text()
NAV = re.findall(r"^ *- (?:[^:\n]+: )?(\S+\.md)$", MKDOCS_YML.split("\nnav:", 1)[1], re.M)

# CI installs exactly what the README says; these two lines are what it runs
SETUP = ('pip install -e . && python -m boost_jax.train          # train the default model on '
         'the bundled corpus',
         'pip install -e ".[test]" && pytest                      # run the tests (see below: '
         '20-50 min)')
README_MAX_LINES = 250

# Every heading of the README at commit 303f86a (`git show 303f86a:README.md | grep "^#"`, less
# the comment lines of its code blocks), and the page and heading where its text lives now.
OLD_README_HOMES = {
    "boost_jax": ("README.md", "boost_jax"),
    "Contents": ("README.md", "Documentation"),
    "Models": ("docs/concepts/models.md", "Models"),
    "Tensor parallelism": ("docs/concepts/tensor-parallelism.md", "Tensor parallelism"),
    "The online statistic in bf16": ("docs/concepts/online-rmsnorm.md",
                                     "The online statistic in bf16"),
    "Communication report and benchmark": ("docs/guides/comm-report.md", "Communication report"),
    "Activation checkpointing": ("docs/concepts/activation-checkpointing.md",
                                 "Activation checkpointing"),
    "Pipeline, data parallelism and multi-host runs": (
        "docs/concepts/parallelism.md", "Pipeline, data parallelism, ZeRO and FSDP"),
    "Performance model and benchmarks": ("docs/guides/bench.md",
                                         "Performance model and benchmarks"),
    "Configuration: gin bindings": ("docs/guides/train.md", "Configuration: gin bindings"),
    "Data": ("docs/guides/prepare.md", "Preparing data"),
    "Training on your own text": ("docs/get-started/your-own-text.md",
                                  "Training on your own text"),
    "Preparing a corpus (C4 end to end)": ("docs/get-started/c4.md",
                                           "Preparing a corpus (C4 end to end)"),
    "Packing: `Data.packing`": ("docs/guides/data-loading.md", "Packing: `Data.packing`"),
    "The loader": ("docs/guides/data-loading.md", "The loader"),
    "Checkpoints and resume": ("docs/guides/preemption.md", "Checkpoints and resume"),
    "Metrics": ("docs/guides/train.md", "Metrics"),
    "Operating a run": ("docs/guides/operating.md", "Operating a run"),
    "Hugging Face import": ("docs/guides/export.md", "Hugging Face import"),
    "Exporting models": ("docs/guides/export.md", "Exporting models"),
    "Tensor names and shapes": ("docs/guides/export.md", "Tensor names and shapes"),
    "Reading exports back": ("docs/guides/export.md", "Reading exports back"),
    "Generating text": ("docs/guides/generate.md", "Generating text"),
    "Samples while training: `Train.sample_every`": (
        "docs/guides/generate.md", "Samples while training: `Train.sample_every`"),
    "Evaluating a model": ("docs/guides/eval.md", "Evaluating a model"),
    "Held-out perplexity": ("docs/guides/eval.md", "Held-out perplexity"),
    "lm-evaluation-harness tasks": ("docs/guides/eval.md", "lm-evaluation-harness tasks"),
    "LORO": ("docs/concepts/loro.md", "LORO"),
    "Planning a layout": ("docs/guides/plan.md", "Planning a layout"),
    "What `--verify` checks": ("docs/guides/plan.md", "What `--verify` checks"),
    "The paper's layouts vs the planner's choice": (
        "docs/guides/plan.md", "The paper's layouts vs the planner's choice"),
    "GPU hosts": ("docs/guides/gpu-hosts.md", "GPU hosts"),
    "Tests": ("docs/reference/tests.md", "Tests"),
    "Package layout": ("docs/reference/package-layout.md", "Package layout"),
}


def _headings(page: str) -> list[str]:
    return re.findall(r"^#{1,6} +(.+?) *#*$", SPLIT[page][0], re.M)


def test_every_old_readme_section_has_a_home():
    for old, (page, heading) in OLD_README_HOMES.items():
        assert page in PAGES, f"README section {old!r}: its page {page} does not exist"
        assert heading in _headings(page), (
            f"README section {old!r}: {page} has no heading {heading!r}")
        assert page == "README.md" or f"{page[len('docs/'):]}" in NAV, (
            f"README section {old!r}: {page} is not in the site's navigation")


def test_the_list_of_old_readme_sections_is_the_old_readme():
    """Where the history is at hand: the headings of README.md at 303f86a, exactly."""
    try:
        old = subprocess.run(["git", "show", "303f86a:README.md"], cwd=REPO, text=True,
                             capture_output=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("commit 303f86a is not in this checkout's history")
    from tests.test_docs import _split

    headings = re.findall(r"^#{1,6} +(.+?) *#*$", _split(old)[0], re.M)
    assert headings == list(OLD_README_HOMES)


def test_readme_is_short_and_keeps_the_setup_commands():
    lines = PAGES["README.md"].splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    for command in SETUP:
        assert command in lines, f"README.md lost the set-up line {command!r}"


def test_the_test_command_says_what_it_costs_before_it_starts():
    """Issue 49: next to the test command, the README says what it installs (GB, minutes), how
    long the suite runs on 2 cores, and a fast part whose tests exist. Seen failing on the old
    README (``# run the tests`` alone)."""
    readme = PAGES["README.md"]
    assert re.search(r"The test command first adds about [\d.]+ GB to the environment", readme)
    assert re.search(r"about \d+ minutes on 2 cores on Python 3\.11", readme)
    fast = re.search(r"`pytest (tests/\S+)` checks .* in about", readme)
    assert fast and (REPO / fast.group(1)).is_dir()


def test_every_page_is_in_the_navigation_and_the_readme_links_them():
    """Each page of docs/ is in mkdocs.yml's nav (the build also warns about one left out) and
    each nav entry is a page; the README's Documentation section links every page but the
    front page and the generated ones."""
    pages = sorted(name[len("docs/"):] for name in PAGES if name.startswith("docs/"))
    generated = set(generated_pages())
    assert sorted(set(NAV) - generated) == pages
    assert len(NAV) == len(set(NAV)), "a page twice in the navigation"
    section = SPLIT["README.md"][0].split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)\)", section))
    assert set(pages) - {"index.md"} <= linked, sorted(set(pages) - {"index.md"} - linked)


def test_readme_sections_the_front_page_includes_exist_and_hold_no_links():
    """index.md includes parts of the README (``--8<-- "README.md:name"``); each has its
    markers, and holds no link (the README's links are relative to the repository, the site's
    to docs/)."""
    readme = PAGES["README.md"]
    included = re.findall(r'^--8<-- "README\.md:(\w+)"$', PAGES["docs/index.md"], re.M)
    assert included
    for name in included:
        part = re.search(rf"--8<-- \[start:{name}\] -->\n(.*?)<!-- --8<-- \[end:{name}\]",
                         readme, re.S)
        assert part, f"README.md has no section {name!r} for docs/index.md"
        assert not re.search(r"\]\(", part[1]), f"README.md section {name!r} holds a link"


def test_mkdocs_build_strict(tmp_path):
    """The site builds with no warning: no broken link or anchor, no page missing from or left
    out of the navigation, every API page's docstrings parsed. The generated configuration
    reference lists every field, and the notebooks' cells are in their pages."""
    from boost_jax.gin_io import describe_fields

    for name in ("mkdocs", "material", "mkdocstrings"):  # the docs extra (in the test extra,
        pytest.importorskip(name, reason="pip install 'boost_jax[docs]'")  # so CI has them)
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = (site / "reference/configuration/index.html").read_text()
    missing = [b for b, *_ in describe_fields() if f"<code>{b}</code>" not in reference]
    assert not missing, f"fields missing from the configuration reference: {missing}"
    for page, output in (("concepts/tensor-parallelism", 'class="notebook-output"'),
                         ("concepts/communication", "data:image/png"),
                         ("concepts/online-rmsnorm", "= 3r + 1")):
        html = (site / page / "index.html").read_text()
        assert "notebook: notebooks/" not in html and output in html, (
            f"{page}: the notebook's cells are not in the page")
