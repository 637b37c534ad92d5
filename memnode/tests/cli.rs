//! The daemon's command line as a Unix tool: its man page is generated from the flags' own
//! definitions, and its output to a reader that went away ends nothing with a panic.

use std::process::{Command, Stdio};

#[test]
fn the_man_page_is_generated_from_the_flags() {
    let dir = std::env::temp_dir().join(format!("rackfs-memnode-man-{}", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_rackfs-memnode"))
        .arg("generate-man")
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success());
    let page = std::fs::read_to_string(dir.join("rackfs-memnode.1")).unwrap();
    for flag in [
        "\\-\\-region",
        "\\-\\-join",
        "\\-\\-etcd",
        "\\-\\-secret\\-file",
    ] {
        assert!(page.contains(flag), "the man page lacks {flag}");
    }
    assert!(page.contains(".TH rackfs-memnode"), "{page}");
    let _ = std::fs::remove_dir_all(dir);
    // Without a directory: a clear error, no panic.
    let out = Command::new(env!("CARGO_BIN_EXE_rackfs-memnode"))
        .arg("generate-man")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs a directory") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn help_into_a_closed_pipe_exits_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rackfs-memnode"))
        .arg("--help")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away before anything is read
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}
