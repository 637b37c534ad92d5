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
        let src = std::fs::read_to_string(root.join("tests").join(format!("{file}.rs")))
            .unwrap_or_else(|_| {
                panic!("SEMANTICS.md names tests/tests/{file}.rs, which does not exist")
            });
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
