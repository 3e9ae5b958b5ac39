//! The house's rules, checked over the sources: no import circle between the modules (files) of
//! any crate. A circle means two files that can only be understood, changed and tested
//! together; they grow back unnoticed (three did after the first house issue removed five), so
//! CI holds the count at zero.
//!
//! The graph: one node per file module (`attention/varlen.rs` is `attention::varlen`,
//! `norm/mod.rs` is `norm`), an edge for every path a file names outside its `#[cfg(test)]`
//! part and its comments: `crate::a::b`, `super::x`, `self::x`, `use crate::{a, b}` and a child
//! module named bare (`cuda::forward` in `norm/mod.rs`), each to the longest module prefix it
//! names. A parent re-exporting its child and the child naming its parent's items is a circle
//! too: shared items go down into a leaf file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use regex::Regex;

type Module = Vec<String>;

/// Every file module of a crate's `src`, by module path (`lib.rs` is the root, `[]`).
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let Some(rel) = path.strip_prefix(src).unwrap().to_str().and_then(|r| r.strip_suffix(".rs")) else {
                continue;
            };
            if rel == "main" {
                continue; // a binary's root: it reaches the library by its crate name
            }
            let mut module: Module = rel.split('/').map(String::from).collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            out.insert(module, path);
        }
    }
    out
}

/// The code of a file that counts: before its `#[cfg(test)]` part, without comments.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines().map(|l| l.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

/// The modules `text` (the code of `module`) names, other than itself.
fn references(module: &Module, text: &str, mods: &BTreeMap<Module, PathBuf>) -> BTreeSet<Module> {
    let parent = || module[..module.len().saturating_sub(1)].to_vec();
    let mut out = BTreeSet::new();
    let mut add = |path: Vec<String>| {
        let found = (0..=path.len()).rev().map(|k| path[..k].to_vec()).find(|p| mods.contains_key(p));
        if let Some(target) = found.filter(|t| t != module) {
            out.insert(target);
        }
    };
    let rooted = Regex::new(r"\b(crate|super|self)((?:::\w+)+)").unwrap();
    for c in rooted.captures_iter(text) {
        let mut path = match &c[1] {
            "crate" => vec![],
            "super" => parent(),
            _ => module.clone(),
        };
        for part in c[2].split("::").filter(|p| !p.is_empty()) {
            if part == "super" {
                path.pop();
            } else {
                path.push(part.to_string());
            }
        }
        add(path);
    }
    let grouped = Regex::new(r"\b(crate|super)::\{([^}]*)\}").unwrap();
    for c in grouped.captures_iter(text) {
        let base = if &c[1] == "crate" { vec![] } else { parent() };
        for item in c[2].split(',') {
            let first = item.trim().split("::").next().unwrap_or_default().trim();
            if !first.is_empty() {
                add([base.clone(), vec![first.to_string()]].concat());
            }
        }
    }
    let bare = Regex::new(r"(?:^|[^:\w])(\w+)::").unwrap();
    for c in bare.captures_iter(text) {
        let child = [module.clone(), vec![c[1].to_string()]].concat();
        if mods.contains_key(&child) {
            add(child);
        }
    }
    out
}

/// The circles of a graph: its strongly connected components of more than one node (Tarjan).
fn circles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        out: Vec<Vec<Module>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a Module) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            for w in &self.graph[v] {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    self.low.insert(v, self.low[v].min(self.low[w]));
                } else if self.stack.contains(&w) {
                    self.low.insert(v, self.low[v].min(self.index[w]));
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    component.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut walk = Walk { graph, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), out: Vec::new() };
    for v in graph.keys() {
        if !walk.index.contains_key(v) {
            walk.visit(v);
        }
    }
    walk.out
}

/// The circles of the crate whose sources are in `src`, each as its modules' names.
fn circles_of(src: &Path) -> Vec<Vec<String>> {
    let mods = modules(src);
    let graph: BTreeMap<Module, BTreeSet<Module>> = mods
        .iter()
        .map(|(m, path)| (m.clone(), references(m, &code(&std::fs::read_to_string(path).unwrap()), &mods)))
        .collect();
    let mut found: Vec<Vec<String>> = circles(&graph)
        .into_iter()
        .map(|c| c.into_iter().map(|m| if m.is_empty() { "crate".into() } else { m.join("::") }).collect())
        .collect();
    found.sort();
    found
}

#[test]
fn no_import_circles_in_any_crate() {
    for krate in ["model", "data", "trainer"] {
        let found = circles_of(&common_root().join(krate).join("src"));
        assert!(found.is_empty(), "{krate}: import circles {found:?} (move what they share into a leaf file)");
    }
}

/// Our CUDA kernels (`model/src/kernels/`) are argument checks and launches: outside their
/// tests they name nothing of the model but the FP8 formats, no route and no stand-in: a route
/// decides when a kernel runs, never the other way.
#[test]
fn kernels_import_no_route() {
    let src = common_root().join("model/src");
    let mods = modules(&src);
    let allowed = |m: &Module| m.first().is_some_and(|f| f == "kernels") || *m == ["fp8", "format"];
    for (m, path) in mods.iter().filter(|(m, _)| m.first().is_some_and(|f| f == "kernels")) {
        let named = references(m, &code(&std::fs::read_to_string(path).unwrap()), &mods);
        let outside: Vec<_> = named.iter().filter(|n| !allowed(n)).map(|n| n.join("::")).collect();
        assert!(outside.is_empty(), "{}: names {outside:?}", path.display());
    }
}

/// Positive controls: the check finds a circle through `crate::` paths, and one between a
/// parent re-exporting its child (a bare child path) and the child importing the parent's item
/// (`use super::{..}`); it ignores test modules and comments, and a chain that does not close
/// (c -> a, kid -> leaf).
#[test]
fn the_check_finds_circles_of_each_kind() {
    let dir = tempfile::tempdir().unwrap();
    let write = |rel: &str, text: &str| {
        let p = dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write("lib.rs", "pub mod a;\npub mod b;\npub mod c;\npub mod p;\n");
    write("a.rs", "use crate::b::Thing;\n");
    write("b.rs", "pub fn f() { crate::a::g() }\n// crate::c::h\n#[cfg(test)]\nmod tests { use crate::c::H; }\n");
    write("c.rs", "use crate::a::X;\n");
    write("p/mod.rs", "mod kid;\nmod leaf;\npub use kid::K;\npub fn shared() {}\n");
    write("p/kid.rs", "use super::{leaf, shared};\n");
    write("p/leaf.rs", "pub fn l() {}\n");
    let found = circles_of(dir.path());
    assert_eq!(found, [vec!["a".to_string(), "b".into()], vec!["p".into(), "p::kid".into()]]);
}

fn common_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The issue tags in the comments of `text` (`issue #N`, `#N item K`, `(#N)`, `#N must-show`),
/// each as its line: history belongs in commits, a comment says why.
fn issue_tags(text: &str) -> Vec<String> {
    let tag = Regex::new(r"(?i)issue #\d|#\d+ (item|must)|\(#\d+\b|#\d+[:;,)]").unwrap();
    let comment = Regex::new(r"^\s*(//|#[^!\[])").unwrap();
    text.lines().filter(|l| comment.is_match(l) && tag.is_match(l)).map(|l| l.trim().to_string()).collect()
}

/// The model crate's surface stays small: what the trainer needs, plus `diagnostics` for
/// selftest and bench; the rest is `pub(crate)` (a newcomer reads the public modules first).
#[test]
fn the_model_crate_exposes_at_most_15_modules() {
    let lib = std::fs::read_to_string(common_root().join("model/src/lib.rs")).unwrap();
    let public: Vec<&str> = lib.lines().filter_map(|l| l.strip_prefix("pub mod ")).collect();
    assert!(public.len() <= 15, "{} public modules: {public:?}", public.len());
}

/// The end-to-end tests are one binary: `tests/it.rs` is the only file Cargo finds in `tests/`
/// (each other `tests/*.rs` would be a binary of its own, linking LibTorch again), no crate has
/// a `tests/` folder, and the README's test map names every module of `tests/it/`, so that what
/// a module checks and needs is written somewhere.
#[test]
fn the_tests_are_one_binary_and_the_readme_maps_its_modules() {
    let root = common_root();
    let tops: Vec<String> = std::fs::read_dir(root.join("tests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs") || p.join("main.rs").is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(tops, ["it.rs"], "test binaries in tests/");
    for krate in ["model", "data", "trainer"] {
        assert!(!root.join(krate).join("tests").exists(), "{krate}/tests: end-to-end tests belong in tests/it/");
    }
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let missing: Vec<String> = rust_files(&root.join("tests/it"))
        .iter()
        .map(|p| p.strip_prefix(&root).unwrap().to_string_lossy().into_owned())
        .filter(|name| !readme.contains(&format!("| `{name}` |")))
        .collect();
    assert!(missing.is_empty(), "not in the README's test map: {missing:?}");
}

/// No code comment names an issue, in any crate, test or script.
#[test]
fn no_issue_tags_in_code_comments() {
    let root = common_root();
    let mut found = Vec::new();
    let mut stack: Vec<PathBuf> =
        ["model", "data", "trainer", "tests", "scripts"].iter().map(|d| root.join(d)).collect();
    while let Some(dir) = stack.pop() {
        for path in std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()) {
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| ["rs", "sh", "py"].iter().any(|x| e == *x)) {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                found.extend(issue_tags(&text).into_iter().map(|l| format!("{}: {l}", path.display())));
            }
        }
    }
    assert!(found.is_empty(), "issue tags in comments:\n{}", found.join("\n"));
    // Positive controls.
    for line in
        ["/// refused (#41 item 3).", "// issue #50: fusions", "# packing (#39), in one run", "//! #24 Must-show 1"]
    {
        assert_eq!(issue_tags(line).len(), 1, "{line}");
    }
    assert!(issue_tags("let x = \"#41\"; // a colour #fff").is_empty());
}

/// The longest a function may be, in lines from its `fn` to its closing brace: one screen
/// (the house issue's rule; tests aside).
const MAX_FUNCTION_LINES: usize = 100;

/// `text` with every string, char literal and comment blanked out (newlines kept), so that
/// braces and `fn` can be read off what is left. Lifetimes (`'a`) stay code.
fn blank_literals(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let keep_newline = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < c.len() {
        let start = i;
        if c[i] == '/' && at(&c, i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && at(&c, i + 1) == '*' {
            let mut depth = 0;
            loop {
                if i >= c.len() {
                    break;
                } else if c[i] == '/' && at(&c, i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(&c, i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c[i] == 'r'
            && (at(&c, i + 1) == '"' || (at(&c, i + 1) == '#' && (at(&c, i + 2) == '"' || at(&c, i + 2) == '#')))
            && (i == 0 || !(c[i - 1].is_alphanumeric() || c[i - 1] == '_'))
        {
            let hashes = (1..).take_while(|&k| at(&c, i + k) == '#').count();
            i += 2 + hashes;
            let closing: Vec<char> = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            while i < c.len() && c[i..].iter().take(closing.len()).ne(closing.iter()) {
                i += 1;
            }
            i += closing.len();
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c[i] == '\''
            && (at(&c, i + 2) == '\'' || (at(&c, i + 1) == '\\' && c[i + 2..].iter().take(10).any(|&x| x == '\'')))
        {
            i += 1;
            while i < c.len() && c[i] != '\'' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else {
            out.push(c[i]);
            i += 1;
            continue;
        }
        out.extend(c[start..i.min(c.len())].iter().map(|&ch| keep_newline(ch)));
    }
    out
}

/// The character at `i`, or NUL past the end.
fn at(c: &[char], i: usize) -> char {
    c.get(i).copied().unwrap_or('\0')
}

/// Each function of `code` (literals and comments blanked): its name and the byte range from
/// `fn` to its closing brace. Declarations without a body are left out.
fn function_spans(code: &str) -> Vec<(String, std::ops::Range<usize>)> {
    let fn_re = Regex::new(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)").unwrap();
    let mut out = Vec::new();
    for m in fn_re.captures_iter(code) {
        let start = m.get(0).unwrap().start();
        let after = &code[start..];
        let (Some(open), semi) = (after.find('{'), after.find(';')) else { continue };
        if semi.is_some_and(|s| s < open) {
            continue; // a declaration without a body (a trait's, an extern's)
        }
        let mut depth = 0usize;
        let mut end = code.len();
        for (k, ch) in after[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = start + open + k + 1;
                break;
            }
        }
        out.push((m[1].to_string(), start..end));
    }
    out
}

/// Every function of `text` (its code before `#[cfg(test)]`) longer than `max` lines: name,
/// first line (1-based) and length.
fn long_functions(text: &str, max: usize) -> Vec<(String, usize, usize)> {
    let code = blank_literals(text.split("#[cfg(test)]").next().unwrap_or_default());
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (name, span) in function_spans(&code) {
        let lines = line_of(span.end - 1) - line_of(span.start) + 1;
        if lines > max {
            out.push((name, line_of(span.start), lines));
        }
    }
    out
}

/// Calls that seed LibTorch's generator: `Device::seed`, and the model's passes, whose training
/// ones reseed it per decoder block (`dropout::BlockSeeds`) whether or not the test seeds
/// first. (`.forward(` is left out: every module has one; a model's training forward through
/// it in a test without the lock would go unseen.)
const SEEDING_CALLS: [&str; 9] = [
    ".seed(",
    "micro_batch_grads(",
    "grads_on_device(",
    "train_step(",
    "recomputed_backward(",
    ".hidden(",
    "hidden_packed(",
    "forward_packed(",
    ".loss(",
];

/// The test functions of `text` (all of it, or its `#[cfg(test)]` part when `src`) that seed
/// LibTorch's generator ([`SEEDING_CALLS`]) without holding `torch_rng_lock()` in their own
/// body. A lock taken only inside a closure or an inner block is released while the rest of
/// the test runs, and a training pass run then changes the draws of a seeding test beside it:
/// CI saw exactly that.
fn unlocked_seeds(text: &str, src: bool) -> Vec<String> {
    let tests = if src { text.split_once("#[cfg(test)]").map_or("", |(_, t)| t) } else { text };
    let code = blank_literals(tests);
    let spans = function_spans(&code);
    let body = |r: &std::ops::Range<usize>| &code[r.clone()];
    // A helper that seeds counts through the test that calls it: the lock must be held there.
    let outermost = |r: &std::ops::Range<usize>| !spans.iter().any(|(_, o)| o.start < r.start && r.end <= o.end);
    // The lock taken at the function body's own level (brace depth 1 from the `fn`).
    let held = |r: &std::ops::Range<usize>| {
        body(r).match_indices("torch_rng_lock()").any(|(at, _)| {
            let before = &body(r)[..at];
            before.matches('{').count() == before.matches('}').count() + 1
        })
    };
    spans
        .iter()
        .filter(|(_, r)| outermost(r) && SEEDING_CALLS.iter().any(|c| body(r).contains(c)) && !held(r))
        .map(|(name, _)| name.clone())
        .collect()
}

#[test]
fn every_test_that_seeds_torch_holds_the_lock() {
    let mut found = Vec::new();
    let mut files: Vec<(PathBuf, bool)> = Vec::new();
    for krate in ["model", "data", "trainer"] {
        files.extend(rust_files(&common_root().join(krate).join("src")).into_iter().map(|p| (p, true)));
        let tests = common_root().join(krate).join("tests");
        if tests.is_dir() {
            files.extend(rust_files(&tests).into_iter().map(|p| (p, false)));
        }
    }
    files.extend(rust_files(&common_root().join("tests")).into_iter().map(|p| (p, false)));
    for (path, src) in files {
        for name in unlocked_seeds(&std::fs::read_to_string(&path).unwrap(), src) {
            found.push(format!("{} fn {name}", path.display()));
        }
    }
    assert!(
        found.is_empty(),
        "tests that seed LibTorch's generator without llora_model::device::torch_rng_lock():\n{}",
        found.join("\n")
    );
}

/// Positive control: a test module's function that seeds without the lock is found, and one
/// that takes it only inside a closure; one that holds it is not, nor is library code (before
/// `#[cfg(test)]`) or a helper called by a test that holds the lock.
#[test]
fn the_seed_check_finds_an_unlocked_seed() {
    let text = "pub fn lib(d: &D) { d.seed(1) }\n#[cfg(test)]\nmod tests {\n\
                fn bad() { device.seed(3); }\n\
                fn good() { let _rng = crate::device::torch_rng_lock(); device.seed(3); }\n\
                fn outer() { let _g = torch_rng_lock(); fn inner(d: &D) { d.seed(2) } }\n\
                fn closure() { let m = || { let _g = torch_rng_lock(); d.seed(1) }; m(); run(); }\n}\n";
    assert_eq!(unlocked_seeds(text, true), ["bad", "closure"]);
    assert_eq!(unlocked_seeds("fn t() { x.seed(1); }", false), ["t"]);
    assert_eq!(unlocked_seeds("fn t() { train_step(&mut m, b); }\nfn u() { f(); }", false), ["t"]);
}

/// The Rust files under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

#[test]
fn every_function_fits_a_screen() {
    let mut found = Vec::new();
    for krate in ["model", "data", "trainer"] {
        for path in rust_files(&common_root().join(krate).join("src")) {
            for (name, line, lines) in long_functions(&std::fs::read_to_string(&path).unwrap(), MAX_FUNCTION_LINES) {
                found.push(format!("{}:{line} fn {name}: {lines} lines", path.display()));
            }
        }
    }
    assert!(found.is_empty(), "functions over {MAX_FUNCTION_LINES} lines (split them):\n{}", found.join("\n"));
}

/// Positive controls: a long function is found, with its name, line and length; braces in
/// strings, raw strings, char literals and comments do not end it early or late; a trait's
/// declaration has no body; lifetimes are code; test modules are left out.
#[test]
fn the_length_check_reads_bodies_as_the_compiler_does() {
    let body = |n: usize| (0..n).map(|i| format!("    let x{i} = 1;\n")).collect::<String>();
    let text = format!(
        "trait T {{ fn decl(&self); }}\nfn short<'a>(x: &'a str) -> char {{ let _ = \"}}\"; '}}' }}\n\
         fn long() {{\n    let s = r#\"{{ \"# ; // {{\n    /* }} */\n{}}}\n#[cfg(test)]\nmod tests {{ fn t() {{\n{}}} }}\n",
        body(8),
        body(20)
    );
    assert_eq!(long_functions(&text, 5), [("long".to_string(), 3, 12)]);
    assert!(long_functions(&text, 12).is_empty());
}

/// A CUDA route is declared once, beside the op it replaces (`routes::declare_route!`: its
/// verdicts, name, fallback, self-tests), and the list `llora selftest` and `llora bench` read
/// is gathered from those declarations: `Verdicts::new` appears nowhere else, and the list
/// file names no route.
#[test]
fn routes_are_declared_once() {
    let src = common_root().join("model/src");
    for path in rust_files(&src) {
        let text = code(&std::fs::read_to_string(&path).unwrap());
        let here = path.ends_with("routes.rs");
        assert!(
            here || !text.contains("Verdicts::new("),
            "{}: a route declared outside declare_route!",
            path.display()
        );
    }
    let list = code(&std::fs::read_to_string(src.join("route_list.rs")).unwrap());
    let body = list.split("#[cfg(test)]").next().unwrap();
    assert!(!body.contains("RouteSpec {") && !body.contains("SelfTest {"), "route_list.rs declares a route");
}

/// Every repository path the docs, the README and the code's comments name in backticks exists
/// (a file moved or split, as the precision module did into a folder, is renamed where it is named);
/// placeholders in capitals (`commands/NAME.rs`) are left alone.
#[test]
fn named_paths_exist() {
    let root = common_root();
    let pattern =
        regex::Regex::new(r"`((?:model|data|trainer|scripts|docs|tests|configs|build)/[A-Za-z0-9_./-]+)`").unwrap();
    let mut files: Vec<PathBuf> = rust_files(&root.join("model/src"));
    for dir in ["data/src", "trainer/src", "tests"] {
        files.extend(rust_files(&root.join(dir)));
    }
    files.push(root.join("README.md"));
    files.extend(
        std::fs::read_dir(root.join("docs"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "md")),
    );
    let mut missing = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for m in pattern.captures_iter(&text) {
            let path = m[1].trim_end_matches('.');
            let placeholder =
                path.split(['/', '.']).any(|part| part.len() > 1 && part.chars().all(|c| c.is_ascii_uppercase()));
            if !placeholder && !root.join(path).exists() {
                missing.push(format!("{}: {path}", file.display()));
            }
        }
    }
    assert!(missing.is_empty(), "named paths that do not exist:\n{}", missing.join("\n"));
}

/// The trainer reaches into at most 8 of the model crate's modules (the rest it names through
/// the crate's root, or not at all): the model owns its micro-step (`loss_and_grads`) and its
/// inference loading, so the recipe does not reach into amax groups or precision internals.
#[test]
fn the_trainer_names_at_most_8_model_modules() {
    let named = regex::Regex::new(r"llora_model::([a-z0-9_]+)::").unwrap();
    let mut modules = BTreeSet::new();
    for path in rust_files(&common_root().join("trainer/src")) {
        let text = std::fs::read_to_string(&path).unwrap();
        modules.extend(named.captures_iter(&text).map(|c| c[1].to_string()));
    }
    assert!(modules.len() <= 8, "{} model modules: {modules:?}", modules.len());
}

/// The spine of `llora train`, from `main` to the first optimizer step, as docs/architecture.md
/// tells it: each file with the call by which it hands the run on (or, for a file the run
/// passes through and returns from, the function it is entered by).
const SPINE: [(&str, &str); 8] = [
    ("trainer/src/main.rs", "commands::train::run("),
    ("trainer/src/commands/train.rs", "train::run("),
    ("trainer/src/engine/train.rs", "pretrain::base_to_make("),
    ("trainer/src/engine/pretrain.rs", "pub fn base_to_make("),
    ("trainer/src/engine/train.rs", "Trainer::setup("),
    ("trainer/src/engine/trainer.rs", "train_step("),
    ("trainer/src/engine/step.rs", "optim.step("),
    ("trainer/src/engine/optim.rs", "pub fn step("),
];

/// From `llora train` to the first optimizer step a reader opens at most ten trainer files
/// (pre-training's run goes back through `engine/train.rs`, the same function, and is not a
/// second file); each file makes the call that leads to the next, and docs/architecture.md
/// names every one.
#[test]
fn the_spine_of_a_run_is_at_most_ten_files_each_calling_the_next() {
    let root = common_root();
    let files: BTreeSet<&str> = SPINE.iter().map(|(f, _)| *f).collect();
    assert!(files.len() <= 10, "{} files on the spine: {files:?}", files.len());
    for (file, call) in SPINE {
        let text = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(
            code(&text).contains(call),
            "{file} no longer calls `{call}`: update the spine and docs/architecture.md"
        );
    }
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let spine_doc = &doc[doc.find("A run is told top-down").unwrap()..doc.find("Every record of the run").unwrap()];
    for file in files {
        assert!(spine_doc.contains(&format!("`{file}`")), "docs/architecture.md's spine does not name {file}");
    }
}

/// No model struct holds FP8 codes as a bare tensor outside `fp8/tensor.rs` (where
/// `Fp8Tensor` pairs them with their scale and `CodesToWrite` is what a kernel writes): a field
/// named for codes typed `tch::Tensor` or `TchTensor` is one. NF4's `u8` codes
/// (`precision/weights.rs`) are not FP8; kernel argument views borrow (`&tch::Tensor`).
#[test]
fn fp8_codes_are_held_as_fp8_tensors() {
    let root = common_root();
    let field = Regex::new(r"^\s*(pub(\([a-z]+\))? )?\w*codes\w*: (tch::Tensor|TchTensor),\s*$").unwrap();
    let mut found = Vec::new();
    for path in rust_files(&root.join("model/src")) {
        let rel = path.strip_prefix(&root).unwrap().display().to_string();
        if rel == "model/src/fp8/tensor.rs" || rel == "model/src/precision/weights.rs" {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in code(&text).lines().enumerate() {
            if field.is_match(line) {
                found.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "bare FP8 codes held outside fp8/tensor.rs (hold an Fp8Tensor):\n{}", found.join("\n"));
    assert!(field.is_match("    pub gate_codes: tch::Tensor,") && !field.is_match("    gate: &'a tch::Tensor,"));
}
