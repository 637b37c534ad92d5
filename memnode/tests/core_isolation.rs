//! A lint as a test: the memory node's logic takes time from its node's
//! [`rackfs_clock::Clock`] (`Node::clock`), starts its threads through its node's
//! `rackfs_clock::Spawn` (`Node::start_thread`), waits for other threads with
//! `rackfs_clock::Bell`s, and opens control connections to other nodes through its node's
//! `rackfs_proto::link::Dial` (`Node::dial`), all handed in through `MemNode::start_in`; it
//! never reads the operating system's clock or sleeps on it, never blocks on a `Condvar`, and
//! never dials a socket itself, so that a simulation can run whole clusters in one process on
//! virtual time. Each rule names the only files allowed to, and why.

use std::path::{Path, PathBuf};

/// Calls the node's logic must not make, and the files (under `memnode/src`) that may.
struct Rule {
    calls: &'static [&'static str],
    /// File and why it may.
    allowed: &'static [(&'static str, &'static str)],
    instead: &'static str,
}

const RULES: [Rule; 7] = [
    Rule {
        calls: &["Instant::now", "SystemTime::now", "thread::sleep"],
        allowed: &[
            // `rackfs-memnode profile` measures how many reads the host serves per second of
            // real time, before any node runs.
            ("main.rs", "the profile command times the host itself"),
        ],
        instead: "take time from the node's Clock (Node::clock) and sleep on it",
    },
    Rule {
        // The serve lease lives on the host's CLOCK_MONOTONIC, where the node's NIC threads
        // and its shm clients (other processes) check it; the node maps its clock onto it in
        // one place.
        calls: &["monotonic_ns", "serve.valid()"],
        allowed: &[(
            "node.rs",
            "maps the node's clock onto the serve lease's (Node::host_origin)",
        )],
        instead: "check the serve lease with Node::serving, move times onto it with Node::lease_ns",
    },
    Rule {
        // `connect` covers `connect_tcp` and `connect_unix`. No file may: every control
        // connection to another node goes through the node's dial.
        calls: &["ControlClient::connect"],
        allowed: &[],
        instead: "open control connections through the node's Dial (Node::dial, or the Dial \
                  passed down where there is no Node yet)",
    },
    Rule {
        // The network's dial is chosen once, where a process starts a node.
        calls: &["NetDial"],
        allowed: &[(
            "daemon.rs",
            "MemNode::start and start_with_clock, the production entry points, hand the node \
             the network's Dial (NodeEnv::host)",
        )],
        instead: "take the Dial the node was started with (Node::dial)",
    },
    Rule {
        // A simulation runs the node's threads as its own processes' threads.
        calls: &["thread::Builder"],
        allowed: &[
            ("conn.rs", "a connection's session threads serve its socket"),
            (
                "daemon.rs",
                "socket_thread: the threads that accept on the node's sockets and serve metrics",
            ),
            (
                "coordinator.rs",
                "CoordService, a coordinator of its own process serving a socket",
            ),
            ("main.rs", "the profile command loads the host itself"),
        ],
        instead: "start threads of the node's logic with Node::start_thread (its Spawn)",
    },
    Rule {
        // A Condvar wait blocks where a simulation cannot see it; a Bell is one it sees.
        calls: &["Condvar"],
        allowed: &[(
            "conn.rs",
            "a socket session's threads take turns reading it (sockets are never simulated)",
        )],
        instead: "wait with rackfs_clock::Bell",
    },
    Rule {
        // A simulation kills the node's process instead: the whole world is one process.
        calls: &["process::exit"],
        allowed: &[("daemon.rs", "NodeEnv::host's exit, the production one")],
        instead: "end the node's process with Node::exit",
    },
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("memnode/src") {
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
fn the_memory_node_reads_no_os_clock_sleeps_on_none_and_dials_no_socket() {
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
                        .map(|c| format!("memnode/src/{rel}:{c}: {}", rule.instead)),
                );
            }
        }
        // The scan itself works: the allowed files do make these calls (a rule that allows
        // no file is checked by `the_scan_sees_calls_and_skips_comments`).
        assert!(
            rule.allowed.is_empty() || allowed_hits > 0,
            "{:?} found nowhere",
            rule.calls
        );
    }
    assert!(
        offences.is_empty(),
        "the memory node reaches for the host's clock or dials a socket itself:\n{}",
        offences.join("\n")
    );
}

#[test]
fn the_scan_sees_calls_and_skips_comments() {
    let text = "let t = std::time::Instant::now();\n// std::thread::sleep(d) in a comment\nx; // SystemTime::now()\nif !node.serve.valid() {\nlet c = rackfs_proto::ControlClient::connect_tcp(a, s, n)?;\n// ControlClient::connect(a, s, n) in a comment";
    let calls = &[
        "Instant::now",
        "SystemTime::now",
        "thread::sleep",
        "serve.valid()",
        "ControlClient::connect",
    ];
    assert_eq!(
        find(text, calls),
        vec![
            "1: Instant::now".to_string(),
            "4: serve.valid()".to_string(),
            "5: ControlClient::connect".to_string()
        ]
    );
}
