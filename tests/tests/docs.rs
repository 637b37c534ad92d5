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
        // (unit tests: the metadata service's file layouts in meta/src, the store's in
        // memnode/src, the record-lock rules in locks/src).
        let src = [
            "tests/tests",
            "meta/tests",
            "meta/src",
            "memnode/src",
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
