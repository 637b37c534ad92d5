//! A lint as a test: the client core takes time from its [`rackfs_fs::clock::Clock`] and never
//! reads the operating system's clock or sleeps on it, so that it runs on virtual time under
//! simulation. Only the files named in `ALLOWED` may.

use std::path::{Path, PathBuf};

/// What the core must not call: the host's clocks and its sleep.
const FORBIDDEN: [&str; 3] = ["Instant::now", "SystemTime::now", "thread::sleep"];

/// Files (under `fs/src`) allowed to, and why.
const ALLOWED: [(&str, &str); 3] = [
    // The real clock: the one place the core's time comes from on a live mount.
    ("clock/system.rs", "the host's clock itself"),
    // Mounting (daemon start, waiting for the mount to show up) is the process's own business,
    // outside the core.
    ("mount.rs", "daemon start-up, outside the core"),
    // The FUSE adapter talks to the kernel, which lives on the host's time.
    ("fuse.rs", "the kernel adapter, outside the core"),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("fs/src") {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The forbidden calls in `text`, as `line: call`, comments left out.
fn calls(text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .flat_map(|(i, line)| {
            let code = line.split("//").next().unwrap_or("");
            FORBIDDEN
                .iter()
                .filter(move |f| code.contains(*f))
                .map(move |f| format!("{}: {f}", i + 1))
        })
        .collect()
}

#[test]
fn the_client_core_reads_no_os_clock_and_never_sleeps_on_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut offences = Vec::new();
    let mut allowed_hits = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).expect("under src");
        let rel = rel.to_string_lossy().replace('\\', "/");
        let found = calls(&std::fs::read_to_string(f).expect("a source file"));
        if ALLOWED.iter().any(|(a, _)| *a == rel) {
            allowed_hits += found.len();
        } else {
            offences.extend(found.into_iter().map(|c| format!("fs/src/{rel}:{c}")));
        }
    }
    assert!(
        offences.is_empty(),
        "the client core must take time from its Clock (crate::clock), not the OS:\n{}",
        offences.join("\n")
    );
    // The scan itself works: the real clock does read the OS clock.
    assert!(
        allowed_hits >= 3,
        "the scan found nothing even where it is allowed"
    );
}

#[test]
fn the_scan_sees_calls_and_skips_comments() {
    let text = "let t = std::time::Instant::now();\n// std::thread::sleep(d) in a comment\nx; // SystemTime::now()";
    assert_eq!(calls(text), vec!["1: Instant::now".to_string()]);
}
