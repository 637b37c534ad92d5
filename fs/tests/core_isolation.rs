//! A lint as a test: the client core takes time from its [`rackfs_fs::clock::Clock`] and starts
//! threads through its [`rackfs_fs::spawn::Spawn`]; it never reads the operating system's
//! clock, sleeps on it or starts a thread itself, so that it runs on virtual time under
//! simulation. Each rule names the only files allowed to, and why.

use std::path::{Path, PathBuf};

/// Calls the core must not make, and the files (under `fs/src`) that may.
struct Rule {
    calls: &'static [&'static str],
    /// File and why it may.
    allowed: &'static [(&'static str, &'static str)],
    instead: &'static str,
}

const RULES: [Rule; 2] = [
    Rule {
        calls: &["Instant::now", "SystemTime::now", "thread::sleep"],
        allowed: &[
            // Mounting (daemon start, waiting for the mount to show up) is the process's own
            // business, outside the core.
            ("mount.rs", "daemon start-up, outside the core"),
            // The FUSE adapter talks to the kernel, which lives on the host's time.
            ("fuse.rs", "the kernel adapter, outside the core"),
        ],
        instead: "take time from the mount's Clock (crate::clock)",
    },
    Rule {
        calls: &["thread::spawn", "thread::Builder"],
        allowed: &[
            ("spawn.rs", "the OS threads' Spawn itself"),
            ("mount.rs", "the signal thread, outside the core"),
            ("fuse.rs", "the kernel adapter, outside the core"),
        ],
        instead: "start threads through the mount's Spawn (crate::spawn)",
    },
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

/// The calls of `calls` in `text`, as `line: call`, comments left out.
fn find(text: &str, calls: &[&str]) -> Vec<String> {
    text.lines()
        .enumerate()
        .flat_map(|(i, line)| {
            let code = line.split("//").next().unwrap_or("");
            calls
                .iter()
                .filter(move |c| code.contains(*c))
                .map(move |c| format!("{}: {c}", i + 1))
        })
        .collect()
}

#[test]
fn the_client_core_reads_no_os_clock_sleeps_on_none_and_starts_no_thread_itself() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut offences = Vec::new();
    for rule in &RULES {
        let mut allowed_hits = 0;
        for f in &files {
            let rel = f.strip_prefix(&src).expect("under src");
            let rel = rel.to_string_lossy().replace('\\', "/");
            let found = find(&std::fs::read_to_string(f).expect("a source"), rule.calls);
            if rule.allowed.iter().any(|(a, _)| *a == rel) {
                allowed_hits += found.len();
            } else {
                offences.extend(
                    found
                        .into_iter()
                        .map(|c| format!("fs/src/{rel}:{c}: {}", rule.instead)),
                );
            }
        }
        // The scan itself works: the real implementations do make these calls.
        assert!(allowed_hits > 0, "{:?} found nowhere", rule.calls);
    }
    assert!(
        offences.is_empty(),
        "the client core reaches for the host:\n{}",
        offences.join("\n")
    );
}

#[test]
fn the_scan_sees_calls_and_skips_comments() {
    let text = "let t = std::time::Instant::now();\n// std::thread::sleep(d) in a comment\nx; // SystemTime::now()";
    let calls = &["Instant::now", "SystemTime::now", "thread::sleep"];
    assert_eq!(find(text, calls), vec!["1: Instant::now".to_string()]);
}
