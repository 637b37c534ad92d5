//! The files of `memnode/src` form a one-way chain (issue 24): no module refers to another that
//! refers back to it, directly or in a circle, so each can be read knowing only those below it.
//!
//! A reference is any `crate::x` or `super::x` in a file, code or doc comment alike (a doc link
//! upward is a dependency on the module above too): `use crate::{a, b::C}` groups, names the
//! crate root re-exports (`crate::Role` is `config`'s) and `super::` inside a file's inline
//! modules (its tests) are resolved. The crate roots (`lib.rs`, `main.rs`) are left out: they
//! name every module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A module's source: its path in the crate (`standby`, `a::b`) and its text.
struct Source {
    module: String,
    text: String,
}

/// An edge of the module graph, with where it was first seen (for the failure message).
type Edges = BTreeMap<String, BTreeMap<String, String>>;

/// Every module file under `dir` (`a.rs`, `a/b.rs`, `a/mod.rs`), crate roots excepted.
fn sources(dir: &Path, prefix: &[String], out: &mut Vec<Source>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .to_string();
        if path.is_dir() {
            let mut p = prefix.to_vec();
            p.push(name);
            sources(&path, &p, out);
            continue;
        }
        let Some(stem) = name.strip_suffix(".rs") else {
            continue;
        };
        let mut module = prefix.to_vec();
        match stem {
            "lib" | "main" if prefix.is_empty() => continue,
            "mod" => {}
            _ => module.push(stem.to_string()),
        }
        out.push(Source {
            module: module.join("::"),
            text: std::fs::read_to_string(&path).expect("read a source file"),
        });
    }
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The paths a use-tree at the start of `s` names: `a::b`, `a::{b, c::d}`, `{a, b}`.
fn use_tree(s: &str) -> Vec<Vec<String>> {
    fn tree(s: &[char], i: &mut usize) -> Vec<Vec<String>> {
        while *i < s.len() && s[*i].is_whitespace() {
            *i += 1;
        }
        if *i < s.len() && s[*i] == '{' {
            *i += 1;
            let mut out = Vec::new();
            loop {
                out.extend(tree(s, i));
                while *i < s.len() && s[*i] != ',' && s[*i] != '}' {
                    *i += 1; // `as` renames, stray tokens
                }
                if *i >= s.len() || s[*i] == '}' {
                    *i += 1;
                    return out;
                }
                *i += 1; // ','
            }
        }
        let start = *i;
        while *i < s.len() && is_ident(s[*i]) {
            *i += 1;
        }
        if start == *i {
            return Vec::new(); // `*`, or not a path
        }
        let ident: String = s[start..*i].iter().collect();
        if s.get(*i) == Some(&':') && s.get(*i + 1) == Some(&':') {
            *i += 2;
            let rest = tree(s, i);
            if !rest.is_empty() {
                return rest
                    .into_iter()
                    .map(|mut p| {
                        p.insert(0, ident.clone());
                        p
                    })
                    .collect();
            }
        }
        vec![vec![ident]]
    }
    let chars: Vec<char> = s.chars().take(2000).collect();
    tree(&chars, &mut 0)
}

/// `text` with its line comments blanked out (same length and offsets), to find inline modules'
/// braces in code only.
fn code_only(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(at) => format!("{}{}", &l[..at], " ".repeat(l.len() - at)),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The inline modules of a file (`mod tests { ... }`): their name and byte range.
fn inline_modules(text: &str) -> Vec<(String, std::ops::Range<usize>)> {
    let code = code_only(text);
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("mod ").map(|a| a + from) {
        from = at + 4;
        if at > 0 && is_ident(bytes[at - 1] as char) {
            continue;
        }
        let rest = &code[from..];
        let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
        let after = rest[name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue; // `mod x;`: a file of its own
        }
        let open = from + (rest.len() - after.len());
        let mut depth = 0;
        let mut end = code.len();
        for (j, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((name, open..end));
    }
    out
}

/// The module graph: for every module, the modules it refers to (itself excepted), each with
/// the first reference seen.
fn graph(sources: &[Source], reexports: &BTreeMap<String, String>) -> Edges {
    let modules: BTreeSet<&str> = sources.iter().map(|s| s.module.as_str()).collect();
    // The longest module `path` starts with (`a::b::Item` is in `a::b`), or a re-export's.
    let resolve = |path: &[String]| -> Option<String> {
        (1..=path.len())
            .rev()
            .map(|n| path[..n].join("::"))
            .find(|m| modules.contains(m.as_str()))
            .or_else(|| path.first().and_then(|p| reexports.get(p).cloned()))
    };
    let mut edges = Edges::new();
    for src in sources {
        let own: Vec<String> = if src.module.is_empty() {
            Vec::new()
        } else {
            src.module.split("::").map(String::from).collect()
        };
        let inline = inline_modules(&src.text);
        let to = edges.entry(src.module.clone()).or_default();
        for key in ["crate::", "super::"] {
            let mut from = 0;
            while let Some(at) = src.text[from..].find(key).map(|a| a + from) {
                from = at + key.len();
                if at > 0 && is_ident(src.text[..at].chars().last().expect("char")) {
                    continue; // `my_crate::`
                }
                let base: Vec<String> = if key == "crate::" {
                    Vec::new()
                } else {
                    // The module this `super::` is written in: the file's, or an inline one's.
                    let mut here = own.clone();
                    here.extend(
                        inline
                            .iter()
                            .filter(|(_, r)| r.contains(&at))
                            .map(|(n, _)| n.clone()),
                    );
                    here.pop();
                    here
                };
                for tail in use_tree(&src.text[from..]) {
                    let mut path = base.clone();
                    path.extend(tail);
                    let Some(m) = resolve(&path) else { continue };
                    if m != src.module {
                        let line = src.text[..at].lines().count().max(1);
                        let seen = format!("{}:{line} `{key}{}`", src.module, path.join("::"));
                        to.entry(m).or_insert(seen);
                    }
                }
            }
        }
    }
    edges
}

/// The names the crate root re-exports (`pub use config::{NodeConfig, Role}`), by module.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in lib.lines().map(str::trim) {
        let Some(tree) = line.strip_prefix("pub use ") else {
            continue;
        };
        for path in use_tree(tree) {
            if let (Some(module), Some(name)) = (path.first(), path.last()) {
                if path.len() > 1 {
                    out.insert(name.clone(), module.clone());
                }
            }
        }
    }
    out
}

/// A circle: the modules around it (the first back at the end), and every module of its group
/// (those that reach each other through it and others).
type Cycle = (Vec<String>, BTreeSet<String>);

/// Every circle of the graph, the shortest one per group of modules that reach each other.
fn cycles(edges: &Edges) -> Vec<Cycle> {
    let nodes: Vec<&String> = edges.keys().collect();
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for m in edges.get(&n).into_iter().flat_map(|e| e.keys()) {
                if seen.insert(m.clone()) {
                    todo.push(m.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        nodes.iter().map(|&n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for &n in &nodes {
        if done.contains(n) || !reaches[n].contains(n) {
            continue;
        }
        // Its group: the modules it reaches that reach it back.
        let group: BTreeSet<&String> = reaches[n]
            .iter()
            .filter(|m| reaches.get(m).is_some_and(|r| r.contains(n)))
            .collect();
        done.extend(group.iter().map(|m| (*m).clone()));
        // The shortest way round from `n`, inside the group.
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([n.clone()]);
        'search: while let Some(a) = queue.pop_front() {
            for b in edges.get(&a).into_iter().flat_map(|e| e.keys()) {
                if b == n {
                    let mut path = vec![a.clone()];
                    while let Some(p) = prev.get(path.last().expect("path")) {
                        path.push(p.clone());
                    }
                    path.reverse();
                    path.push(n.clone());
                    out.push((path, group.iter().map(|m| (*m).clone()).collect()));
                    break 'search;
                }
                if group.contains(b) && !prev.contains_key(b) && b != n {
                    prev.insert(b.clone(), a.clone());
                    queue.push_back(b.clone());
                }
            }
        }
    }
    out
}

/// How a circle reads in a failure: each step with where the reference is.
fn describe((cycle, group): &Cycle, edges: &Edges) -> String {
    let steps: Vec<String> = cycle
        .windows(2)
        .map(|w| format!("  {} -> {}   ({})", w[0], w[1], edges[&w[0]][&w[1]]))
        .collect();
    let group: Vec<&str> = group.iter().map(String::as_str).collect();
    format!(
        "{}\n{}\n  (modules that reach each other: {})",
        cycle.join(" -> "),
        steps.join("\n"),
        group.join(", ")
    )
}

#[test]
fn memnode_modules_form_a_one_way_chain() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &[], &mut files);
    assert!(
        files.len() > 10,
        "memnode's modules not found in {}",
        src.display()
    );
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let edges = graph(&files, &reexports(&lib));
    let found = cycles(&edges);
    let shown: Vec<String> = found.iter().map(|c| describe(c, &edges)).collect();
    assert!(
        found.is_empty(),
        "memnode's modules import each other in a circle (a module may only use those below \
         it; turn the upward reference into a value returned, a callback the daemon installs, \
         or a type moved down):\n{}",
        shown.join("\n")
    );
}

#[test]
fn a_reference_back_up_is_caught() {
    let file = |module: &str, text: &str| Source {
        module: module.into(),
        text: text.into(),
    };
    let lib = "pub use config::{NodeConfig, Role};\npub use daemon::MemNode;";
    let files = [
        file("config", "pub enum Role {}"),
        file("node", "use crate::{config::NodeConfig, store};\n"),
        file("store", "//! See [`crate::alloc`].\n"),
        file(
            "alloc",
            "fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        ),
        file(
            "control",
            "use crate::node::Node;\nfn f() -> crate::Role { todo!() }",
        ),
        file("daemon", "use crate::{control, node::{self, Node}};"),
    ];
    let edges = graph(&files, &reexports(lib));
    let to = |m: &str| edges[m].keys().cloned().collect::<Vec<_>>();
    assert_eq!(to("node"), ["config", "store"]);
    assert_eq!(to("store"), ["alloc"]);
    assert_eq!(
        to("alloc"),
        Vec::<String>::new(),
        "an inline module's super:: is its file"
    );
    assert_eq!(to("control"), ["config", "node"]);
    assert_eq!(to("daemon"), ["control", "node"]);
    assert!(cycles(&edges).is_empty());

    // One doc link back up closes a circle, and the test names it.
    let mut files = files;
    files[2] = file(
        "store",
        "//! Used by [`crate::daemon::MemNode`].\nuse super::alloc;",
    );
    let edges = graph(&files, &reexports(lib));
    let found = cycles(&edges);
    assert_eq!(found.len(), 1, "{found:?}");
    let mut around = found[0].0.clone();
    around.pop();
    around.sort();
    assert_eq!(around, ["control", "daemon", "node", "store"]);
    assert_eq!(around, found[0].1.iter().cloned().collect::<Vec<_>>());
    assert!(describe(&found[0], &edges).contains("store:1 `crate::daemon::MemNode`"));
}
