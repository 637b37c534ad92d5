//! The documentation's claims point at tests that exist.

#[test]
fn semantics_doc_names_existing_tests() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("../doc/SEMANTICS.md")).expect("doc/SEMANTICS.md");
    let mut named = 0;
    for part in doc.split('`') {
        let Some((file, test)) = part.split_once(".rs::") else {
            continue;
        };
        if file.contains(' ') || test.contains(' ') {
            continue;
        }
        // Integration tests live in tests/tests; tests of one crate in that crate's tests/
        // (the whole-cluster simulation in memnode/tests; unit tests: the metadata service's
        // file layouts in meta/src, the store's in memnode/src, the record-lock rules in
        // locks/src).
        let src = [
            "tests/tests",
            "fs/tests",
            "meta/tests",
            "meta/src",
            "memnode/src",
            "memnode/tests",
            "locks/tests",
            "locks/src",
            "qos/tests",
            "verbs/tests",
        ]
        .iter()
        .find_map(|d| {
            std::fs::read_to_string(root.join("..").join(d).join(format!("{file}.rs"))).ok()
        })
        .unwrap_or_else(|| panic!("SEMANTICS.md names {file}.rs, which no tests/ folder holds"));
        assert!(
            src.contains(&format!("fn {test}(")),
            "SEMANTICS.md names {file}.rs::{test}, which does not exist"
        );
        named += 1;
    }
    assert!(
        named >= 15,
        "SEMANTICS.md should tie its claims to tests ({named} found)"
    );
}

/// Every link of the README and of doc/ resolves inside the repository (a user's clone has
/// nothing beside it), and none points outside it.
#[test]
fn every_link_resolves_inside_the_repository() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap();
    let mut pages = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("doc")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let name = page.strip_prefix(&root).unwrap().display().to_string();
        assert!(
            !text.contains("../shared"),
            "{name} names ../shared, which a user's clone does not have"
        );
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            if target.is_empty()
                || target.starts_with('#')
                || target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let path = target.split('#').next().unwrap();
            let at = page.parent().unwrap().join(path);
            let resolved = at
                .canonicalize()
                .unwrap_or_else(|e| panic!("{name} links {target}, which does not exist: {e}"));
            assert!(
                resolved.starts_with(&root),
                "{name} links {target}, outside the repository"
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 5,
        "only {checked} links found: the parser misses them"
    );
}
