//! `rackfs-bench rpc-table`: control RPCs and verbs per file operation (issue 25), the table
//! `tests/tests/rpc_counts.rs` holds to its bounds, in markdown for the docs.

use std::process::Command;
use std::time::Duration;

use rackfs_tests::rpc_table::{measure, Config};

/// Measures every row with `n` operations each on `nodes` memory nodes; returns the report.
pub fn run(n: usize, nodes: usize) -> String {
    let cfg = Config {
        n,
        warmup: (n / 10).max(5),
        idle: Duration::from_secs(2),
        nodes,
    };
    let measured = measure(&cfg);
    let out = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into())
    };
    format!(
        "# Control RPCs per operation\n\n\
         Produced by `rackfs-bench rpc-table --ops {n} --nodes {nodes}` at commit `{}` on {}.\n\n{}",
        out("git", &["rev-parse", "--short", "HEAD"]),
        out("date", &["+%F"]),
        measured.markdown()
    )
}
