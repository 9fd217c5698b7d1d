"""scripts/module-graph on tiny synthetic source trees: how paths resolve to files, what is not
an edge (comments, literals, unit tests, `mod` declarations), and how cycles are reported."""
import importlib.machinery
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "module-graph"


def load():
    loader = importlib.machinery.SourceFileLoader("module_graph", str(SCRIPT))
    spec = importlib.util.spec_from_loader("module_graph", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def tree(root, files):
    src = root / "src"
    for name, text in files.items():
        p = src / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return src


def run(src, *flags):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--src", str(src), *flags],
        capture_output=True,
        text=True,
    )
    return proc.returncode, proc.stdout


def section(out, header=None):
    """`name -> a, b` lines as a dict: the module part (header None) or the `files:` part."""
    lines = out.splitlines()
    if header:
        lines = lines[lines.index(header) + 1 :]
    graph = {}
    for line in lines:
        if not line.strip():
            break
        name, _, uses = line.partition(" -> ")
        graph[name.strip()] = set() if uses == "(nothing)" else set(uses.split(", "))
    return graph


# The tree: `a` (a/mod.rs, a/b.rs, a/c.rs), `e` (e/mod.rs, e/f/mod.rs, e/f/g.rs), d.rs.
TREE = {
    "lib.rs": "pub mod a;\npub mod d;\npub mod e;\n",
    "a/mod.rs": """
        mod b;
        mod c;
        #[cfg(test)]
        mod tests;
        pub use c::Thing; // a re-export: a/mod.rs -> a/c.rs

        pub struct A;

        pub fn run() {
            b::go(); // a child module's path: a/mod.rs -> a/b.rs
        }
    """,
    "a/b.rs": """
        use super::{
            A,
            c::{self, Thing as T},
        };

        pub fn go() {}
    """,
    "a/c.rs": r'''
        //! Docs that name crate::d::X, and [`super::b`].
        /* a block /* nested */ crate::d::Y */
        pub struct Thing;

        pub fn literals() -> (&'static str, &'static str, &'static str, char, char) {
            let s = "crate::d::Z and super::b::go(), with \" an escaped quote: crate::d";
            let r = r#"a raw "crate::d::W" and super::b"#;
            let b = br"crate::d";
            let q = '"';
            let e = '\'';
            (s, r, "self::b", q, e)
        }

        fn lifetimes<'a>(x: &'a str) -> &'a str {
            'outer: loop {
                break 'outer;
            }
            x
        }

        #[cfg(test)]
        use crate::d::Helper;

        #[cfg(test)]
        fn only_in_tests() {
            crate::d::helper();
        }

        pub fn after_the_test_items() {
            crate::e::f::g::deep(); // the longest prefix backed by a file: e/f/g.rs
        }
    ''',
    "a/tests.rs": "use crate::d::*;\n",
    "d.rs": """
        use crate::{
            a::{self, b as bee},
            e::f::{Inner as I},
        };

        pub fn f() {
            a::run();
        }
    """,
    "e/mod.rs": """
        mod f; // a declaration alone is no edge

        pub struct X;
    """,
    "e/f/mod.rs": """
        mod g;

        pub struct Inner;

        pub fn call() {
            self::g::deep();
        }
    """,
    "e/f/g.rs": """
        use super::super::X;

        pub fn deep() {
            let _ = super::Inner;
        }
    """,
}


@pytest.fixture
def src(tmp_path):
    return tree(tmp_path, TREE)


def test_file_edges(src):
    rc, out = run(src)
    assert rc == 0
    files = section(out, "files:")
    assert files == {
        # grouped and nested imports: `A` is an item of a/mod.rs, `c::{self, Thing as T}` is a/c.rs
        "a/b.rs": {"a/mod.rs", "a/c.rs"},
        # the child-module path and the re-export; not `mod tests;`, not the tests.rs file
        "a/mod.rs": {"a/b.rs", "a/c.rs"},
        # nothing from comments, strings, raw strings, char literals or `#[cfg(test)]` items
        "a/c.rs": {"e/f/g.rs"},
        # `use crate::{a::{self, b as bee}, e::f::{Inner as I}}` and `a::run()` via the import
        "d.rs": {"a/mod.rs", "a/b.rs", "e/f/mod.rs"},
        "e/mod.rs": set(),
        # `self::g::...`
        "e/f/mod.rs": {"e/f/g.rs"},
        # `super::super::X` and `super::Inner`
        "e/f/g.rs": {"e/mod.rs", "e/f/mod.rs"},
    }
    assert section(out) == {"a": {"e"}, "d": {"a", "e"}, "e": set()}


def test_cycles_are_listed_and_checked(src):
    rc, out = run(src)
    lines = out.splitlines()
    cycles = [line for line in lines if line.startswith("cycle: ")]
    assert cycles == ["cycle: a/b.rs, a/mod.rs", "cycle: e/f/g.rs, e/f/mod.rs"]
    i = lines.index("cycle: a/b.rs, a/mod.rs")
    assert lines[i + 1].strip() == "a/b.rs -> a/mod.rs; a/mod.rs -> a/b.rs"
    assert lines[-1] == "cycles: 2 (0 among modules, 2 among files)"
    assert rc == 0
    rc, out2 = run(src, "--check")
    assert rc == 1
    assert out2 == out


def test_module_level_cycle(tmp_path):
    src = tree(
        tmp_path,
        {
            "lib.rs": "mod x;\nmod y;\n",
            "x.rs": "pub fn f() { crate::y::g() }\n",
            "y/mod.rs": "mod z;\npub fn g() {}\n",
            "y/z.rs": "use crate::x::f;\n",
        },
    )
    rc, out = run(src, "--check")
    assert rc == 1
    assert section(out) == {"x": {"y"}, "y": {"x"}}
    assert "cycle: x, y" in out.splitlines()
    assert "cycle: x.rs, y/mod.rs, y/z.rs" not in out  # y/mod.rs does not use z.rs
    assert out.splitlines()[-1] == "cycles: 1 (1 among modules, 0 among files)"


def test_acyclic_tree(tmp_path):
    src = tree(
        tmp_path,
        {
            "main.rs": "use crate::p::q;\nmod p;\nfn main() {}\n",
            "p/mod.rs": "mod q;\nmod r;\npub use r::R;\n",
            "p/q.rs": "use super::r::{self, R};\npub fn q() { r::f(); }\n",
            "p/r.rs": "pub struct R;\npub fn f() {}\n",
            "p/s.rs": "use super::*;\n",  # a glob names no file but the module's own
        },
    )
    rc, out = run(src, "--check")
    assert rc == 0
    assert section(out, "files:") == {
        "p/mod.rs": {"p/r.rs"},
        "p/q.rs": {"p/r.rs"},
        "p/r.rs": set(),
        "p/s.rs": {"p/mod.rs"},
    }
    assert out.splitlines()[-1] == "cycles: none"


def test_glob_import_brings_child_modules(tmp_path):
    # `use super::*` brings the parent's child modules: `svg::f` is report/svg.rs.
    src = tree(
        tmp_path,
        {
            "report/mod.rs": "mod png;\nmod svg;\npub struct Plot;\n",
            "report/png.rs": "use super::*;\npub fn raster() { svg::f(); }\n",
            "report/svg.rs": "pub fn f() {}\n",
        },
    )
    _, out = run(src)
    assert section(out, "files:")["report/png.rs"] == {"report/mod.rs", "report/svg.rs"}


def test_inline_module_and_field_access_are_not_paths(tmp_path):
    src = tree(
        tmp_path,
        {
            "k/mod.rs": "mod v;\npub struct K;\nfn m(s: S) { s.v::<u8>(); }\n",
            "k/v.rs": """
                pub mod inner {
                    pub fn f() { super::super::K; }
                }
                pub fn g(s: S) { s.inner::<u8>(); let v = 1u8; }
            """,
        },
    )
    _, out = run(src)
    # `super::super` from the inline module k::v::inner is k: k/mod.rs
    assert section(out, "files:")["k/v.rs"] == {"k/mod.rs"}
    # a method `v::<u8>` is not the child module `v`
    assert section(out, "files:")["k/mod.rs"] == set()


def test_strip_keeps_code_and_lines():
    mg = load()
    text = 'let a = "x\\"y"; // c\nlet b = r##"q"#"##; /* /* n */ */ let c = \'"\';\nfn f<\'a>() {}\n'
    out = mg.strip(text)
    assert out.count("\n") == text.count("\n")
    assert mg.tokens(out) == mg.tokens(
        'let a = ""; \nlet b = ""; let c = \' \';\nfn f<\'a>() {}\n'
    )


def test_dot(src):
    rc, out = run(src, "--dot")
    assert rc == 0 and out.startswith("digraph diffmon {") and "  d -> a;" in out
    rc, out = run(src, "--files", "--dot")
    assert rc == 0 and '"a/b.rs" -> "a/mod.rs";' in out and 'subgraph "cluster_a"' in out


def test_bad_arguments(tmp_path):
    assert run(tmp_path / "missing")[0] == 2
    assert subprocess.run([sys.executable, str(SCRIPT), "--nope"], capture_output=True).returncode == 2


# The crate itself (ARCHITECTURE.md, "Modules"): the rules the tree keeps.
ROOT = SCRIPT.parents[1]


def test_the_crate_has_no_import_cycle():
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("cycles: none"), out.stdout[-3000:]


def test_no_source_file_is_over_the_limit():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "file-sizes"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_architecture_names_every_source_file():
    """Every .rs file under src/ is named in ARCHITECTURE.md's module table, and every file the
    table names exists: a row `a/x.rs`, or `a/x.rs, y.rs, z.rs (in `a/`)` for several."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text[text.index("\n## Modules\n"):text.index("\n### Module dependency graph")]
    named = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        first = row.split(" | ")[0]
        names = [n for n in first.split("`")[1::2]]
        folder = first.split("(in `")[1].split("`")[0] if "(in `" in first else ""
        for n in names:
            if n.endswith(".rs"):
                named.add(n if "/" in n or not folder else folder + n)
    actual = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src").rglob("*.rs")}
    assert not actual - named, f"files missing from ARCHITECTURE.md's table: {sorted(actual - named)}"
    assert not named - actual, f"the table names files that do not exist: {sorted(named - actual)}"


def test_the_leaves_and_the_jobs_layer_keep_their_places():
    """The leaves a crate split would cut out (ARCHITECTURE.md, "Module dependency graph") depend
    on nothing in the crate, so the boundary a separate crate would enforce is enforced here; and
    inside the daemon the jobs layer sits below Slurm, with one file choosing the executor."""
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True)
    modules = {a.strip(): b.strip() for a, b in (line.split(" -> ") for line in
                                                  out.stdout.split("\nfiles:")[0].splitlines()
                                                  if " -> " in line)}
    for leaf in ("weights", "record", "sign"):
        assert modules[leaf] == "(nothing)", (leaf, modules)
    files = subprocess.run([sys.executable, str(SCRIPT), "--files"], capture_output=True,
                           text=True, check=True).stdout
    edges = {a.strip(): b.split(", ") for a, b in (l.split(" -> ") for l in files.splitlines()
                                                    if " -> " in l)}
    jobs = [f for f in edges if f.startswith("daemon/jobs/")]
    assert jobs and not any(t.startswith("daemon/slurm/") for f in jobs for t in edges[f])
    assert any(t.startswith("daemon/jobs/") for t in edges["daemon/slurm/mod.rs"])
    choosers = {f for f, ts in edges.items() if "daemon/slurm/mod.rs" in ts and "daemon/local.rs" in ts}
    assert choosers == {"daemon/choice.rs"}, choosers
